// A sample plugin that brings its own kernels: layer/snake, the Snake activation with
// a learned frequency per channel (see snake_kernels.hpp),
//   y[t, c] = x[t, c] + sin(alpha[c] x[t, c])^2 / alpha[c],
// a residual-friendly nonlinearity to put in a block:
//   block = ["attention", "mlp", "snake"]
//
// The device op table has no such op, so the plugin has its own kernels:
//  - on the CPU, plain C++ functions run as host tasks (loom::Device::host_task): the
//    device runs them in stream order, and a capture (exec/partial_graph) records
//    them, with their arguments, like any op;
//  - on CUDA (built when CMake finds a CUDA compiler), __global__ kernels launched on
//    the device's native stream (loom::Device::native_stream) on memory from the
//    device's allocator (loom::Buffer): a capture of that stream records them too.
// validate() refuses, before the run starts, what there is no kernel for: a CUDA
// device when the plugin was built without CUDA, and dtypes other than fp32.
// Between its own kernels it uses the device's ops (copy, reduce) as any layer does.
#include <loom/cpp/plugin.hpp>

#include "snake_kernels.hpp"

#include <map>

namespace {

class Snake : public loom::Layer {
 public:
  Snake(const loom::Options&, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), hidden_(args.dims->hidden), on_cuda_(!rank.device().is_host_memory()) {
    // This rank's rows of a microbatch: its context-parallel slice, its sequence shard under SP.
    const int64_t shards = rank.group_or_single("cp").size() * (args.sequence_parallel ? args.tp.size : 1);
    rows_ = args.dims->seq_len / shards * args.dims->micro_batch;
    // The same refusals as validate's, for an engine that creates without validating.
    require_kernels(on_cuda_ ? kDLCUDA : kDLCPU, rank.device().has_host_task());
  }

  // Called by `loom validate`, `loom plan` and before `loom run` starts any rank.
  static void validate(const loom::Options&, const loom::LayerValidation& v) {
    LOOM_REQUIRE(v.act_dtype() == LOOM_DTYPE_F32 && v.param_dtype() == LOOM_DTYPE_F32,
                 "layer/snake computes in fp32 only: set device.param_dtype = \"fp32\"");
    require_kernels(v.device_type(), v.has_host_task());
  }

  // Position-wise: a context-parallel slice of the sequence is just fewer rows.
  static constexpr uint64_t kFeatures = LOOM_LAYER_CONTEXT_PARALLEL;

  std::vector<loom::ParamSpec> params() override {
    loom::ParamSpec alpha;
    alpha.name = "alpha";
    alpha.shape = {hidden_};  // duplicated on every tensor-parallel rank
    alpha.init = LOOM_INIT_ONES;
    alpha.no_weight_decay = true;
    return {alpha};
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    LOOM_REQUIRE(params[0].dtype.code == kDLFloat && params[0].dtype.bits == 32 && grads[0].dtype.bits == 32,
                 "layer/snake: alpha and its gradient must be fp32");
    alpha_ = static_cast<float*>(params[0].data);
    alpha_grad_ = static_cast<float*>(grads[0].data);
  }

  // y = snake(x), keeping x for the backward of this microbatch.
  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t n = numel(*a.input);
    loom::Device dev = rank.device();
    loom::Buffer saved(rank_, n * sizeof(float));
    dev.copy(saved.get(), a.input->data, n * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE);
    SnakeArgs k;
    k.rows = n / hidden_;
    k.cols = hidden_;
    k.x = static_cast<const float*>(a.input->data);
    k.alpha = alpha_;
    k.y = static_cast<float*>(a.output->data);
    launch(dev, snake_forward_cpu, kForwardCuda, k);
    if (a.training) saved_[a.microbatch] = std::move(saved);
  }

  // dx from the kernel; dalpha += the column sums of its per-row parts (the device's reduce).
  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    const int64_t n = numel(*a.grad_output);
    loom::Device dev = rank.device();
    loom::Buffer rows(rank_, n * sizeof(float));
    SnakeArgs k;
    k.rows = n / hidden_;
    k.cols = hidden_;
    k.x = static_cast<const float*>(saved_.at(a.microbatch).get());
    k.alpha = alpha_;
    k.dy = static_cast<const float*>(a.grad_output->data);
    k.dx = static_cast<float*>(a.grad_input->data);
    k.dalpha_rows = static_cast<float*>(rows.get());
    launch(dev, snake_backward_cpu, kBackwardCuda, k);
    dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = n, .cols = hidden_, .x = rows.get(), .out = alpha_grad_,
                .accumulate = 1, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
    release(a.microbatch);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  // Every launch goes through the device (its ops, host tasks, or kernels on its
  // stream), nothing is read back: exec/partial_graph may capture and replay the layer.
  bool capturable() override { return true; }

  uint64_t activation_bytes() override { return static_cast<uint64_t>(rows_ * hidden_) * sizeof(float); }  // x

 private:
  using CudaKernel = void (*)(void*, const SnakeArgs&);
#ifdef SNAKE_WITH_CUDA
  static constexpr CudaKernel kForwardCuda = snake_forward_cuda, kBackwardCuda = snake_backward_cuda;
#else
  static constexpr CudaKernel kForwardCuda = nullptr, kBackwardCuda = nullptr;
#endif

  static void require_kernels(int32_t device_type, bool host_tasks) {
    if (device_type == kDLCPU) {
      LOOM_REQUIRE(host_tasks, "layer/snake runs its CPU kernels as host tasks, which this device plugin does "
                               "not offer (ABI 1.12): use a newer device plugin");
      return;
    }
    LOOM_REQUIRE(device_type == kDLCUDA, "layer/snake has kernels for the CPU and CUDA only (device memory type "
                                             << device_type << ")");
    LOOM_REQUIRE(kForwardCuda != nullptr,
                 "layer/snake was built without its CUDA kernels (no CUDA compiler found when it was configured): "
                 "rebuild it with CUDA (-DSNAKE_CUDA=ON), or run with device.kind = \"cpu\"");
  }

  // The CPU kernel as a host task, or the CUDA kernel on the device's stream.
  void launch(const loom::Device& dev, void (*cpu)(SnakeArgs*), CudaKernel cuda, const SnakeArgs& k) const {
    if (!on_cuda_)
      dev.host_task(cpu, k);
    else
      cuda(dev.native_stream(), k);
  }

  static int64_t numel(const DLTensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    return n;
  }

  loom_rank* rank_;
  int64_t hidden_, rows_ = 0;
  bool on_cuda_;
  float* alpha_ = nullptr;
  float* alpha_grad_ = nullptr;
  std::map<int32_t, loom::Buffer> saved_;  // x per microbatch in flight
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Snake>(
    "snake", "1.0.0", "Snake activation y = x + sin(a x)^2 / a, a learned per channel, own CPU and CUDA kernels (SDK sample)",
    {}))
