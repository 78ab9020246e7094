// A tutorial plugin: a layer with one learned gain per hidden channel,
//   y[t, c] = x[t, c] * g[c]
// Put it in a model with   block = ["attention", "mlp", "learned_scale"].
//
// A layer (1) declares its parameters, (2) receives views of them, (3) runs
// forward, saving what backward needs per microbatch, (4) runs backward,
// accumulating parameter gradients. All math goes through the rank's device,
// so the same code runs on CPU and GPU.
#include <loom/cpp/plugin.hpp>

#include <map>

class LearnedScale : public loom::Layer {
 public:
  LearnedScale(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), hidden_(args.dims->hidden), ones_(options.declared_string("init") == "ones") {}

  // (1) One parameter of shape [hidden], duplicated on every tensor-parallel rank.
  std::vector<loom::ParamSpec> params() override {
    loom::ParamSpec gain;
    gain.name = "gain";
    gain.shape = {hidden_};
    gain.init = ones_ ? LOOM_INIT_ONES : LOOM_INIT_ZEROS;
    gain.no_weight_decay = true;  // like a norm's weight
    return {gain};
  }

  // (2) The engine owns the memory; we keep pointers into its flat buffers.
  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    gain_ = static_cast<float*>(params[0].data);
    gain_grad_ = static_cast<float*>(grads[0].data);
  }

  // (3) y = x * g, remembering x for this microbatch.
  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t n = numel(*a.input);
    loom::Device dev = rank.device();
    loom::Buffer saved(rank_, n * sizeof(float));
    dev.copy(saved.get(), a.input->data, n * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE);
    dev.elementwise({.op = LOOM_EW_MUL_COLS, .n = n, .cols = hidden_, .x = a.input->data,
                     .y = gain_, .out = a.output->data, .dtype = LOOM_DTYPE_F32});
    if (a.training) saved_[a.microbatch] = std::move(saved);
  }

  // (4) dx = dy * g;  dg += sum over tokens of dy * x.
  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    const int64_t n = numel(*a.grad_output);
    loom::Device dev = rank.device();
    loom::Buffer& x = saved_.at(a.microbatch);
    loom::Buffer dy_x(rank_, n * sizeof(float));
    dev.elementwise({.op = LOOM_EW_MUL, .n = n, .x = a.grad_output->data, .y = x.get(),
                     .out = dy_x.get(), .dtype = LOOM_DTYPE_F32});
    dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = n, .cols = hidden_, .x = dy_x.get(), .out = gain_grad_,
                .accumulate = 1, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
    dev.elementwise({.op = LOOM_EW_MUL_COLS, .n = n, .cols = hidden_, .x = a.grad_output->data,
                     .y = gain_, .out = a.grad_input->data, .dtype = LOOM_DTYPE_F32});
    release(a.microbatch);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

 private:
  static int64_t numel(const DLTensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    return n;
  }

  loom_rank* rank_;
  int64_t hidden_;
  bool ones_;
  float* gain_ = nullptr;
  float* gain_grad_ = nullptr;
  std::map<int32_t, loom::Buffer> saved_;  // x per microbatch in flight
};

// The one registration line: kind "layer", name "learned_scale", its options.
LOOM_PLUGIN_LIBRARY(loom::layer_plugin<LearnedScale>(
    "learned_scale", "1.0.0", "per-channel learned gain y = x * g (SDK sample)",
    {loom::opt_string("init", "ones", "initial gain: ones (the identity) or zeros").one_of("ones|zeros")}))
