// layer/lm_head: final LayerNorm, output logits and softmax cross-entropy, the last layer.
//   logits = LN(x) W^T,  loss[t] = logsumexp(logits[t]) - logits[t, target[t]]
// W [padded_vocab, hidden] is vocab-parallel (this rank holds V_local rows) and,
// with tied embeddings, shares the word embedding's storage (tie_key
// "word_embedding"). The logits stay split: the parallel/tensor service fuses
// them with the cross-entropy, two all-reduces of per-token scalars (row max,
// then sum-exp and target logit), so only O(tokens) floats cross ranks, never
// O(tokens * vocab). Under sequence parallelism the final LayerNorm runs on this
// rank's sequence shard and its output is all-gathered before the logits.
#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>

#include <algorithm>
#include <limits>
#include <map>

namespace {

using namespace loom::layers;

class LmHead : public loom::Layer {
 public:
  LmHead(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()) {
    LOOM_REQUIRE(args.dims != nullptr, "lm_head: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "lm_head";
    tp_ = loom::TensorParallel(rank_, args.tp, args.sequence_parallel != 0, name_);
    fusion_ = grad_accumulation_fusion(args);
    hidden_ = d.hidden;
    seq_ = d.seq_len / rank.group_or_single("cp").size();  // this rank's rows (its slice under context parallelism)
    micro_batch_ = d.micro_batch;
    vocab_ = d.vocab;
    padded_vocab_ = d.padded_vocab;
    tie_ = d.tie_embeddings != 0;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && vocab_ > 0, name_ << ": hidden and vocab must be positive");
    LOOM_REQUIRE(padded_vocab_ >= vocab_ && padded_vocab_ % tp == 0,
                 name_ << ": padded_vocab (" << padded_vocab_ << ") must be >= vocab (" << vocab_
                       << ") and divisible by the tensor-parallel size (" << tp << ")");
    vocab_local_ = tp_.vocab_range(vocab_, padded_vocab_).rows;
    norm_ = norm_option(options);
    norm_.require_ops(rank.device(), name_);  // as validate asks the run's device
    params_ = ParamSet(name_, {.tp = tp});
    ln_w_ = params_.add({.name = "ln.weight", .shape = {hidden_}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
    if (!norm_.rms)
      ln_b_ = params_.add({.name = "ln.bias", .shape = {hidden_}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    word_ = params_.add({.name = "word.weight", .shape = {padded_vocab_, hidden_}, .partition_dim = 0,
                         .init = LOOM_INIT_NORMAL, .tie_key = tie_ ? "word_embedding" : ""});
    w_.assign(params_.size(), nullptr);
    g_.assign(params_.size(), nullptr);
  }

  // Before launch: the norm's ops, of the run's device.
  static void validate(const loom::Options& options, const loom::LayerValidation& v) {
    norm_option(options).require_ops(v, v.instance_name());
  }

  // Position-independent: a context-parallel slice of the sequence is just fewer rows.
  // Documents (ABI 1.22) need nothing here: no positions are mixed or embedded.
  static constexpr uint64_t kFeatures =
      LOOM_LAYER_CONTEXT_PARALLEL | LOOM_LAYER_WRITES_LOSS | LOOM_LAYER_KV_CACHE | LOOM_LAYER_DOCUMENTS;

  std::vector<loom::ParamSpec> params() override { return params_.specs(); }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    dt_ = params_.bind(params, grads, w_.data(), g_.data());
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    if (a.kv_cache) return forward_cached(rank, a);
    const int64_t H = hidden_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    // The input is this rank's sequence shard under sequence parallelism; the
    // targets cover the whole sequence.
    const bool sp = tp_.sequence_parallel();
    const int64_t Sl = a.input->shape[0], B = a.input->shape[1], Tl = Sl * B;
    const int64_t S = sp ? Sl * tp_.size() : Sl, T = S * B;
    require_tensor(a.targets, "targets", name_, kDLInt, 32, {S, B});
    const void* x = data_of<void>(*a.input);
    const int32_t* targets = data_of<int32_t>(*a.targets);
    loom::Device dev = rank.device();

    Saved s = saved_layout(S, B, a.training);
    s.mem.allocate(rank_);

    ForwardTemps ft = forward_temps(S, B);
    Arena& tmp = ft.mem;
    const size_t ln = ft.ln, ln_full = ft.ln_full, loss = ft.loss, total = ft.total;
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, Tl * H * dt_.act_bytes());
    copy_d2d(dev, s.mem.at<int32_t>(s.targets), targets, T * sizeof(int32_t));
    norm_.forward(dev, x, w(ln_w_), w(ln_b_), tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), Tl, H, dt_.act);
    // logits[T, Vl] = LN(x) W_local^T fused with the vocab-parallel cross-entropy
    // (f: identity, or the all-gather of the LN output under SP).
    tp_.vocab_parallel_cross_entropy_forward(
        {.rows = T, .hidden = H, .vocab = vocab_, .padded_vocab = padded_vocab_, .x = tmp.at(ln),
         .x_full = sp ? tmp.at(ln_full) : nullptr, .weight = w(word_), .logits = s.mem.at(s.logits),
         .stats = s.mem.at(s.stats), .targets = s.mem.at<int32_t>(s.targets), .loss = tmp.at(loss),
         .predictions = a.predictions, .dtype = dt_.act});

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

  // Generation (ABI 1.13 kv_cache): the logits of each sequence's last row only,
  // [B, V_local] in fp32 per tp rank, all-gathered and written whole to a.logits.
  void forward_cached(loom::Rank& rank, const loom_layer_fwd_args& a) {
    const int64_t H = hidden_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    LOOM_REQUIRE(!tp_.sequence_parallel(), name_ << ": a kv_cache forward runs without sequence parallelism");
    if (a.logits == nullptr) return;
    const int64_t S = a.input->shape[0], B = a.input->shape[1], Vl = vocab_local_;
    const int tp = tp_.size() > 0 ? tp_.size() : 1;
    loom::Device dev = rank.device();
    Arena tmp;
    const size_t ln = tmp.elems(B * H, dt_.act), mean = tmp.floats(B), rstd = tmp.floats(B),
                 local = tmp.floats(B * Vl), all = tmp.floats(tp * B * Vl);
    tmp.allocate(rank_);
    // Rows (S - 1) * B .. S * B - 1 are the last position of every sequence.
    const void* last = advance(data_of<const void>(*a.input), (S - 1) * B * H, dt_.act);
    norm_.forward(dev, last, w(ln_w_), w(ln_b_), tmp.at(ln), tmp.at(mean), tmp.at(rstd), B, H, dt_.act);
    loom_gemm_args g = loom::make<loom_gemm_args>();  // [B, H] x W_local^T [H, V_local]
    g.trans_b = 1;
    g.m = B, g.n = Vl, g.k = H;
    g.a = tmp.at(ln), g.lda = H;
    g.b = w(word_), g.ldb = H;
    g.c = tmp.at(local), g.ldc = Vl;
    g.batch = 1;
    g.alpha = 1.0f;
    g.dtype = dt_.act;
    g.c_dtype = LOOM_DTYPE_F32;
    dev.gemm(g);
    const float* gathered = tmp.at(local);
    if (tp > 1) {
      rank.group_or_single("tp").all_gather(dev.native_stream(), tmp.at(local), tmp.at(all),
                                            static_cast<size_t>(B * Vl), LOOM_DTYPE_F32);
      gathered = tmp.at(all);
    }
    std::vector<float> host(static_cast<size_t>(tp * B * Vl));
    dev.copy(host.data(), gathered, host.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    for (int r = 0; r < tp; ++r)  // rank r holds vocabulary rows [r * V_local, (r + 1) * V_local)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < Vl && r * Vl + j < vocab_; ++j)
          a.logits[b * vocab_ + r * Vl + j] = host[static_cast<size_t>((r * B + b) * Vl + j)];
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, S = s.S, B = s.B, T = S * B;
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B;
    require_act(a.grad_input, "grad_input", name_, dt_.act, {Sl, B, H});
    void* dx = data_of<void>(*a.grad_input);
    loom::Device dev = rank.device();
    GradShadow gs(rank_, dev, dt_, g_, params_.local_numels(),
                  tp_.features(), fusion_);

    BackwardTemps bt = backward_temps(S, B);
    Arena& tmp = bt.mem;
    const size_t ln = bt.ln, ln_full = bt.ln_full, dln = bt.dln;
    tmp.allocate(rank_);

    // The LN output, recomputed (and gathered again under SP).
    const void* ln_in = recompute_ln_input(dev, tp_, s.mem.at(s.x), w(ln_w_), w(ln_b_), s.mem.at(s.mean),
                                           s.mem.at(s.rstd), tmp.at(ln), tmp.at(ln_full), Tl, H, dt_.act, norm_);
    // dlogits = loss_scale * (softmax - onehot) on the local slice; dW_local +=
    // dlogits^T LN(x); dLN = dlogits W_local summed over tp (f's backward).
    tp_.vocab_parallel_cross_entropy_backward(
        {.rows = T, .hidden = H, .vocab = vocab_, .padded_vocab = padded_vocab_, .x = ln_in, .weight = w(word_),
         .logits = s.mem.at(s.logits), .stats = s.mem.at(s.stats), .targets = s.mem.at<int32_t>(s.targets),
         .scale = a.loss_scale, .dx = tmp.at(dln), .dweight = gs[word_], .dtype = dt_.act, .grad_fp32 = gs.grad_fp32(),
         .logits_scratch = 1});  // the saved logits are dropped below
    norm_.backward(dev, tmp.at(dln), s.mem.at(s.x), w(ln_w_), s.mem.at(s.mean), s.mem.at(s.rstd), dx, gs[ln_w_],
                   ln_b_ == kNone ? nullptr : gs[ln_b_], Tl, H, /*accumulate_dx=*/false, dt_.act, gs.grad_fp32());
    gs.commit();
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  // Includes the local logits [T, V_local], kept for backward.
  uint64_t activation_bytes() override { return saved_layout(seq_, micro_batch_, true).mem.bytes(); }

  // The larger of a training forward's and a backward's temporaries (the logits are
  // saved, their gradient formed over them: ABI 1.18 logits_scratch).
  uint64_t workspace_bytes() override {
    const loom::Device dev = loom::Rank(rank_).device();
    const uint64_t shadows = GradShadow::bytes(dev, dt_, params_.local_numels(), tp_.features(), fusion_);
    // The service's cross-entropy backward holds the input's gradient over the whole
    // sequence [T, H] (and, on a device that cannot form it in place, the logits').
    Arena xent;
    xent.elems(seq_ * micro_batch_ * hidden_, dt_.act);
    if ((dev.features() & LOOM_DEVICE_XENT_IN_PLACE) == 0)
      xent.elems(seq_ * micro_batch_ * (padded_vocab_ / tp_.size()), dt_.act);
    return std::max<uint64_t>(forward_temps(seq_, micro_batch_).mem.bytes(),
                              backward_temps(seq_, micro_batch_).mem.bytes() + shadows + xent.bytes());
  }

  // logits 2*T*H*V_local.
  double forward_flops() override {
    return 2.0 * static_cast<double>(seq_ * micro_batch_) * static_cast<double>(hidden_) *
           static_cast<double>(vocab_local_);
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);  // a parameter the options leave out
  void* w(size_t i) const { return i == kNone ? nullptr : w_[i]; }

  // A forward's temporaries over S x B rows (S the whole sequence): the norm's output
  // (and its gather), the per-token losses and their sum.
  struct ForwardTemps {
    Arena mem;
    size_t ln = 0, ln_full = 0, loss = 0, total = 0;
  };
  ForwardTemps forward_temps(int64_t S, int64_t B) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    ForwardTemps t;
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp ? T * H : 0, dt_.act);
    t.loss = t.mem.floats(T);
    t.total = t.mem.floats(1);
    return t;
  }

  // A backward's: the recomputed norm output (and its gather) and its gradient.
  struct BackwardTemps {
    Arena mem;
    size_t ln = 0, ln_full = 0, dln = 0;
  };
  BackwardTemps backward_temps(int64_t S, int64_t B) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    BackwardTemps t;
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp ? T * H : 0, dt_.act);
    t.dln = t.mem.elems(Tl * H, dt_.act);
    return t;
  }

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, logits = 0, stats = 0, targets = 0;
  };

