// layer/moe: pre-norm mixture-of-experts feed-forward block with a residual,
//   y = x + dropout(sum_k gate_k(t) * expert_{e_k(t)}(LN(x)_t))
// as Megatron-Core's MoE layer with a top-k router (dropless, or with expert capacity).
// GPT-style by default (LayerNorm, GeLU experts with biases); Mixtral's and
// Qwen-MoE's with norm = "rmsnorm" (LN is then RMSNorm, without ln.bias),
// activation = "swiglu" and bias = false, as layer/mlp offers them for Llama:
//  - router (router.cpp): logits = LN(x) W_r [tokens, experts] (no bias); probs =
//    softmax over all experts; each token goes to its top_k experts (ties: lower
//    index). Gates are the softmax over the chosen logits (= the chosen probs
//    renormalised, Megatron's default), or the chosen probs as they are with
//    pre_softmax = true. With score_function = "sigmoid" (DeepSeek-V3) the scores
//    are each expert's sigmoid and the gates the chosen ones over their sum (as
//    they are for top_k = 1). topk_scaling_factor multiplies the gates. With
//    num_groups and group_topk (group-limited routing) a token's top_k come from
//    its group_topk groups of consecutive experts whose top_k / group_topk best
//    scores sum highest (group_score = "best": whose best score is highest). With expert_bias (DeepSeek-V3's auxiliary-loss-free
//    balancing, sigmoid scores) a per-expert bias is added to the scores for the
//    choice only; end_step moves it by the global batch's load (ABI 1.23 layer
//    state, checkpointed by the engine).
//  - experts (experts.cpp): MLPs fc2(act(fc1 x)), each with its own weights, on
//    the tokens routed to it; act is GeLU, or SwiGLU, silu(gate) * up, where fc1
//    makes the gate and the up projection (experts.fc1.weight [E, H, 2F], each
//    tp rank holding [its gate | its up]: partition_stride 2), as Mixtral's
//    experts and Megatron-Core's gated_linear_unit; fc1 and fc2 have biases
//    unless bias = false. Dropless by default; with capacity_factor c > 0
//    (Megatron's moe_expert_capacity_factor; the router decides the drop) each
//    expert takes at most ceil(T k / E * c) of a microbatch's routed slots: those
//    with the largest gates (drop_policy = "probs", ties to the lower token) or the
//    first tokens ("position"). A dropped slot contributes nothing (its gate is
//    not renormalised away); the load balancing term counts the routing before
//    the drop, as Megatron does. The capacity counts a microbatch's tokens over
//    the whole sequence, also under sequence parallelism (where Megatron's router
//    drops per shard), so SP does not change which slots are dropped.
//  - load balancing (router.cpp): the Switch Transformer auxiliary loss
//      aux = coeff * E * sum_e f_e * P_e,
//    f_e = (tokens routed to e) / (tokens * top_k), P_e = mean over tokens of
//    probs[:, e] (the sigmoids over their sum with score_function = "sigmoid"),
//    the top_k counted by these probabilities over all experts, groups or not (as
//    Megatron's compute_routing_scores_for_aux_loss); its gradient flows into the
//    router only (f_e is a count). With load_balancing_type = "seq_aux_loss" the
//    term is each sequence's (f_e and P_e over its tokens), averaged over the
//    microbatch's sequences (Megatron's seq_aux_loss, DeepSeek-V2/V3). It
//    enters the objective with the engine's aux_loss_scale (1 / microbatches,
//    ABI 1.4) and is reported through loom_layer_fwd_args.aux_loss.
//  - shared experts (shared_expert.cpp; Megatron's
//    moe_shared_expert_intermediate_size), optional: an MLP of width
//    shared_expert_ffn_hidden_size with the routed experts' activation and biases
//    (Qwen-MoE's is SwiGLU without biases) on every token, beside the routed experts on
//    the same LN output, its output added to theirs (ungated):
//      y = x + dropout(routed(LN(x)) + shared(LN(x))),
//    optionally gated (shared_expert_gate, Megatron's moe_shared_expert_gate):
//    shared(LN(x))_t times sigmoid(LN(x)_t . w_gate), w_gate a [hidden] weight.
//  - router z-loss (router.cpp; ST-MoE, Megatron's moe_z_loss_coeff), optional:
//      z = z_loss_coeff * mean over tokens of logsumexp(logits)^2,
//    keeps the router's logits small; weighted and reported with the aux loss.
// Routing is decided on the host (the router's [tokens, experts] logits are
// read back once per forward, as Megatron's dropless dispatcher syncs on the
// tokens-per-expert counts), so the layer step is not capturable as a whole. Its
// static parts are (Megatron-LM's moe_router CUDA-graph scope, ABI 1.7 sub-steps): the norm and
// the router GEMM in forward, the norm again at the start of the backward, and
// the router's and the norm's backward at its end run through the exec plugin,
// which captures and replays them (tp = 1; cp = 1 or dropless); routing, dispatch, experts and
// combine run eagerly between them, reading and writing the sub-steps' memory at
// the addresses of their capture (StepArena). Tokens are permuted (dispatch.cpp)
// into expert order with the device's row gather (embedding_fwd) and combined back
// with the same gather, accumulating each token's top_k rows in slot order; the
// expert GEMMs run per expert on contiguous rows.
//
// Tensor parallelism (expert tensor parallelism = tp, Megatron's default): each
// expert's fc1 is split by output columns and fc2 by input rows across tp, the
// router and the norm are duplicated. The layer enters the TP region once (f:
// identity, or the all-gather of the sequence shards under SP), every rank routes
// all tokens identically, and the combined partial outputs leave it once (g:
// all-reduce, or reduce-scatter under SP), so one collective per direction for all
// experts together. fc2's bias is added by tp rank 0 only (it must be counted once
// in the sum).
//
// Expert parallelism (parallel.ep = P > 1): ep rank q holds experts
// [q E/P, (q+1) E/P) (the expert parameters' dim 0, split by the engine, ABI 1.4).
// Each rank routes its own tokens over all E experts into expert-major dispatch
// rows; the expert-parallel service (parallel.expert: all-to-all, or all-gather +
// reduce-scatter; dispatch.cpp's TokenDispatcher) moves them to their experts'
// ranks and the outputs back, where they are gated and combined. Backward sends the recomputed inputs, the output
// gradients and the gates the same way and returns the input and gate gradients.
// An ep group joins ranks of one tp rank, which route identically to their tp
// peers, so each expert's tensor parallelism is unchanged. The engine reduces
// expert gradients over edp.
//
// MoE parallel folding (parallel.etp = 1 under tp > 1, Megatron-Core's ETP1 layouts,
// sequence parallelism required): the experts are not split over tp; the expert
// groups (ep x edp) fold over the tp x dp ranks, so an ep group may join tp peers,
// which hold other tokens (their sequence shards). Each rank runs LayerNorm and
// the router on its shard only. With a capacity the router's logits are
// all-gathered over tp (tokens x experts floats) so that every tp rank takes the
// whole sequence's routing decision, as without folding (capacity drops see the
// whole microbatch), and each dispatches its own tokens' rows; dropless, each
// routes its own tokens and the load-balancing and z-loss terms' 2E + 1 sums are
// all-reduced over tp (route_own_tokens). The
// experts run at full width with no tp collective; only the shared expert, split
// over tp like the MLP, enters and leaves the TP region.
//
// Context parallelism (parallel.cp = C > 1, ABI 1.6): this rank's rows are two
// chunks of the sequence (loom::ContextSlice). The MoE block is token-wise except
// for its routing decision, which (capacity, load balancing, z-loss) is the whole
// microbatch's. With a capacity the fp32 logits of the cp ranks are all-gathered
// over cp (after the tp gather when folded) and put in position order, so every cp
// rank routes the whole sequence exactly as the serial run does, and each
// dispatches only its own tokens' rows. Dropless, each rank routes its own tokens
// (top-k is per token) and all-reduces the loss terms' 2E + 1 sums over cp, which
// trains identically for far less traffic. The router's backward then adds, on each rank, its tokens'
// part of the whole routing's gradient; the engine scales aux_loss_scale by C as
// it does loss_scale, so the dp-cp average of those partial sums is the serial
// gradient. An ep group spans cp ranks (Megatron's expert generator folds cp into
// edp), which dispatch their own tokens like any ep peers.
//
// Where the parts live (the split of Megatron-Core's transformer/moe/):
//   router.{hpp,cpp}         the routing decision on the host: softmax, top-k, gates, the capacity
//                            drop, the load-balancing and z-loss terms, the logits' gradient (router.py)
//   dispatch.{hpp,cpp}       dispatch rows per expert, the row gather and combine on the device,
//                            the expert-parallel service (token_dispatcher.py)
//   experts.{hpp,cpp}        the routed experts' GEMMs and activation, split over tp or folded (experts.py)
//   activation.hpp           GeLU or SwiGLU, for the routed and the shared experts
//   shared_expert.{hpp,cpp}  the shared expert and its sigmoid gate (shared_experts.py)
//   gates.hpp                per-row gates on the device, shared by the three above
//   moe.cpp                  the layer (moe_layer.py): parameters, the moe_router sub-steps
//                            (the norm and the router's GEMM), which tokens each rank routes and
//                            dispatches under tp/sp/cp/folding, the TP region's f and g, dropout and
//                            the residual, and the plugin's registration
#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>
#include "dispatch.hpp"
#include "experts.hpp"
#include "router.hpp"
#include "shared_expert.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <numeric>

