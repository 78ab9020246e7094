// layer/attention: pre-LayerNorm causal multi-head self-attention with a residual,
//   y = x + dropout(proj(attn(LN(x))))
// Tensor-parallel in Megatron's way, through the parallel/tensor service: the
// QKV GEMM is column-parallel (this rank holds heads/tp heads), the output
// projection row-parallel (`g` after it in forward, `f`'s backward closing the
// backward). LayerNorm, the projection bias, dropout and the residual are
// duplicated on every tp rank; under sequence parallelism they run on this
// rank's sequence shard, f and g becoming all-gather and reduce-scatter. The k
// part of qkv.bias gets an exactly-zero gradient (see backward): it cannot
// change the output (unless rotated or normalised).
//
// Context parallelism (parallel.cp > 1; Megatron's all-gather form): this rank's
// rows are two chunks of the sequence (loom::ContextSlice). Its queries attend to
// the keys and values of the whole sequence, all-gathered over cp and put in
// position order; each chunk is one windowed attention call (its queries at their
// positions, keys up to its causal limit). Backward sums the key/value gradients
// of every rank's queries with a reduce-scatter back to their owners. K and V are
// gathered again in backward rather than kept, so saved activations shrink with cp.
//
// Rotary position embedding (position_embedding = "rope"; Su et al., RoFormer, 2021,
// as Llama and Megatron-LM apply it): q and k of every head are rotated right after
// the QKV GEMM, each token by its position in the whole sequence (under cp, this
// rank's chunks), and the saved qkv holds the rotated values; backward rotates dq
// and dk back before the QKV GEMM's backward. The first rotary_percent of each head's
// dimensions rotate, the rest pass through. rope_scaling = "llama3" (Llama 3.1's) or
// "yarn" (DeepSeek-V2/V3's, Qwen's long context) stretches the low frequencies: each
// pair's frequency is worked out at create (rope_scaling.hpp) and handed to the device
// op (ABI 1.20 inv_freq); YaRN's attention factor goes into the softmax scale.
//
// QK normalisation (qk_norm = true; Megatron-LM's --qk-layernorm, as Qwen3 and OLMo 2
// use it): each head's q and k rows are normalised over the head's dimensions right
// after the QKV GEMM, before the rotation, by the layer's `norm` (rmsnorm or layernorm)
// with one learned [head_dim] gamma (and beta) for all query heads and one for all key
// heads. The pre-norm q and k are kept for backward. Every tp rank holds both gammas
// and sees only its heads, so their gradients are summed over tp: by the engine under
// sequence parallelism (it sums every duplicated parameter's), else here. Some bias
// directions the norm or the softmax cannot see (the per-head mean of qkv.bias's q and
// k parts under LayerNorm; without rope, k_norm.bias, which is left at zero) get
// gradients of rounding noise only, which Adam scales up: layouts that sum in another
// order drift apart there first.
//
// Sliding-window attention (sliding_window = W > 0; Mistral, Gemma's and GPT-OSS's
// local layers): the token at position p attends to positions (p - W, p] only, a
// mask the device op applies (ABI 1.21 window, key tiles outside skipped). Positions
// are the whole sequence's, so context-parallel windows and the generation cache
// (queries at P.. of the cached keys) slide the same window.
//
// Grouped-query attention (num_query_groups G < heads; 1 = multi-query; Ainslie et
// al., 2023): the QKV weight holds Megatron-LM's layout, per group [its heads/G query
// heads | one key head | one value head], so a tp rank's contiguous block of columns is
// its G/tp groups. After the GEMM the layer lays the rows out as for multi-head
// attention (q copied, each group's k and v repeated for its query heads by a batched
// GEMM with [I ... I]); backward sums the repeated heads' gradients back the same way.
// Activations and the attention kernel are then those of multi-head attention: GQA
// saves the K/V projection's parameters and FLOPs here, not attention memory.
//
// Multi-latent attention (multi_latent_attention = true; DeepSeek-V2 and V3): q, k and v
// come from normalised low-rank latents instead of the fused QKV GEMM, with a rotary
// part of q and one rotary key shared by every head (latent_projection.hpp). The
// layer packs them as multi-head attention heads of max(qk, v) elements, zero-padded,
// so rotation, context parallelism, documents, windows and the generation cache run
// as above; the output projection reads the value heads without their padding.
#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>
#include <loom/layers/positions.hpp>

#include "latent_projection.hpp"
#include "rope_scaling.hpp"

#include <cmath>
#include <map>