  // What a forward of S x B rows keeps for its backward (laid out, not allocated):
  // activation_bytes() reports the same layout a training forward allocates.
  Saved saved_layout(int64_t S, int64_t B, bool training) const {
    const int64_t T = S * B, Tl = (tp_.sequence_parallel() ? S / tp_.size() : S) * B;
    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.elems(training ? Tl * hidden_ : 0, dt_.act);  // this rank's shard under SP
    s.mean = s.mem.floats(Tl);
    s.rstd = s.mem.floats(Tl);
    s.logits = s.mem.elems(T * vocab_local_, dt_.act);
    s.stats = s.mem.floats(3 * T);  // row max | row sum-exp | target logit
    s.targets = s.mem.add(T * sizeof(int32_t));
    return s;
  }

  loom_rank* rank_;
  loom::TensorParallel tp_;
  std::string name_;
  int64_t hidden_ = 0, seq_ = 0, micro_batch_ = 0, vocab_ = 0, padded_vocab_ = 0;
  int64_t vocab_local_ = 0;
  bool tie_ = false;
  ParamSet params_;
  Dtypes dt_;
  bool fusion_ = false;  // gradient-accumulation fusion allowed (see GradShadow)
  Norm norm_;
  size_t ln_w_ = kNone, ln_b_ = kNone, word_ = kNone;
  std::vector<void*> w_, g_;  // by parameter index
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<LmHead>(
    "lm_head", "1.4.0",
    "final norm (LayerNorm or RMSNorm) + output logits fused with vocab-parallel cross-entropy (last layer)",
    loom::layers::norm_option_specs()))