namespace {

using namespace loom::layers;
using namespace loom::layers::moe;

class Moe : public loom::Layer {
 public:
  Moe(const loom::Options& options, loom::Rank& rank, const loom_layer_create_args& args)
      : rank_(rank.raw()), tp_group_(args.tp) {
    LOOM_REQUIRE(args.dims != nullptr, "moe: model dims are required");
    const loom_model_dims& d = *args.dims;
    name_ = args.instance_name ? args.instance_name : "moe";
    tp_ = loom::TensorParallel(rank_, args.tp, args.sequence_parallel != 0, name_);
    fusion_ = grad_accumulation_fusion(args);
    hidden_ = d.hidden;
    seq_ = d.seq_len;
    micro_batch_ = d.micro_batch;
    RouterConfig router;
    experts_ = router.experts = options.declared_int("num_experts");
    top_k_ = router.top_k = options.declared_int("top_k");
    ffn_ = options.declared_int("ffn_hidden_size");
    if (ffn_ == 0) ffn_ = d.ffn_hidden;
    router.sigmoid = options.declared_string("score_function") == "sigmoid";
    router.pre_softmax = options.declared_bool("pre_softmax");
    router.scaling = options.declared_float("topk_scaling_factor");
    router.groups = options.declared_int("num_groups");
    router.group_topk = options.declared_int("group_topk");
    router.group_by_best = options.declared_string("group_score") == "best";
    router.per_sequence = options.declared_string("load_balancing_type") == "seq_aux_loss";
    router.aux_coeff = options.declared_float("aux_loss_coeff");
    router.z_coeff = options.declared_float("z_loss_coeff");
    router.capacity_factor = options.declared_float("capacity_factor");
    shared_ffn_ = options.declared_int("shared_expert_ffn_hidden_size");
    shared_gate_ = options.declared_bool("shared_expert_gate");
    const std::string policy = options.declared_string("drop_policy");
    router.drop_by_probs = policy == "probs";
    router.expert_bias = options.declared_bool("expert_bias");
    bias_rate_ = static_cast<float>(options.declared_float("expert_bias_update_rate"));
    check_router(router);
    router_ = Router(router);
    dropout_ = dropout_option(options);
    norm_ = norm_option(options);
    require_ops(options, rank.device(), name_);
    activation_.swiglu = options.declared_string("activation") == "swiglu";
    bias_ = options.declared_bool("bias");
    LOOM_REQUIRE(top_k_ <= experts_, name_ << ": option top_k = " << top_k_ << " must be at most num_experts = "
                                           << experts_);
    LOOM_REQUIRE(hidden_ > 0 && ffn_ > 0, name_ << ": hidden and ffn_hidden_size must be positive");
    const int64_t tp = tp_.size() > 0 ? tp_.size() : 1;
    const int64_t etp = std::max(1, rank.group("etp").size());
    LOOM_REQUIRE(etp == tp || etp == 1,
                 name_ << ": parallel.etp = " << etp << " under parallel.tp = " << tp
                       << ": the experts are split over tp like the MLP (etp = tp) or not at all (etp = 1, MoE "
                          "folding); set parallel.etp = 0 (same as tp) or 1");
    fold_ = etp != tp;
    LOOM_REQUIRE(!fold_ || tp_.sequence_parallel(),
                 name_ << ": parallel.etp = 1 under parallel.tp = " << tp
                       << " folds the experts' tensor parallelism into expert parallelism, which needs every tp rank "
                          "to hold other tokens; set parallel.sequence_parallel = true (or parallel.etp = 0)");
    LOOM_REQUIRE(ffn_ % etp == 0, name_ << ": ffn_hidden_size (" << ffn_
                                        << ") must be divisible by the expert tensor-parallel size (" << etp << ")");
    ffn_local_ = ffn_ / etp;
    LOOM_REQUIRE(shared_ffn_ >= 0 && shared_ffn_ % tp == 0,
                 name_ << ": option shared_expert_ffn_hidden_size = " << shared_ffn_
                       << " must be >= 0 (0 = no shared expert) and divisible by the tensor-parallel size (" << tp
                       << ")");
    shared_local_ = shared_ffn_ / tp;
    LOOM_REQUIRE(!shared_gate_ || shared_ffn_ > 0,
                 name_ << ": option shared_expert_gate = true gates the shared expert, but there is none; set "
                          "shared_expert_ffn_hidden_size > 0 or shared_expert_gate = false");
    const loom::Group ep_group = rank.group("ep");
    const int64_t ep = std::max(1, ep_group.size());
    LOOM_REQUIRE(experts_ % ep == 0, name_ << ": option num_experts = " << experts_
                                           << " does not split over the expert-parallel group (parallel.ep = " << ep
                                           << "); choose an ep that divides it");
    local_experts_ = experts_ / ep;
    dispatcher_ = TokenDispatcher(rank_, ep_group, experts_, name_);
    cp_group_ = rank.group_or_single("cp");
    cp_ = loom::ContextSlice(seq_, cp_group_.size(), cp_group_.rank());
    routed_experts_ = Experts(rank_, local_experts_, hidden_, ffn_local_, activation_, fold_, tp_.rank(), tp_group_);
    shared_expert_ = SharedExpert(rank_, hidden_, shared_local_, activation_, shared_gate_, tp_.rank(), tp_.size(),
                                  tp_group_);
    declare_params(tp, ep, etp);
    if (router.expert_bias) {
      expert_bias_.assign(static_cast<size_t>(experts_), 0.0f);
      last_load_.assign(static_cast<size_t>(experts_), 0.0f);
      step_load_.assign(static_cast<size_t>(experts_), 0.0);
    }
    w_.assign(params_.size(), nullptr);
    g_.assign(params_.size(), nullptr);
  }

  // What the router's options must agree on (each option's own range is declared).
  void check_router(const RouterConfig& r) const {
    LOOM_REQUIRE(!r.expert_bias || r.sigmoid,
                 name_ << ": option expert_bias = true (auxiliary-loss-free balancing) biases the sigmoid scores; set "
                          "score_function = \"sigmoid\" (as Megatron-LM requires) or expert_bias = false");
    LOOM_REQUIRE(!(r.sigmoid && r.pre_softmax),
                 name_ << ": option pre_softmax = true chooses between the softmax's gates; with score_function = "
                          "\"sigmoid\" the gates are the chosen sigmoids over their sum (set pre_softmax = false)");
    LOOM_REQUIRE((r.groups > 0) == (r.group_topk > 0),
                 name_ << ": options num_groups = " << r.groups << " and group_topk = " << r.group_topk
                       << " go together: set both (group-limited routing) or neither");
    LOOM_REQUIRE(r.groups > 0 || !r.group_by_best,
                 name_ << ": option group_score = \"best\" ranks groups of experts: set num_groups and group_topk, "
                          "or leave group_score out");
    if (r.groups == 0) return;
    LOOM_REQUIRE(r.experts % r.groups == 0, name_ << ": option num_groups = " << r.groups
                                                  << " must divide num_experts = " << r.experts);
    LOOM_REQUIRE(r.group_topk <= r.groups, name_ << ": option group_topk = " << r.group_topk
                                                 << " must be at most num_groups = " << r.groups);
    LOOM_REQUIRE(r.group_by_best || r.group_topk <= r.top_k,
                 name_ << ": option group_topk = " << r.group_topk << " must be at most top_k = " << r.top_k
                       << " (a group is ranked by the sum of its top_k / group_topk best scores; group_score = "
                          "\"best\" ranks it by its best)");
    LOOM_REQUIRE(r.top_k <= r.group_topk * (r.experts / r.groups),
                 name_ << ": option top_k = " << r.top_k << " is more than the " << r.group_topk * (r.experts / r.groups)
                       << " experts of group_topk = " << r.group_topk << " groups of " << r.experts / r.groups);
  }

  // The device ops the options need: of the run's device before launch, of this rank's at create.
  template <class Ops>
  static void require_ops(const loom::Options& options, const Ops& dev, const std::string& name) {
    require_ffn_ops(options, dev, name);
    if (options.declared_bool("shared_expert_gate"))
      require_device_ops(dev.has_sigmoid_fwd() && dev.has_sigmoid_bwd(), name, "shared_expert_gate = true",
                         "sigmoid_fwd and sigmoid_bwd");
  }
  static void validate(const loom::Options& options, const loom::LayerValidation& v) {
    require_ops(options, v, v.instance_name());
  }

  // A generation step (kv_cache) is an evaluation forward of its rows: routing is per
  // token, but with a capacity factor the capacity follows the tokens of the call, so
  // a decode step of one token drops none (Megatron-LM's inference runs dropless too).
  // Documents (ABI 1.22) need nothing here: no positions are mixed or embedded.
  static constexpr uint64_t kFeatures =
      LOOM_LAYER_CONTEXT_PARALLEL | LOOM_LAYER_KV_CACHE | LOOM_LAYER_DOCUMENTS;

