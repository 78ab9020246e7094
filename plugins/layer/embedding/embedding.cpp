// layer/embedding: word + learned position embeddings, the first layer.
//   out[s, b, :] = dropout(word[tokens[s, b]] + pos[s])
// With position_embedding = "rope" there is no position table (the attention layers
// rotate q and k instead): out = dropout(word[tokens]).
// The word table is vocab-parallel (this rank holds rows [tp_rank*V_local,
// (tp_rank+1)*V_local)); through the parallel/tensor service a token outside the
// slice looks up zeros and `g` (all-reduce over tp) completes every row. Position
// embeddings and dropout (the stream shared by every tp rank) are duplicated.
// Under sequence parallelism g is a reduce-scatter: this rank keeps its sequence
// shard, then adds the positions of that shard (so pos.weight's gradient covers
// the shard only; the engine sums it over tp).
//
// The position term is a second embedding lookup whose ids are the positions of
// the rows (row r = s*B + b has id s): one op forward, one op backward. Under
// context parallelism the rows are this cp rank's two chunks of the sequence
// (loom::ContextSlice) and carry those positions; pos.weight's gradient then covers
// them only, and the gradient reduction over dp-cp completes it.
#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>
#include <loom/layers/positions.hpp>

#include <map>

namespace {

using namespace loom::layers;

class Embedding : public loom::Layer {
 public:
  Embedding(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()) {
    LOOM_REQUIRE(args.dims != nullptr, "embedding: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "embedding";
    tp_ = loom::TensorParallel(rank_, args.tp, args.sequence_parallel != 0, name_);
    fusion_ = grad_accumulation_fusion(args);
    hidden_ = d.hidden;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    vocab_ = d.vocab;
    padded_vocab_ = d.padded_vocab;
    tie_ = d.tie_embeddings != 0;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    LOOM_REQUIRE(hidden_ > 0 && seq_ > 0, name_ << ": hidden and seq_len must be positive");
    LOOM_REQUIRE(padded_vocab_ >= vocab_ && padded_vocab_ % tp == 0,
                 name_ << ": padded_vocab (" << padded_vocab_ << ") must be >= vocab (" << vocab_
                       << ") and divisible by the tensor-parallel size (" << tp << ")");
    vocab_local_ = tp_.vocab_range(vocab_, padded_vocab_).rows;
    dropout_ = dropout_option(options);
    cp_ = rank.group_or_single("cp");
    learned_positions_ = options.declared_string("position_embedding") == "learned_absolute";
    params_ = ParamSet(name_, {.tp = tp});
    params_.add({.name = "word.weight", .shape = {padded_vocab_, hidden_}, .partition_dim = 0,
                 .init = LOOM_INIT_NORMAL, .tie_key = tie_ ? "word_embedding" : ""});
    if (learned_positions_) params_.add({.name = "pos.weight", .shape = {seq_, hidden_}, .init = LOOM_INIT_NORMAL});
  }

  static constexpr uint64_t kFeatures =
      LOOM_LAYER_CONTEXT_PARALLEL | LOOM_LAYER_READS_TOKENS | LOOM_LAYER_KV_CACHE | LOOM_LAYER_DOCUMENTS;

  std::vector<loom::ParamSpec> params() override { return params_.specs(); }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    dt_ = params_.bind(params, grads, w_, g_);
    // Built now, so that a steady-state forward does no host-to-device copy; not by an
    // instance that only plans memory (its views have no data), which never runs.
    if (learned_positions_ && micro_batch_ > 0 && !params.empty() && params.front().data != nullptr)
      position_ids(loom::Rank(rank_).device(), seq_ / cp_.size(), micro_batch_);
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_;
    require_tensor(a.tokens, "tokens", name_, kDLInt, 32, {-1, -1});
    const int64_t S = a.tokens->shape[0], B = a.tokens->shape[1], T = S * B;
    if (a.kv_cache) return forward_cached(rank, a, S, B);
    LOOM_REQUIRE(S * cp_.size() <= seq_, name_ << ": sequence of " << S * cp_.size() << " tokens is longer than seq_len "
                                               << seq_ << " (the position table)");
    // The output is this rank's sequence shard under sequence parallelism.
    const int64_t Sl = shard_positions(S), Tl = Sl * B;
    require_act(a.output, "output", name_, dt_.act, {Sl, B, H});
    const int32_t* tokens = data_of<int32_t>(*a.tokens);
    void* y = data_of<void>(*a.output);
    loom::Device dev = rank.device();
    const bool drop = a.training && dropout_ > 0.0f;

    Saved s = saved_layout(S, B, a.training, drop);
    s.mem.allocate(rank_);
    if (a.training) copy_d2d(dev, s.mem.at<int32_t>(s.tokens), tokens, T * sizeof(int32_t));
    // Positions counted from each document's start (ABI 1.22 position_ids; the engine
    // keeps them until the backward), else from the sequence's.
    if (a.position_ids) require_tensor(a.position_ids, "position_ids", name_, kDLInt, 32, {S, B});
    s.positions = a.position_ids ? data_of<int32_t>(*a.position_ids) : nullptr;

    // Vocab-parallel lookup of every token, then g (all-reduce, or reduce-scatter
    // to the shard under SP); then the positions of the rows this rank holds.
    tp_.vocab_parallel_embedding_forward({.rows = T, .dim = H, .padded_vocab = padded_vocab_, .ids = tokens,
                                          .table = w_[kWord], .out = y, .dtype = dt_.act});
    if (learned_positions_)
      dev.embedding_fwd({.n = Tl, .dim = H, .vocab_rows = seq_, .vocab_start = 0, .ids = position_ids(dev, S, B, s.positions),
                         .table = w_[kPos], .out = y, .accumulate = 1, .dtype = dt_.act});
    if (drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = y, .out = y,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch, .dtype = dt_.act,
                           .seed_device = a.dropout_seed_device});

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  // Generation (ABI 1.13 kv_cache): tokens at positions [P, P + S), no dropout, nothing kept.
  void forward_cached(loom::Rank& rank, const loom_layer_fwd_args& a, int64_t S, int64_t B) {
    const int64_t H = hidden_, P = a.position_offset;
    LOOM_REQUIRE(!tp_.sequence_parallel() && cp_.size() == 1,
                 name_ << ": a kv_cache forward runs without sequence or context parallelism");
    LOOM_REQUIRE(P >= 0 && P + S <= seq_, name_ << ": positions [" << P << ", " << P + S
                                                << ") run past seq_len " << seq_ << " (the position table)");
    require_act(a.output, "output", name_, dt_.act, {S, B, H});
    loom::Device dev = rank.device();
    void* y = data_of<void>(*a.output);
    tp_.vocab_parallel_embedding_forward({.rows = S * B, .dim = H, .padded_vocab = padded_vocab_,
                                          .ids = data_of<int32_t>(*a.tokens), .table = w_[kWord], .out = y,
                                          .dtype = dt_.act});
    if (a.position_ids) require_tensor(a.position_ids, "position_ids", name_, kDLInt, 32, {S, B});
    if (learned_positions_)
      dev.embedding_fwd({.n = S * B, .dim = H, .vocab_rows = seq_, .vocab_start = 0,
                         .ids = a.position_ids ? data_of<int32_t>(*a.position_ids)
                                               : positions_.get(rank_, dev, loom::ContextSlice(seq_, 1, 0), P, S, B),
                         .table = w_[kPos], .out = y, .accumulate = 1, .dtype = dt_.act});
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const int64_t H = hidden_, S = s.S, B = s.B, T = S * B;
    const int64_t Sl = shard_positions(S), Tl = Sl * B;
    require_act(a.grad_output, "grad_output", name_, dt_.act, {Sl, B, H});
    const void* dy = data_of<void>(*a.grad_output);
    loom::Device dev = rank.device();
    std::vector<void*> grads = {g_[kWord]};
    if (learned_positions_) grads.push_back(g_[kPos]);
    GradShadow gs(rank_, dev, dt_, grads, params_.local_numels(), tp_.features(), fusion_);

    Arena tmp;
    const size_t dout = tmp.elems(s.dropped ? Tl * H : 0, dt_.act);
    tmp.allocate(rank_);
    const void* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dout), s.mem.at<uint8_t>(s.mask), Tl * H, dropout_, dt_.act);
      d = tmp.at(dout);
    }
    // g's backward (identity, or the all-gather under SP): each rank scatters every
    // token's gradient into its own vocab slice.
    tp_.vocab_parallel_embedding_backward({.rows = T, .dim = H, .padded_vocab = padded_vocab_,
                                           .ids = s.mem.at<int32_t>(s.tokens), .dout = d, .dtable = gs[0], .dtype = dt_.act,
                                           .grad_fp32 = gs.grad_fp32()});
    // pos grad[s] += sum_b dout[s, b] over the positions this rank holds.
    if (learned_positions_)
      dev.embedding_bwd({.n = Tl, .dim = H, .vocab_rows = seq_, .vocab_start = 0,
                         .ids = position_ids(dev, S, B, s.positions), .dout = d, .dtable = gs[1],
                         .dtype = dt_.act, .grad_fp32 = gs.grad_fp32()});
    gs.commit();
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  uint64_t activation_bytes() override {
    return saved_layout(seq_ / cp_.size(), micro_batch_, true, dropout_ > 0.0f).mem.bytes();
  }

  // A backward's: the gradient through the dropout, and the gradient shadows when the
  // gradients are kept in another dtype; under sequence parallelism the service's
  // whole-sequence buffer, forward and backward.
  uint64_t workspace_bytes() override {
    const int64_t Tl = shard_positions(seq_ / cp_.size()) * micro_batch_;
    Arena dout;
    dout.elems(dropout_ > 0.0f ? Tl * hidden_ : 0, dt_.act);
    const loom::Device dev = loom::Rank(rank_).device();
    return dout.bytes() + GradShadow::bytes(dev, dt_, params_.local_numels(), tp_.features(), fusion_) +
           sequence_parallel_service_bytes(tp_, (seq_ / cp_.size()) * micro_batch_, hidden_, dt_.act);
  }

  // A lookup: no multiply-adds.
  double forward_flops() override { return 0.0; }

 private:
  enum { kWord, kPos };

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t tokens = 0, mask = 0;
    bool dropped = false;
    const int32_t* positions = nullptr;  // position_ids, or null
  };

  // What a forward of S x B tokens keeps for its backward (laid out, not allocated):
  // activation_bytes() reports the same layout a training forward allocates.
  Saved saved_layout(int64_t S, int64_t B, bool training, bool drop) const {
    Saved s;
    s.S = S;
    s.B = B;
    s.tokens = s.mem.add(training ? S * B * sizeof(int32_t) : 0);
    s.mask = s.mem.add(drop ? shard_positions(S) * B * hidden_ : 0);  // this rank's shard under SP
    s.dropped = drop;
    return s;
  }

  // Positions this rank holds of a sequence of S: all of them, or under sequence
  // parallelism the shard [tp_rank * S / tp, (tp_rank + 1) * S / tp).
  int64_t shard_positions(int64_t S) const {
    if (!tp_.sequence_parallel()) return S;
    LOOM_REQUIRE(S % tp_.size() == 0, name_ << ": sequence of " << S << " tokens cannot be split into "
                                            << tp_.size() << " sequence-parallel shards");
    return S / tp_.size();
  }

  // Device ids [Sl*B]: row s*B + b of this rank's rows gets the position of local
  // row first + s (first = the SP shard's first row) in this cp rank's slice of a
  // sequence of S * cp; built at bind for (seq_len, micro_batch) and again only if a
  // microbatch of another shape comes.
  // Given the engine's position_ids [S, B], the same rows of them.
  const int32_t* position_ids(const loom::Device& dev, int64_t S, int64_t B, const int32_t* given = nullptr) {
    const int64_t Sl = shard_positions(S), first = tp_.sequence_parallel() ? tp_.rank() * Sl : 0;
    if (given) return given + first * B;
    return positions_.get(rank_, dev, loom::ContextSlice(S * cp_.size(), cp_.size(), cp_.rank()), first, Sl, B);
  }

  loom_rank* rank_;
  loom::TensorParallel tp_;
  loom::Group cp_;  // context parallelism: this rank's slice of the sequence
  std::string name_;
  int64_t hidden_ = 0, seq_ = 0, micro_batch_ = 0, vocab_ = 0, padded_vocab_ = 0;
  int64_t vocab_local_ = 0;
  bool tie_ = false;
  float dropout_ = 0.0f;
  Dtypes dt_;
  bool fusion_ = false;  // gradient-accumulation fusion allowed (see GradShadow)
  ParamSet params_;
  void* w_[2] = {};
  void* g_[2] = {};
  bool learned_positions_ = true;  // position_embedding = learned_absolute: pos.weight
  PositionIds positions_;
  std::map<int32_t, Saved> saved_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Embedding>(
    "embedding", "1.5.0", "word (vocab-parallel) + learned position embeddings (context-parallel)",
    {loom::layers::dropout_option_spec("the embedding output"),
     loom::layers::position_embedding_option_spec("no position table here: the attention layers rotate q and k")}))
