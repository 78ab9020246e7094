// layer/mlp: pre-norm feed-forward block with a residual,
//   y = x + dropout(fc2(act(fc1(norm(x)))))
// GPT-2's (LayerNorm, GeLU, biases) by default; Llama's with norm = "rmsnorm",
// activation = "swiglu" (fc1 makes the gate and the up projection, ffn columns each:
// silu(gate) * up) and bias = false.
// Tensor-parallel in Megatron's way, through the parallel/tensor service: fc1 is
// column-parallel (this rank holds ffn/tp columns, of the gate and of the up
// projection under SwiGLU: partition_stride 2; the activation applied locally), fc2
// row-parallel (`g` after it, bias after the reduction). The norm, dropout and
// the residual are duplicated, or run on this rank's sequence shard under
// sequence parallelism. activation_dropout (on the activation's output) is inside the TP
// region and draws from a stream per tp rank.
#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>

#include <map>

namespace {

using namespace loom::layers;

class Mlp : public loom::Layer {
 public:
  Mlp(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()) {
    LOOM_REQUIRE(args.dims != nullptr, "mlp: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "mlp";
    tp_ = loom::TensorParallel(rank_, args.tp, args.sequence_parallel != 0, name_);
    fusion_ = grad_accumulation_fusion(args);
    hidden_ = d.hidden;
    ffn_ = d.ffn_hidden;
    seq_ = d.seq_len / rank.group_or_single("cp").size();  // this rank's rows (its slice under context parallelism)
    micro_batch_ = d.micro_batch;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && ffn_ > 0, name_ << ": hidden and ffn_hidden must be positive");
    LOOM_REQUIRE(ffn_ % tp == 0, name_ << ": ffn_hidden (" << ffn_
                                       << ") must be divisible by the tensor-parallel size ("
                                       << tp << ")");
    ffn_local_ = ffn_ / tp;
    dropout_ = dropout_option(options);
    activation_dropout_ = static_cast<float>(options.declared_float("activation_dropout"));
    norm_ = norm_option(options);
    require_ffn_ops(options, rank.device(), name_);
    swiglu_ = options.declared_string("activation") == "swiglu";
    service_gelu_ = !swiglu_ && (tp_.features() & LOOM_TP_ACTIVATION) != 0;
    const bool bias = options.declared_bool("bias");
    // fc1's columns: ffn, or the gate's ffn then the up projection's under SwiGLU,
    // split with stride 2 so that each tp rank holds [its gate | its up].
    const int32_t parts = swiglu_ ? 2 : 1;
    fc1_local_ = parts * ffn_local_;
    const int64_t H = hidden_, F = ffn_;
    params_ = ParamSet(name_, {.tp = tp});
    ln_w_ = params_.add({.name = "ln.weight", .shape = {H}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
    if (!norm_.rms)
      ln_b_ = params_.add({.name = "ln.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    fc1_w_ = params_.add({.name = "fc1.weight", .shape = {H, parts * F}, .partition_dim = 1,
                          .partition_stride = parts, .init = LOOM_INIT_NORMAL});
    if (bias)
      fc1_b_ = params_.add({.name = "fc1.bias", .shape = {parts * F}, .partition_dim = 0, .partition_stride = parts,
                            .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    fc2_w_ = params_.add({.name = "fc2.weight", .shape = {F, H}, .partition_dim = 0, .init = LOOM_INIT_NORMAL_SCALED});
    if (bias)
      fc2_b_ = params_.add({.name = "fc2.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    w_.assign(params_.size(), nullptr);
    g_.assign(params_.size(), nullptr);
  }

  // Before launch: the ops the options need, of the run's device (create asks the rank's).
  static void validate(const loom::Options& options, const loom::LayerValidation& v) {
    require_ffn_ops(options, v, v.instance_name());
  }

  // Position-independent: a context-parallel slice of the sequence is just fewer rows,
  // and a generation step (kv_cache) an evaluation forward of its rows.
  // Documents (ABI 1.22) need nothing here: no positions are mixed or embedded.
  static constexpr uint64_t kFeatures =
      LOOM_LAYER_CONTEXT_PARALLEL | LOOM_LAYER_KV_CACHE | LOOM_LAYER_DOCUMENTS;

  std::vector<loom::ParamSpec> params() override { return params_.specs(); }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    dt_ = params_.bind(params, grads, w_.data(), g_.data());
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, Fl = ffn_local_, F1 = fc1_local_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    // The input is this rank's sequence shard under sequence parallelism.
    const bool sp = tp_.sequence_parallel();
    const int64_t Sl = a.input->shape[0], B = a.input->shape[1], Tl = Sl * B;
    const int64_t S = sp ? Sl * tp_.size() : Sl, T = S * B;
    require_act(a.output, "output", name_, dt_.act, {Sl, B, H});
    const void* x = data_of<void>(*a.input);
    void* y = data_of<void>(*a.output);
    loom::Device dev = rank.device();
    const bool drop = a.training && dropout_ > 0.0f;
    const bool act_drop = a.training && activation_dropout_ > 0.0f;

    Saved s = saved_layout(S, B, a.training, drop, act_drop);
    s.mem.allocate(rank_);

    ForwardTemps ft = forward_temps(S, B);
    Arena& tmp = ft.mem;
    const size_t ln = ft.ln, ln_full = ft.ln_full, act = ft.act, out = ft.out;
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, Tl * H * dt_.act_bytes());
    norm_.forward(dev, x, w(ln_w_), w(ln_b_), tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), Tl, H, dt_.act);
    // Column-parallel fc1 (f: identity, or the all-gather under SP); the activation locally.
    if (service_gelu_) {  // h and gelu(h) from fc1's call (one GEMM on a device with epilogues)
      tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = F1, .x = tmp.at(ln),
                                          .x_full = sp ? tmp.at(ln_full) : nullptr, .weight = w(fc1_w_),
                                          .bias = w(fc1_b_), .y = tmp.at(act), .dtype = dt_.act,
                                          .pre_activation = s.mem.at(s.h), .activation = LOOM_TP_ACTIVATION_GELU});
    } else {
      tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = F1, .x = tmp.at(ln),
                                          .x_full = sp ? tmp.at(ln_full) : nullptr, .weight = w(fc1_w_),
                                          .bias = w(fc1_b_), .y = s.mem.at(s.h), .dtype = dt_.act});
      activate(dev, s.mem.at(s.h), tmp.at(act), T);
    }
    // Inside the TP region: each tp rank holds other columns, so its own stream.
    if (act_drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_PARALLEL, .n = T * Fl, .x = tmp.at(act), .out = tmp.at(act),
                           .mask = s.mem.at<uint8_t>(s.act_mask), .p = activation_dropout_,
                           .seed = a.dropout_seed, .microbatch = a.microbatch, .stream = 1, .dtype = dt_.act,
                           .seed_device = a.dropout_seed_device});
    // Row-parallel fc2 (g: all-reduce, or reduce-scatter under SP), bias after it.
    void* o = tmp.at<void>(out);
    tp_.row_parallel_linear_forward({.rows = T, .in = Fl, .out = H, .x = tmp.at(act), .weight = w(fc2_w_),
                                     .bias = w(fc2_b_), .y = o, .dtype = dt_.act});
    if (drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = o, .out = o,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch, .dtype = dt_.act,
                           .seed_device = a.dropout_seed_device});
    add(dev, x, o, y, Tl * H, dt_.act);  // the residual

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, Fl = ffn_local_, F1 = fc1_local_, S = s.S, B = s.B, T = S * B;
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B;
    require_act(a.grad_output, "grad_output", name_, dt_.act, {Sl, B, H});
    require_act(a.grad_input, "grad_input", name_, dt_.act, {Sl, B, H});
    const void* dy = data_of<void>(*a.grad_output);
    void* dx = data_of<void>(*a.grad_input);
    loom::Device dev = rank.device();
    GradShadow gs(rank_, dev, dt_, g_, params_.local_numels(), tp_.features(), fusion_);
    auto grad = [&gs](size_t i) { return i == kNone ? nullptr : gs[i]; };

    BackwardTemps bt = backward_temps(S, B, s.dropped);
    Arena& tmp = bt.mem;
    const size_t dout = bt.dout, act = bt.act, dact = bt.dact, ln = bt.ln, ln_full = bt.ln_full, dln = bt.dln;
    const size_t dh = act;
    tmp.allocate(rank_);

    const void* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dout), s.mem.at<uint8_t>(s.mask), Tl * H, dropout_, dt_.act);
      d = tmp.at(dout);
    }
    // fc2 (its input, act(h) after the activation dropout, is recomputed).
    activate(dev, s.mem.at(s.h), tmp.at(act), T);
    if (s.act_dropped)
      dropout_bwd(dev, tmp.at(act), tmp.at(act), s.mem.at<uint8_t>(s.act_mask), T * Fl, activation_dropout_, dt_.act);
    // With the GeLU's backward in fc2's (no activation dropout between them), dh
    // comes straight from it; else dact, then the dropout's and the activation's
    // backwards make dh, the gradient of fc1's output.
    const bool through_gelu = service_gelu_ && !s.act_dropped;
    void* dfc1 = tmp.at(through_gelu ? dact : dh);  // dh
    tp_.row_parallel_linear_backward({.rows = T, .in = Fl, .out = H, .x = tmp.at(act), .weight = w(fc2_w_),
                                      .dy = d, .dx = tmp.at(dact), .dweight = grad(fc2_w_),
                                      .dbias = grad(fc2_b_), .dtype = dt_.act, .grad_fp32 = gs.grad_fp32(),
                                      .pre_activation = through_gelu ? s.mem.at(s.h) : nullptr,
                                      .activation = through_gelu ? LOOM_TP_ACTIVATION_GELU : LOOM_TP_ACTIVATION_NONE});
    if (s.act_dropped)
      dropout_bwd(dev, tmp.at(dact), tmp.at(dact), s.mem.at<uint8_t>(s.act_mask), T * Fl, activation_dropout_, dt_.act);
    if (swiglu_)
      dev.swiglu_bwd({.rows = T, .cols = Fl, .x = s.mem.at(s.h), .dy = tmp.at(dact), .out = dfc1, .dtype = dt_.act});
    else if (!through_gelu)
      dev.gelu_bwd({.n = T * Fl, .x = s.mem.at(s.h), .dy = tmp.at(dact), .out = dfc1, .dtype = dt_.act});
    // fc1 with the norm's output recomputed (and gathered again under SP); f's
    // backward (all-reduce, or reduce-scatter to the shard) closes it.
    const void* ln_in = recompute_ln_input(dev, tp_, s.mem.at(s.x), w(ln_w_), w(ln_b_), s.mem.at(s.mean),
                                           s.mem.at(s.rstd), tmp.at(ln), tmp.at(ln_full), Tl, H, dt_.act, norm_);
    tp_.column_parallel_linear_backward({.rows = T, .in = H, .out = F1, .x = ln_in, .weight = w(fc1_w_),
                                         .dy = dfc1, .dx = tmp.at(dln), .dweight = grad(fc1_w_),
                                         .dbias = grad(fc1_b_), .dtype = dt_.act, .grad_fp32 = gs.grad_fp32()});

    // dx = dy (the residual) + the norm's backward; every read of dy is done above.
    copy_d2d(dev, dx, dy, Tl * H * dt_.act_bytes());
    norm_.backward(dev, tmp.at(dln), s.mem.at(s.x), w(ln_w_), s.mem.at(s.mean), s.mem.at(s.rstd), dx, grad(ln_w_),
                   grad(ln_b_), Tl, H, /*accumulate_dx=*/true, dt_.act, gs.grad_fp32());
    gs.commit();
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  // Device work only, on fixed shapes; the dropouts read the step's seed on the
  // device when the service and device can (ABI 1.3). With tp > 1 the engine does
  // not capture (collectives).
  bool capturable() override {
    return (dropout_ == 0.0f && activation_dropout_ == 0.0f) || dropout_seed_on_device(loom::Rank(rank_).device(), tp_);
  }

  uint64_t activation_bytes() override {
    return saved_layout(seq_, micro_batch_, true, dropout_ > 0.0f, activation_dropout_ > 0.0f).mem.bytes();
  }

  // The larger of a forward's and a backward's temporaries (with the backward's
  // gradient shadows when the gradients are kept in another dtype).
  uint64_t workspace_bytes() override {
    const loom::Device dev = loom::Rank(rank_).device();
    const uint64_t shadows = GradShadow::bytes(dev, dt_, params_.local_numels(), tp_.features(), fusion_);
    return std::max<uint64_t>(forward_temps(seq_, micro_batch_).mem.bytes(),
                              backward_temps(seq_, micro_batch_, dropout_ > 0.0f).mem.bytes() + shadows) +
           sequence_parallel_service_bytes(tp_, seq_ * micro_batch_, hidden_, dt_.act);
  }

  // fc1 2*T*H*F1 + fc2 2*T*Fl*H (F1 = Fl, or 2 Fl under SwiGLU).
  double forward_flops() override {
    const double T = static_cast<double>(seq_ * micro_batch_), H = static_cast<double>(hidden_);
    return 2.0 * T * H * static_cast<double>(fc1_local_) + 2.0 * T * static_cast<double>(ffn_local_) * H;
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);  // a parameter the options leave out
  void* w(size_t i) const { return i == kNone ? nullptr : w_[i]; }

  // act = gelu(h), or silu(gate) * up of h = [gate | up] (T rows).
  void activate(const loom::Device& dev, const void* h, void* act, int64_t T) const {
    if (swiglu_)
      dev.swiglu_fwd({.rows = T, .cols = ffn_local_, .x = h, .out = act, .dtype = dt_.act});
    else
      dev.gelu_fwd({.n = T * ffn_local_, .x = h, .out = act, .dtype = dt_.act});
  }

  // A forward's temporaries over S x B rows (S the whole sequence; this rank's shard
  // under SP): the norm's output (and its gather), the activation, fc2's output.
  struct ForwardTemps {
    Arena mem;
    size_t ln = 0, ln_full = 0, act = 0, out = 0;
  };
  ForwardTemps forward_temps(int64_t S, int64_t B) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    ForwardTemps t;
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp ? T * H : 0, dt_.act);
    t.act = t.mem.elems(T * ffn_local_, dt_.act);
    t.out = t.mem.elems(Tl * H, dt_.act);
    return t;
  }

  // A backward's: act holds the recomputed activation, then (once fc2's backward has
  // read it) dh, the gradient of fc1's output: T x F1; or dh is dact, when fc2's
  // backward makes it.
  struct BackwardTemps {
    Arena mem;
    size_t dout = 0, act = 0, dact = 0, ln = 0, ln_full = 0, dln = 0;
  };
  BackwardTemps backward_temps(int64_t S, int64_t B, bool dropped) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    BackwardTemps t;
    t.dout = t.mem.elems(dropped ? Tl * H : 0, dt_.act);
    t.act = t.mem.elems(T * fc1_local_, dt_.act);
    t.dact = t.mem.elems(T * ffn_local_, dt_.act);
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp ? T * H : 0, dt_.act);
    t.dln = t.mem.elems(Tl * H, dt_.act);
    return t;
  }

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, h = 0, act_mask = 0, mask = 0;
    bool dropped = false, act_dropped = false;
  };

  // What a forward of S x B rows keeps for its backward (laid out, not allocated):
  // activation_bytes() reports the same layout a training forward allocates.
  Saved saved_layout(int64_t S, int64_t B, bool training, bool drop, bool act_drop) const {
    const int64_t T = S * B, Tl = (tp_.sequence_parallel() ? S / tp_.size() : S) * B;
    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.elems(training ? Tl * hidden_ : 0, dt_.act);  // this rank's shard under SP
    s.mean = s.mem.floats(Tl);
    s.rstd = s.mem.floats(Tl);
    s.h = s.mem.elems(T * fc1_local_, dt_.act);  // fc1 output before the activation
    s.act_mask = s.mem.add(act_drop ? T * ffn_local_ : 0);
    s.mask = s.mem.add(drop ? Tl * hidden_ : 0);
    s.dropped = drop;
    s.act_dropped = act_drop;
    return s;
  }

  loom_rank* rank_;
  loom::TensorParallel tp_;
  std::string name_;
  int64_t hidden_ = 0, ffn_ = 0, ffn_local_ = 0, seq_ = 0, micro_batch_ = 0;
  float dropout_ = 0.0f, activation_dropout_ = 0.0f;
  ParamSet params_;
  Dtypes dt_;
  bool fusion_ = false;  // gradient-accumulation fusion allowed (see GradShadow)
  Norm norm_;
  bool swiglu_ = false;
  bool service_gelu_ = false;  // the tp service applies the GeLU (and its backward) in fc1's and fc2's calls
  int64_t fc1_local_ = 0;  // fc1's columns on this rank: ffn_local_, or twice that under SwiGLU
  size_t ln_w_ = kNone, ln_b_ = kNone, fc1_w_ = kNone, fc1_b_ = kNone, fc2_w_ = kNone, fc2_b_ = kNone;
  std::vector<void*> w_, g_;  // by parameter index
  std::map<int32_t, Saved> saved_;
};

}  // namespace

namespace {
std::vector<loom::OptionSpec> mlp_options() {
  std::vector<loom::OptionSpec> o = {
      loom::layers::dropout_option_spec("the MLP output"),
      loom::opt_float("activation_dropout", 0.0,
                      "dropout probability on the activation's output, inside the tensor-parallel region (a stream "
                      "per tp rank; training only)")
          .in("[0, 1)"),
      loom::opt_string("activation", "gelu",
                       "gelu (GPT-2), or swiglu: fc1 makes a gate and an up projection of ffn_hidden_size "
                       "each, silu(gate) * up (Llama)")
          .one_of("gelu|swiglu"),
      loom::opt_bool("bias", true, "fc1 and fc2 have biases (GPT-2); false as Llama")};
  for (loom::OptionSpec& n : loom::layers::norm_option_specs()) o.push_back(std::move(n));
  return o;
}
}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Mlp>(
    "mlp", "1.4.0", "pre-norm feed-forward block with residual: GeLU or SwiGLU, LayerNorm or RMSNorm (tensor-parallel)",
    mlp_options()))