  std::vector<loom::ParamSpec> params() override { return params_.specs(); }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    dt_ = params_.bind(params, grads, w_.data(), g_.data());
    routed_experts_.bind({.fc1_w = w(fc1_w_), .fc1_b = w(fc1_b_), .fc2_w = w(fc2_w_), .fc2_b = w(fc2_b_)}, dt_.act);
    shared_expert_.bind({.fc1_w = w(shared1_w_), .fc1_b = w(shared1_b_), .fc2_w = w(shared2_w_),
                         .fc2_b = w(shared2_b_), .gate_w = w(shared_gate_w_)},
                        dt_.act);
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, E = experts_;
    require_act(a.input, "input", name_, dt_.act, {-1, -1, H});
    const bool sp = tp_.sequence_parallel();
    const int64_t Sl = a.input->shape[0], B = a.input->shape[1], Tl = Sl * B;
    const int64_t S = sp ? Sl * tp_.size() : Sl, T = S * B;  // the TP region: this cp rank's rows
    const int64_t cp = cp_.cp(), Tw = cp * T;                // the whole microbatch's tokens
    require_act(a.output, "output", name_, dt_.act, {Sl, B, H});
    // Positions in the whole sequence come from the model's seq_len (whole_token).
    cp_.require_local_rows(S, name_);
    const void* x = data_of<void>(*a.input);
    void* y = data_of<void>(*a.output);
    loom::Device dev = rank.device();
    const int32_t act = dt_.act;
    const bool drop = a.training && dropout_ > 0.0f;

    // The router sub-step's memory: kept to the backward (training), or for this
    // forward only (evaluation, which must not move the addresses training replays).
    RouterMemory eval_memory;
    RouterMemory& m = a.training ? router_memory_[a.microbatch] : eval_memory;
    const bool fold = fold_, full_in = sp && (!fold || shared_ffn_ > 0);
    const int64_t Tr = fold ? Tl : T;  // tokens whose dispatch rows this rank gathers and combines
    // A graph replays on the layout of its capture: the shapes must not change.
    const std::array<int64_t, 3> shape = {Tl, T, Tw};
    LOOM_REQUIRE(!m.kept.laid_out() || m.shape == shape,
                 name_ << ": microbatch " << a.microbatch << " has " << Tl << " local tokens (" << T << " in the TP region, "
                       << Tw << " in all) where an earlier step had " << m.shape[0] << " (" << m.shape[1] << ", "
                       << m.shape[2] << "): the microbatch shape must not change between training steps");
    const bool gather = router_.gathers_logits();
    if (!m.kept.laid_out()) {
      m.shape = shape;
      Arena& k = m.kept.layout();
      m.x = k.elems(a.training ? Tl * H : 0, act);
      m.mean = k.floats(Tl);
      m.rstd = k.floats(Tl);
      Arena& f = m.fwd.layout();
      m.ln = f.elems(Tl * H, act);
      m.ln_full = f.elems(full_in ? T * H : 0, act);
      m.logits = f.floats((fold && !gather ? Tl : T) * E);  // folded and dropless: its shard's
      m.shard_logits = f.floats(fold && gather ? Tl * E : 0);
      m.cp_logits = f.floats(cp > 1 && gather ? Tw * E : 0);
    }
    Saved s;
    s.S = S;
    s.B = B;
    s.mask = s.mem.add(drop ? Tl * H : 0);
    // The shared expert's fc1 output (its gate and up projection under SwiGLU).
    s.shared_h = s.mem.elems(a.training ? T * activation_.parts() * shared_local_ : 0, act);
    s.shared_out = s.mem.elems(a.training && shared_gate_ ? T * H : 0, act);  // and its output, ungated
    s.dropped = drop;
    s.mem.allocate(rank_);

    // The moe_router sub-step: LayerNorm, into the TP region (f), and the router's
    // logits in fp32. Folded, the routed experts read this rank's shard (Tr = Tl
    // tokens) and only the shared expert enters the TP region. With a capacity the
    // logits are all-gathered (over tp when folded, over cp), so that the whole
    // microbatch is routed on every rank; dropless, each rank routes its own tokens
    // (below). Captured (no collective inside then) when the engine allows parts to be.
    rank.run_substep("moe_router", a.step_key, 1, a.training && a.substeps_capturable != 0 && router_capturable(), [&] {
      m.kept.allocate(rank_);
      m.fwd.allocate(rank_);
      if (a.training) copy_d2d(dev, m.kept.at(m.x), x, Tl * H * dt_.act_bytes());
      norm_.forward(dev, x, w(ln_w_), w(ln_b_), m.fwd.at(m.ln), m.kept.at(m.mean), m.kept.at(m.rstd), Tl, H, act);
      if (full_in) tp_.enter_forward({.rows = T, .cols = H, .x = m.fwd.at(m.ln), .out = m.fwd.at(m.ln_full), .dtype = act});
      if (fold && gather) {
        gemm(dev, false, false, Tl, E, H, m.fwd.at(m.ln), w(router_w_), m.fwd.at(m.shard_logits), 0.0f, act,
             LOOM_DTYPE_F32);
        tp_group_.all_gather(dev.native_stream(), m.fwd.at(m.shard_logits), m.fwd.at(m.logits),
                             static_cast<size_t>(Tl * E), LOOM_DTYPE_F32);
      } else {  // the TP region's T tokens, or folded and dropless this rank's Tl only
        gemm(dev, false, false, fold ? Tl : T, E, H, full_in && !fold ? m.fwd.at(m.ln_full) : m.fwd.at(m.ln),
             w(router_w_), m.fwd.at(m.logits), 0.0f, act, LOOM_DTYPE_F32);
      }
      if (cp > 1 && gather)
        cp_group_.all_gather(dev.native_stream(), m.fwd.at(m.logits), m.fwd.at(m.cp_logits),
                             static_cast<size_t>(T * E), LOOM_DTYPE_F32);
    });
    const void* xfull = full_in ? m.fwd.at(m.ln_full) : m.fwd.at(m.ln);  // LN(x) of every token of the TP region
    const void* xin = fold ? m.fwd.at(m.ln) : xfull;                      // the routed experts' input, Tr rows
    if (gather || (!fold && cp == 1))
      route_whole_microbatch(dev, a, s, cp > 1 ? m.fwd.at(m.cp_logits) : m.fwd.at(m.logits), T, Tl, Tr, B);
    else
      route_own_tokens(dev, a, s, m.fwd.at(m.logits), Tr, Tl, Tw, B);
    // Where this rank's experts get their rows (the counts exchanged over ep).
    s.experts = dispatcher_.plan(dev, s.dispatch, a.microbatch);
    forward_after_routing(dev, a, s, xin, xfull, x, y, Tl, T, Tr);

    m.fwd.free();  // LN output and logits (x and the LN statistics stay for the backward)
    if (a.training) saved_[a.microbatch] = std::move(s);
  }

