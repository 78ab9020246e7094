// layer/lm_head: final LayerNorm, output logits and softmax cross-entropy, the last layer.
//   logits = LN(x) W^T,  loss[t] = logsumexp(logits[t]) - logits[t, target[t]]
// W [padded_vocab, hidden] is vocab-parallel (this rank holds V_local rows) and,
// with tied embeddings, shares the word embedding's storage (tie_key
// "word_embedding"). The logits stay split: cross-entropy runs on the local slice
// with two all-reduces of per-token scalars (row max, then sum-exp and target
// logit), so only O(tokens) floats cross ranks, never O(tokens * vocab).
#include "../common/layer_math.hpp"

#include <algorithm>
#include <limits>
#include <map>

namespace {

using namespace loom::layers;

class LmHead : public loom::Layer {
 public:
  LmHead(const loom::Options& /*options*/, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), tp_(args.tp) {
    LOOM_REQUIRE(args.dims != nullptr, "lm_head: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "lm_head";
    hidden_ = d.hidden;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    vocab_ = d.vocab;
    padded_vocab_ = d.padded_vocab;
    tie_ = d.tie_embeddings != 0;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && vocab_ > 0, name_ << ": hidden and vocab must be positive");
    LOOM_REQUIRE(padded_vocab_ >= vocab_ && padded_vocab_ % tp == 0,
                 name_ << ": padded_vocab (" << padded_vocab_ << ") must be >= vocab (" << vocab_
                       << ") and divisible by the tensor-parallel size (" << tp << ")");
    vocab_local_ = padded_vocab_ / tp;
    vocab_start_ = static_cast<int64_t>(tp_.rank()) * vocab_local_;
    // Padded columns (and whole slices past the real vocab) never take part.
    valid_cols_ = std::clamp<int64_t>(vocab_ - vocab_start_, 0, vocab_local_);
  }

  std::vector<loom::ParamSpec> params() override {
    std::vector<loom::ParamSpec> p(3);
    p[0] = {.name = "ln.weight", .shape = {hidden_}, .init = LOOM_INIT_ONES, .no_weight_decay = true};
    p[1] = {.name = "ln.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    p[2] = {.name = "word.weight", .shape = {padded_vocab_, hidden_}, .partition_dim = 0,
            .init = LOOM_INIT_NORMAL, .tie_key = tie_ ? "word_embedding" : ""};
    return p;
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    LOOM_REQUIRE(params.size() == 3 && grads.size() == 3,
                 name_ << ": bind expects 3 parameters, got " << params.size());
    const int64_t H = hidden_;
    const int64_t expect[3] = {H, H, vocab_local_ * H};
    const char* names[3] = {"ln.weight", "ln.bias", "word.weight"};
    for (int i = 0; i < 3; ++i) {
      w_[i] = bound(params[i], expect[i], name_, names[i]);
      g_[i] = bound(grads[i], expect[i], name_, std::string(names[i]) + " (grad)");
    }
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, Vl = vocab_local_;
    require_tensor(a.input, "input", name_, kDLFloat, 32, {-1, -1, H});
    const int64_t S = a.input->shape[0], B = a.input->shape[1], T = S * B;
    require_tensor(a.targets, "targets", name_, kDLInt, 32, {S, B});
    const float* x = data_of<float>(*a.input);
    const int32_t* targets = data_of<int32_t>(*a.targets);
    loom::Device dev = rank.device();
    void* stream = dev.native_stream();

    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.floats(a.training ? T * H : 0);
    s.mean = s.mem.floats(T);
    s.rstd = s.mem.floats(T);
    s.logits = s.mem.floats(T * Vl);
    s.stats = s.mem.floats(3 * T);  // row_max | row_sumexp | target_logit
    s.targets = s.mem.add(T * sizeof(int32_t));
    s.mem.allocate(rank_);

    Arena tmp;
    const size_t ln = tmp.floats(T * H), loss = tmp.floats(T), total = tmp.floats(1);
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, T * H * sizeof(float));
    copy_d2d(dev, s.mem.at<int32_t>(s.targets), targets, T * sizeof(int32_t));
    layernorm_fwd(dev, x, w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), T, H,
                  kLayerNormEps);
    // logits[T, Vl] = LN(x) W_local^T
    float* logits = s.mem.at(s.logits);
    gemm(dev, false, true, T, Vl, H, tmp.at(ln), w_[kW], logits, 0.0f);

