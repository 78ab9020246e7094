// layer/attention: pre-LayerNorm causal multi-head self-attention with a residual,
//   y = x + dropout(proj(attn(LN(x))))
// Tensor-parallel in Megatron's way: the QKV GEMM is column-parallel (this rank
// holds heads/tp heads), the output projection row-parallel; `g` (all-reduce over
// tp) follows the projection GEMM in forward, `f` (all-reduce of the gradient of
// the LN output) closes the backward. LayerNorm, bias, dropout and the residual
// are duplicated on every tp rank. The k part of qkv.bias gets an exactly-zero
// gradient (see backward): it cannot change the output.
#include "../common/layer_math.hpp"

#include <cmath>
#include <map>

namespace {

using namespace loom::layers;

class Attention : public loom::Layer {
 public:
  Attention(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), tp_(args.tp) {
    LOOM_REQUIRE(args.dims != nullptr, "attention: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "attention";
    hidden_ = d.hidden;
    heads_ = d.heads;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && heads_ > 0 && hidden_ % heads_ == 0,
                 name_ << ": hidden (" << hidden_ << ") must be a positive multiple of heads ("
                       << heads_ << ")");
    LOOM_REQUIRE(heads_ % tp == 0, name_ << ": heads (" << heads_
                                         << ") must be divisible by the tensor-parallel size ("
                                         << tp << ")");
    head_dim_ = hidden_ / heads_;
    heads_local_ = heads_ / tp;
    hidden_local_ = heads_local_ * head_dim_;
    dropout_ = dropout_option(options, name_);
  }