  void backward(loom::Rank& rank, const loom_layer_bwd_args& a) override {
    auto it = saved_.find(a.microbatch);
    LOOM_REQUIRE(it != saved_.end(), name_ << ": backward of microbatch " << a.microbatch
                                           << " without a training forward");
    Saved& s = it->second;
    RouterMemory& m = router_memory_.at(a.microbatch);
    const bool sp = tp_.sequence_parallel(), fold = fold_, full_in = sp && (!fold || shared_ffn_ > 0);
    const int64_t H = hidden_, E = experts_, S = s.S, B = s.B, T = S * B;
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B;
    require_act(a.grad_output, "grad_output", name_, dt_.act, {Sl, B, H});
    require_act(a.grad_input, "grad_input", name_, dt_.act, {Sl, B, H});
    const void* dy = data_of<void>(*a.grad_output);
    void* dx = data_of<void>(*a.grad_input);
    loom::Device dev = rank.device();
    const int32_t act = dt_.act;
    const bool capture_router = a.substeps_capturable != 0 && router_capturable();

    // The router's memory for the backward: its recomputed LN output, and the
    // gradients the eager part below hands to the router's backward (the LN
    // output's, the logits').
    if (!m.bwd.laid_out()) lay_out_router_backward(m.bwd.layout(), m, Tl, T);
    // moe_router backward, part 1: LayerNorm again (and into the TP region), and
    // the gradient buffers at addresses a replay keeps.
    rank.run_substep("moe_router", a.step_key, 1, capture_router, [&] {
      m.bwd.allocate(rank_);
      if (full_in)
        recompute_ln_input(dev, tp_, m.kept.at(m.x), w(ln_w_), w(ln_b_), m.kept.at(m.mean), m.kept.at(m.rstd),
                           m.bwd.at(m.b_ln), m.bwd.at(m.b_ln_full), Tl, H, act, norm_);
      else
        norm_.forward(dev, m.kept.at(m.x), w(ln_w_), w(ln_b_), m.bwd.at(m.b_ln), m.kept.at(m.mean),
                      m.kept.at(m.rstd), Tl, H, act);
    });
    const void* xfull = full_in ? m.bwd.at(m.b_ln_full) : m.bwd.at(m.b_ln);
    // The LN output's gradient: this rank's rows (its shard under SP).
    void* dl = sp && !fold ? m.bwd.at<void>(m.dln) : m.bwd.at<void>(m.dln_full);
    {
      // The router's and the norm's gradients are the second sub-step's (numel 0: no shadow here).
      std::vector<int64_t> numels = params_.local_numels();
      for (const size_t i : router_step_params()) numels[i] = 0;
      GradShadow gs(rank_, dev, dt_, g_, numels, tp_.features(), fusion_);
      eager_backward(rank, a, s, gs, dy, xfull, m.bwd.at(m.b_ln), m.bwd.at(m.dln_full), dl, m.bwd.at(m.dlogits));
      gs.commit();
    }

    // moe_router backward, part 2: the router's weight and input gradients, the
    // residual, the norm's backward.
    rank.run_substep("moe_router", a.step_key, 2, capture_router, [&] {
      // The router's and the norm's gradients only (the eager part's shadow has the rest).
      const std::vector<size_t> mine = router_step_params();
      std::vector<void*> grads;
      std::vector<int64_t> numels;
      for (const size_t i : mine) {
        grads.push_back(g_[i]);
        numels.push_back(params_.local_numel(i));
      }
      GradShadow gs(rank_, dev, dt_, grads, numels, tp_.features(), fusion_);
      auto router_grad = [&](size_t i) -> void* {  // by parameter index; null for one the options leave out
        const auto at = std::find(mine.begin(), mine.end(), i);
        return at == mine.end() ? nullptr : gs[static_cast<size_t>(at - mine.begin())];
      };
      const int32_t gdt = gs.grad_dtype();
      const void* dl_router = m.bwd.at(m.dlogits);
      if (act != LOOM_DTYPE_F32) {
        dev.elementwise({.op = LOOM_EW_CAST, .n = Tl * E, .x = m.bwd.at(m.dlogits), .out = m.bwd.at(m.dlogits_act),
                         .dtype = LOOM_DTYPE_F32, .out_dtype = act});
        dl_router = m.bwd.at(m.dlogits_act);
      }
      gemm(dev, true, false, H, E, Tl, m.bwd.at(m.b_ln), dl_router, router_grad(router_w_), 1.0f, act, gdt);
      gemm(dev, false, true, Tl, H, E, dl_router, w(router_w_), dl, 1.0f, act, act);
      // dx = dy (the residual) + the norm's backward.
      copy_d2d(dev, dx, dy, Tl * H * dt_.act_bytes());
      norm_.backward(dev, dl, m.kept.at(m.x), w(ln_w_), m.kept.at(m.mean), m.kept.at(m.rstd), dx,
                     router_grad(ln_w_), router_grad(ln_b_), Tl, H, /*accumulate_dx=*/true, act, gs.grad_fp32());
      gs.commit();
      m.kept.free();
      m.bwd.free();
    });
    for (size_t e = 0; e < s.load.size(); ++e) step_load_[e] += static_cast<double>(s.load[e]);
    saved_.erase(it);
    dispatcher_.release(a.microbatch);
  }

  void release(int32_t microbatch) override {
    saved_.erase(microbatch);
    dispatcher_.release(microbatch);
    auto m = router_memory_.find(microbatch);
    if (m != router_memory_.end()) {  // what this step's sub-steps allocated (their layout stays)
      m->second.kept.free();
      m->second.fwd.free();
      m->second.bwd.free();
    }
  }

  // The expert bias and the load that last moved it (ABI 1.23 layer state): the engine
  // checkpoints them, and the load shows how balanced the last step was.
  std::vector<loom::StateSpec> state() override {
    if (expert_bias_.empty()) return {};
    return {{.name = "router.expert_bias", .data = expert_bias_.data(), .count = experts_},
            {.name = "router.expert_load", .data = last_load_.data(), .count = experts_, .optional = true}};
  }