namespace {

using namespace loom::layers;

class Attention : public loom::Layer {
 public:
  Attention(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()) {
    LOOM_REQUIRE(args.dims != nullptr, "attention: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "attention";
    tp_ = loom::TensorParallel(rank_, args.tp, args.sequence_parallel != 0, name_);
    fusion_ = grad_accumulation_fusion(args);
    hidden_ = d.hidden;
    heads_ = d.heads;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    latent_ = options.declared_bool("multi_latent_attention");
    LOOM_REQUIRE(hidden_ > 0 && heads_ > 0 && (latent_ || hidden_ % heads_ == 0),
                 name_ << ": hidden (" << hidden_ << ") must be a positive multiple of heads ("
                       << heads_ << ")");
    LOOM_REQUIRE(heads_ % tp == 0, name_ << ": heads (" << heads_
                                         << ") must be divisible by the tensor-parallel size ("
                                         << tp << ")");
    head_dim_ = hidden_ / heads_;
    heads_local_ = heads_ / tp;
    norm_ = norm_option(options);
    if (latent_) {
      const LatentProjection::Dims ld = latent_dims(options, hidden_, heads_, name_);
      mla_ = LatentProjection({.hidden = hidden_, .heads = heads_, .heads_local = heads_local_, .q_rank = ld.q_rank,
                               .kv_rank = ld.kv_rank, .nope = ld.nope, .rope = ld.rope, .v = ld.v},
                              rank_, &tp_, norm_);
      head_dim_ = ld.width();  // the packed heads (latent_projection.hpp)
      qk_dim_ = ld.qk();
      value_dim_ = ld.v;
    } else {
      qk_dim_ = value_dim_ = head_dim_;
    }
    hidden_local_ = heads_local_ * head_dim_;
    const int64_t G = options.declared_int("num_query_groups");
    groups_ = G > 0 ? G : heads_;
    LOOM_REQUIRE(heads_ % groups_ == 0, name_ << ": num_query_groups (" << groups_ << ") must divide the heads ("
                                              << heads_ << ")");
    LOOM_REQUIRE(groups_ % tp == 0, name_ << ": num_query_groups (" << groups_
                                          << ") must be divisible by the tensor-parallel size (" << tp << ")");
    grouped_ = groups_ < heads_;
    group_heads_ = heads_ / groups_;
    // Local QKV columns: [q | k | v] of this rank's heads, or its G/tp groups.
    qkv_local_ = grouped_ ? groups_ / tp * (group_heads_ + 2) * head_dim_ : 3 * hidden_local_;
    proj_in_local_ = heads_local_ * value_dim_;
    dropout_ = dropout_option(options);
    cp_group_ = rank.group_or_single("cp");
    cp_ = loom::ContextSlice(seq_, cp_group_.size(), cp_group_.rank());
    LOOM_REQUIRE(cp_.cp() == 1 || (rank.device().features() & LOOM_DEVICE_ATTENTION_WINDOW) != 0,
                 name_ << ": context parallelism (cp = " << cp_.cp()
                       << ") needs windowed attention, which this device plugin does not advertise "
                          "(LOOM_DEVICE_ATTENTION_WINDOW, ABI 1.6); rebuild it against ABI 1.6 or set parallel.cp = 1");
    require_ops(options, rank.device(), name_, rank.device().features());
    rope_ = options.declared_string("position_embedding") == "rope";
    rope_theta_ = static_cast<float>(options.declared_float("rotary_base"));
    rotary_dim_ = latent_ ? mla_.dims().rope : rotary_dim_of(options, head_dim_);
    LOOM_REQUIRE(!rope_ || rotary_dim_ >= 2, name_ << ": rotary_percent leaves no pair of the head's " << head_dim_
                                                     << " dimensions to rotate");
    if (rope_) {
      const rope_scaling::Scaling scaling =
          rope_scaling::scaling_of(options, rope_theta_, rotary_dim_, qk_dim_, latent_, name_);
      if (!scaling.inv_freq.empty()) upload_rope_frequencies(rank.device(), scaling.inv_freq);
      softmax_factor_ = scaling.softmax_factor;
    }
    qk_norm_ = options.declared_bool("qk_norm");
    window_ = options.declared_int("sliding_window");
    tp_group_ = loom::Group(args.tp);
    const bool bias = options.declared_bool("bias");
    LOOM_REQUIRE(!(bias && options.declared_bool("add_qkv_bias")),
                 name_ << ": add_qkv_bias gives q, k and v biases in a layer without them (bias = false); with bias = "
                          "true every projection has one already: set bias = false or leave add_qkv_bias out");
    const bool qkv_bias = bias || options.declared_bool("add_qkv_bias");  // Qwen2's: q, k and v only
    const int64_t H = hidden_;
    params_ = ParamSet(name_, {.tp = tp});
    ln_w_ = params_.add({.name = "ln.weight", .shape = {H}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
    if (!norm_.rms)
      ln_b_ = params_.add({.name = "ln.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    if (latent_) {
      mla_.declare(params_);
    } else {
      // Fused [q | k | v] columns: each tp rank holds its heads of all three (stride 3);
      // grouped, [q heads | k | v] per group, each tp rank a contiguous block of groups.
      const int64_t qkv_cols = grouped_ ? groups_ * (group_heads_ + 2) * head_dim_ : 3 * H;
      const int32_t qkv_stride = grouped_ ? 1 : 3;
      qkv_w_ = params_.add({.name = "qkv.weight", .shape = {H, qkv_cols}, .partition_dim = 1,
                            .partition_stride = qkv_stride, .init = LOOM_INIT_NORMAL});
      if (qkv_bias)
        qkv_b_ = params_.add({.name = "qkv.bias", .shape = {qkv_cols}, .partition_dim = 0,
                              .partition_stride = qkv_stride, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    }
    proj_w_ = params_.add({.name = "proj.weight", .shape = {heads_ * value_dim_, H}, .partition_dim = 0,
                           .init = LOOM_INIT_NORMAL_SCALED});
    if (bias)
      proj_b_ = params_.add({.name = "proj.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    if (qk_norm_) {
      const int64_t D = head_dim_;
      q_norm_w_ = params_.add({.name = "q_norm.weight", .shape = {D}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
      k_norm_w_ = params_.add({.name = "k_norm.weight", .shape = {D}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
      if (!norm_.rms) {
        q_norm_b_ = params_.add({.name = "q_norm.bias", .shape = {D}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
        k_norm_b_ = params_.add({.name = "k_norm.bias", .shape = {D}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
      }
    }
    w_.assign(params_.size(), nullptr);
    g_.assign(params_.size(), nullptr);
  }

  // The device ops the options need: of the run's device before launch, of this rank's at create.
  template <class Ops>
  static void require_ops(const loom::Options& options, const Ops& dev, const std::string& name,
                          uint64_t device_features) {
    require_latent_options(options, name);
    norm_option(options).require_ops(dev, name);
    if (options.declared_string("position_embedding") == "rope")
      require_device_ops(dev.has_rope_fwd() && dev.has_rope_bwd(), name, "position_embedding = \"rope\"",
                         "rope_fwd and rope_bwd");
    const bool rope = options.declared_string("position_embedding") == "rope";
    LOOM_REQUIRE(rope || options.declared_string("rope_scaling") == "none",
                 name << ": rope_scaling = \"" << options.declared_string("rope_scaling")
                      << "\" scales rotary embeddings, and position_embedding is \""
                      << options.declared_string("position_embedding") << "\"; set position_embedding = \"rope\" "
                      << "or rope_scaling = \"none\"");
    if (options.declared_int("sliding_window") > 0)
      LOOM_REQUIRE((device_features & LOOM_DEVICE_ATTENTION_SLIDING_WINDOW) != 0,
                   name << ": sliding_window = " << options.declared_int("sliding_window")
                        << " needs a device whose attention slides a window over the keys "
                           "(LOOM_DEVICE_ATTENTION_SLIDING_WINDOW, ABI 1.21); rebuild the device plugin against ABI 1.21");
    if (rope && options.declared_string("rope_scaling") != "none")
      LOOM_REQUIRE((device_features & LOOM_DEVICE_ROPE_FREQUENCIES) != 0,
                   name << ": rope_scaling = \"" << options.declared_string("rope_scaling")
                        << "\" needs a device whose rotary embedding takes its frequencies "
                           "(LOOM_DEVICE_ROPE_FREQUENCIES, ABI 1.20); rebuild the device plugin against ABI 1.20");
  }
  // multi_latent_attention's options: what it replaces (the fused QKV and its bias,
  // grouped queries, q/k normalisation) cannot be asked for with it, and its rotary
  // part is its only position signal.
  static void require_latent_options(const loom::Options& options, const std::string& name) {
    if (!options.declared_bool("multi_latent_attention")) {
      for (const char* key : {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"})
        LOOM_REQUIRE(options.declared_int(key) == 0,
                     name << ": " << key << " = " << options.declared_int(key)
                          << " sizes multi-latent attention; set multi_latent_attention = true or leave it out");
      return;
    }
    const auto refuse = [&](bool bad, const std::string& what) {
      LOOM_REQUIRE(!bad, name << ": multi_latent_attention " << what);
    };
    refuse(options.declared_string("position_embedding") != "rope",
           "rotates the decoupled part of q and k (qk_pos_emb_head_dim): set position_embedding = \"rope\" (here "
           "and on layer/embedding)");
    refuse(options.declared_bool("bias") || options.declared_bool("add_qkv_bias"),
           "has no biases (DeepSeek-V2/V3): set bias = false and leave add_qkv_bias out");
    refuse(options.declared_int("num_query_groups") != 0,
           "shares keys and values through its latent, not by query groups: leave num_query_groups out");
    refuse(options.declared_bool("qk_norm"), "normalises its latents, not q and k: leave qk_norm out");
    refuse(options.declared_float("rotary_percent") != 1.0,
           "rotates qk_pos_emb_head_dim elements of each head: leave rotary_percent out");
    refuse(options.declared_int("kv_lora_rank") < 1, "needs kv_lora_rank, the key/value latent's width (>= 1)");
    // A LayerNorm over one element outputs its bias whatever the element: every token
    // would get the same latent.
    if (options.declared_string("norm") == "layernorm")
      for (const char* key : {"q_lora_rank", "kv_lora_rank"})
        refuse(options.declared_int(key) == 1, std::string("normalises its latents, and a LayerNorm over ") + key +
                                                   " = 1 element is its bias alone: make it 2 or more, or set norm = "
                                                   "\"rmsnorm\"");
  }

  // The latent projection's widths; a head size left 0 is hidden / heads (the rotary
  // part half of it).
  static LatentProjection::Dims latent_dims(const loom::Options& options, int64_t hidden, int64_t heads,
                                            const std::string& name) {
    const int64_t head = hidden / heads;
    const auto or_default = [&](const char* key, int64_t fallback, const char* what) {
      const int64_t v = options.declared_int(key);
      if (v > 0) return v;
      LOOM_REQUIRE(hidden % heads == 0, name << ": " << key << " defaults to " << what << ", and hidden (" << hidden
                                             << ") is not a multiple of heads (" << heads << "); set " << key);
      LOOM_REQUIRE(fallback > 0, name << ": " << key << " defaults to " << what << ", 0 here (hidden " << hidden
                                      << ", heads " << heads << "); set " << key);
      return fallback;
    };
    LatentProjection::Dims d;
    d.q_rank = options.declared_int("q_lora_rank");
    d.kv_rank = options.declared_int("kv_lora_rank");
    d.nope = or_default("qk_head_dim", head, "hidden / heads");
    d.rope = or_default("qk_pos_emb_head_dim", head / 2 / 2 * 2, "half of hidden / heads, rounded down to even");
    d.v = or_default("v_head_dim", head, "hidden / heads");
    LOOM_REQUIRE(d.rope % 2 == 0, name << ": qk_pos_emb_head_dim (" << d.rope
                                       << ") must be even: the rotation turns pairs of elements");
    return d;
  }

  static void validate(const loom::Options& options, const loom::LayerValidation& v) {
    require_ops(options, v, v.instance_name(), v.device_features());
    const int64_t hidden = v.dims().hidden, heads = v.dims().heads;
    if (options.declared_bool("multi_latent_attention")) {
      const LatentProjection::Dims d = latent_dims(options, hidden, heads, v.instance_name());
      (void)rope_scaling::scaling_of(options, options.declared_float("rotary_base"), d.rope, d.qk(), true,
                                     v.instance_name());
    } else if (options.declared_string("position_embedding") == "rope" && heads > 0 && hidden % heads == 0) {
      const int64_t head = hidden / heads;
      if (rotary_dim_of(options, head) >= 2)
        (void)rope_scaling::scaling_of(options, options.declared_float("rotary_base"), rotary_dim_of(options, head),
                                       head, false, v.instance_name());
    }
  }
  // The rotated elements of each head: its first rotary_percent, an even count.
  static int64_t rotary_dim_of(const loom::Options& options, int64_t head_dim) {
    return static_cast<int64_t>(static_cast<double>(head_dim) * options.declared_float("rotary_percent")) / 2 * 2;
  }

  static constexpr uint64_t kFeatures = LOOM_LAYER_CONTEXT_PARALLEL | LOOM_LAYER_KV_CACHE | LOOM_LAYER_DOCUMENTS;

  std::vector<loom::ParamSpec> params() override { return params_.specs(); }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    dt_ = params_.bind(params, grads, w_.data(), g_.data());
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    if (a.kv_cache) return forward_cached(rank, a);
    const int64_t H = hidden_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    // The input is this rank's sequence shard under sequence parallelism.
    const int64_t Sl = a.input->shape[0], B = a.input->shape[1], Tl = Sl * B;
    const int64_t S = tp_.sequence_parallel() ? Sl * tp_.size() : Sl, T = S * B;
    require_act(a.output, "output", name_, dt_.act, {Sl, B, H});
    // The windows' positions come from the model's seq_len: the rows must be this
    // cp rank's slice of it, or the key window would run past the gathered rows.
    cp_.require_local_rows(S, name_);
    const void* x = data_of<void>(*a.input);
    void* y = data_of<void>(*a.output);
    loom::Device dev = rank.device();
    const bool drop = a.training && dropout_ > 0.0f;
    const bool sp = tp_.sequence_parallel();
    // Documents packed in the sequences (ABI 1.22): each row's document's start, its
    // position in its document.
    if (a.document_start) {
      require_tensor(a.document_start, "document_start", name_, kDLInt, 32, {S, B});
      require_key_start(dev);
    }
    if (a.position_ids) require_tensor(a.position_ids, "position_ids", name_, kDLInt, 32, {S, B});

    Saved s = saved_layout(S, B, a.training, drop, a.document_start != nullptr);
    s.mem.allocate(rank_);
    s.positions = a.position_ids ? data_of<int32_t>(*a.position_ids) : nullptr;
    if (a.document_start)
      key_starts(dev, data_of<int32_t>(*a.document_start), s.mem.at<int32_t>(s.key_start), S, B, halves());

    ForwardTemps ft = forward_temps(S, B);
    Arena& tmp = ft.mem;
    const size_t ln = ft.ln, ln_full = ft.ln_full, proj = ft.proj, grouped = ft.grouped, ctx_c = ft.ctx_c;
    tmp.allocate(rank_);

    if (a.training) copy_d2d(dev, s.mem.at(s.x), x, Tl * H * dt_.act_bytes());
    norm_.forward(dev, x, w(ln_w_), w(ln_b_), tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), Tl, H, dt_.act);
    if (latent_) {
      mla_.forward(dev, tmp.at(ln), tmp.at(ln_full), Tl, s.mem.at(s.qkv), s.latents.at(s.mem), w_, dt_.act);
    } else {
      // Column-parallel QKV (f: identity, or the all-gather under SP): local
      // columns [q | k | v], each heads_local * head_dim.
      tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = qkv_local_, .x = tmp.at(ln),
                                          .x_full = sp ? tmp.at(ln_full) : nullptr, .weight = w(qkv_w_),
                                          .bias = w(qkv_b_), .y = grouped_ ? tmp.at(grouped) : s.mem.at(s.qkv),
                                          .dtype = dt_.act});
      if (grouped_) ungroup(dev, tmp.at(grouped), s.mem.at(s.qkv), T);
    }
    if (qk_norm_) normalize_qk(dev, s.mem.at(s.qkv), T, s.mem.at(s.qk_x), s.mem.at(s.qk_mean), s.mem.at(s.qk_rstd));
    if (rope_) rotate(dev, s.mem.at(s.qkv), S, B, /*backward=*/false, 0, s.positions);
    {
      KvFull kv(*this, dev, s, /*backward=*/false);
      for (int h = 0; h < halves(); ++h) dev.attention_fwd(attention_args(s, kv, h));
    }
    // Row-parallel projection (g: all-reduce, or reduce-scatter under SP), bias after it.
    void* p = tmp.at<void>(proj);
    tp_.row_parallel_linear_forward({.rows = T, .in = proj_in_local_, .out = H,
                                     .x = value_heads(dev, s.mem.at(s.ctx), tmp.at(ctx_c), T), .weight = w(proj_w_),
                                     .bias = w(proj_b_), .y = p, .dtype = dt_.act});
    if (drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = p, .out = p,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch, .dtype = dt_.act,
                           .seed_device = a.dropout_seed_device});
    add(dev, x, p, y, Tl * H, dt_.act);  // the residual

    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  // Generation (ABI 1.13 kv_cache): rows at positions [P, P + S) of B sequences. Their
  // keys and values go into the cache at those positions; the queries attend to the
  // cache's first P + S positions as a window (the same op context parallelism uses).
  // Multi-latent attention caches each position's latent instead (latent_projection.hpp).
  void forward_cached(loom::Rank& rank, const loom_layer_fwd_args& a) {
    const int64_t H = hidden_, Hl = hidden_local_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    const int64_t S = a.input->shape[0], B = a.input->shape[1], T = S * B, P = a.position_offset;
    require_act(a.output, "output", name_, dt_.act, {S, B, H});
    LOOM_REQUIRE(!tp_.sequence_parallel() && cp_.cp() == 1,
                 name_ << ": a kv_cache forward runs without sequence or context parallelism");
    LOOM_REQUIRE(P >= 0 && S > 0 && P + S <= seq_, name_ << ": positions [" << P << ", " << P + S
                                                         << ") run past the model's seq_len " << seq_);
    LOOM_REQUIRE(P == 0 || B == cache_batch_, name_ << ": a kv_cache forward at position " << P << " of " << B
                                                    << " sequences continues no cached sequences of that batch");
    loom::Device dev = rank.device();
    LOOM_REQUIRE((dev.features() & LOOM_DEVICE_ATTENTION_WINDOW) != 0,
                 name_ << ": generation with a key/value cache needs windowed attention (LOOM_DEVICE_ATTENTION_WINDOW)");
    const size_t eb = loom::dtype_size(dt_.act);
    const int64_t W = cache_width();
    if (P == 0 && (cache_.get() == nullptr || cache_batch_ != B)) {
      cache_ = loom::Buffer(rank_, static_cast<size_t>(seq_ * B * W) * eb);
      cache_batch_ = B;
    }
    const void* x = data_of<void>(*a.input);
    void* y = data_of<void>(*a.output);

    const int64_t Lc = latent_ ? mla_.cache_width() : 0;
    Arena tmp;
    const size_t ln = tmp.elems(T * H, dt_.act), qkv = tmp.elems(T * 3 * Hl, dt_.act),
                 grouped = tmp.elems(grouped_ ? T * qkv_local_ : 0, dt_.act),
                 ctx = tmp.elems(latent_ ? 0 : T * Hl, dt_.act), mean = tmp.floats(T), rstd = tmp.floats(T),
                 lse = tmp.floats(B * heads_local_ * S), proj = tmp.elems(T * H, dt_.act),
                 qk_x = tmp.elems(qk_norm_ ? 2 * T * Hl : 0, dt_.act),
                 ctx_c = tmp.elems(packed_values() || latent_ ? T * proj_in_local_ : 0, dt_.act),
                 qk_mean = tmp.floats(qk_norm_ && !norm_.rms ? 2 * T * heads_local_ : 0),
                 qk_rstd = tmp.floats(qk_norm_ ? 2 * T * heads_local_ : 0),
                 key_start = tmp.add(a.document_start ? T * sizeof(int32_t) : 0),
                 // the latent cache's absorbed queries, keys of every cached position, context
                 q_abs = tmp.elems(T * heads_local_ * Lc, dt_.act),
                 k_abs = tmp.elems((P + S) * B * heads_local_ * Lc, dt_.act),
                 ctx_abs = tmp.elems(T * heads_local_ * Lc, dt_.act);
    const LatentProjection::LatentPieces latents = latent_ ? mla_.lay_out(tmp, T, dt_.act) : LatentProjection::LatentPieces{};
    tmp.allocate(rank_);
    norm_.forward(dev, x, w(ln_w_), w(ln_b_), tmp.at(ln), tmp.at(mean), tmp.at(rstd), T, H, dt_.act);
    if (latent_) {
      mla_.forward(dev, tmp.at(ln), nullptr, T, tmp.at(qkv), latents.at(tmp), w_, dt_.act);
    } else {
      tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = qkv_local_, .x = tmp.at(ln), .x_full = nullptr,
                                          .weight = w(qkv_w_), .bias = w(qkv_b_),
                                          .y = grouped_ ? tmp.at(grouped) : tmp.at(qkv), .dtype = dt_.act});
      if (grouped_) ungroup(dev, tmp.at(grouped), tmp.at(qkv), T);
    }
    if (qk_norm_) normalize_qk(dev, tmp.at(qkv), T, tmp.at(qk_x), tmp.at(qk_mean), tmp.at(qk_rstd));
    if (a.position_ids) require_tensor(a.position_ids, "position_ids", name_, kDLInt, 32, {S, B});
    if (rope_) rotate(dev, tmp.at(qkv), S, B, /*backward=*/false, P,
                      a.position_ids ? data_of<int32_t>(*a.position_ids) : nullptr);
    void* cache = cache_.get();
    if (latent_)
      mla_.cache_latents(dev, latents.at(tmp), w_, tmp.at(qkv), advance(cache, P * B * W, dt_.act), W, T, dt_.act);
    else
      dev.copy_2d(advance(cache, P * B * W, dt_.act), W * eb, advance(tmp.at<const void>(qkv), Hl, dt_.act),
                  3 * Hl * eb, W * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    loom_attention_args at = loom::make<loom_attention_args>();
    at.batch = B;
    at.seq = S;
    at.heads = heads_local_;
    at.lse = tmp.at(lse);
    at.scale = softmax_scale();
    at.causal = 1;
    at.dtype = dt_.act;
    at.q_offset = P;
    at.kv_seq = P + S;
    at.window = window_;
    if (a.document_start) {  // the queries' documents' starts, [B, S] from the engine's [S, B]
      require_tensor(a.document_start, "document_start", name_, kDLInt, 32, {S, B});
      require_key_start(dev);
      key_starts(dev, data_of<int32_t>(*a.document_start), tmp.at<int32_t>(key_start), S, B, 1);
      at.key_start = tmp.at<int32_t>(key_start);
    }
    const void* values = nullptr;  // what the output projection reads: [T, proj_in_local_]
    if (latent_) {
      // Every head attends over the latent rows [k_pe | kv] (as keys and as values);
      // the op takes one key row per head, so the rows are repeated per head here.
      mla_.absorb_queries(dev, tmp.at(qkv), tmp.at(q_abs), T, w_, dt_.act);
      copy_heads(dev, tmp.at(k_abs), heads_local_ * Lc, Lc, cache, W, 0, Lc, (P + S) * B, heads_local_, dt_.act);
      at.head_dim = Lc;
      at.qkv_stride_b = heads_local_ * Lc;
      at.qkv_stride_s = B * heads_local_ * Lc;
      at.out_stride_b = heads_local_ * Lc;
      at.out_stride_s = B * heads_local_ * Lc;
      at.q = tmp.at(q_abs);
      at.k = tmp.at(k_abs);
      at.v = tmp.at(k_abs);
      at.out = tmp.at(ctx_abs);
      at.kv_stride_b = heads_local_ * Lc;
      at.kv_stride_s = B * heads_local_ * Lc;
      dev.attention_fwd(at);
      mla_.expand_values(dev, tmp.at(ctx_abs), tmp.at(ctx_c), T, w_, dt_.act);
      values = tmp.at(ctx_c);
    } else {
      at.head_dim = head_dim_;
      at.qkv_stride_b = 3 * Hl;
      at.qkv_stride_s = B * 3 * Hl;
      at.out_stride_b = Hl;
      at.out_stride_s = B * Hl;
      at.q = tmp.at(qkv);
      at.k = cache;
      at.v = advance(cache, Hl, dt_.act);
      at.out = tmp.at(ctx);
      at.kv_stride_b = W;
      at.kv_stride_s = B * W;
      dev.attention_fwd(at);
      values = value_heads(dev, tmp.at(ctx), tmp.at(ctx_c), T);
    }
    tp_.row_parallel_linear_forward({.rows = T, .in = proj_in_local_, .out = H, .x = values, .weight = w(proj_w_),
                                     .bias = w(proj_b_), .y = tmp.at(proj), .dtype = dt_.act});
    add(dev, x, tmp.at(proj), y, T * H, dt_.act);  // the residual
  }

  // The elements a generation cache keeps per position and sequence: this rank's k | v
  // heads, or multi-latent attention's latent [k_pe | kv] (the same on every tp rank).
  int64_t cache_width() const { return latent_ ? mla_.cache_width() : 2 * hidden_local_; }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, Hl = hidden_local_, S = s.S, B = s.B, T = S * B;
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
    const size_t dproj = bt.dproj, dctx = bt.dctx, dqkv = bt.dqkv, dln = bt.dln, ctx_c = bt.ctx_c,
                 dctx_c = bt.dctx_c;
    tmp.allocate(rank_);

    // Through dropout; the projection and its bias (g's backward: identity, or
    // the all-gather under SP).
    const void* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dproj), s.mem.at<uint8_t>(s.mask), Tl * H, dropout_, dt_.act);
      d = tmp.at(dproj);
    }
    tp_.row_parallel_linear_backward({.rows = T, .in = proj_in_local_, .out = H,
                                      .x = value_heads(dev, s.mem.at(s.ctx), tmp.at(ctx_c), T), .weight = w(proj_w_),
                                      .dy = d, .dx = packed_values() ? tmp.at(dctx_c) : tmp.at(dctx),
                                      .dweight = grad(proj_w_), .dbias = grad(proj_b_), .dtype = dt_.act,
                                      .grad_fp32 = gs.grad_fp32()});
    if (packed_values()) {  // into the packed heads, zero beyond each head's values
      fill_zero(dev, tmp.at(dctx), T * Hl, dt_.act);
      copy_heads(dev, tmp.at(dctx), Hl, head_dim_, tmp.at(dctx_c), proj_in_local_, value_dim_, value_dim_, T,
                 heads_local_, dt_.act);
    }

    {
      KvFull kv(*this, dev, s, /*backward=*/true);
      void* dkv = kv.gathered ? kv.grad() : nullptr;  // dK, dV of the whole sequence (cp > 1)
      for (int h = 0; h < halves(); ++h) {
        loom_attention_args att = attention_args(s, kv, h);
        att.dout = advance(tmp.at<const void>(dctx), h * kv.chunk_rows * Hl, dt_.act);
        att.dq = advance(tmp.at<void>(dqkv), h * kv.chunk_rows * 3 * Hl, dt_.act);
        att.dk = dkv ? dkv : advance(tmp.at<void>(dqkv), Hl, dt_.act);
        att.dv = advance(att.dk, Hl, dt_.act);
        att.accumulate_dkv = dkv ? 1 : 0;
        dev.attention_bwd(att);
      }
      if (dkv) kv.scatter_grad(tmp.at<void>(dqkv));
    }
    if (rope_) rotate(dev, tmp.at(dqkv), S, B, /*backward=*/true, 0, s.positions);  // dq, dk of the unrotated q, k
    // The gradient of the normalised input, into tmp.at(bt.dln); the projections' weight gradients.
    if (latent_)
      latent_projection_backward(dev, s, bt, gs, Tl);
    else
      qkv_projection_backward(dev, s, bt, gs, Tl);

    // dx = dy (the residual) + LN backward; every read of dy is done above.
    copy_d2d(dev, dx, dy, Tl * H * dt_.act_bytes());
    norm_.backward(dev, tmp.at(dln), s.mem.at(s.x), w(ln_w_), s.mem.at(s.mean), s.mem.at(s.rstd), dx, grad(ln_w_),
                   grad(ln_b_), Tl, H, /*accumulate_dx=*/true, dt_.act, gs.grad_fp32());
    gs.commit();
    saved_.erase(it);
  }

  void release(int32_t microbatch) override { saved_.erase(microbatch); }

  // Device work only, on fixed shapes; the dropout reads the step's seed on the
  // device when the service and device can (ABI 1.3). With tp > 1 the engine does
  // not capture (collectives); under context parallelism the K/V exchange over cp
  // is a collective too.
  bool capturable() override {
    if (cp_.cp() > 1) return false;
    return dropout_ == 0.0f || dropout_seed_on_device(loom::Rank(rank_).device(), tp_);
  }

  uint64_t activation_bytes() override {
    return saved_layout(cp_.local_length(), micro_batch_, true, dropout_ > 0.0f).mem.bytes();
  }

  // The larger of a training forward's and a backward's temporaries, each with the
  // whole sequence's K and V under context parallelism (KvFull), the backward with its
  // gradient shadows when the gradients are kept in another dtype.
  uint64_t workspace_bytes() override {
    const int64_t S = cp_.local_length(), B = micro_batch_;
    const auto kv_full = [&](bool backward) {
      const int64_t cp = cp_.cp(), T = S * B, W = 2 * hidden_local_;
      if (cp <= 1) return uint64_t{0};
      Arena a;
      a.elems(cp * T * W, dt_.act);
      a.elems(T * W, dt_.act);
      a.elems(cp * T * W, dt_.act);
      a.elems(backward ? cp * T * W : 0, dt_.act);
      return uint64_t{a.bytes()};
    };
    const loom::Device dev = loom::Rank(rank_).device();
    const uint64_t shadows = GradShadow::bytes(dev, dt_, params_.local_numels(), tp_.features(), fusion_);
    const uint64_t service = sequence_parallel_service_bytes(tp_, S * B, hidden_, dt_.act);
    const auto latent = [&](bool backward) {
      return latent_ ? mla_.temp_bytes(tp_.local_rows(S * B), backward, dt_.act) : uint64_t{0};
    };
    return std::max<uint64_t>(forward_temps(S, B).mem.bytes() + kv_full(false) + qk_norm_temp_bytes(S * B, false) +
                                  latent(false),
                              backward_temps(S, B, dropout_ > 0.0f).mem.bytes() + kv_full(true) + shadows +
                                  qk_norm_temp_bytes(S * B, true) + latent(true)) +
           service;
  }

  // QKV 2*T*H*(its local columns) + QK^T 2*T*S*Hl + PV 2*T*S*Hl + proj 2*T*Hl*H
  // (causal counted as full), over this rank's T tokens (1/cp of them) against all S
  // keys, or the sliding window's W of them (a window counted as full too). Multi-latent
  // attention: its projections instead of QKV, and the heads' own q/k and value sizes
  // (not the packed heads' zeros).
  double forward_flops() override {
    const double T = static_cast<double>(cp_.local_length() * micro_batch_);
    const double S = static_cast<double>(window_ > 0 ? std::min(window_, seq_) : seq_);
    const double H = static_cast<double>(hidden_), hl = static_cast<double>(heads_local_);
    const double qk = hl * static_cast<double>(qk_dim_), v = hl * static_cast<double>(value_dim_);
    const double projections = latent_ ? mla_.forward_flops(tp_.local_rows(cp_.local_length() * micro_batch_))
                                       : 2.0 * T * H * static_cast<double>(qkv_local_);
    return projections + 2.0 * T * S * (qk + v) + 2.0 * T * v * H;
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);  // a parameter the options leave out
  void* w(size_t i) const { return i == kNone ? nullptr : w_[i]; }

  // Whether a column-parallel GEMM reads the norm's output gathered over tp under
  // sequence parallelism (multi-latent attention with a query latent gathers its latents instead).
  bool gathers_norm_output() const { return !latent_ || mla_.needs_gathered_input(); }

  // 1 / sqrt(q/k head size), times what a YaRN rope_scaling does to the scores (rope_scaling.hpp).
  float softmax_scale() const {
    return static_cast<float>(softmax_factor_ / std::sqrt(static_cast<double>(qk_dim_)));
  }

  // Whether a packed head holds more than its values (multi-latent attention with
  // value heads narrower than q and k): then the output projection reads the value
  // heads copied out of the packed context.
  bool packed_values() const { return value_dim_ != head_dim_; }

  // The context [T, Hl] as the output projection reads it: itself, or its value heads
  // compacted into `compact` [T, heads_local * value_dim].
  const void* value_heads(const loom::Device& dev, const void* ctx, void* compact, int64_t T) const {
    if (!packed_values()) return ctx;
    copy_heads(dev, compact, proj_in_local_, value_dim_, ctx, hidden_local_, head_dim_, value_dim_, T, heads_local_,
               dt_.act);
    return compact;
  }

  // A training forward's temporaries over S x B rows (S this rank's part of the
  // sequence, whole under SP): the norm's output (and its gather), the projection's
  // output, Q|K|V grouped for grouped-query attention.
  struct ForwardTemps {
    Arena mem;
    size_t ln = 0, ln_full = 0, proj = 0, grouped = 0, ctx_c = 0;
  };
  ForwardTemps forward_temps(int64_t S, int64_t B) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    ForwardTemps t;
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp && gathers_norm_output() ? T * H : 0, dt_.act);
    t.proj = t.mem.elems(Tl * H, dt_.act);
    t.grouped = t.mem.elems(grouped_ ? T * qkv_local_ : 0, dt_.act);
    t.ctx_c = t.mem.elems(packed_values() ? T * proj_in_local_ : 0, dt_.act);
    return t;
  }

  // A backward's: the gradients of the context, Q|K|V, the norm's output, and the
  // recomputed norm output.
  struct BackwardTemps {
    Arena mem;
    size_t dproj = 0, ln = 0, ln_full = 0, dctx = 0, dqkv = 0, dln = 0, dgrouped = 0, dbias = 0;
    size_t ctx_c = 0, dctx_c = 0;  // the value heads without their padding (multi-latent attention)
  };
  BackwardTemps backward_temps(int64_t S, int64_t B, bool dropped) const {
    const bool sp = tp_.sequence_parallel();
    const int64_t H = hidden_, Hl = hidden_local_, T = S * B, Tl = (sp ? S / tp_.size() : S) * B;
    BackwardTemps t;
    t.dproj = t.mem.elems(dropped ? Tl * H : 0, dt_.act);
    t.ln = t.mem.elems(Tl * H, dt_.act);
    t.ln_full = t.mem.elems(sp && gathers_norm_output() ? T * H : 0, dt_.act);
    t.dctx = t.mem.elems(T * Hl, dt_.act);
    t.dqkv = t.mem.elems(T * 3 * Hl, dt_.act);
    t.dln = t.mem.elems(Tl * H, dt_.act);
    t.dgrouped = t.mem.elems(grouped_ ? T * qkv_local_ : 0, dt_.act);
    t.dbias = t.mem.floats(qkv_local_);
    t.ctx_c = t.mem.elems(packed_values() ? T * proj_in_local_ : 0, dt_.act);
    t.dctx_c = t.mem.elems(packed_values() ? T * proj_in_local_ : 0, dt_.act);
    return t;
  }

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;
    size_t x = 0, mean = 0, rstd = 0, qkv = 0, ctx = 0, lse = 0, mask = 0;
    size_t qk_x = 0, qk_mean = 0, qk_rstd = 0;  // qk_norm: q and k before it, their statistics
    size_t key_start = 0;                         // documents: each query's first key (see key_starts)
    bool dropped = false, documents = false;
    const int32_t* positions = nullptr;  // position_ids (the engine's, alive until backward), or null
    LatentProjection::LatentPieces latents;  // multi-latent attention: its latents before their norms
  };

  // What a forward of S x B rows keeps for its backward (laid out, not allocated):
  // activation_bytes() reports the same layout a training forward allocates.
  Saved saved_layout(int64_t S, int64_t B, bool training, bool drop, bool documents = false) const {
    const int64_t H = hidden_, Hl = hidden_local_;
    const int64_t T = S * B, Tl = (tp_.sequence_parallel() ? S / tp_.size() : S) * B;
    Saved s;
    s.S = S;
    s.B = B;
    s.x = s.mem.elems(training ? Tl * H : 0, dt_.act);  // this rank's shard under SP
    s.mean = s.mem.floats(Tl);
    s.rstd = s.mem.floats(Tl);
    s.qkv = s.mem.elems(T * 3 * Hl, dt_.act);
    s.ctx = s.mem.elems(T * Hl, dt_.act);  // the attention output
    s.lse = s.mem.floats(B * heads_local_ * S);
    s.mask = s.mem.add(drop ? Tl * H : 0);
    s.qk_x = s.mem.elems(qk_norm_ ? 2 * T * Hl : 0, dt_.act);
    s.qk_mean = s.mem.floats(qk_norm_ && !norm_.rms ? 2 * T * heads_local_ : 0);
    s.qk_rstd = s.mem.floats(qk_norm_ ? 2 * T * heads_local_ : 0);
    s.key_start = s.mem.add(documents ? T * sizeof(int32_t) : 0);
    if (latent_) s.latents = mla_.lay_out(s.mem, Tl, dt_.act);
    s.dropped = drop;
    s.documents = documents;
    return s;
  }

  // Multi-latent attention's projections backward (latent_projection.hpp), from the
  // packed dq, dk, dv in bt.dqkv.
  void latent_projection_backward(const loom::Device& dev, Saved& s, BackwardTemps& bt, const GradShadow& gs,
                                  int64_t Tl) {
    const int64_t H = hidden_;
    Arena& tmp = bt.mem;
    const size_t ln = bt.ln, ln_full = bt.ln_full, dqkv = bt.dqkv, dln = bt.dln;
    // The norm's output recomputed, here this rank's rows (and gathered for a
    // column-parallel q under SP).
    const void* ln_in = tmp.at(ln);
    if (mla_.needs_gathered_input())
      ln_in = recompute_ln_input(dev, tp_, s.mem.at(s.x), w(ln_w_), w(ln_b_), s.mem.at(s.mean), s.mem.at(s.rstd),
                                 tmp.at(ln), tmp.at(ln_full), Tl, H, dt_.act, norm_);
    else
      norm_.forward(dev, s.mem.at(s.x), w(ln_w_), w(ln_b_), tmp.at(ln), s.mem.at(s.mean), s.mem.at(s.rstd), Tl, H,
                    dt_.act);
    mla_.backward(dev, tmp.at(dqkv), tmp.at(ln), ln_in, s.latents.at(s.mem), tmp.at(dln), Tl, w_, gs, dt_.act);
  }

  // The fused QKV GEMM's backward (column-parallel, through the query groups and the
  // q/k norms), from the packed dq, dk, dv in bt.dqkv.
  void qkv_projection_backward(const loom::Device& dev, Saved& s, BackwardTemps& bt, GradShadow& gs, int64_t Tl) {
    const int64_t H = hidden_, Hl = hidden_local_, T = s.S * s.B;
    Arena& tmp = bt.mem;
    const size_t ln = bt.ln, ln_full = bt.ln_full, dqkv = bt.dqkv, dln = bt.dln, dgrouped = bt.dgrouped,
                 dbias = bt.dbias;
    auto grad = [&gs](size_t i) { return i == kNone ? nullptr : gs[i]; };
    if (qk_norm_) normalize_qk_backward(dev, tmp.at(dqkv), T, s, gs);  // dq, dk of the GEMM's q, k
    // The gradient of the GEMM's output: [q | k | v] as is, or summed back into groups.
    void* dout = tmp.at(dqkv);
    if (grouped_) {
      regroup(dev, tmp.at(dqkv), tmp.at(dgrouped), T);
      dout = tmp.at(dgrouped);
    }

    // The LN output, recomputed (and gathered again under SP).
    const void* ln_in = recompute_ln_input(dev, tp_, s.mem.at(s.x), w(ln_w_), w(ln_b_), s.mem.at(s.mean),
                                           s.mem.at(s.rstd), tmp.at(ln), tmp.at(ln_full), Tl, H, dt_.act, norm_);
    // f's backward (all-reduce, or reduce-scatter to the shard) closes the column-parallel GEMM.
    tp_.column_parallel_linear_backward({.rows = T, .in = H, .out = qkv_local_, .x = ln_in, .weight = w(qkv_w_),
                                         .dy = dout, .dx = tmp.at(dln), .dweight = grad(qkv_w_), .dtype = dt_.act,
                                         .grad_fp32 = gs.grad_fp32()});
    // qkv.bias: without rotary embeddings only its q and v parts get a gradient. The
    // k part's is exactly zero (softmax is invariant to adding one vector to every
    // key: each row of dS sums to 0, so sum_t dK[t] = 0); summing dK would only
    // accumulate rounding noise, which Adam (g / sqrt(v)) turns into real,
    // run-dependent updates. Rotated, the added vector differs from token to token,
    // and normalised per head (qk_norm) it is not added to the keys at all: then every
    // part has a gradient.
    float* colsum = tmp.at(dbias);  // fp32 (reductions write fp32)
    if (qkv_b_ != kNone) {
      void* qkv_b = gs[qkv_b_];
      const int32_t gdt = gs.grad_dtype();
      column_sum(dev, dout, colsum, T, qkv_local_, dt_.act);
      if (rope_ || qk_norm_) {
        accumulate_f32(rank_, dev, colsum, qkv_b, qkv_local_, gdt);
      } else if (!grouped_) {
        accumulate_f32(rank_, dev, colsum, qkv_b, Hl, gdt);                                        // q
        accumulate_f32(rank_, dev, colsum + 2 * Hl, advance(qkv_b, 2 * Hl, gdt), Hl, gdt);  // v
      } else {
        const int64_t D = head_dim_, Wg = (group_heads_ + 2) * D;
        for (int64_t g = 0; g < qkv_local_ / Wg; ++g) {
          accumulate_f32(rank_, dev, colsum + g * Wg, advance(qkv_b, g * Wg, gdt), group_heads_ * D, gdt);  // q
          accumulate_f32(rank_, dev, colsum + g * Wg + (group_heads_ + 1) * D,
                         advance(qkv_b, g * Wg + (group_heads_ + 1) * D, gdt), D, gdt);  // v
        }
      }
    }

  }

  void require_key_start(const loom::Device& dev) const {
    LOOM_REQUIRE((dev.features() & LOOM_DEVICE_ATTENTION_KEY_START) != 0,
                 name_ << ": documents packed in a sequence (data.reset_attention_mask) need a device whose attention "
                          "takes each query's first key (LOOM_DEVICE_ATTENTION_KEY_START, ABI 1.22); rebuild the "
                          "device plugin against ABI 1.22");
  }

  // The attention op's key_start (ABI 1.22) from the engine's document starts [S, B]:
  // per attention call (the sequence, or each of its `calls` cp chunks) a block [B,
  // rows of the call], each batch element's column copied into a row. The starts are
  // positions in the whole sequence, as the gathered keys are under cp.
  static void key_starts(const loom::Device& dev, const int32_t* document_start, int32_t* out, int64_t S, int64_t B,
                         int calls) {
    const int64_t rows = S / calls;
    for (int h = 0; h < calls; ++h)
      for (int64_t b = 0; b < B; ++b)
        dev.copy_2d(out + (h * B + b) * rows, sizeof(int32_t), document_start + h * rows * B + b, B * sizeof(int32_t),
                    sizeof(int32_t), static_cast<size_t>(rows), LOOM_COPY_DEVICE_TO_DEVICE);
  }

  int halves() const { return cp_.cp() > 1 ? 2 : 1; }

  // Grouped-query attention's layouts: `grouped` [T, qkv_local_] holds per local group
  // [its query heads | k | v]; `packed` [T, 3 * Hl] is [q | k | v] of every local query
  // head, the multi-head layout the attention op and the saved activations use.
  // ungroup: q copied, each group's k and v repeated for its query heads; regroup:
  // dq copied back, the repeated heads' dk and dv summed into their group's.
  void ungroup(const loom::Device& dev, void* grouped, void* packed, int64_t T) {
    for_each_group(dev, grouped, packed, T, /*to_packed=*/true);
  }
  void regroup(const loom::Device& dev, void* packed, void* grouped, int64_t T) {
    for_each_group(dev, grouped, packed, T, /*to_packed=*/false);
  }

  void for_each_group(const loom::Device& dev, void* grouped, void* packed, int64_t T, bool to_packed) {
    // Wg: one group's columns; a grouped row holds qkv_local_ (all local groups).
    const int64_t D = head_dim_, Hl = hidden_local_, qD = group_heads_ * D, Wg = qD + 2 * D, Wr = qkv_local_;
    const int64_t groups = qkv_local_ / Wg;
    const size_t eb = loom::dtype_size(dt_.act);
    for (int64_t g = 0; g < groups; ++g) {  // the query heads, as they are
      void* q_g = advance(grouped, g * Wg, dt_.act);
      void* q_p = advance(packed, g * qD, dt_.act);
      if (to_packed)
        dev.copy_2d(q_p, 3 * Hl * eb, q_g, Wr * eb, qD * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
      else
        dev.copy_2d(q_g, Wr * eb, q_p, 3 * Hl * eb, qD * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    }
    const void* repeat = repeat_matrix(dev);  // [D, qD] = [I ... I]
    for (int part = 1; part <= 2; ++part) {   // k, then v: one GEMM batched over the groups
      loom_gemm_args a = loom::make<loom_gemm_args>();
      a.batch = groups;
      a.alpha = 1.0f;
      a.dtype = a.c_dtype = dt_.act;
      void* g_part = advance(grouped, qD + (part - 1) * D, dt_.act);  // [T, D] per group, ld Wr
      void* p_part = advance(packed, part * Hl, dt_.act);            // [T, qD] per group, ld 3 Hl
      a.m = T;
      a.b = repeat;
      a.stride_b = 0;
      if (to_packed) {  // [T, D] x [D, qD]
        a.n = qD;
        a.k = D;
        a.a = g_part, a.lda = Wr, a.stride_a = Wg;
        a.ldb = qD;
        a.c = p_part, a.ldc = 3 * Hl, a.stride_c = qD;
      } else {  // [T, qD] x [D, qD]^T: the sum over the group's heads
        a.n = D;
        a.k = qD;
        a.a = p_part, a.lda = 3 * Hl, a.stride_a = qD;
        a.trans_b = 1;
        a.ldb = qD;
        a.c = g_part, a.ldc = Wr, a.stride_c = Wg;
      }
      dev.gemm(a);
    }
  }

  // [D, group_heads * D]: group_heads identity blocks side by side, in the activations'
  // dtype (exact: 0 and 1), built once.
  const void* repeat_matrix(const loom::Device& dev) {
    if (repeat_.get() == nullptr) {
      const int64_t D = head_dim_, n = group_heads_ * D;
      std::vector<float> e(static_cast<size_t>(D * n), 0.0f);
      for (int64_t r = 0; r < D; ++r)
        for (int64_t h = 0; h < group_heads_; ++h) e[static_cast<size_t>(r * n + h * D + r)] = 1.0f;
      const size_t eb = loom::dtype_size(dt_.act);
      std::vector<uint16_t> e16;
      const void* src = e.data();
      if (dt_.act == LOOM_DTYPE_BF16) {
        e16.assign(e.size(), 0);
        for (size_t i = 0; i < e.size(); ++i) e16[i] = e[i] != 0.0f ? 0x3f80 : 0;  // bf16 1.0
        src = e16.data();
      }
      loom::Buffer buf(rank_, e.size() * eb);
      dev.copy(buf.get(), src, e.size() * eb, LOOM_COPY_HOST_TO_DEVICE);
      dev.synchronize();  // the host vectors die here
      repeat_ = std::move(buf);
    }
    return repeat_.get();
  }

  // What normalize_qk (forward) and normalize_qk_backward allocate for T rows.
  uint64_t qk_norm_temp_bytes(int64_t T, bool backward) const {
    if (!qk_norm_) return 0;
    Arena a;
    a.elems(T * hidden_local_, dt_.act);
    if (backward) {
      a.elems(T * hidden_local_, dt_.act);
      a.floats(4 * head_dim_);
    }
    return a.bytes();
  }

  // qk_norm: q and k of the packed [T, 3 * Hl] normalised in place, head by head (rows
  // of head_dim). `x` [2, T * Hl] gets them as they were (q, then k), `mean` and `rstd`
  // [2, T * heads_local] their statistics (mean: layernorm only).
  void normalize_qk(const loom::Device& dev, void* qkv, int64_t T, void* x, float* mean, float* rstd) {
    const int64_t Hl = hidden_local_, rows = T * heads_local_;
    const size_t eb = loom::dtype_size(dt_.act);
    Arena tmp;
    const size_t y = tmp.elems(T * Hl, dt_.act);
    tmp.allocate(rank_);
    for (int part = 0; part < 2; ++part) {  // q, then k
      void* in_qkv = advance(qkv, part * Hl, dt_.act);
      void* xp = advance(x, part * T * Hl, dt_.act);
      dev.copy_2d(xp, Hl * eb, in_qkv, 3 * Hl * eb, Hl * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
      norm_.forward(dev, xp, w(part == 0 ? q_norm_w_ : k_norm_w_), w(part == 0 ? q_norm_b_ : k_norm_b_), tmp.at(y),
                    norm_.rms ? nullptr : mean + part * rows, rstd + part * rows, rows, head_dim_, dt_.act);
      dev.copy_2d(in_qkv, 3 * Hl * eb, tmp.at(y), Hl * eb, Hl * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    }
  }

  // The transpose: dq and dk of the packed dqkv [T, 3 * Hl] replaced, in place, by the
  // gradients of the q and k before the norm; the gammas' (and betas') gradients
  // accumulated, summed over tp here when the engine does not (no sequence
  // parallelism). Without rope, k_norm.bias is added to every key alike, which the
  // softmax cannot see: its gradient is exactly zero, as qkv.bias's k part's (see
  // backward), and is left so rather than summed from rounding noise.
  void normalize_qk_backward(const loom::Device& dev, void* dqkv, int64_t T, const Saved& s, const GradShadow& gs) {
    const int64_t Hl = hidden_local_, D = head_dim_, rows = T * heads_local_;
    const size_t eb = loom::dtype_size(dt_.act);
    const int32_t gdt = gs.grad_dtype();
    Arena tmp;
    const size_t dy = tmp.elems(T * Hl, dt_.act), dx = tmp.elems(T * Hl, dt_.act), partial = tmp.elems(4 * D, gdt);
    tmp.allocate(rank_);
    fill_zero(dev, tmp.at(partial), 4 * D, gdt);
    // [q gamma | q beta | k gamma | k beta] of this rank's heads.
    auto piece = [&](int i) { return advance(tmp.at<void>(partial), i * D, gdt); };
    const float* mean = s.mem.at(s.qk_mean);
    const float* rstd = s.mem.at(s.qk_rstd);
    for (int part = 0; part < 2; ++part) {
      void* in_dqkv = advance(dqkv, part * Hl, dt_.act);
      dev.copy_2d(tmp.at(dy), Hl * eb, in_dqkv, 3 * Hl * eb, Hl * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
      norm_.backward(dev, tmp.at(dy), advance(s.mem.at<const void>(s.qk_x), part * T * Hl, dt_.act),
                     w(part == 0 ? q_norm_w_ : k_norm_w_), norm_.rms ? nullptr : mean + part * rows,
                     rstd + part * rows, tmp.at(dx), piece(2 * part), norm_.rms ? nullptr : piece(2 * part + 1), rows,
                     D, /*accumulate_dx=*/false, dt_.act, gs.grad_fp32());
      dev.copy_2d(in_dqkv, 3 * Hl * eb, tmp.at(dx), Hl * eb, Hl * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    }
    if (tp_.size() > 1 && !tp_.sequence_parallel())
      tp_group_.all_reduce(dev.native_stream(), tmp.at(partial), tmp.at(partial), static_cast<size_t>(4 * D), gdt);
    const size_t targets[4] = {q_norm_w_, q_norm_b_, k_norm_w_, rope_ ? k_norm_b_ : kNone};
    for (int i = 0; i < 4; ++i)
      if (targets[i] != kNone) add(dev, gs[targets[i]], piece(i), gs[targets[i]], D, gdt);
  }

  void upload_rope_frequencies(const loom::Device& dev, const std::vector<float>& f) {
    rope_inv_freq_ = loom::Buffer(rank_, f.size() * sizeof(float));
    dev.copy(rope_inv_freq_.get(), f.data(), f.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
    dev.synchronize();  // the host vector dies here
  }

  // Rotates q and k of the packed [S * B, 3 * Hl] in place by each row's position
  // (row s * B + b: local row first + s of this cp rank's slice), or back (backward: the
  // transpose, for their gradients).
  // positions: the engine's position_ids (documents), else each row's in the sequence.
  void rotate(const loom::Device& dev, void* qkv, int64_t S, int64_t B, bool backward, int64_t first = 0,
              const int32_t* given = nullptr) {
    const int64_t Hl = hidden_local_;
    const int32_t* positions = given ? given : rope_positions_.get(rank_, dev, cp_, first, S, B);
    for (int part = 0; part < 2; ++part) {  // q, then k
      void* x = advance(qkv, part * Hl, dt_.act);
      const loom_rope_args r = {.tokens = S * B, .heads = heads_local_, .head_dim = head_dim_,
                                .rotary_dim = rotary_dim_, .stride_t = 3 * Hl, .x = x, .out = x,
                                .positions = positions, .theta = rope_theta_, .dtype = dt_.act,
                                .inv_freq = rope_inv_freq_.get<const float>()};
      if (backward)
        dev.rope_bwd(r);
      else
        dev.rope_fwd(r);
    }
  }

  // Under context parallelism, K and V of the whole sequence [cp * S, B, 2*Hl] in
  // position order, gathered from every cp rank's packed qkv (nothing with cp = 1:
  // k and v are read in place). grad() is a zeroed buffer of the same shape for
  // their gradients (backward only), which scatter_grad() sums back to their owners.
  struct KvFull {
    const Attention& l;
    const loom::Device& dev;
    int64_t B = 0, T = 0, chunk_rows = 0;  // chunk_rows: one chunk's rows (= T with cp = 1)
    Arena mem;
    size_t full = 0, local = 0, gathered_at = 0, dfull = 0;
    bool gathered = false;
    KvFull(const Attention& layer, const loom::Device& d, const Saved& s, bool backward)
        : l(layer), dev(d) {
      const int64_t W = 2 * l.hidden_local_, cp = l.cp_.cp();
      B = s.B;
      T = s.S * s.B;
      chunk_rows = (cp > 1 ? s.S / 2 : s.S) * B;
      gathered = cp > 1;
      if (!gathered) return;
      full = mem.elems(cp * T * W, l.dt_.act);
      local = mem.elems(T * W, l.dt_.act);
      gathered_at = mem.elems(cp * T * W, l.dt_.act);
      dfull = mem.elems(backward ? cp * T * W : 0, l.dt_.act);
      mem.allocate(l.rank_);
      const size_t eb = loom::dtype_size(l.dt_.act);
      // This rank's k|v columns, all-gathered over cp (rank-major), then each
      // rank's two chunks copied to their positions.
      dev.copy_2d(mem.at(local), W * eb, advance(s.mem.at<const void>(s.qkv), l.hidden_local_, l.dt_.act),
                  3 * l.hidden_local_ * eb, W * eb, static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
      l.cp_group_.all_gather(dev.native_stream(), mem.at(local), mem.at(gathered_at), static_cast<size_t>(T * W),
                             l.dt_.act);
      permute(mem.at<void>(gathered_at), mem.at<void>(full), /*to_positions=*/true);
      if (backward) fill_zero(dev, mem.at(dfull), cp * T * W, l.dt_.act);
    }
    void* k() const { return mem.at<void>(full); }
    void* grad() const { return mem.at<void>(dfull); }
    // Rank-major blocks (rank j's rows: its early chunk, then its late one) to
    // position order, or back.
    void permute(void* rank_major, void* positions, bool to_positions) const {
      const int64_t W = 2 * l.hidden_local_;
      const size_t chunk_bytes = static_cast<size_t>(chunk_rows * W) * loom::dtype_size(l.dt_.act);
      for (int j = 0; j < l.cp_.cp(); ++j)
        for (int h = 0; h < 2; ++h) {
          void* r = advance(rank_major, (j * T + h * chunk_rows) * W, l.dt_.act);
          void* p = advance(positions, l.cp_.chunk_start(j, h) * B * W, l.dt_.act);
          copy_d2d(dev, to_positions ? p : r, to_positions ? r : p, chunk_bytes);
        }
    }
    // dK, dV of the whole sequence (grad()) summed over cp into this rank's rows,
    // written into the k|v columns of the packed dqkv [T, 3*Hl].
    void scatter_grad(void* dqkv) const {
      const int64_t W = 2 * l.hidden_local_;
      const size_t eb = loom::dtype_size(l.dt_.act);
      permute(mem.at<void>(gathered_at), mem.at<void>(dfull), /*to_positions=*/false);
      l.cp_group_.reduce_scatter(dev.native_stream(), mem.at(gathered_at), mem.at(local), static_cast<size_t>(T * W),
                                 l.dt_.act);
      dev.copy_2d(advance(dqkv, l.hidden_local_, l.dt_.act), 3 * l.hidden_local_ * eb, mem.at(local), W * eb, W * eb,
                  static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    }
  };

  // The attention of query rows `half` (the whole local sequence with cp = 1; else
  // chunk `half` of this rank's two) over q, k, v in the packed [T, 3*Hl]
  // activation, row r = s*B + b; under context parallelism k and v are the
  // gathered whole sequence and the queries a window of it at their positions.
  loom_attention_args attention_args(const Saved& s, const KvFull& kv, int half) const {
    const int64_t Hl = hidden_local_;
    loom_attention_args at = loom::make<loom_attention_args>();
    at.batch = s.B;
    at.seq = kv.chunk_rows / s.B;
    at.heads = heads_local_;
    at.head_dim = head_dim_;
    at.qkv_stride_b = 3 * Hl;
    at.qkv_stride_s = s.B * 3 * Hl;
    at.out_stride_b = Hl;
    at.out_stride_s = s.B * Hl;
    void* qkv = s.mem.at<void>(s.qkv);
    at.q = advance(qkv, half * kv.chunk_rows * 3 * Hl, dt_.act);
    at.k = advance(qkv, Hl, dt_.act);
    at.v = advance(qkv, 2 * Hl, dt_.act);
    at.out = advance(s.mem.at<void>(s.ctx), half * kv.chunk_rows * Hl, dt_.act);
    at.lse = s.mem.at(s.lse) + half * s.B * heads_local_ * at.seq;
    at.scale = softmax_scale();
    at.causal = 1;
    at.window = window_;
    if (s.documents) at.key_start = s.mem.at<int32_t>(s.key_start) + half * s.B * at.seq;
    at.dtype = dt_.act;
    if (kv.gathered) {
      at.q_offset = cp_.chunk_start(cp_.rank(), half);
      at.kv_seq = at.q_offset + at.seq;  // the keys its causal limit reaches
      at.k = kv.k();
      at.v = advance(kv.k(), Hl, dt_.act);
      at.kv_stride_b = 2 * Hl;
      at.kv_stride_s = s.B * 2 * Hl;
    }
    return at;
  }

  loom_rank* rank_;
  loom::TensorParallel tp_;
  loom::Group cp_group_;
  loom::ContextSlice cp_;
  std::string name_;
  int64_t hidden_ = 0, heads_ = 0, seq_ = 0, micro_batch_ = 0;
  int64_t head_dim_ = 0, heads_local_ = 0, hidden_local_ = 0;
  int64_t groups_ = 0, group_heads_ = 1, qkv_local_ = 0;  // query groups, heads per group, local QKV columns
  bool grouped_ = false;                                 // groups_ < heads_
  bool latent_ = false;                                  // multi_latent_attention
  LatentProjection mla_;                                 // its projections
  int64_t qk_dim_ = 0, value_dim_ = 0;  // q/k and v elements of a head (head_dim_: the packed heads' width)
  int64_t proj_in_local_ = 0;           // the output projection's local input: heads_local * value_dim
  loom::Buffer repeat_;                                  // repeat_matrix()
  loom::Buffer cache_;                                   // generation: k | v of seq_ positions x cache_batch_
  int64_t cache_batch_ = 0;
  float dropout_ = 0.0f;
  ParamSet params_;
  Dtypes dt_;
  bool fusion_ = false;  // gradient-accumulation fusion allowed (see GradShadow)
  Norm norm_;
  bool rope_ = false;  // position_embedding = rope
  float rope_theta_ = 10000.0f;
  int64_t rotary_dim_ = 0;
  loom::Buffer rope_inv_freq_;  // rope_scaling: each pair's frequency (device); empty: theta's
  double softmax_factor_ = 1.0;  // rope_scaling = "yarn"'s on the softmax scale
  PositionIds rope_positions_;
  size_t ln_w_ = kNone, ln_b_ = kNone, qkv_w_ = kNone, qkv_b_ = kNone, proj_w_ = kNone, proj_b_ = kNone;
  bool qk_norm_ = false;
  int64_t window_ = 0;    // sliding_window: the keys each query sees, itself included; 0: every earlier one
  loom::Group tp_group_;  // qk_norm: its gammas' gradients summed over tp (no sequence parallelism)
  size_t q_norm_w_ = kNone, q_norm_b_ = kNone, k_norm_w_ = kNone, k_norm_b_ = kNone;
  std::vector<void*> w_, g_;  // by parameter index
  std::map<int32_t, Saved> saved_;
};

}  // namespace

namespace {
std::vector<loom::OptionSpec> attention_options() {
  std::vector<loom::OptionSpec> o = {
      loom::layers::dropout_option_spec("the attention output"),
      loom::opt_bool("bias", true, "qkv and proj have biases (GPT-2); false as Llama"),
      loom::opt_bool("add_qkv_bias", false,
                     "with bias = false, q, k and v have biases all the same and proj none (Megatron-LM's "
                     "--add-qkv-bias; Qwen2's attention)"),
      loom::layers::position_embedding_option_spec("rotary embeddings on q and k here"),
      loom::opt_int("num_query_groups", 0,
                    "grouped-query attention: key/value heads, each shared by heads / num_query_groups query heads "
                    "(1 = multi-query; 0 = heads: multi-head); must divide heads and be divisible by tp")
          .in("[0, inf)"),
      loom::opt_float("rotary_base", 10000.0, "rope: the base theta of the rotation frequencies (Llama 2 10000, Llama 3 500000)")
          .in("(1, inf)"),
      loom::opt_float("rotary_percent", 1.0, "rope: the share of each head's dimensions that rotate (Megatron-LM's --rotary-percent)")
          .in("(0, 1]"),
      loom::opt_string("rope_scaling", "none",
                       "rope: \"llama3\" slows the low frequencies as Llama 3.1 does (transformers' rope_type "
                       "llama3: rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor, "
                       "rope_original_max_position); \"yarn\" as YaRN does (DeepSeek-V2/V3, Qwen's long context; "
                       "transformers' rope_type yarn, Megatron-Core's YarnRotaryEmbedding: rope_scaling_factor, "
                       "rope_original_max_position, rope_beta_fast, rope_beta_slow, rope_mscale, "
                       "rope_mscale_all_dim, rope_attention_factor)")
          .one_of("none|llama3|yarn"),
      loom::opt_float("rope_scaling_factor", 8.0,
                      "rope_scaling: how much the low frequencies slow (llama3: 8 for Llama 3.1; yarn: the context's "
                      "growth, 40 for DeepSeek-V3)")
          .in("(0, inf)"),
      loom::opt_float("rope_low_freq_factor", 1.0,
                      "rope_scaling = llama3: wavelengths above rope_original_max_position / this are slowed whole")
          .in("(0, inf)"),
      loom::opt_float("rope_high_freq_factor", 4.0,
                      "rope_scaling = llama3: wavelengths below rope_original_max_position / this keep their frequency")
          .in("(0, inf)"),
      loom::opt_int("rope_original_max_position", 8192,
                    "rope_scaling: the context length the frequencies were trained for (transformers' "
                    "original_max_position_embeddings; Llama 3.1 8192, DeepSeek-V3 4096)")
          .in("[1, inf)"),
      loom::opt_float("rope_beta_fast", 32.0,
                      "rope_scaling = yarn: pairs turning more often than this over rope_original_max_position keep "
                      "their frequency")
          .in("(0, inf)"),
      loom::opt_float("rope_beta_slow", 1.0,
                      "rope_scaling = yarn: pairs turning less often than this are slowed by rope_scaling_factor "
                      "whole; those between blend")
          .in("(0, inf)"),
      loom::opt_float("rope_mscale", 1.0,
                      "rope_scaling = yarn: cos and sin are multiplied by mscale(rope_mscale) / "
                      "mscale(rope_mscale_all_dim), mscale(m) = 0.1 m ln(rope_scaling_factor) + 1")
          .in("[0, inf)"),
      loom::opt_float("rope_mscale_all_dim", 0.0,
                      "rope_scaling = yarn: see rope_mscale; multi-latent attention's softmax scale is also multiplied "
                      "by mscale(rope_mscale_all_dim)^2 (DeepSeek-V2/V3)")
          .in("[0, inf)"),
      loom::opt_float("rope_attention_factor", 0.0,
                      "rope_scaling = yarn: the factor on cos and sin, in place of rope_mscale's ratio (transformers' "
                      "attention_factor; 0 = the ratio)")
          .in("[0, inf)"),
      loom::opt_bool("qk_norm", false,
                     "normalise each head's q and k with the layer's norm over head_dim, one learned gamma for the "
                     "query heads and one for the key heads, before the rotation (Megatron-LM's --qk-layernorm; "
                     "Qwen3, OLMo 2)"),
      loom::opt_int("sliding_window", 0,
                    "sliding-window attention: each token attends to itself and the sliding_window - 1 tokens before "
                    "it (Mistral's and transformers' sliding_window; Megatron-LM's window_size = (sliding_window - 1, "
                    "0)); 0 = every earlier token. Alternating local and global layers (Gemma, GPT-OSS) are two "
                    "attention instances in model.block")
          .in("[0, inf)"),
      loom::opt_bool("multi_latent_attention", false,
                     "DeepSeek-V2/V3's multi-latent attention (Megatron-LM's --multi-latent-attention): q, k and v "
                     "projected up from normalised low-rank latents, with a decoupled rotary part whose key is shared "
                     "by every head; needs position_embedding = \"rope\", bias = false and kv_lora_rank"),
      loom::opt_int("q_lora_rank", 0,
                    "multi_latent_attention: the query latent's width (DeepSeek-V3 1536); 0 = q projected from the "
                    "input directly (DeepSeek-V2-Lite)")
          .in("[0, 1048576]"),
      loom::opt_int("kv_lora_rank", 0, "multi_latent_attention: the key/value latent's width (DeepSeek-V3 512)")
          .in("[0, 1048576]"),
      loom::opt_int("qk_head_dim", 0,
                    "multi_latent_attention: each head's q and k elements without rotation (DeepSeek-V3 128; 0 = "
                    "hidden / heads)")
          .in("[0, 1048576]"),
      loom::opt_int("qk_pos_emb_head_dim", 0,
                    "multi_latent_attention: each head's rotated q and the shared rotated k elements, even "
                    "(DeepSeek-V3 64; 0 = half of hidden / heads)")
          .in("[0, 1048576]"),
      loom::opt_int("v_head_dim", 0, "multi_latent_attention: each head's value elements (DeepSeek-V3 128; 0 = hidden / heads)")
          .in("[0, 1048576]")};
  for (loom::OptionSpec& n : loom::layers::norm_option_specs()) o.push_back(std::move(n));
  return o;
}
}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Attention>(
    "attention", "1.10.0", "pre-norm causal multi-head self-attention with residual, learned or rotary positions, grouped queries, q/k normalisation, sliding windows, multi-latent attention (tensor- and context-parallel)",
    attention_options()))