    float* row_max = s.mem.at(s.stats);
    float* sums = row_max + T;  // row_sumexp then target_logit: one all-reduce
    loom_xent_args xa = xent_args(s);
    xa.loss = tmp.at(loss);
    xa.step = LOOM_XENT_ROW_MAX;
    dev.xent(xa);
    // Predictions (evaluation): this rank's argmax over its real vocab columns and
    // its local max, taken before row_max becomes the global max.
    std::vector<int32_t> local_arg;
    std::vector<float> local_max;
    if (a.predictions) {
      local_arg.assign(static_cast<size_t>(T), 0);
      local_max.assign(static_cast<size_t>(T), -std::numeric_limits<float>::infinity());
      if (valid_cols_ > 0) {
        Arena am;
        const size_t idx = am.add(T * sizeof(int32_t));
        am.allocate(rank_);
        dev.reduce({.op = LOOM_RED_ROW_ARGMAX, .n = T * valid_cols_, .cols = valid_cols_, .x = logits,
                    .out = am.at<int32_t>(idx), .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_I32, .ld = Vl});
        dev.copy(local_arg.data(), am.at<int32_t>(idx), T * sizeof(int32_t), LOOM_COPY_DEVICE_TO_HOST);
        dev.copy(local_max.data(), row_max, T * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
        dev.synchronize();
      }
    }
    tp_.all_reduce(stream, row_max, row_max, static_cast<size_t>(T), LOOM_DTYPE_F32, LOOM_REDUCE_MAX);
    if (a.predictions) {
      // The winner is the lowest vocab id whose logit equals the global max.
      std::vector<float> global_max(static_cast<size_t>(T));
      dev.copy(global_max.data(), row_max, T * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
      dev.synchronize();
      for (int64_t r = 0; r < T; ++r)
        a.predictions[r] = (valid_cols_ > 0 && local_max[r] == global_max[r])
                               ? static_cast<int32_t>(vocab_start_ + local_arg[r])
                               : std::numeric_limits<int32_t>::max();
      tp_.all_reduce(nullptr, a.predictions, a.predictions, static_cast<size_t>(T), LOOM_DTYPE_I32, LOOM_REDUCE_MIN);
    }
    xa.step = LOOM_XENT_SUMEXP;
    dev.xent(xa);
    tp_.all_reduce(stream, sums, sums, static_cast<size_t>(2 * T), LOOM_DTYPE_F32, LOOM_REDUCE_SUM);
    xa.step = LOOM_XENT_LOSS;
    dev.xent(xa);

    // Σ loss on the device, one float to the host; the token count from the targets.
    dev.reduce({.op = LOOM_RED_SUM, .n = T, .x = tmp.at(loss), .out = tmp.at(total),
                .accumulate = 0, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
    float loss_sum = 0.0f;
    std::vector<int32_t> host_targets(static_cast<size_t>(T));
    dev.copy(&loss_sum, tmp.at(total), sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.copy(host_targets.data(), targets, T * sizeof(int32_t), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    int64_t count = 0;
    for (int32_t t : host_targets) count += t >= 0 ? 1 : 0;
    if (a.loss_sum) *a.loss_sum = loss_sum;
    if (a.loss_count) *a.loss_count = count;

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const int64_t H = hidden_, Vl = vocab_local_, S = s.S, B = s.B, T = S * B;
    require_tensor(a.grad_input, "grad_input", name_, kDLFloat, 32, {S, B, H});
    float* dx = data_of<float>(*a.grad_input);
    loom::Device dev = rank.device();

    Arena tmp;
    const size_t dlogits = tmp.floats(T * Vl), ln = tmp.floats(T * H), dln = tmp.floats(T * H);
    tmp.allocate(rank_);

    // dlogits = loss_scale * (softmax - onehot) on the local slice.
    loom_xent_args xa = xent_args(s);
    xa.step = LOOM_XENT_BACKWARD;
    xa.dlogits = tmp.at(dlogits);
    xa.scale = a.loss_scale;
    dev.xent(xa);

    layernorm_fwd(dev, s.mem.at(s.x), w_[kLnW], w_[kLnB], tmp.at(ln), s.mem.at(s.mean),
                  s.mem.at(s.rstd), T, H, kLayerNormEps);
    // dW_local += dlogits^T LN(x);  dLN = dlogits W_local, summed over tp (f).
    gemm(dev, true, false, Vl, H, T, tmp.at(dlogits), tmp.at(ln), g_[kW], 1.0f);
    gemm(dev, false, false, T, H, Vl, tmp.at(dlogits), w_[kW], tmp.at(dln), 0.0f);
    tp_.all_reduce(dev.native_stream(), tmp.at(dln), tmp.at(dln), static_cast<size_t>(T * H),
                   LOOM_DTYPE_F32);
    layernorm_bwd(dev, tmp.at(dln), s.mem.at(s.x), w_[kLnW], s.mem.at(s.mean), s.mem.at(s.rstd), dx,
                  g_[kLnW], g_[kLnB], T, H, /*accumulate_dx=*/false);
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  // Includes the local logits [T, V_local], kept for backward.
  uint64_t activation_bytes() override {
    const int64_t T = seq_ * micro_batch_;
    Arena a;
    a.floats(T * hidden_);       // x
    a.floats(T);                 // mean
    a.floats(T);                 // rstd
    a.floats(T * vocab_local_);  // logits
    a.floats(3 * T);             // row max, sum-exp, target logit
    a.add(T * sizeof(int32_t));  // targets
    return a.bytes();
  }

  // logits 2*T*H*V_local.
  double forward_flops() override {
    return 2.0 * static_cast<double>(seq_ * micro_batch_) * static_cast<double>(hidden_) *
           static_cast<double>(vocab_local_);
  }

 private:
  enum { kLnW, kLnB, kW };

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, logits = 0, stats = 0, targets = 0;
  };

  loom_xent_args xent_args(const Saved& s) const {
    const int64_t T = s.S * s.B;
    loom_xent_args xa = loom::make<loom_xent_args>();
    xa.rows = T;
    xa.cols = vocab_local_;
    xa.ld = vocab_local_;
    xa.valid_cols = valid_cols_;
    xa.vocab_start = vocab_start_;
    xa.logits = s.mem.at(s.logits);
    xa.targets = s.mem.at<int32_t>(s.targets);
    xa.row_max = s.mem.at(s.stats);
    xa.row_sumexp = s.mem.at(s.stats) + T;
    xa.target_logit = s.mem.at(s.stats) + 2 * T;
    xa.scale = 1.0f;
    xa.dtype = LOOM_DTYPE_F32;
    return xa;
  }

  loom_rank* rank_;
  loom::Group tp_;
  std::string name_;
  int64_t hidden_ = 0, seq_ = 0, micro_batch_ = 0, vocab_ = 0, padded_vocab_ = 0;
  int64_t vocab_local_ = 0, vocab_start_ = 0, valid_cols_ = 0;
  bool tie_ = false;
  float* w_[3] = {};
  float* g_[3] = {};
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<LmHead>(
    "lm_head", "1.0.0",
    "final LayerNorm + output logits fused with vocab-parallel cross-entropy (last layer)"))