  // The step's load over every rank holding the layer (tp x dp x cp, Megatron's
  // tensor-and-data-parallel group with cp), then the bias update, as Megatron-Core's
  // finalize_model_grads does; the same sums on every rank keep their biases equal.
  void end_step(loom::Rank& rank, const loom_layer_step_end_args&) override {
    if (expert_bias_.empty()) return;
    const loom::Device dev = rank.device();
    const loom::Group holders = rank.group_or_single("tp-dp-cp");
    if (holders.size() > 1) {
      Arena buf;
      const size_t at = buf.add(step_load_.size() * sizeof(double));
      buf.allocate(rank_);
      double* d = buf.at<double>(at);
      dev.copy(d, step_load_.data(), step_load_.size() * sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
      holders.all_reduce(dev.native_stream(), d, d, step_load_.size(), LOOM_DTYPE_F64);
      dev.copy(step_load_.data(), d, step_load_.size() * sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
      dev.synchronize();
    }
    update_expert_bias(expert_bias_, step_load_, bias_rate_);
    std::copy(step_load_.begin(), step_load_.end(), last_load_.begin());  // whole numbers, exact below 2^24
    std::fill(step_load_.begin(), step_load_.end(), 0.0);
  }

  // Routing is decided on the host from device data: the step as a whole is not
  // capturable, but the router's parts are (moe_router sub-steps, ABI 1.7).
  bool capturable() override { return false; }
  bool captures_parts() override { return router_capturable(); }

  // With balanced routing (every expert gets tokens * top_k / experts rows). Under
  // ep the rows this rank's experts take range from 0 to ep times that, so a
  // skewed router can need up to ep x the experts' part of this estimate.
  uint64_t activation_bytes() override {
    const int64_t T = cp_.local_length() * micro_batch_, H = hidden_;  // this cp rank's tokens
    const int64_t Tl = tp_.sequence_parallel() ? T / tp_.size() : T, N = (fold_ ? Tl : T) * top_k_;
    Arena a;
    a.elems(Tl * H, dt_.act);                 // x
    a.floats(Tl);                             // mean
    a.floats(Tl);                             // rstd
    a.add(dropout_ > 0.0f ? Tl * H : 0);      // dropout mask
    a.add(static_cast<size_t>(N) * sizeof(int32_t));  // dispatch token ids
    a.add(static_cast<size_t>(N) * sizeof(int32_t));  // each slot's dispatch row
    a.elems(N, dt_.act);                      // gates
    a.elems(N * activation_.parts() * ffn_local_, dt_.act);     // experts' fc1 outputs
    a.elems(T * activation_.parts() * shared_local_, dt_.act);  // the shared expert's fc1 output
    a.elems(shared_gate_ ? T * H : 0, dt_.act);  // and its ungated output
    if (dispatcher_.moves_rows())
      a.add(2 * static_cast<size_t>(N) * sizeof(int32_t));  // the dispatcher's plan (row indices)
    return a.bytes();
  }

  // A backward's temporaries with balanced routing (as activation_bytes): the
  // router's backward memory and the eager part's, which are alive together, with the
  // gradient shadows when the gradients are kept in another dtype. A skewed router
  // under ep can need up to ep x the experts' rows.
  uint64_t workspace_bytes() override {
    const int64_t T = cp_.local_length() * micro_batch_;  // this cp rank's tokens
    const int64_t Tl = tp_.sequence_parallel() ? T / tp_.size() : T, N = (fold_ ? Tl : T) * top_k_;
    Arena router;
    RouterMemory layout;
    lay_out_router_backward(router, layout, Tl, T);
    // The shared expert's backward over the TP region's T rows (shared_expert.cpp):
    // the gate's expansion and product, its activation and gradient (twice as wide
    // under SwiGLU).
    Arena shared;
    if (shared_ffn_ > 0) {
      if (shared_gate_) {
        shared.elems(T, dt_.act);
        shared.elems(hidden_, dt_.act);
        shared.elems(T * hidden_, dt_.act);
        shared.elems(T * hidden_, dt_.act);
        for (int i = 0; i < 3; ++i) shared.floats(T);
      }
      shared.elems(T * shared_local_, dt_.act);
      shared.elems(T * shared_local_, dt_.act);
      shared.elems(activation_.parts() > 1 ? T * activation_.parts() * shared_local_ : 0, dt_.act);
    }
    const loom::Device dev = loom::Rank(rank_).device();
    return router.bytes() + expert_backward_temps(Tl, T, N, N, 0, dropout_ > 0.0f).mem.bytes() + shared.bytes() +
           GradShadow::bytes(dev, dt_, params_.local_numels(), tp_.features(), fusion_);
  }

  // Router 2*T*H*E, and per routed token fc1 + fc2 (2*H*F1 + 2*H*Fl, F1 = Fl or,
  // under SwiGLU, 2 Fl; the shared expert's alike per token); under ep the rows
  // processed here are the group's tokens routed to this rank's experts, as many
  // as its own when the routing is balanced. Folded, a rank routes its sequence
  // shard and its experts take whole rows.
  // A capacity bounds the routed rows at E * capacity (this shard's part of it).
  // Under cp all of this is over the rank's tokens, 1/cp of the sequence.
  double forward_flops() override {
    const int64_t whole = seq_ * micro_batch_, tokens = whole / cp_.cp(), own = fold_ ? tokens / tp_.size() : tokens;
    const double T = static_cast<double>(tokens), H = static_cast<double>(hidden_);
    double rows = static_cast<double>(own * top_k_);
    if (router_.config().capacity_factor > 0.0)
      rows = std::min(rows, static_cast<double>(experts_ * router_.capacity(whole)) * static_cast<double>(own) /
                                static_cast<double>(whole));
    const double mlp_widths = static_cast<double>(activation_.parts() + 1);  // fc1's columns + fc2's rows, per Fl
    return 2.0 * static_cast<double>(own) * H * static_cast<double>(experts_) +
           2.0 * mlp_widths * rows * H * static_cast<double>(ffn_local_) +
           2.0 * mlp_widths * T * H * static_cast<double>(shared_local_) + (shared_gate_ ? 2.0 * T * H : 0.0);
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);  // a parameter the options leave out
  void* w(size_t i) const { return i == kNone ? nullptr : w_[i]; }
  static void* grad(const GradShadow& gs, size_t i) { return i == kNone ? nullptr : gs[i]; }

  // The parameters the moe_router sub-steps' backward updates: the norm's and the router's.
  std::vector<size_t> router_step_params() const {
    std::vector<size_t> p = {ln_w_};
    if (ln_b_ != kNone) p.push_back(ln_b_);
    p.push_back(router_w_);
    return p;
  }

  // The eager backward's temporaries for Tl / T tokens (this rank's, the TP
  // region's), N dispatched slots and R rows this rank's experts take: the gradient
  // through dropout (and its gather), the expert rows and their gradients, gates.
  struct ExpertBackwardTemps {
    Arena mem;
    size_t dout = 0, dfull = 0, xg = 0, dyg = 0, xs = 0, dys = 0, gates = 0, dgate_rows = 0, a_out = 0, gexp = 0,
           ones = 0, dgate = 0, da = 0, prod = 0, shared_dfull = 0, shared_dshard = 0;
  };
  ExpertBackwardTemps expert_backward_temps(int64_t Tl, int64_t T, int64_t N, int64_t R, int64_t zero_row,
                                            bool dropped) const {
    const bool sp = tp_.sequence_parallel(), full_in = sp && (!fold_ || shared_ffn_ > 0);
    const bool shared_apart = fold_ && shared_ffn_ > 0, moved = dispatcher_.moves_rows();
    const int64_t H = hidden_, Fl = ffn_local_;
    const int32_t act = dt_.act;
    ExpertBackwardTemps t;
    Arena& a = t.mem;
    t.dout = a.elems(dropped ? Tl * H : 0, act);
    t.dfull = a.elems(full_in ? T * H : 0, act);
    t.xg = a.elems(N * H, act);
    t.dyg = a.elems((N + zero_row) * H, act);
    t.xs = a.elems(moved ? R * H : 0, act);
    t.dys = a.elems(moved ? R * H : 0, act);
    t.gates = a.elems(moved ? R : 0, act);
    t.dgate_rows = a.floats(moved ? N : 0);
    t.a_out = a.elems(R * Fl, act);
    t.gexp = a.elems((R + zero_row) * H, act);
    t.ones = a.elems(std::max(H, Fl), act);
    t.dgate = a.floats(R);
    t.da = a.elems(R * Fl, act);
    t.prod = a.elems(R * activation_.parts() * Fl, act);
    t.shared_dfull = a.elems(shared_apart ? T * H : 0, act);
    t.shared_dshard = a.elems(shared_apart ? Tl * H : 0, act);
    return t;
  }

  // The router's memory for the backward (m's bwd indices): its recomputed LN output,
  // and the gradients the eager part hands to the router's backward (the LN
  // output's, the logits').
  template <typename Memory>
  void lay_out_router_backward(Arena& b, Memory& m, int64_t Tl, int64_t T) const {
    const bool sp = tp_.sequence_parallel(), full_in = sp && (!fold_ || shared_ffn_ > 0);
    const int64_t H = hidden_, E = experts_, Tr = fold_ ? Tl : T;
    const int32_t act = dt_.act;
    m.b_ln = b.elems(Tl * H, act);
    m.b_ln_full = b.elems(full_in ? T * H : 0, act);
    m.dln_full = b.elems(Tr * H, act);
    m.dln = b.elems(sp && !fold_ ? Tl * H : 0, act);
    m.dlogits = b.floats(Tl * E);
    m.dlogits_act = b.elems(act == LOOM_DTYPE_F32 ? 0 : Tl * E, act);
  }

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;    // fixed size: dropout mask, the shared expert's fc1 output (and its ungated output)
    Arena route;  // sized by the routing: token ids, gates, fc1 outputs
    size_t mask = 0, tok = 0, slot_row = 0, gate = 0, h = 0, shared_h = 0, shared_out = 0;
    bool dropped = false;
    Dispatch dispatch;   // the rows this rank dispatches (its tokens' part of the whole microbatch's routing)
    RouterRows router;   // what the router's backward needs of the whole routing, for this rank's LN rows
    ExpertRows experts;
    // With the expert bias: the slots each expert kept of the tokens this rank counts
    // (counted in backward: a recomputed forward routes again).
    std::vector<int64_t> load;
  };

  // What the moe_router sub-steps of one training microbatch allocate (the layout
  // and, through StepArena, the addresses a replay uses): kept from the forward to
  // the router's backward, the forward's LN output and logits, and the backward's
  // LN output and gradients. Kept across steps, per microbatch.
  struct RouterMemory {
    StepArena kept, fwd, bwd;
    std::array<int64_t, 3> shape{};  // tokens: this rank's, the TP region's, the microbatch's
    size_t x = 0, mean = 0, rstd = 0;                                       // kept
    size_t ln = 0, ln_full = 0, logits = 0, shard_logits = 0, cp_logits = 0;  // fwd
    size_t b_ln = 0, b_ln_full = 0, dln_full = 0, dln = 0, dlogits = 0, dlogits_act = 0;  // bwd
  };

  // The forward after routing: the dispatch rows to the experts (over ep), the
  // experts, their gated outputs combined per token, the shared expert, g (out of
  // the TP region), dropout and the residual into y. The experts' fc1 outputs and
  // the dispatch's device arrays go to s.route for the backward.
  void forward_after_routing(const loom::Device& dev, const loom_layer_fwd_args& a, Saved& s, const void* xin,
                             const void* xfull, const void* x, void* y, int64_t Tl, int64_t T, int64_t Tr) {
    const Dispatch& r = s.dispatch;
    const ExpertRows& xr = s.experts;
    const int64_t H = hidden_, Fl = ffn_local_, R = xr.rows;
    const int64_t N = r.rows(), zero_row = r.dropped_any() ? 1 : 0;  // dropped slots read a zero row after the N
    const int32_t act = dt_.act;
    const bool sp = tp_.sequence_parallel(), fold = fold_, moved = dispatcher_.moves_rows();

    // What the backward needs of the dispatch: token ids and gates per row, and
    // the experts' fc1 outputs (before the activation); the service keeps the
    // exchange's plan.
    s.tok = s.route.add(static_cast<size_t>(N) * sizeof(int32_t));
    s.slot_row = s.route.add(static_cast<size_t>(r.slots()) * sizeof(int32_t));
    s.gate = s.route.elems(N, act);
    s.h = s.route.elems(R * activation_.parts() * Fl, act);
    s.route.allocate(rank_);
    upload_dispatch(rank_, dev, r, s.route.at<int32_t>(s.tok), s.route.at<int32_t>(s.slot_row), s.route.at(s.gate),
                    act);

    Arena tmp;
    const bool shared_apart = fold && shared_ffn_ > 0;  // the shared expert's own TP region
    const size_t xg = tmp.elems(N * H, act), xs = tmp.elems(moved ? R * H : 0, act), a_out = tmp.elems(R * Fl, act),
                 ys = tmp.elems(moved ? R * H : 0, act), yx = tmp.elems((N + zero_row) * H, act),
                 gexp = tmp.elems(N * H, act), ones = tmp.elems(H, act), out_full = tmp.elems(Tr * H, act),
                 o = tmp.elems(sp && !fold ? Tl * H : 0, act), shared_full = tmp.elems(shared_apart ? T * H : 0, act),
                 shared_o = tmp.elems(shared_apart ? Tl * H : 0, act);
    tmp.allocate(rank_);
    gather_rows(dev, xin, s.route.at<int32_t>(s.tok), tmp.at(xg), N, Tr, H, act);
    const void* xe = tmp.at(xg);  // the experts' input rows, expert-major
    void* ye = tmp.at(yx);        // their output rows
    if (moved) {
      dispatcher_.to_experts(dev, a.microbatch, xe, tmp.at(xs), H, act);
      xe = tmp.at(xs);
      ye = tmp.at(ys);
    }
    routed_experts_.forward(dev, xe, s.route.at(s.h), tmp.at(a_out), ye, xr);
    if (moved) {
      dispatcher_.from_experts(dev, a.microbatch, ye, tmp.at(yx), H, act);
      if (!a.training) dispatcher_.release(a.microbatch);  // no backward will use the plan
    }
    // Gate each row, then scatter-add the rows back to their tokens.
    combine_gated(dev, tmp.at(yx), s.route.at(s.gate), tmp.at(ones), tmp.at(gexp), r,
                  s.route.at<int32_t>(s.slot_row), tmp.at(out_full), Tr, H, act);
    void* shared_h = a.training ? s.mem.at(s.shared_h) : nullptr;
    void* shared_out = a.training && shared_gate_ ? s.mem.at(s.shared_out) : nullptr;
    void* out = tmp.at<void>(out_full);
    if (fold) {  // the routed output is this rank's shard already; the shared expert's leaves its region (g)
      if (shared_apart) {
        shared_expert_.forward(dev, xfull, shared_h, shared_out, tmp.at(shared_full), T, /*accumulate=*/false);
        tp_.exit_forward({.rows = T, .cols = H, .x = tmp.at(shared_full), .out = tmp.at(shared_o), .dtype = act});
        add(dev, tmp.at(shared_o), out, out, Tl * H, act);
      }
    } else {
      if (shared_ffn_ > 0) shared_expert_.forward(dev, xin, shared_h, shared_out, out, T, /*accumulate=*/true);
      // g: the partial sums over tp ranks, reduced (to this rank's shard under SP).
      out = sp ? tmp.at<void>(o) : tmp.at<void>(out_full);
      tp_.exit_forward({.rows = T, .cols = H, .x = tmp.at(out_full), .out = out, .dtype = act});
    }
    if (s.dropped)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = out, .out = out,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch, .dtype = act, .seed_device = a.dropout_seed_device});
    add(dev, x, out, y, Tl * H, act);  // the residual
  }

  // The backward between the router's sub-steps (eager: it reads routing decisions
  // on the host): the output gradient through dropout and g, the experts' and the
  // shared expert's backward into dln_full [Tr, H] (the LN output's gradient of the
  // tokens this rank dispatched), f's backward into dl (this rank's rows; dl ==
  // dln_full but under SP unfolded), and the router's logit gradients [Tl, E] fp32
  // uploaded to dlogits. gs: where the expert and shared-expert gradients go.
  void eager_backward(loom::Rank& rank, const loom_layer_bwd_args& a, Saved& s, GradShadow& gs, const void* dy,
                      const void* xfull, const void* ln, void* dln_full, void* dl, float* dlogits) {
    const Dispatch& r = s.dispatch;
    const bool sp = tp_.sequence_parallel(), fold = fold_, full_in = sp && (!fold || shared_ffn_ > 0);
    const bool shared_apart = fold && shared_ffn_ > 0;
    const int64_t H = hidden_, S = s.S, B = s.B, T = S * B, N = r.rows();
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B, Tr = fold ? Tl : T;
    loom::Device dev = rank.device();
    const int32_t act = dt_.act, gdt = gs.grad_dtype();
    const ExpertRows& xr = s.experts;
    const int64_t R = xr.rows, zero_row = r.dropped_any() ? 1 : 0;
    const bool moved = dispatcher_.moves_rows();
    ExpertBackwardTemps bt = expert_backward_temps(Tl, T, N, R, zero_row, s.dropped);
    Arena& tmp = bt.mem;
    const size_t dout = bt.dout, dfull = bt.dfull, xg = bt.xg, dyg = bt.dyg, xs = bt.xs, dys = bt.dys, gates = bt.gates,
                 dgate_rows = bt.dgate_rows, a_out = bt.a_out, gexp = bt.gexp, ones = bt.ones, dgate = bt.dgate,
                 da = bt.da, prod = bt.prod, shared_dfull = bt.shared_dfull, shared_dshard = bt.shared_dshard;
    tmp.allocate(rank_);

    const void* d = dy;
    if (s.dropped) {
      dropout_bwd(dev, dy, tmp.at(dout), s.mem.at<uint8_t>(s.mask), Tl * H, dropout_, act);
      d = tmp.at(dout);
    }
    // g's backward: the whole output gradient on every tp rank (folded: for the
    // shared expert only; the routed rows are this rank's shard's).
    const void* dshard = d;
    if (full_in) {
      tp_.exit_backward({.rows = T, .cols = H, .x = d, .out = tmp.at(dfull), .dtype = act});
      d = tmp.at(dfull);
    }
    // The dispatched inputs (LN recomputed by the router's sub-step) and the output
    // gradients per dispatch row; at the experts (sent there under ep > 1) with the gates.
    const void* xin = fold ? ln : xfull;
    const int32_t* tok = s.route.at<int32_t>(s.tok);
    gather_rows(dev, xin, tok, tmp.at(xg), N, Tr, H, act);
    gather_rows(dev, fold ? dshard : d, tok, tmp.at(dyg), N, Tr, H, act);
    const void* xe = tmp.at(xg);
    void* dye = tmp.at(dyg);
    const void* gate_e = s.route.at(s.gate);
    if (moved) {
      dispatcher_.to_experts(dev, a.microbatch, xe, tmp.at(xs), H, act);
      dispatcher_.to_experts(dev, a.microbatch, dye, tmp.at(dys), H, act);
      dispatcher_.to_experts(dev, a.microbatch, gate_e, tmp.at(gates), 1, act);
      xe = tmp.at(xs);
      dye = tmp.at(dys);
      gate_e = tmp.at(gates);
    }

    // The gates' gradients, back per dispatch row where the tokens live, to the host
    // for the router (read after the synchronize below).
    routed_experts_.gate_gradients(dev, dye, s.route.at(s.h), tmp.at(a_out), tmp.at(da), tmp.at(prod),
                                   tmp.at(ones), tmp.at(dgate), xr);
    const float* dgate_src = tmp.at(dgate);
    if (moved) {
      dispatcher_.from_experts(dev, a.microbatch, tmp.at(dgate), tmp.at(dgate_rows), 1, LOOM_DTYPE_F32);
      dgate_src = tmp.at(dgate_rows);
    }
    std::vector<float> row_dgate(static_cast<size_t>(N));
    dev.copy(row_dgate.data(), dgate_src, row_dgate.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);

    const bool count_bias = !sp || tp_.rank() == 0;  // SP: the engine sums duplicated gradients over tp
    const bool count_expert_bias = fold || count_bias;  // folded: no tp sum of expert gradients
    void* dxe = tmp.at(gexp);  // the expanded gates are used up by then
    routed_experts_.backward(dev, expert_grads(gs), gdt, xe, dye, gate_e, s.route.at(s.h), tmp.at(a_out), tmp.at(da),
                             tmp.at(gexp), tmp.at(prod), tmp.at(ones), dxe, xr, count_expert_bias);
    // The input gradients per dispatch row, back where the tokens live (the
    // output-gradient rows there are used up), then summed per token.
    void* dxg = dxe;
    if (moved) {
      dxg = tmp.at(dyg);
      dispatcher_.from_experts(dev, a.microbatch, dxe, dxg, H, act);
    }
    if (zero_row) fill_zero_row(dev, dxg, N, H, act);
    combine_rows(dev, dxg, N + zero_row, s.route.at<int32_t>(s.slot_row), dln_full, Tr, H, top_k_, act);
    loom::Buffer gate_dlogits;  // the shared-expert gate's logit gradients of the TP region's tokens (device)
    if (fold) {  // the routed part is this rank's shard's; the shared expert's leaves its region (f)
      if (shared_apart) {
        gate_dlogits = shared_expert_.backward(dev, shared_grads(gs), gdt, xfull, s.mem.at(s.shared_h),
                                               s.mem.at(s.shared_out), d, tmp.at(shared_dfull), T, count_bias,
                                               /*accumulate=*/false);
        tp_.enter_backward({.rows = T, .cols = H, .x = tmp.at(shared_dfull), .out = tmp.at(shared_dshard),
                            .dtype = act});
        add(dev, tmp.at(shared_dshard), dln_full, dln_full, Tl * H, act);
      }
    } else {
      if (shared_ffn_ > 0)
        gate_dlogits = shared_expert_.backward(dev, shared_grads(gs), gdt, xin, s.mem.at(s.shared_h),
                                               s.mem.at(s.shared_out), d, dln_full, T, count_bias,
                                               /*accumulate=*/true);
      // f's backward: summed over tp (reduce-scattered to the shard under SP).
      tp_.enter_backward({.rows = T, .cols = H, .x = dln_full, .out = dl, .dtype = act});
    }
    // The shared-expert gate's weight and input gradients, on the rows this rank
    // holds (its shard under SP).
    if (shared_gate_)
      shared_expert_.gate_input_backward(dev, shared_grads(gs), gdt, gate_dlogits.get<float>(),
                                         sp ? tp_.rank() * Tl : 0, Tl, ln, dl);

    // The router, on the rows this rank holds (its shard under SP): every tp rank
    // routed all tokens identically, so each adds the router's part of its rows
    // (folded or under cp, the gates' gradients of its own rows are all it has, and
    // all it needs).
    dev.synchronize();  // row_dgate
    // The router's Tl tokens are TP-region tokens from row0, the dispatch rows'
    // from t0.
    const int64_t row0 = sp ? tp_.rank() * Tl : 0, t0 = fold ? tp_.rank() * Tl : 0;
    const std::vector<double> slot_dgate = slot_gate_gradients(r, row_dgate, row0 - t0, Tl);
    const std::vector<float> dlog =
        router_.logit_gradients(s.router, slot_dgate, static_cast<double>(a.aux_loss_scale));
    dev.copy(dlogits, dlog.data(), dlog.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
  }

  // The whole microbatch's logits [Tw, E] on the device (cp ranks' blocks in rank
  // order under cp): read back, put in position order and routed on every rank,
  // which keeps the router's rows of its LN and dispatches its own Tr tokens'
  // rows (folded or under cp, the routing covers more tokens than that).
  void route_whole_microbatch(const loom::Device& dev, const loom_layer_fwd_args& a, Saved& s, const float* logits,
                              int64_t T, int64_t Tl, int64_t Tr, int64_t B) const {
    const int64_t E = experts_, cp = cp_.cp(), Tw = cp * T;
    std::vector<float> gathered(static_cast<size_t>(Tw * E));
    dev.copy(gathered.data(), logits, gathered.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    std::vector<float> host_logits = cp > 1 ? std::vector<float>(gathered.size()) : std::move(gathered);
    for (int j = 0; cp > 1 && j < cp; ++j)  // cp rank j's block, token by token, to its place
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(gathered.begin() + (j * T + t) * E, E, host_logits.begin() + whole_token(j, t, B) * E);
    const Routing whole = router_.route(std::move(host_logits), Tw, B, expert_bias_.data());
    // Every tp and cp rank routed the whole microbatch alike: the first counts it.
    if (a.training) note_load(s, whole, tp_.rank() == 0 && cp_group_.rank() == 0);
    if (a.training && a.aux_loss != nullptr && router_.has_loss_terms())
      *a.aux_loss += static_cast<float>(router_.loss(whole));
    // The router's backward runs on the rows of this rank's LN (its shard under SP).
    const bool sp = tp_.sequence_parallel();
    if (a.training) s.router = router_rows(whole, whole_tokens(sp ? tp_.rank() * Tl : 0, Tl, B));
    Dispatch all = dispatch_rows(whole);
    s.dispatch = fold_ || cp > 1 ? shard_of(all, whole_tokens(fold_ ? tp_.rank() * Tl : 0, Tr, B)) : std::move(all);
  }

  // Dropless routing under cp or folding: this rank routes the Tr tokens it
  // dispatches from their logits [Tr, E] (device, fp32), exactly as routing the
  // whole microbatch would (top-k is per token; the local token order is the
  // whole one's restricted to them). The loss terms are the whole microbatch's
  // (Tw tokens), their sums all-reduced over the ranks holding its other tokens:
  // cp, and tp when folded (unfolded tp ranks route the same tokens).
  void route_own_tokens(const loom::Device& dev, const loom_layer_fwd_args& a, Saved& s, const float* logits,
                        int64_t Tr, int64_t Tl, int64_t Tw, int64_t micro_batch) const {
    std::vector<float> host_logits(static_cast<size_t>(Tr * experts_));
    dev.copy(host_logits.data(), logits, host_logits.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    const Routing own = router_.route(std::move(host_logits), Tr, micro_batch, expert_bias_.data());
    if (a.training) s.router = router_rows(own, own_router_rows(Tl));
    // Folded tp ranks route their own shards; unfolded ones the same tokens.
    if (a.training) note_load(s, own, fold_ || tp_.rank() == 0);
    // The sums feed the loss terms only: without them (evaluation, both coefficients
    // 0; the same on every rank) the router's rows need nothing of the others.
    if (a.training && router_.has_loss_terms()) {
      std::vector<loom::Group> others;
      if (fold_) others.push_back(tp_group_);
      if (cp_.cp() > 1) others.push_back(cp_group_);
      LossTerms terms = router_.reduce_loss_terms(rank_, dev, own, Tw, others);
      if (a.aux_loss != nullptr) *a.aux_loss += static_cast<float>(terms.loss);
      s.router.tokens = Tw;  // the loss terms' means are over the whole microbatch
      s.router.slots = Tw * top_k_;
      s.router.routed = std::move(terms.routed);
    }
    s.dispatch = dispatch_rows(own);
  }

  // With the expert bias: the slots each expert kept of a routing's tokens, when this
  // rank is the one that counts them (so that the sum over the ranks holding the
  // layer counts each token once), else none.
  void note_load(Saved& s, const Routing& r, bool counts) const {
    if (expert_bias_.empty()) return;
    s.load = counts ? r.kept_slots : std::vector<int64_t>(static_cast<size_t>(experts_), 0);
  }

  // The router's rows among the tokens this rank routes itself: its Tl LN rows (its
  // sequence shard of the TP region when unfolded under SP; all of them when folded).
  std::vector<int64_t> own_router_rows(int64_t Tl) const {
    const int64_t row0 = tp_.sequence_parallel() && !fold_ ? tp_.rank() * Tl : 0;
    std::vector<int64_t> rows(static_cast<size_t>(Tl));
    std::iota(rows.begin(), rows.end(), row0);
    return rows;
  }

  // Whether the router's sub-steps may be captured when the engine allows parts
  // to be (tp = 1 then): not when the forward gathers logits over cp (with a
  // capacity); dropless, the all-reduce of the loss sums runs eagerly after it.
  bool router_capturable() const { return cp_.cp() == 1 || !router_.gathers_logits(); }

  // The parameters, each index kept (kNone where the options leave it out). With
  // the default options (LayerNorm, GeLU, biases) the names and the order are
  // those of every earlier version, so their checkpoints load.
  void declare_params(int64_t tp, int64_t ep, int64_t etp) {
    const int64_t E = experts_, H = hidden_, F = ffn_, parts = activation_.parts();
    params_ = ParamSet(name_, {.tp = tp, .ep = ep, .etp = etp});
    ln_w_ = params_.add({.name = "ln.weight", .shape = {H}, .init = LOOM_INIT_ONES, .no_weight_decay = true});
    if (!norm_.rms)
      ln_b_ = params_.add({.name = "ln.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true});
    router_w_ = params_.add({.name = "router.weight", .shape = {H, E}, .init = LOOM_INIT_NORMAL});
    // The experts' parameters: dim 0 is the expert, split over ep by the engine,
    // then partition_dim over etp (tp, or 1 when folded). fc1's columns are the
    // gate's F then the up projection's under SwiGLU, split with stride 2 so that
    // each etp rank holds [its gate | its up].
    fc1_w_ = params_.add({.name = "experts.fc1.weight", .shape = {E, H, parts * F}, .partition_dim = 2,
                          .partition_stride = static_cast<int32_t>(parts), .init = LOOM_INIT_NORMAL, .expert = true});
    if (bias_)
      fc1_b_ = params_.add({.name = "experts.fc1.bias", .shape = {E, parts * F}, .partition_dim = 1,
                            .partition_stride = static_cast<int32_t>(parts), .init = LOOM_INIT_ZEROS,
                            .no_weight_decay = true, .expert = true});
    fc2_w_ = params_.add({.name = "experts.fc2.weight", .shape = {E, F, H}, .partition_dim = 1,
                          .init = LOOM_INIT_NORMAL_SCALED, .expert = true});
    if (bias_)
      fc2_b_ = params_.add({.name = "experts.fc2.bias", .shape = {E, H}, .init = LOOM_INIT_ZEROS,
                            .no_weight_decay = true, .expert = true});
    if (shared_ffn_ == 0) return;
    // The shared expert, split like the MLP: fc1 by columns (stride 2 under SwiGLU), fc2 by rows.
    const int64_t Fs = shared_ffn_;
    shared1_w_ = params_.add({.name = "shared.fc1.weight", .shape = {H, parts * Fs}, .partition_dim = 1,
                              .partition_stride = static_cast<int32_t>(parts), .init = LOOM_INIT_NORMAL});
    if (bias_)
      shared1_b_ = params_.add({.name = "shared.fc1.bias", .shape = {parts * Fs}, .partition_dim = 0,
                                .partition_stride = static_cast<int32_t>(parts), .init = LOOM_INIT_ZEROS,
                                .no_weight_decay = true});
    shared2_w_ = params_.add(
        {.name = "shared.fc2.weight", .shape = {Fs, H}, .partition_dim = 0, .init = LOOM_INIT_NORMAL_SCALED});
    if (bias_)
      shared2_b_ = params_.add({.name = "shared.fc2.bias", .shape = {H}, .init = LOOM_INIT_ZEROS,
                                .no_weight_decay = true});
    // Megatron's shared-expert gate: sigmoid(x . w) per token, duplicated over tp.
    if (shared_gate_)
      shared_gate_w_ = params_.add({.name = "shared.gate.weight", .shape = {H}, .init = LOOM_INIT_NORMAL});
  }

  // Where the backward accumulates the experts' and the shared expert's gradients
  // (null for a parameter the options leave out).
  ExpertGrads expert_grads(const GradShadow& gs) const {
    return {.fc1_w = grad(gs, fc1_w_), .fc1_b = grad(gs, fc1_b_), .fc2_w = grad(gs, fc2_w_),
            .fc2_b = grad(gs, fc2_b_)};
  }
  SharedExpertGrads shared_grads(const GradShadow& gs) const {
    return {.fc1_w = grad(gs, shared1_w_), .fc1_b = grad(gs, shared1_b_), .fc2_w = grad(gs, shared2_w_),
            .fc2_b = grad(gs, shared2_b_), .gate_w = grad(gs, shared_gate_w_)};
  }

  // The whole microbatch's token (position-major, as the serial run numbers them)
  // of token t of cp rank j's TP region (rows seq-major: t = s * B + b).
  int64_t whole_token(int j, int64_t t, int64_t B) const {
    if (cp_.cp() == 1) return t;
    return cp_.position_of(j, t / B) * B + t % B;
  }
  // Those of this rank's TP-region tokens [t0, t0 + n).
  std::vector<int64_t> whole_tokens(int64_t t0, int64_t n, int64_t B) const {
    std::vector<int64_t> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = whole_token(cp_.rank(), t0 + i, B);
    return out;
  }

  loom_rank* rank_;
  loom::Group tp_group_, cp_group_;
  loom::ContextSlice cp_;  // this rank's rows of the sequence (all of them with cp = 1)
  bool fold_ = false;      // parallel.etp = 1 under tp > 1: experts whole, ep spanning tp ranks
  int64_t local_experts_ = 0;  // experts held here (num_experts / ep)
  loom::TensorParallel tp_;
  std::string name_;
  int64_t hidden_ = 0, experts_ = 0, top_k_ = 0, ffn_ = 0, ffn_local_ = 0, seq_ = 0, micro_batch_ = 0;
  int64_t shared_ffn_ = 0, shared_local_ = 0;  // the shared expert's width (0 = none), and this tp rank's part
  bool shared_gate_ = false;                   // its output times sigmoid(x . w) per token
  float dropout_ = 0.0f;
  Norm norm_;                    // before the router and the experts: LayerNorm, or RMSNorm (no ln.bias)
  ExpertActivation activation_;  // of the routed and the shared experts: GeLU, or SwiGLU
  bool bias_ = true;             // the experts' fc1 and fc2 have biases
  Router router_;
  TokenDispatcher dispatcher_;
  Experts routed_experts_;
  SharedExpert shared_expert_;
  ParamSet params_;
  size_t ln_w_ = kNone, ln_b_ = kNone, router_w_ = kNone;  // indices into params_
  size_t fc1_w_ = kNone, fc1_b_ = kNone, fc2_w_ = kNone, fc2_b_ = kNone;
  size_t shared1_w_ = kNone, shared1_b_ = kNone, shared2_w_ = kNone, shared2_b_ = kNone, shared_gate_w_ = kNone;
  Dtypes dt_;
  bool fusion_ = false;
  std::vector<void*> w_, g_;  // by parameter index
  std::map<int32_t, Saved> saved_;
  std::map<int32_t, RouterMemory> router_memory_;  // per training microbatch, across steps
  std::vector<float> expert_bias_;   // [experts] with option expert_bias (the layer's state), else empty
  std::vector<float> last_load_;     // [experts]: the slots each expert kept in the last step's global batch (state)
  std::vector<double> step_load_;    // [experts]: this step's counted slots, until end_step
  float bias_rate_ = 0.0f;           // expert_bias_update_rate
};

}  // namespace

namespace {
std::vector<loom::OptionSpec> moe_options() {
  std::vector<loom::OptionSpec> o = {
      loom::opt_int("num_experts", 8, "experts in the layer").in("[1, 65536]"),
      loom::opt_int("top_k", 2, "experts each token is routed to (at most num_experts)").in("[1, 65536]"),
      loom::opt_int("ffn_hidden_size", 0, "each expert's inner width (0 = model.ffn_hidden_size)").in("[0, 4194304]"),
      loom::opt_string("score_function", "softmax",
                       "the router's scores (Megatron's moe_router_score_function): \"softmax\" over all experts, or "
                       "each expert's \"sigmoid\" (DeepSeek-V3), whose gates are the chosen ones over their sum "
                       "(top_k > 1)")
          .one_of("softmax|sigmoid"),
      loom::opt_bool("pre_softmax", false,
                     "score_function = \"softmax\": gates = the softmax over all experts at the chosen ones (true), or "
                     "the softmax over the chosen logits only (false, Megatron's default)"),
      loom::opt_float("topk_scaling_factor", 0.0,
                      "the gates times this (Megatron's moe_router_topk_scaling_factor, DeepSeek-V3's "
                      "routed_scaling_factor; 0 = as they are)")
          .in("[0, inf)"),
      loom::opt_int("num_groups", 0,
                    "group-limited routing (Megatron's moe_router_num_groups, DeepSeek-V3's n_group): the experts in "
                    "this many groups of consecutive experts, each token's top_k taken within its group_topk best "
                    "groups, a group ranked by the sum of its top_k / group_topk best scores (0 = no groups)")
          .in("[0, 65536]"),
      loom::opt_int("group_topk", 0,
                    "with num_groups: the groups each token's experts come from (Megatron's moe_router_group_topk, "
                    "DeepSeek-V3's topk_group)")
          .in("[0, 65536]"),
      loom::opt_string("group_score", "top_sum",
                       "with num_groups: what ranks a group, \"top_sum\" the sum of its top_k / group_topk best "
                       "scores (DeepSeek-V3's, Megatron's), or \"best\" its best score (DeepSeek-V2's "
                       "group_limited_greedy)")
          .one_of("top_sum|best"),
      loom::opt_float("aux_loss_coeff", 0.01, "weight of the Switch Transformer load-balancing loss (0 = off)")
          .in("[0, inf)"),
      loom::opt_string("load_balancing_type", "aux_loss",
                       "what the load-balancing loss balances (Megatron's moe_router_load_balancing_type): "
                       "\"aux_loss\", each microbatch's tokens, or \"seq_aux_loss\", each sequence's, averaged "
                       "(DeepSeek-V2/V3's sequence-wise auxiliary loss)")
          .one_of("aux_loss|seq_aux_loss"),
      loom::opt_float("z_loss_coeff", 0.0, "weight of the router z-loss, mean of logsumexp(logits)^2 (0 = off)")
          .in("[0, inf)"),
      loom::opt_bool("expert_bias", false,
                     "DeepSeek-V3's auxiliary-loss-free load balancing (Megatron's moe_router_enable_expert_bias; "
                     "score_function = \"sigmoid\"): a per-expert bias added to the scores when the experts are "
                     "chosen, not to the gates, moved after every training step by expert_bias_update_rate, up for "
                     "the experts that kept fewer than the mean of the global batch's slots, down for those that "
                     "kept more; checkpointed with the model"),
      loom::opt_float("expert_bias_update_rate", 1e-3,
                      "with expert_bias: how far each step moves a bias (Megatron's moe_router_bias_update_rate; "
                      "the sigmoid scores it competes with are in (0, 1))")
          .in("[0, 1]"),
      loom::opt_int("shared_expert_ffn_hidden_size", 0,
                    "width of a shared expert every token goes through beside the routed ones (0 = none)")
          .in("[0, 4194304]"),
      loom::opt_bool("shared_expert_gate", false,
                     "scale the shared expert's output per token by sigmoid(x . w), w a learned [hidden] vector "
                     "(Megatron's moe_shared_expert_gate, Qwen2-MoE)"),
      loom::opt_float("capacity_factor", 0.0,
                      "each expert keeps at most ceil(tokens * top_k / num_experts * capacity_factor) of a "
                      "microbatch's slots, the rest are dropped (0 = dropless)")
          .in("[0, inf)"),
      loom::opt_string("drop_policy", "probs",
                       "which slots an expert over capacity keeps: \"probs\" (largest gates) or \"position\" "
                       "(first tokens)")
          .one_of("probs|position"),
      loom::layers::dropout_option_spec("the MoE output"),
      loom::opt_string("activation", "gelu",
                       "the routed and shared experts' activation: gelu (GPT), or swiglu: fc1 makes a gate and an up "
                       "projection of ffn_hidden_size each, silu(gate) * up (Mixtral, Qwen-MoE)")
          .one_of("gelu|swiglu"),
      loom::opt_bool("bias", true, "the routed and shared experts' fc1 and fc2 have biases (GPT); false as Mixtral")};
  for (loom::OptionSpec& n : loom::layers::norm_option_specs()) o.push_back(std::move(n));
  return o;
}
}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Moe>(
    "moe", "1.9.0",
    "pre-norm mixture of GeLU or SwiGLU experts (LayerNorm or RMSNorm, biases optional), top-k router (dropless "
    "or with capacity), shared expert, load-balancing loss (tensor-, expert- and context-parallel)",
    moe_options()))
