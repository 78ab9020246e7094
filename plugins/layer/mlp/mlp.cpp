// layer/mlp: pre-LayerNorm feed-forward block with a residual,
//   y = x + dropout(fc2(gelu(fc1(LN(x)))))
// Tensor-parallel in Megatron's way: fc1 is column-parallel (this rank holds
// ffn/tp columns, GeLU applied locally), fc2 row-parallel; `g` (all-reduce over
// tp) follows the fc2 GEMM in forward, `f` (all-reduce of the gradient of the LN
// output) closes the backward.
#include "../common/layer_math.hpp"

#include <map>

namespace {

using namespace loom::layers;

class Mlp : public loom::Layer {
 public:
  Mlp(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), tp_(args.tp) {
    LOOM_REQUIRE(args.dims != nullptr, "mlp: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "mlp";
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
    const int64_t S = a.input->shape[0], B = a.input->shape[1], T = S * B;
    require_tensor(a.output, "output", name_, kDLFloat, 32, {S, B, H});
    const float* x = data_of<float>(*a.input);
    float* y = data_of<float>(*a.output);
    loom::Device dev = rank.device();
    const bool drop = a.training && dropout_ > 0.0f;

    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.floats(a.training ? T * H : 0);
    s.mean = s.mem.floats(T);
    s.rstd = s.mem.floats(T);
    s.h = s.mem.floats(T * Fl);  // fc1 output before GeLU
    s.mask = s.mem.add(drop ? T * H : 0);
    s.dropped = drop;
    s.mem.allocate(rank_);

    Arena tmp;
    const size_t ln = tmp.floats(T * H), act = tmp.floats(T * Fl), out = tmp.floats(T * H);
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, T * H * sizeof(float));
    layernorm_fwd(dev, x, w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), T, H,
                  kLayerNormEps);
    linear_fwd(dev, tmp.at(ln), w_[kFc1W], w_[kFc1B], s.mem.at(s.h), T, H, Fl);  // column-parallel
    dev.gelu_fwd({.n = T * Fl, .x = s.mem.at(s.h), .out = tmp.at(act), .dtype = LOOM_DTYPE_F32});
    // Row-parallel fc2; g: all-reduce the partial sums, then the bias.
    float* o = tmp.at(out);
    gemm(dev, false, false, T, H, Fl, tmp.at(act), w_[kFc2W], o, 0.0f);
    tp_.all_reduce(dev.native_stream(), o, o, static_cast<size_t>(T * H), LOOM_DTYPE_F32);
    add_bias(dev, o, w_[kFc2B], o, T, H);
    if (drop)
      dropout_fwd(dev, o, o, s.mem.at<uint8_t>(s.mask), T * H, dropout_,
                  dropout_seed(a.dropout_seed, name_, a.microbatch));
    add(dev, x, o, y, T * H);  // the residual

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const int64_t H = hidden_, Fl = ffn_local_, S = s.S, B = s.B, T = S * B;
    require_tensor(a.grad_output, "grad_output", name_, kDLFloat, 32, {S, B, H});
    require_tensor(a.grad_input, "grad_input", name_, kDLFloat, 32, {S, B, H});
    const float* dy = data_of<float>(*a.grad_output);
    float* dx = data_of<float>(*a.grad_input);
    loom::Device dev = rank.device();

    Arena tmp;
    const size_t dout = tmp.floats(s.dropped ? T * H : 0), act = tmp.floats(T * Fl),
                 dact = tmp.floats(T * Fl), ln = tmp.floats(T * H), dln = tmp.floats(T * H);
    tmp.allocate(rank_);

    const float* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dout), s.mem.at<uint8_t>(s.mask), T * H, dropout_);
      d = tmp.at(dout);
    }
    // fc2 (its input, gelu(h), is recomputed); g's backward is the identity.
    dev.gelu_fwd({.n = T * Fl, .x = s.mem.at(s.h), .out = tmp.at(act), .dtype = LOOM_DTYPE_F32});
    linear_bwd(dev, tmp.at(act), w_[kFc2W], d, tmp.at(dact), g_[kFc2W], g_[kFc2B], T, Fl, H);
    // GeLU backward into the buffer of the recomputed activation (no longer needed).
    dev.gelu_bwd({.n = T * Fl, .x = s.mem.at(s.h), .dy = tmp.at(dact), .out = tmp.at(act),
                  .dtype = LOOM_DTYPE_F32});
    // fc1, with the LN output recomputed.
    layernorm_fwd(dev, s.mem.at(s.x), w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean),
                  s.mem.at(s.rstd), T, H, kLayerNormEps);
    linear_bwd(dev, tmp.at(ln), w_[kFc1W], tmp.at(act), tmp.at(dln), g_[kFc1W], g_[kFc1B], T, H, Fl);
    // f: the gradient w.r.t. the input of the column-parallel GEMM is summed over tp.
    tp_.all_reduce(dev.native_stream(), tmp.at(dln), tmp.at(dln), static_cast<size_t>(T * H),
                   LOOM_DTYPE_F32);

    // dx = dy (the residual) + LN backward; every read of dy is done above.
    copy_d2d(dev, dx, dy, T * H * sizeof(float));
    layernorm_bwd(dev, tmp.at(dln), s.mem.at(s.x), w_[kLnW], s.mem.at(s.mean), s.mem.at(s.rstd), dx,
                  g_[kLnW], g_[kLnB], T, H, /*accumulate_dx=*/true);
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  uint64_t activation_bytes() override {
    const int64_t T = seq_ * micro_batch_, H = hidden_, Fl = ffn_local_;
    Arena a;
    a.floats(T * H);                     // x
    a.floats(T);                         // mean
    a.floats(T);                         // rstd
    a.floats(T * Fl);                    // fc1 output
    a.add(dropout_ > 0.0f ? T * H : 0);  // dropout mask
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
    size_t x = 0, mean = 0, rstd = 0, h = 0, mask = 0;
    bool dropped = false;
  };

  loom_rank* rank_;
  loom::Group tp_;
  std::string name_;
  int64_t hidden_ = 0, ffn_ = 0, ffn_local_ = 0, seq_ = 0, micro_batch_ = 0;
  float dropout_ = 0.0f;
  float* w_[6] = {};
  float* g_[6] = {};
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Mlp>(
    "mlp", "1.0.0", "pre-LN GeLU feed-forward block with residual (tensor-parallel)",
    {loom::layers::dropout_option_spec("the MLP output")}))
