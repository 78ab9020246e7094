// layer/faulty_scale: a per-channel gain y = x * g (as samples/learned_scale) with
// the mistakes layer authors make, chosen by the option `fault`, so the harness's
// tests can show that each check catches its kind of mistake:
//   none          correct
//   gradient      the gain's gradient twice too large
//   overwrite     the gain's gradient overwritten instead of accumulated
//   input         grad_input accumulated into instead of overwritten
//   shared_state  one saved input for all microbatches in flight
//   reduce        the gain's gradient all-reduced over tp by the layer (the engine
//                 does that for sequence parallelism; without it every rank's is whole)
//   kv_cache      LOOM_LAYER_KV_CACHE declared (as always here), but a kv_cache forward
//                 (generation) leaves its output unwritten
//   grad_overrun  one value written past the end of the gain's gradient (in the
//                 engine's flat buffer: into the next parameter's gradient)
//   input_overrun grad_input written one value too long
//   writes_input  a forward that scales its input in place
//   workspace     a backward temporary of 64 KiB that workspace_bytes leaves out
//   leak          a backward that leaves a copy of the saved input allocated
// With `state` (ABI 1.23) it keeps the rows its training microbatches saw as layer
// state: "backward" counts them in backward, each row on one rank (its sequence shard
// under sequence parallelism, else tp rank 0), summed over the ranks holding the layer
// at the step's end (correct); "forward" counts in forward (twice when recomputed, and
// for forwards never trained); "unreduced" counts every row a rank sees and never sums
// over the ranks (under sequence parallelism their copies drift apart); "nan" ends each
// step on a NaN; "none" declares no state.
// And, with the option `fail_forward` = N > 0, its N-th training forward fails (a
// rank that stops in the middle of a step, for the engine's failure tests). With
// `borrow_input` = true (no mistake) the backward reads the forward's input where it
// was given instead of a copy: the ABI keeps that memory until the backward.

#include <loom/cpp/plugin.hpp>

#include <cmath>
#include <map>
#include <string>

namespace {

class FaultyScale : public loom::Layer {
 public:
  FaultyScale(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), tp_(args.tp), hidden_(args.dims->hidden),
        rows_(args.dims->seq_len / (args.sequence_parallel != 0 && args.tp.size > 1 ? args.tp.size : 1) *
              args.dims->micro_batch),
        fault_(options.declared_string("fault")),
        fail_forward_(options.declared_int("fail_forward")), borrow_input_(options.declared_bool("borrow_input")),
        state_(options.declared_string("state")), sequence_parallel_(args.sequence_parallel != 0) {}

  // The saved input; the backward's three temporaries (dy * x, the gain's gradient, dx).
  uint64_t activation_bytes() override { return static_cast<uint64_t>(rows_ * hidden_) * sizeof(float); }
  uint64_t workspace_bytes() override { return static_cast<uint64_t>(2 * rows_ * hidden_ + hidden_) * sizeof(float); }

  std::vector<loom::StateSpec> state() override {
    if (state_ == "none") return {};
    return {{.name = "rows_seen", .data = &rows_seen_, .count = 1}};
  }

