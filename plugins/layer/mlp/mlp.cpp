// layer/mlp: pre-LayerNorm feed-forward block with a residual,
//   y = x + dropout(fc2(gelu(fc1(LN(x)))))
// Tensor-parallel in Megatron's way, through the parallel/tensor service: fc1 is
// column-parallel (this rank holds ffn/tp columns, GeLU applied locally), fc2
// row-parallel (`g` after it, bias after the reduction). LayerNorm, dropout and
// the residual are duplicated, or run on this rank's sequence shard under
// sequence parallelism. activation_dropout (on the GeLU output) is inside the TP
// region and draws from a stream per tp rank.
#include "../common/layer_math.hpp"

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
    hidden_ = d.hidden;
    ffn_ = d.ffn_hidden;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && ffn_ > 0, name_ << ": hidden and ffn_hidden must be positive");
    LOOM_REQUIRE(ffn_ % tp == 0, name_ << ": ffn_hidden (" << ffn_
                                       << ") must be divisible by the tensor-parallel size ("
                                       << tp << ")");
    ffn_local_ = ffn_ / tp;
    dropout_ = dropout_option(options, name_);
    const double ap = options.get_float("activation_dropout", 0.0);
    LOOM_REQUIRE(ap >= 0.0 && ap < 1.0, name_ << ": option activation_dropout = " << ap << " must be in [0, 1)");
    activation_dropout_ = static_cast<float>(ap);
  }

  std::vector<loom::ParamSpec> params() override {
    std::vector<loom::ParamSpec> p(6);
    p[0] = {.name = "ln.weight", .shape = {hidden_}, .init = LOOM_INIT_ONES, .no_weight_decay = true};
    p[1] = {.name = "ln.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    p[2] = {.name = "fc1.weight", .shape = {hidden_, ffn_}, .partition_dim = 1,
            .init = LOOM_INIT_NORMAL};
    p[3] = {.name = "fc1.bias", .shape = {ffn_}, .partition_dim = 0, .init = LOOM_INIT_ZEROS,
            .no_weight_decay = true};
    p[4] = {.name = "fc2.weight", .shape = {ffn_, hidden_}, .partition_dim = 0,
            .init = LOOM_INIT_NORMAL_SCALED};
    p[5] = {.name = "fc2.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    return p;
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    LOOM_REQUIRE(params.size() == 6 && grads.size() == 6,
                 name_ << ": bind expects 6 parameters, got " << params.size());
    const int64_t H = hidden_, Fl = ffn_local_;
    const int64_t expect[6] = {H, H, H * Fl, Fl, Fl * H, H};
    const char* names[6] = {"ln.weight", "ln.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    for (int i = 0; i < 6; ++i) {
      w_[i] = bound(params[i], expect[i], name_, names[i]);
      g_[i] = bound(grads[i], expect[i], name_, std::string(names[i]) + " (grad)");
    }
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, Fl = ffn_local_;
    require_tensor(a.input, "input", name_, kDLFloat, 32, {-1, -1, H});
    // The input is this rank's sequence shard under sequence parallelism.
    const bool sp = tp_.sequence_parallel();
    const int64_t Sl = a.input->shape[0], B = a.input->shape[1], Tl = Sl * B;
    const int64_t S = sp ? Sl * tp_.size() : Sl, T = S * B;
    require_tensor(a.output, "output", name_, kDLFloat, 32, {Sl, B, H});
    const float* x = data_of<float>(*a.input);
    float* y = data_of<float>(*a.output);
    loom::Device dev = rank.device();
    const bool drop = a.training && dropout_ > 0.0f;
    const bool act_drop = a.training && activation_dropout_ > 0.0f;

    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.floats(a.training ? Tl * H : 0);
    s.mean = s.mem.floats(Tl);
    s.rstd = s.mem.floats(Tl);
    s.ln_full = s.mem.floats(sp ? T * H : 0);  // the gathered LN output (kept for dW)
    s.h = s.mem.floats(T * Fl);                // fc1 output before GeLU
    s.act_mask = s.mem.add(act_drop ? T * Fl : 0);
    s.mask = s.mem.add(drop ? Tl * H : 0);
    s.dropped = drop;
    s.act_dropped = act_drop;
    s.mem.allocate(rank_);

    Arena tmp;
    const size_t ln = tmp.floats(Tl * H), act = tmp.floats(T * Fl), out = tmp.floats(Tl * H);
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, Tl * H * sizeof(float));
    layernorm_fwd(dev, x, w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), Tl, H,
                  kLayerNormEps);
    // Column-parallel fc1 (f: identity, or the all-gather under SP); GeLU locally.
    tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = Fl, .x = tmp.at(ln),
                                        .x_full = sp ? s.mem.at(s.ln_full) : nullptr, .weight = w_[kFc1W],
                                        .bias = w_[kFc1B], .y = s.mem.at(s.h)});
    dev.gelu_fwd({.n = T * Fl, .x = s.mem.at(s.h), .out = tmp.at(act), .dtype = LOOM_DTYPE_F32});
    // Inside the TP region: each tp rank holds other columns, so its own stream.
    if (act_drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_PARALLEL, .n = T * Fl, .x = tmp.at(act), .out = tmp.at(act),
                           .mask = s.mem.at<uint8_t>(s.act_mask), .p = activation_dropout_,
                           .seed = a.dropout_seed, .microbatch = a.microbatch, .stream = 1});
    // Row-parallel fc2 (g: all-reduce, or reduce-scatter under SP), bias after it.
    float* o = tmp.at(out);
    tp_.row_parallel_linear_forward({.rows = T, .in = Fl, .out = H, .x = tmp.at(act), .weight = w_[kFc2W],
                                     .bias = w_[kFc2B], .y = o});
    if (drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = o, .out = o,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch});
    add(dev, x, o, y, Tl * H);  // the residual

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, Fl = ffn_local_, S = s.S, B = s.B, T = S * B;
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B;
    require_tensor(a.grad_output, "grad_output", name_, kDLFloat, 32, {Sl, B, H});
    require_tensor(a.grad_input, "grad_input", name_, kDLFloat, 32, {Sl, B, H});
    const float* dy = data_of<float>(*a.grad_output);
    float* dx = data_of<float>(*a.grad_input);
    loom::Device dev = rank.device();

    Arena tmp;
    const size_t dout = tmp.floats(s.dropped ? Tl * H : 0), act = tmp.floats(T * Fl),
                 dact = tmp.floats(T * Fl), ln = tmp.floats(sp ? 0 : T * H), dln = tmp.floats(Tl * H);
    tmp.allocate(rank_);

    const float* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dout), s.mem.at<uint8_t>(s.mask), Tl * H, dropout_);
      d = tmp.at(dout);
    }
    // fc2 (its input, gelu(h) after the activation dropout, is recomputed).
    dev.gelu_fwd({.n = T * Fl, .x = s.mem.at(s.h), .out = tmp.at(act), .dtype = LOOM_DTYPE_F32});
    if (s.act_dropped)
      dropout_bwd(dev, tmp.at(act), tmp.at(act), s.mem.at<uint8_t>(s.act_mask), T * Fl, activation_dropout_);
    tp_.row_parallel_linear_backward({.rows = T, .in = Fl, .out = H, .x = tmp.at(act), .weight = w_[kFc2W],
                                      .dy = d, .dx = tmp.at(dact), .dweight = g_[kFc2W], .dbias = g_[kFc2B]});
    if (s.act_dropped)
      dropout_bwd(dev, tmp.at(dact), tmp.at(dact), s.mem.at<uint8_t>(s.act_mask), T * Fl, activation_dropout_);
    // GeLU backward into the buffer of the recomputed activation (no longer needed).
    dev.gelu_bwd({.n = T * Fl, .x = s.mem.at(s.h), .dy = tmp.at(dact), .out = tmp.at(act),
                  .dtype = LOOM_DTYPE_F32});
    // fc1 with the LN output kept gathered under SP, else recomputed; f's backward
    // (all-reduce, or reduce-scatter to the shard) closes it.
    const float* ln_in = sp ? s.mem.at(s.ln_full) : tmp.at(ln);
    if (!sp)
      layernorm_fwd(dev, s.mem.at(s.x), w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), T, H,
                    kLayerNormEps);
    tp_.column_parallel_linear_backward({.rows = T, .in = H, .out = Fl, .x = ln_in, .weight = w_[kFc1W],
                                         .dy = tmp.at(act), .dx = tmp.at(dln), .dweight = g_[kFc1W],
                                         .dbias = g_[kFc1B]});

    // dx = dy (the residual) + LN backward; every read of dy is done above.
    copy_d2d(dev, dx, dy, Tl * H * sizeof(float));
    layernorm_bwd(dev, tmp.at(dln), s.mem.at(s.x), w_[kLnW], s.mem.at(s.mean), s.mem.at(s.rstd), dx,
                  g_[kLnW], g_[kLnB], Tl, H, /*accumulate_dx=*/true);
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  uint64_t activation_bytes() override {
    const int64_t T = seq_ * micro_batch_, H = hidden_, Fl = ffn_local_;
    const bool sp = tp_.sequence_parallel();
    const int64_t Tl = sp ? T / tp_.size() : T;
    Arena a;
    a.floats(Tl * H);                                // x (this rank's shard under SP)
    a.floats(Tl);                                    // mean
    a.floats(Tl);                                    // rstd
    a.floats(sp ? T * H : 0);                        // the gathered LN output (SP)
    a.floats(T * Fl);                                // fc1 output
    a.add(activation_dropout_ > 0.0f ? T * Fl : 0);  // activation dropout mask
    a.add(dropout_ > 0.0f ? Tl * H : 0);             // dropout mask
    return a.bytes();
  }

  // fc1 2*T*H*Fl + fc2 2*T*Fl*H.
  double forward_flops() override {
    const double T = static_cast<double>(seq_ * micro_batch_);
    return 4.0 * T * static_cast<double>(hidden_) * static_cast<double>(ffn_local_);
  }

 private:
  enum { kLnW, kLnB, kFc1W, kFc1B, kFc2W, kFc2B };

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, ln_full = 0, h = 0, act_mask = 0, mask = 0;
    bool dropped = false, act_dropped = false;
  };

  loom_rank* rank_;
  loom::TensorParallel tp_;
  std::string name_;
  int64_t hidden_ = 0, ffn_ = 0, ffn_local_ = 0, seq_ = 0, micro_batch_ = 0;
  float dropout_ = 0.0f, activation_dropout_ = 0.0f;
  float* w_[6] = {};
  float* g_[6] = {};
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Mlp>(
    "mlp", "1.1.0", "pre-LN GeLU feed-forward block with residual (tensor-parallel)",
    {loom::layers::dropout_option_spec("the MLP output"),
     loom::opt_float("activation_dropout", 0.0,
                     "dropout probability on the GeLU output, inside the tensor-parallel region (a stream "
                     "per tp rank; training only)")}))