  std::vector<loom::ParamSpec> params() override {
    std::vector<loom::ParamSpec> p(6);
    p[0] = {.name = "ln.weight", .shape = {hidden_}, .init = LOOM_INIT_ONES, .no_weight_decay = true};
    p[1] = {.name = "ln.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    p[2] = {.name = "qkv.weight", .shape = {hidden_, 3 * hidden_}, .partition_dim = 1,
            .partition_stride = 3, .init = LOOM_INIT_NORMAL};
    p[3] = {.name = "qkv.bias", .shape = {3 * hidden_}, .partition_dim = 0, .partition_stride = 3,
            .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    p[4] = {.name = "proj.weight", .shape = {hidden_, hidden_}, .partition_dim = 0,
            .init = LOOM_INIT_NORMAL_SCALED};
    p[5] = {.name = "proj.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    return p;
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    LOOM_REQUIRE(params.size() == 6 && grads.size() == 6,
                 name_ << ": bind expects 6 parameters, got " << params.size());
    const int64_t H = hidden_, Hl = hidden_local_;
    const int64_t expect[6] = {H, H, H * 3 * Hl, 3 * Hl, Hl * H, H};
    const char* names[6] = {"ln.weight", "ln.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"};
    for (int i = 0; i < 6; ++i) {
      w_[i] = bound(params[i], expect[i], name_, names[i]);
      g_[i] = bound(grads[i], expect[i], name_, std::string(names[i]) + " (grad)");
    }
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, Hl = hidden_local_;
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
    s.qkv = s.mem.floats(T * 3 * Hl);
    s.ctx = s.mem.floats(T * Hl);
    s.lse = s.mem.floats(B * heads_local_ * S);
    s.mask = s.mem.add(drop ? T * H : 0);
    s.dropped = drop;
    s.mem.allocate(rank_);

    Arena tmp;
    const size_t ln = tmp.floats(T * H), proj = tmp.floats(T * H);
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, T * H * sizeof(float));
    layernorm_fwd(dev, x, w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), T, H,
                  kLayerNormEps);
    // Column-parallel QKV: local columns [q | k | v], each heads_local * head_dim.
    linear_fwd(dev, tmp.at(ln), w_[kQkvW], w_[kQkvB], s.mem.at(s.qkv), T, H, 3 * Hl);
    dev.attention_fwd(attention_args(s));
    // Row-parallel projection; g: all-reduce the partial sums, then the bias.
    float* p = tmp.at(proj);
    gemm(dev, false, false, T, H, Hl, s.mem.at(s.ctx), w_[kProjW], p, 0.0f);
    tp_.all_reduce(dev.native_stream(), p, p, static_cast<size_t>(T * H), LOOM_DTYPE_F32);
    add_bias(dev, p, w_[kProjB], p, T, H);
    if (drop)
      dropout_fwd(dev, p, p, s.mem.at<uint8_t>(s.mask), T * H, dropout_,
                  dropout_seed(a.dropout_seed, name_, a.microbatch));
    add(dev, x, p, y, T * H);  // the residual

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const int64_t H = hidden_, Hl = hidden_local_, S = s.S, B = s.B, T = S * B;
    require_tensor(a.grad_output, "grad_output", name_, kDLFloat, 32, {S, B, H});
    require_tensor(a.grad_input, "grad_input", name_, kDLFloat, 32, {S, B, H});
    const float* dy = data_of<float>(*a.grad_output);
    float* dx = data_of<float>(*a.grad_input);
    loom::Device dev = rank.device();

    Arena tmp;
    const size_t dproj = tmp.floats(s.dropped ? T * H : 0), ln = tmp.floats(T * H),
                 dctx = tmp.floats(T * Hl), dqkv = tmp.floats(T * 3 * Hl), dln = tmp.floats(T * H),
                 dbias = tmp.floats(3 * Hl);
    tmp.allocate(rank_);

    // Through dropout; the bias and the projection (g's backward is the identity).
    const float* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dproj), s.mem.at<uint8_t>(s.mask), T * H, dropout_);
      d = tmp.at(dproj);
    }
    linear_bwd(dev, s.mem.at(s.ctx), w_[kProjW], d, tmp.at(dctx), g_[kProjW], g_[kProjB], T, Hl, H);

    loom_attention_args att = attention_args(s);
    att.dout = tmp.at(dctx);
    att.dq = tmp.at(dqkv);
    att.dk = tmp.at(dqkv) + Hl;
    att.dv = tmp.at(dqkv) + 2 * Hl;
    dev.attention_bwd(att);

    // The LN output is recomputed rather than saved (same op, same input).
    layernorm_fwd(dev, s.mem.at(s.x), w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean),
                  s.mem.at(s.rstd), T, H, kLayerNormEps);
    linear_bwd(dev, tmp.at(ln), w_[kQkvW], tmp.at(dqkv), tmp.at(dln), g_[kQkvW], nullptr, T, H,
               3 * Hl);
    // qkv.bias: only its q and v parts get a gradient. The k part's is exactly zero
    // (softmax is invariant to adding one vector to every key: each row of dS sums
    // to 0, so sum_t dK[t] = 0); summing dK would only accumulate rounding noise,
    // which Adam (g / sqrt(v)) turns into real, run-dependent updates.
    float* colsum = tmp.at(dbias);
    column_sum(dev, tmp.at(dqkv), colsum, T, 3 * Hl);
    add(dev, g_[kQkvB], colsum, g_[kQkvB], Hl);                             // q
    add(dev, g_[kQkvB] + 2 * Hl, colsum + 2 * Hl, g_[kQkvB] + 2 * Hl, Hl);  // v
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
    const int64_t T = seq_ * micro_batch_, H = hidden_, Hl = hidden_local_;
    Arena a;
    a.floats(T * H);                          // x
    a.floats(T);                              // mean
    a.floats(T);                              // rstd
    a.floats(T * 3 * Hl);                     // qkv
    a.floats(T * Hl);                         // attention output
    a.floats(micro_batch_ * heads_local_ * seq_);  // lse
    a.add(dropout_ > 0.0f ? T * H : 0);       // dropout mask
    return a.bytes();
  }

  // QKV 2*T*H*3Hl + QK^T 2*T*S*Hl + PV 2*T*S*Hl + proj 2*T*Hl*H (causal counted as full).
  double forward_flops() override {
    const double T = static_cast<double>(seq_ * micro_batch_), S = static_cast<double>(seq_);
    const double H = static_cast<double>(hidden_), Hl = static_cast<double>(hidden_local_);
    return 2.0 * T * H * 3.0 * Hl + 4.0 * T * S * Hl + 2.0 * T * Hl * H;
  }

 private:
  enum { kLnW, kLnB, kQkvW, kQkvB, kProjW, kProjB };

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, qkv = 0, ctx = 0, lse = 0, mask = 0;
    bool dropped = false;
  };

  // q, k, v inside the packed [T, 3*Hl] activation; row r = s*B + b.
  loom_attention_args attention_args(const Saved& s) const {
    const int64_t Hl = hidden_local_;
    loom_attention_args at = loom::make<loom_attention_args>();
    at.batch = s.B;
    at.seq = s.S;
    at.heads = heads_local_;
    at.head_dim = head_dim_;
    at.qkv_stride_b = 3 * Hl;
    at.qkv_stride_s = s.B * 3 * Hl;
    at.out_stride_b = Hl;
    at.out_stride_s = s.B * Hl;
    float* qkv = s.mem.at(s.qkv);
    at.q = qkv;
    at.k = qkv + Hl;
    at.v = qkv + 2 * Hl;
    at.out = s.mem.at(s.ctx);
    at.lse = s.mem.at(s.lse);
    at.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim_)));
    at.causal = 1;
    at.dtype = LOOM_DTYPE_F32;
    return at;
  }

  loom_rank* rank_;
  loom::Group tp_;
  std::string name_;
  int64_t hidden_ = 0, heads_ = 0, seq_ = 0, micro_batch_ = 0;
  int64_t head_dim_ = 0, heads_local_ = 0, hidden_local_ = 0;
  float dropout_ = 0.0f;
  float* w_[6] = {};
  float* g_[6] = {};
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Attention>(
    "attention", "1.0.0", "pre-LN causal multi-head self-attention with residual (tensor-parallel)",
    {loom::layers::dropout_option_spec("the attention output")}))