  void end_step(loom::Rank& rank, const loom_layer_step_end_args&) override {
    double rows = static_cast<double>(step_rows_);
    const loom::Group holders = rank.group_or_single("tp-dp-cp");
    if (state_ != "unreduced" && holders.size() > 1) {
      loom::Device dev = rank.device();
      loom::Buffer d(rank_, sizeof(double));
      dev.copy(d.get(), &rows, sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
      holders.all_reduce(dev.native_stream(), d.get(), d.get(), 1, LOOM_DTYPE_F64);
      dev.copy(&rows, d.get(), sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
      dev.synchronize();
    }
    rows_seen_ = state_ == "nan" ? std::nanf("") : rows_seen_ + static_cast<float>(rows);
    step_rows_ = 0;
  }

  std::vector<loom::ParamSpec> params() override {
    loom::ParamSpec gain;
    gain.name = "gain";
    gain.shape = {hidden_};
    gain.init = LOOM_INIT_ONES;
    return {gain};
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    gain_ = static_cast<float*>(params[0].data);
    gain_grad_ = static_cast<float*>(grads[0].data);
  }

  // Position-wise: generation's kv_cache forwards are evaluation forwards of their rows.
  static constexpr uint64_t kFeatures = LOOM_LAYER_KV_CACHE;

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    if (a.kv_cache && fault_ == "kv_cache") return;
    if (a.training && ++training_forwards_ == fail_forward_)
      throw loom::Error("faulty_scale: training forward " + std::to_string(fail_forward_) + " fails as told");
    const int64_t n = numel(*a.input);
    loom::Device dev = rank.device();
    const int32_t key = fault_ == "shared_state" ? 0 : a.microbatch;
    loom::Buffer saved(rank_, n * sizeof(float));
    dev.copy(saved.get(), a.input->data, n * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE);
    dev.elementwise({.op = LOOM_EW_MUL_COLS, .n = n, .cols = hidden_, .x = a.input->data, .y = gain_,
                     .out = a.output->data, .dtype = LOOM_DTYPE_F32});
    if (fault_ == "writes_input")
      dev.elementwise({.op = LOOM_EW_SCALE, .n = n, .x = a.input->data, .out = a.input->data, .alpha = 0.5f,
                       .dtype = LOOM_DTYPE_F32});
    if (a.training) saved_[key] = std::move(saved);
    if (a.training && state_ == "forward" && (sequence_parallel_ || tp_.rank() == 0)) step_rows_ += n / hidden_;
    if (a.training) borrowed_[key] = static_cast<const float*>(a.input->data);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    const int64_t n = numel(*a.grad_output);
    loom::Device dev = rank.device();
    const int32_t key = fault_ == "shared_state" ? 0 : a.microbatch;
    loom::Buffer dy_x(rank_, n * sizeof(float));
    void* input = borrow_input_ ? const_cast<float*>(borrowed_.at(key)) : saved_.at(key).get();  // y is read only by MUL
    dev.elementwise({.op = LOOM_EW_MUL, .n = n, .x = a.grad_output->data, .y = input, .out = dy_x.get(),
                     .dtype = LOOM_DTYPE_F32});
    loom::Buffer dg(rank_, hidden_ * sizeof(float));
    loom::Buffer undeclared(rank_, fault_ == "workspace" ? 64 * 1024 : 0);
    if (fault_ == "leak") leaked_.push_back(std::move(saved_.at(key)));
    dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = n, .cols = hidden_, .x = dy_x.get(), .out = dg.get(),
                .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
    if (fault_ == "reduce")
      tp_.all_reduce(dev.native_stream(), dg.get(), dg.get(), static_cast<size_t>(hidden_), LOOM_DTYPE_F32);
    const float scale = fault_ == "gradient" ? 2.0f : 1.0f;
    if (fault_ == "overwrite")
      dev.copy(gain_grad_, dg.get(), hidden_ * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE);
    else if (fault_ == "grad_overrun")  // adds dg[0..hidden) into gain_grad_[1..hidden]: one past the end
      dev.elementwise({.op = LOOM_EW_AXPBY, .n = hidden_, .x = dg.get(), .y = gain_grad_ + 1, .alpha = 1.0f,
                       .beta = 1.0f, .dtype = LOOM_DTYPE_F32});
    else
      dev.elementwise({.op = LOOM_EW_AXPBY, .n = hidden_, .x = dg.get(), .y = gain_grad_, .alpha = scale,
                       .beta = 1.0f, .dtype = LOOM_DTYPE_F32});
    // dx = dy * g, or (fault "input") dx += dy * g.
    loom::Buffer dx(rank_, n * sizeof(float));
    dev.elementwise({.op = LOOM_EW_MUL_COLS, .n = n, .cols = hidden_, .x = a.grad_output->data, .y = gain_,
                     .out = dx.get(), .dtype = LOOM_DTYPE_F32});
    if (fault_ == "input")
      dev.elementwise({.op = LOOM_EW_AXPBY, .n = n, .x = dx.get(), .y = a.grad_input->data, .alpha = 1.0f,
                       .beta = 1.0f, .dtype = LOOM_DTYPE_F32});
    else
      dev.copy(a.grad_input->data, dx.get(), n * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE);
    if (fault_ == "input_overrun") dev.copy(static_cast<float*>(a.grad_input->data) + n, dx.get(), sizeof(float),
                                            LOOM_COPY_DEVICE_TO_DEVICE);
    dev.synchronize();  // the temporaries die here
    // Each row counted on one rank: its shard's under SP, else tp rank 0's (the others hold the same rows).
    const bool counts = sequence_parallel_ || tp_.rank() == 0 || state_ == "unreduced";
    if (counts && (state_ == "backward" || state_ == "unreduced" || state_ == "nan")) step_rows_ += n / hidden_;
    saved_.erase(key);
    borrowed_.erase(key);
  }

  void release(int32_t microbatch) override {
    saved_.erase(fault_ == "shared_state" ? 0 : microbatch);
    borrowed_.erase(fault_ == "shared_state" ? 0 : microbatch);
  }

 private:
  static int64_t numel(const DLTensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    return n;
  }

  loom_rank* rank_;
  loom::Group tp_;
  int64_t hidden_;
  int64_t rows_;  // of this rank's hidden states
  std::string fault_;
  int64_t fail_forward_ = 0;
  int64_t training_forwards_ = 0;
  bool borrow_input_ = false;
  std::string state_;
  bool sequence_parallel_ = false;
  float rows_seen_ = 0;   // the state: rows of the trained microbatches so far
  int64_t step_rows_ = 0;  // this step's, until end_step
  std::map<int32_t, const float*> borrowed_;  // each microbatch's input as the forward was given it
  float* gain_ = nullptr;
  float* gain_grad_ = nullptr;
  std::map<int32_t, loom::Buffer> saved_;
  std::vector<loom::Buffer> leaked_;  // fault "leak"
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<FaultyScale>(
    "faulty_scale", "1.0.0", "y = x * g with a chosen mistake (the layer harness's own tests)",
    {loom::opt_string("fault", "none", "which mistake to make")
         .one_of("none|gradient|overwrite|input|shared_state|reduce|kv_cache|grad_overrun|input_overrun|writes_input|"
                 "workspace|leak"),
     loom::opt_int("fail_forward", 0, "the training forward (1, 2, ...) that fails; 0 = none"),
     loom::opt_bool("borrow_input", false, "the backward reads the forward's input where it was given"),
     loom::opt_string("state", "none", "layer state: the rows seen, counted in backward, in forward, not summed over ranks, or NaN")
         .one_of("none|backward|forward|unreduced|nan")}))
