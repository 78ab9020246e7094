// layer/moe: pre-LayerNorm mixture-of-experts feed-forward block with a residual,
//   y = x + dropout(sum_k gate_k(t) * expert_{e_k(t)}(LN(x)_t))
// as Megatron-Core's MoE layer with a top-k router (dropless, or with expert capacity):
//  - router: logits = LN(x) W_r [tokens, experts] (no bias); probs = softmax over
//    all experts; each token goes to its top_k experts (ties: lower index). Gates
//    are the softmax over the chosen logits (= the chosen probs renormalised,
//    Megatron's default), or the chosen probs as they are with pre_softmax = true.
//  - experts: GeLU MLPs fc2(gelu(fc1 x)), each with its own weights, on the tokens
//    routed to it. Dropless by default; with capacity_factor c > 0 (Megatron's
//    moe_expert_capacity_factor) each expert takes at most ceil(T k / E * c) of a
//    microbatch's routed slots: those with the largest gates (drop_policy =
//    "probs", ties to the lower token) or the first tokens ("position"). A dropped
//    slot contributes nothing (its gate is not renormalised away); the load
//    balancing term counts the routing before the drop, as Megatron does. The
//    capacity counts a microbatch's tokens over the whole sequence, also under
//    sequence parallelism (where Megatron's router drops per shard), so SP does
//    not change which slots are dropped.
//  - load balancing: the Switch Transformer auxiliary loss
//      aux = coeff * E * sum_e f_e * P_e,
//    f_e = (tokens routed to e) / (tokens * top_k), P_e = mean over tokens of
//    probs[:, e]; its gradient flows into the router only (f_e is a count). It
//    enters the objective with the engine's aux_loss_scale (1 / microbatches,
//    ABI 1.4) and is reported through loom_layer_fwd_args.aux_loss.
//  - shared experts (Megatron's moe_shared_expert_intermediate_size), optional: a
//    GeLU MLP of width shared_expert_ffn_hidden_size on every token, beside the
//    routed experts on the same LN output, its output added to theirs (ungated):
//      y = x + dropout(routed(LN(x)) + shared(LN(x))),
//    optionally gated (shared_expert_gate, Megatron's moe_shared_expert_gate):
//    shared(LN(x))_t times sigmoid(LN(x)_t . w_gate), w_gate a [hidden] weight.
//  - router z-loss (ST-MoE; Megatron's moe_z_loss_coeff), optional:
//      z = z_loss_coeff * mean over tokens of logsumexp(logits)^2,
//    keeps the router's logits small; weighted and reported with the aux loss.
// Routing is decided on the host (the router's [tokens, experts] probabilities are
// read back once per forward, as Megatron's dropless dispatcher syncs on the
// tokens-per-expert counts), so the layer step is not capturable as a whole. Its
// static parts are (Megatron-LM's moe_router CUDA-graph scope, ABI 1.7 sub-steps): LayerNorm and
// the router GEMM in forward, LayerNorm again at the start of the backward, and
// the router's and LayerNorm's backward at its end run through the exec plugin,
// which captures and replays them (tp = 1; cp = 1 or dropless); routing, dispatch, experts and
// combine run eagerly between them, reading and writing the sub-steps' memory at
// the addresses of their capture (StepArena). Tokens are permuted
// into expert order with the device's row gather (embedding_fwd) and combined back
// with the same gather, accumulating each token's top_k rows in slot order; the
// expert GEMMs run per expert on contiguous rows.
//
// Tensor parallelism (expert tensor parallelism = tp, Megatron's default): each
// expert's fc1 is split by output columns and fc2 by input rows across tp, the
// router and LayerNorm are duplicated. The layer enters the TP region once (f:
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
// reduce-scatter) moves them to their experts' ranks and the outputs back, where
// they are gated and combined. Backward sends the recomputed inputs, the output
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
#include "../common/layer_math.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>

namespace {

using namespace loom::layers;

// The host side of one microbatch's routing (what the backward needs of it).
struct Routing {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<float> probs;         // [tokens, experts]: softmax over all experts
  std::vector<int32_t> chosen;      // [tokens, top_k]: expert of each slot
  std::vector<int32_t> row_token;   // [tokens * top_k]: dispatch row -> token (expert-major)
  std::vector<int32_t> row_slot;    // dispatch row -> its slot (t * top_k + k)
  std::vector<int32_t> slot_row;    // [top_k, tokens]: the dispatch row of slot (t, k) at k * tokens + t
  std::vector<float> row_gate;      // dispatch row -> gate
  std::vector<int64_t> offset;      // [experts + 1]: first dispatch row of each expert
  std::vector<int64_t> routed;      // [experts]: slots routed to each before any capacity drop
  std::vector<double> prob_sum;     // [experts]: sum over tokens of probs[:, e]
  double aux = 0;                   // the unweighted load-balancing term E * sum f_e P_e
  std::vector<double> lse;          // [tokens]: logsumexp of each token's logits
  double z = 0;                     // the unweighted z-loss term, mean of lse^2
  // Dispatch rows (the kept slots): tokens * top_k without a capacity drop. A
  // dropped slot's slot_row is rows(), a zero row after the real ones.
  int64_t rows() const { return offset[static_cast<size_t>(experts)]; }
  int64_t slots() const { return tokens * top_k; }
  bool dropped_any() const { return rows() < slots(); }
  int64_t count(int64_t e) const { return offset[e + 1] - offset[e]; }
};

// The rows this rank's experts process, expert-major: the dispatch rows
// themselves (ep = 1), or what the expert-parallel service delivers (ep > 1).
struct ExpertRows {
  int64_t rows = 0;             // R
  std::vector<int64_t> offset;  // [local experts + 1]: first row of each
  int64_t count(int64_t le) const { return offset[le + 1] - offset[le]; }
};

// The unweighted load-balancing term E * sum_e f_e P_e of a routing of `tokens`
// tokens: f_e = routed[e] / (tokens * top_k), P_e = prob_sum[e] / tokens.
double load_balance(const std::vector<int64_t>& routed, const std::vector<double>& prob_sum, int64_t tokens,
                    int64_t top_k) {
  const size_t experts = routed.size();
  double aux = 0;
  for (size_t e = 0; e < experts; ++e)
    aux += (static_cast<double>(routed[e]) / static_cast<double>(tokens * top_k)) *
           (prob_sum[e] / static_cast<double>(tokens));
  return aux * static_cast<double>(experts);
}

// Routes `tokens` rows of fp32 logits: softmax, top-k, gates, dispatch order.
// capacity: the most slots an expert keeps (0 = dropless); by_probs: keep the
// largest gates (else the first tokens).
Routing route(const std::vector<float>& logits, int64_t tokens, int64_t experts, int64_t top_k, bool pre_softmax,
              int64_t capacity = 0, bool by_probs = true) {
  Routing r;
  r.tokens = tokens;
  r.experts = experts;
  r.top_k = top_k;
  r.probs.resize(static_cast<size_t>(tokens * experts));
  r.chosen.resize(static_cast<size_t>(tokens * top_k));
  std::vector<float> slot_gate(static_cast<size_t>(tokens * top_k));
  std::vector<int64_t> routed(static_cast<size_t>(experts), 0);
  std::vector<double> prob_sum(static_cast<size_t>(experts), 0.0);
  std::vector<int32_t> order(static_cast<size_t>(experts));
  r.lse.resize(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits.data() + t * experts;
    float* p = r.probs.data() + t * experts;
    double mx = l[0];
    for (int64_t e = 1; e < experts; ++e) mx = std::max<double>(mx, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(static_cast<double>(l[e]) - mx);
    r.lse[static_cast<size_t>(t)] = mx + std::log(sum);
    r.z += r.lse[static_cast<size_t>(t)] * r.lse[static_cast<size_t>(t)] / static_cast<double>(tokens);
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - mx) / sum);
      prob_sum[static_cast<size_t>(e)] += p[e];
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return l[a] > l[b] || (l[a] == l[b] && a < b);
    });
    double chosen_sum = 0;
    for (int64_t k = 0; k < top_k; ++k) chosen_sum += p[order[static_cast<size_t>(k)]];
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = order[static_cast<size_t>(k)];
      r.chosen[static_cast<size_t>(t * top_k + k)] = e;
      slot_gate[static_cast<size_t>(t * top_k + k)] = static_cast<float>(pre_softmax ? p[e] : p[e] / chosen_sum);
      ++routed[static_cast<size_t>(e)];
    }
  }
  r.routed = routed;
  // The capacity: each expert keeps at most `capacity` of its slots.
  std::vector<char> kept(static_cast<size_t>(tokens * top_k), 1);
  std::vector<int64_t> keep = routed;
  if (capacity > 0) {
    std::vector<std::vector<int64_t>> slots_of(static_cast<size_t>(experts));  // in token order
    for (int64_t slot = 0; slot < tokens * top_k; ++slot)
      slots_of[static_cast<size_t>(r.chosen[static_cast<size_t>(slot)])].push_back(slot);
    for (int64_t e = 0; e < experts; ++e) {
      std::vector<int64_t>& sl = slots_of[static_cast<size_t>(e)];
      if (static_cast<int64_t>(sl.size()) <= capacity) continue;
      if (by_probs)
        std::stable_sort(sl.begin(), sl.end(), [&](int64_t a, int64_t b) {
          return slot_gate[static_cast<size_t>(a)] > slot_gate[static_cast<size_t>(b)];
        });
      for (size_t i = static_cast<size_t>(capacity); i < sl.size(); ++i) kept[static_cast<size_t>(sl[i])] = 0;
      keep[static_cast<size_t>(e)] = capacity;
    }
  }
  r.offset.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t e = 0; e < experts; ++e) r.offset[e + 1] = r.offset[e] + keep[static_cast<size_t>(e)];
  const int64_t n = r.rows();
  r.row_token.resize(static_cast<size_t>(n));
  r.row_slot.resize(static_cast<size_t>(n));
  r.row_gate.resize(static_cast<size_t>(n));
  r.slot_row.assign(static_cast<size_t>(tokens * top_k), static_cast<int32_t>(n));  // dropped: the zero row
  std::vector<int64_t> next(r.offset.begin(), r.offset.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)  // tokens in order within each expert
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t slot = t * top_k + k;
      if (!kept[static_cast<size_t>(slot)]) continue;
      const int64_t row = next[static_cast<size_t>(r.chosen[static_cast<size_t>(slot)])]++;
      r.row_token[static_cast<size_t>(row)] = static_cast<int32_t>(t);
      r.row_slot[static_cast<size_t>(row)] = static_cast<int32_t>(slot);
      r.slot_row[static_cast<size_t>(k * tokens + t)] = static_cast<int32_t>(row);
      r.row_gate[static_cast<size_t>(row)] = slot_gate[static_cast<size_t>(slot)];
    }
  r.prob_sum = prob_sum;
  r.aux = load_balance(routed, prob_sum, tokens, top_k);
  return r;
}

// The dispatch of this rank's tokens within a routing of more (a tp rank's
// sequence shard under MoE folding, a cp rank's chunks under context
// parallelism): token i of this rank is token mine[i] of `r`. Its rows in the
// same expert-major order, with token ids and slots local to this rank. probs,
// chosen, routed and the loss terms stay with `r` (router_rows keeps what the
// router's backward needs of them).
Routing shard_of(const Routing& r, const std::vector<int64_t>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> local_of(static_cast<size_t>(r.tokens), -1);  // token of r -> this rank's, or -1
  for (int64_t i = 0; i < n; ++i) local_of[static_cast<size_t>(mine[static_cast<size_t>(i)])] = i;
  Routing s;
  s.tokens = n;
  s.experts = r.experts;
  s.top_k = r.top_k;
  s.offset.assign(static_cast<size_t>(r.experts + 1), 0);
  for (int64_t row = 0; row < r.rows(); ++row) {
    const int64_t t = local_of[static_cast<size_t>(r.row_token[static_cast<size_t>(row)])];
    if (t < 0) continue;
    const int32_t slot = r.row_slot[static_cast<size_t>(row)];
    ++s.offset[static_cast<size_t>(r.chosen[static_cast<size_t>(slot)]) + 1];
    s.row_token.push_back(static_cast<int32_t>(t));
    s.row_slot.push_back(static_cast<int32_t>(t * r.top_k + slot % r.top_k));
    s.row_gate.push_back(r.row_gate[static_cast<size_t>(row)]);
  }
  for (int64_t e = 0; e < r.experts; ++e) s.offset[e + 1] += s.offset[e];
  const int64_t rows = s.rows();
  s.slot_row.assign(static_cast<size_t>(n * r.top_k), static_cast<int32_t>(rows));  // dropped: the zero row
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = s.row_slot[static_cast<size_t>(i)];
    s.slot_row[static_cast<size_t>((slot % r.top_k) * n + slot / r.top_k)] = static_cast<int32_t>(i);
  }
  return s;
}

// What the router's backward needs of a routing, for the tokens whose logits this
// rank computed (mine: their indices in the routing): their probabilities, choices
// and logsumexp, and the whole routing's counts. Under cp or folding the routing
// covers cp * tp times this rank's tokens; only these rows are kept per microbatch.
struct RouterRows {
  int64_t tokens = 0, slots = 0;  // of the whole routing (the loss terms' means)
  int64_t experts = 0, top_k = 0;
  std::vector<int64_t> routed;    // [experts]: slots routed to each before any drop
  std::vector<float> probs;       // [n, experts]
  std::vector<int32_t> chosen;    // [n, top_k]
  std::vector<double> lse;        // [n]
};

RouterRows router_rows(const Routing& r, const std::vector<int64_t>& mine) {
  RouterRows rr;
  rr.tokens = r.tokens;
  rr.slots = r.slots();
  rr.experts = r.experts;
  rr.top_k = r.top_k;
  rr.routed = r.routed;
  const int64_t E = r.experts, K = r.top_k;
  for (const int64_t t : mine) {
    rr.probs.insert(rr.probs.end(), r.probs.begin() + t * E, r.probs.begin() + (t + 1) * E);
    rr.chosen.insert(rr.chosen.end(), r.chosen.begin() + t * K, r.chosen.begin() + (t + 1) * K);
    rr.lse.push_back(r.lse[static_cast<size_t>(t)]);
  }
  return rr;
}

// d(objective)/d(logits) [n, experts] of the router's rows from their slots'
// gate gradients slot_dgate [n, top_k] (0 for a dropped slot), the load-balancing
// loss's weight aux_scale = coeff * aux_loss_scale and the z-loss's z_scale =
// z_loss_coeff * aux_loss_scale.
std::vector<float> router_grad(const RouterRows& r, const std::vector<double>& slot_dgate, double aux_scale,
                               double z_scale, bool pre_softmax) {
  const int64_t n = static_cast<int64_t>(r.lse.size()), E = r.experts, K = r.top_k;
  const double T = static_cast<double>(r.tokens);
  // d aux / d probs[t, e] = E * f_e / T (f_e is a count: no gradient).
  std::vector<double> aux_dp(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    aux_dp[static_cast<size_t>(e)] = aux_scale * static_cast<double>(E) *
                                     (static_cast<double>(r.routed[static_cast<size_t>(e)]) /
                                      static_cast<double>(r.slots)) /
                                     T;
  std::vector<float> dlogits(static_cast<size_t>(n * E));
  std::vector<double> dp(static_cast<size_t>(E));
  for (int64_t t = 0; t < n; ++t) {
    const float* p = r.probs.data() + t * E;
    for (int64_t e = 0; e < E; ++e) dp[static_cast<size_t>(e)] = aux_dp[static_cast<size_t>(e)];
    const int32_t* chosen = r.chosen.data() + t * K;
    const double* dg = slot_dgate.data() + t * K;
    if (pre_softmax) {  // gate_k = p[e_k]
      for (int64_t k = 0; k < K; ++k) dp[static_cast<size_t>(chosen[k])] += dg[k];
    } else {  // gate_k = p[e_k] / S, S = sum_j p[e_j]
      double s = 0, dg_dot_p = 0;
      for (int64_t k = 0; k < K; ++k) {
        s += p[chosen[k]];
        dg_dot_p += dg[k] * p[chosen[k]];
      }
      for (int64_t k = 0; k < K; ++k) dp[static_cast<size_t>(chosen[k])] += dg[k] / s - dg_dot_p / (s * s);
    }
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += p[e] * dp[static_cast<size_t>(e)];
    // d lse^2 / d logit_e = 2 lse p_e.
    const double dz = z_scale * 2.0 * r.lse[static_cast<size_t>(t)] / T;
    for (int64_t e = 0; e < E; ++e)
      dlogits[static_cast<size_t>(t * E + e)] = static_cast<float>(p[e] * (dp[static_cast<size_t>(e)] - dot + dz));
  }
  return dlogits;
}

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
    experts_ = options.get_int("num_experts", 8);
    top_k_ = options.get_int("top_k", 2);
    ffn_ = options.get_int("ffn_hidden_size", 0);
    if (ffn_ == 0) ffn_ = d.ffn_hidden;
    pre_softmax_ = options.get_bool("pre_softmax", false);
    aux_coeff_ = options.get_float("aux_loss_coeff", 0.01);
    z_coeff_ = options.get_float("z_loss_coeff", 0.0);
    capacity_factor_ = options.get_float("capacity_factor", 0.0);
    shared_ffn_ = options.get_int("shared_expert_ffn_hidden_size", 0);
    shared_gate_ = options.get_bool("shared_expert_gate", false);
    const std::string policy = options.get_string("drop_policy", "probs");
    drop_by_probs_ = policy == "probs";
    dropout_ = dropout_option(options);
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
    ep_group_ = rank.group("ep");
    ep_ = std::max(1, ep_group_.size());
    LOOM_REQUIRE(experts_ % ep_ == 0, name_ << ": option num_experts = " << experts_
                                            << " does not split over the expert-parallel group (parallel.ep = " << ep_
                                            << "); choose an ep that divides it");
    local_experts_ = experts_ / ep_;
    if (ep_ > 1) ep_service_ = loom::ExpertParallel(rank_, ep_group_.raw(), experts_, name_);
    cp_group_ = rank.group_or_single("cp");
    cp_ = loom::ContextSlice(seq_, cp_group_.size(), cp_group_.rank());
  }

  static constexpr uint64_t kFeatures = LOOM_LAYER_CONTEXT_PARALLEL;

  std::vector<loom::ParamSpec> params() override {
    const int64_t E = experts_, H = hidden_, F = ffn_;
    std::vector<loom::ParamSpec> p(7);
    p[kLnW] = {.name = "ln.weight", .shape = {H}, .init = LOOM_INIT_ONES, .no_weight_decay = true};
    p[kLnB] = {.name = "ln.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
    p[kRouter] = {.name = "router.weight", .shape = {H, E}, .init = LOOM_INIT_NORMAL};
    // The experts' parameters: dim 0 is the expert, split over ep by the engine,
    // then partition_dim over etp (tp, or 1 when folded).
    p[kFc1W] = {.name = "experts.fc1.weight", .shape = {E, H, F}, .partition_dim = 2, .init = LOOM_INIT_NORMAL,
                .expert = true};
    p[kFc1B] = {.name = "experts.fc1.bias", .shape = {E, F}, .partition_dim = 1, .init = LOOM_INIT_ZEROS,
                .no_weight_decay = true, .expert = true};
    p[kFc2W] = {.name = "experts.fc2.weight", .shape = {E, F, H}, .partition_dim = 1,
                .init = LOOM_INIT_NORMAL_SCALED, .expert = true};
    p[kFc2B] = {.name = "experts.fc2.bias", .shape = {E, H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true,
                .expert = true};
    if (shared_ffn_ > 0) {  // split like the MLP: fc1 by columns, fc2 by rows
      const int64_t Fs = shared_ffn_;
      p.resize(kShared2B + 1);
      p[kShared1W] = {.name = "shared.fc1.weight", .shape = {H, Fs}, .partition_dim = 1, .init = LOOM_INIT_NORMAL};
      p[kShared1B] = {.name = "shared.fc1.bias", .shape = {Fs}, .partition_dim = 0, .init = LOOM_INIT_ZEROS,
                      .no_weight_decay = true};
      p[kShared2W] = {.name = "shared.fc2.weight", .shape = {Fs, H}, .partition_dim = 0,
                      .init = LOOM_INIT_NORMAL_SCALED};
      p[kShared2B] = {.name = "shared.fc2.bias", .shape = {H}, .init = LOOM_INIT_ZEROS, .no_weight_decay = true};
      // Megatron's shared-expert gate: sigmoid(x . w) per token, duplicated over tp.
      if (shared_gate_) p.push_back({.name = "shared.gate.weight", .shape = {H}, .init = LOOM_INIT_NORMAL});
    }
    return p;
  }

  void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) override {
    const size_t n = num_params();
    LOOM_REQUIRE(params.size() == n && grads.size() == n,
                 name_ << ": bind expects " << n << " parameters, got " << params.size());
    const std::vector<int64_t> expect = local_numels();
    const char* names[kSharedGate + 1] = {"ln.weight",          "ln.bias",           "router.weight",
                                          "experts.fc1.weight", "experts.fc1.bias",  "experts.fc2.weight",
                                          "experts.fc2.bias",   "shared.fc1.weight", "shared.fc1.bias",
                                          "shared.fc2.weight",  "shared.fc2.bias",   "shared.gate.weight"};
    dt_ = bound_dtypes(params, grads, name_);
    for (size_t i = 0; i < n; ++i) {
      w_[i] = bound(params[i], expect[static_cast<size_t>(i)], name_, names[i], dt_.act);
      g_[i] = bound(grads[i], expect[static_cast<size_t>(i)], name_, std::string(names[i]) + " (grad)", dt_.grad);
    }
  }

  void forward(loom::Rank& rank, const loom_layer_fwd_args& a) override {
    const int64_t H = hidden_, E = experts_, Fl = ffn_local_, K = top_k_;
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
    if (!m.kept.laid_out()) {
      m.shape = shape;
      Arena& k = m.kept.layout();
      m.x = k.elems(a.training ? Tl * H : 0, act);
      m.mean = k.floats(Tl);
      m.rstd = k.floats(Tl);
      Arena& f = m.fwd.layout();
      m.ln = f.elems(Tl * H, act);
      m.ln_full = f.elems(full_in ? T * H : 0, act);
      m.logits = f.floats((fold && !gathers_logits() ? Tl : T) * E);  // folded and dropless: its shard's
      m.shard_logits = f.floats(fold && gathers_logits() ? Tl * E : 0);
      m.cp_logits = f.floats(cp > 1 && gathers_logits() ? Tw * E : 0);
    }
    Saved s;
    s.S = S;
    s.B = B;
    s.mask = s.mem.add(drop ? Tl * H : 0);
    s.shared_h = s.mem.elems(a.training ? T * shared_local_ : 0, act);  // the shared expert's fc1 output
    s.shared_out = s.mem.elems(a.training && shared_gate_ ? T * H : 0, act);  // and its output, ungated
    s.dropped = drop;
    s.mem.allocate(rank_);

    // The moe_router sub-step: LayerNorm, into the TP region (f), and the router's
    // logits in fp32. Folded, the routed experts read this rank's shard (Tr = Tl
    // tokens) and only the shared expert enters the TP region. With a capacity the
    // logits are all-gathered (over tp when folded, over cp), so that the whole
    // microbatch is routed on every rank; dropless, each rank routes its own tokens
    // (below). Captured (no collective inside then) when the engine allows parts to be.
    const bool gather = gathers_logits();
    rank.run_substep("moe_router", a.step_key, 1, a.training && a.substeps_capturable != 0 && router_capturable(), [&] {
      m.kept.allocate(rank_);
      m.fwd.allocate(rank_);
      if (a.training) copy_d2d(dev, m.kept.at(m.x), x, Tl * H * dt_.act_bytes());
      layernorm_fwd(dev, x, w_[kLnW], w_[kLnB], m.fwd.at(m.ln), m.kept.at(m.mean), m.kept.at(m.rstd), Tl, H,
                    kLayerNormEps, act);
      if (full_in) tp_.enter_forward({.rows = T, .cols = H, .x = m.fwd.at(m.ln), .out = m.fwd.at(m.ln_full), .dtype = act});
      if (fold && gather) {
        gemm(dev, false, false, Tl, E, H, m.fwd.at(m.ln), w_[kRouter], m.fwd.at(m.shard_logits), 0.0f, act,
             LOOM_DTYPE_F32);
        tp_group_.all_gather(dev.native_stream(), m.fwd.at(m.shard_logits), m.fwd.at(m.logits),
                             static_cast<size_t>(Tl * E), LOOM_DTYPE_F32);
      } else {  // the TP region's T tokens, or folded and dropless this rank's Tl only
        gemm(dev, false, false, fold ? Tl : T, E, H, full_in && !fold ? m.fwd.at(m.ln_full) : m.fwd.at(m.ln),
             w_[kRouter], m.fwd.at(m.logits), 0.0f, act, LOOM_DTYPE_F32);
      }
      if (cp > 1 && gather)
        cp_group_.all_gather(dev.native_stream(), m.fwd.at(m.logits), m.fwd.at(m.cp_logits),
                             static_cast<size_t>(T * E), LOOM_DTYPE_F32);
    });
    const void* xfull = full_in ? m.fwd.at(m.ln_full) : m.fwd.at(m.ln);  // LN(x) of every token of the TP region
    const void* xin = fold ? m.fwd.at(m.ln) : xfull;                      // the routed experts' input, Tr rows
    if (gather || (!fold && cp == 1)) {
      // The whole microbatch's logits here, in position order: route it all.
      const float* routed_logits = cp > 1 ? m.fwd.at(m.cp_logits) : m.fwd.at(m.logits);
      std::vector<float> gathered(static_cast<size_t>(Tw * E));
      dev.copy(gathered.data(), routed_logits, gathered.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
      dev.synchronize();
      std::vector<float> host_logits = cp > 1 ? std::vector<float>(gathered.size()) : std::move(gathered);
      for (int j = 0; cp > 1 && j < cp; ++j)  // cp rank j's block, token by token, to its place
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(gathered.begin() + (j * T + t) * E, E, host_logits.begin() + whole_token(j, t, B) * E);
      Routing whole = route(host_logits, Tw, E, K, pre_softmax_, capacity(Tw), drop_by_probs_);
      if (a.training && a.aux_loss != nullptr && (aux_coeff_ > 0.0 || z_coeff_ > 0.0))
        *a.aux_loss += static_cast<float>(aux_coeff_ * whole.aux + z_coeff_ * whole.z);
      // The router's backward runs on the rows of this rank's LN (its shard under SP).
      if (a.training) s.router = router_rows(whole, whole_tokens(sp ? tp_.rank() * Tl : 0, Tl, B));
      // Folded or under cp, the routing covers more tokens than this rank dispatches.
      s.routing =
          fold || cp > 1 ? shard_of(whole, whole_tokens(fold ? tp_.rank() * Tl : 0, Tr, B)) : std::move(whole);
    } else {
      route_own_tokens(dev, a, s, m.fwd.at(m.logits), Tr, Tl, Tw);
    }
    const Routing& r = s.routing;
    const int64_t N = r.rows(), zero_row = r.dropped_any() ? 1 : 0;  // dropped slots read a zero row after the N

    // Where this rank's experts get their rows (the counts exchanged over ep).
    s.experts = plan_expert_rows(dev, r, a.microbatch);
    const ExpertRows& xr = s.experts;
    const int64_t R = xr.rows;
    const bool moved = ep_ > 1;

    // What the backward needs of the dispatch: token ids and gates per row, and
    // the experts' fc1 outputs (pre-GeLU); the service keeps the exchange's plan.
    s.tok = s.route.add(static_cast<size_t>(N) * sizeof(int32_t));
    s.slot_row = s.route.add(static_cast<size_t>(r.slots()) * sizeof(int32_t));
    s.gate = s.route.elems(N, act);
    s.h = s.route.elems(R * Fl, act);
    s.route.allocate(rank_);
    upload_dispatch(dev, r, s.route.at<int32_t>(s.tok), s.route.at<int32_t>(s.slot_row), s.route.at(s.gate));

    Arena tmp;
    const bool shared_apart = fold && shared_ffn_ > 0;  // the shared expert's own TP region
    const size_t xg = tmp.elems(N * H, act), xs = tmp.elems(moved ? R * H : 0, act), a_out = tmp.elems(R * Fl, act),
                 ys = tmp.elems(moved ? R * H : 0, act), yx = tmp.elems((N + zero_row) * H, act),
                 gexp = tmp.elems(N * H, act), ones = tmp.elems(H, act), out_full = tmp.elems(Tr * H, act),
                 o = tmp.elems(sp && !fold ? Tl * H : 0, act), shared_full = tmp.elems(shared_apart ? T * H : 0, act),
                 shared_o = tmp.elems(shared_apart ? Tl * H : 0, act);
    tmp.allocate(rank_);
    gather_rows(dev, xin, s.route.at<int32_t>(s.tok), tmp.at(xg), N, Tr, H);
    const void* xe = tmp.at(xg);  // the experts' input rows, expert-major
    void* ye = tmp.at(yx);        // their output rows
    if (moved) {
      to_experts(dev, a.microbatch, xe, tmp.at(xs), H, act);
      xe = tmp.at(xs);
      ye = tmp.at(ys);
    }
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t n = xr.count(e), r0 = xr.offset[static_cast<size_t>(e)];
      if (n == 0) continue;
      void* h = advance(s.route.at(s.h), r0 * Fl, act);
      gemm(dev, false, false, n, Fl, H, advance(xe, r0 * H, act), advance(w_[kFc1W], e * H * Fl, act), h, 0.0f, act,
           act);
      add_bias(dev, h, advance(w_[kFc1B], e * Fl, act), h, n, Fl, act);
    }
    if (R > 0) dev.gelu_fwd({.n = R * Fl, .x = s.route.at(s.h), .out = tmp.at(a_out), .dtype = act});
    expert_outputs(dev, tmp.at(a_out), ye, xr);
    if (moved) {
      from_experts(dev, a.microbatch, ye, tmp.at(yx), H, act);
      if (!a.training) ep_service_.release(a.microbatch);  // no backward will use the plan
    }
    // Gate each row, then scatter-add the rows back to their tokens.
    expand_gates(dev, s.route.at(s.gate), tmp.at(ones), tmp.at(gexp), N, H);
    dev.elementwise({.op = LOOM_EW_MUL, .n = N * H, .x = tmp.at(yx), .y = tmp.at(gexp), .out = tmp.at(yx),
                     .dtype = act, .out_dtype = act});
    if (zero_row) fill_zero_row(dev, tmp.at(yx), N, H);
    combine_rows(dev, tmp.at(yx), N + zero_row, s.route.at<int32_t>(s.slot_row), tmp.at(out_full), Tr, H);
    void* shared_h = a.training ? s.mem.at(s.shared_h) : nullptr;
    void* shared_out = a.training && shared_gate_ ? s.mem.at(s.shared_out) : nullptr;
    void* out = tmp.at<void>(out_full);
    if (fold) {  // the routed output is this rank's shard already; the shared expert's leaves its region (g)
      if (shared_apart) {
        shared_forward(dev, xfull, shared_h, shared_out, tmp.at(shared_full), T, /*accumulate=*/false);
        tp_.exit_forward({.rows = T, .cols = H, .x = tmp.at(shared_full), .out = tmp.at(shared_o), .dtype = act});
        add(dev, tmp.at(shared_o), out, out, Tl * H, act);
      }
    } else {
      if (shared_ffn_ > 0) shared_forward(dev, xin, shared_h, shared_out, out, T, /*accumulate=*/true);
      // g: the partial sums over tp ranks, reduced (to this rank's shard under SP).
      out = sp ? tmp.at<void>(o) : tmp.at<void>(out_full);
      tp_.exit_forward({.rows = T, .cols = H, .x = tmp.at(out_full), .out = out, .dtype = act});
    }
    if (drop)
      tp_.dropout_forward({.region = LOOM_TP_RNG_DUPLICATED, .n = Tl * H, .x = out, .out = out,
                           .mask = s.mem.at<uint8_t>(s.mask), .p = dropout_, .seed = a.dropout_seed,
                           .microbatch = a.microbatch, .dtype = act, .seed_device = a.dropout_seed_device});
    add(dev, x, out, y, Tl * H, act);  // the residual

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
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B, Tr = fold ? Tl : T;
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
    if (!m.bwd.laid_out()) {
      Arena& b = m.bwd.layout();
      m.b_ln = b.elems(Tl * H, act);
      m.b_ln_full = b.elems(full_in ? T * H : 0, act);
      m.dln_full = b.elems(Tr * H, act);
      m.dln = b.elems(sp && !fold ? Tl * H : 0, act);
      m.dlogits = b.floats(Tl * E);
      m.dlogits_act = b.elems(act == LOOM_DTYPE_F32 ? 0 : Tl * E, act);
    }
    // moe_router backward, part 1: LayerNorm again (and into the TP region), and
    // the gradient buffers at addresses a replay keeps.
    rank.run_substep("moe_router", a.step_key, 1, capture_router, [&] {
      m.bwd.allocate(rank_);
      if (full_in)
        recompute_ln_input(dev, tp_, m.kept.at(m.x), w_[kLnW], w_[kLnB], m.kept.at(m.mean), m.kept.at(m.rstd),
                           m.bwd.at(m.b_ln), m.bwd.at(m.b_ln_full), Tl, H, act);
      else
        layernorm_fwd(dev, m.kept.at(m.x), w_[kLnW], w_[kLnB], m.bwd.at(m.b_ln), m.kept.at(m.mean),
                      m.kept.at(m.rstd), Tl, H, kLayerNormEps, act);
    });
    const void* xfull = full_in ? m.bwd.at(m.b_ln_full) : m.bwd.at(m.b_ln);
    // The LN output's gradient: this rank's rows (its shard under SP).
    void* dl = sp && !fold ? m.bwd.at<void>(m.dln) : m.bwd.at<void>(m.dln_full);
    {
      // The router's and LayerNorm's gradients are the second sub-step's (numel 0: no shadow here).
      std::vector<int64_t> numels = local_numels();
      numels[kLnW] = numels[kLnB] = numels[kRouter] = 0;
      GradShadow gs(rank_, dev, dt_, std::vector<void*>(g_, g_ + num_params()), numels, tp_.features(), fusion_);
      experts_backward(rank, a, s, gs, dy, xfull, m.bwd.at(m.b_ln), m.bwd.at(m.dln_full), dl, m.bwd.at(m.dlogits));
      gs.commit();
    }

    // moe_router backward, part 2: the router's weight and input gradients, the
    // residual, LayerNorm's backward.
    rank.run_substep("moe_router", a.step_key, 2, capture_router, [&] {
      // The router's and LayerNorm's gradients only (the eager part's shadow has the rest).
      GradShadow gs(rank_, dev, dt_, {g_[kLnW], g_[kLnB], g_[kRouter]}, {H, H, H * E}, tp_.features(), fusion_);
      const int32_t gdt = gs.grad_dtype();
      const void* dl_router = m.bwd.at(m.dlogits);
      if (act != LOOM_DTYPE_F32) {
        dev.elementwise({.op = LOOM_EW_CAST, .n = Tl * E, .x = m.bwd.at(m.dlogits), .out = m.bwd.at(m.dlogits_act),
                         .dtype = LOOM_DTYPE_F32, .out_dtype = act});
        dl_router = m.bwd.at(m.dlogits_act);
      }
      gemm(dev, true, false, H, E, Tl, m.bwd.at(m.b_ln), dl_router, gs[2], 1.0f, act, gdt);
      gemm(dev, false, true, Tl, H, E, dl_router, w_[kRouter], dl, 1.0f, act, act);
      // dx = dy (the residual) + LN backward.
      copy_d2d(dev, dx, dy, Tl * H * dt_.act_bytes());
      layernorm_bwd(dev, dl, m.kept.at(m.x), w_[kLnW], m.kept.at(m.mean), m.kept.at(m.rstd), dx, gs[0], gs[1], Tl,
                    H, /*accumulate_dx=*/true, act, gs.grad_fp32());
      gs.commit();
      m.kept.free();
      m.bwd.free();
    });
    saved_.erase(it);
    ep_service_.release(a.microbatch);
  }

  void release(int32_t microbatch) override {
    saved_.erase(microbatch);
    ep_service_.release(microbatch);
    auto m = router_memory_.find(microbatch);
    if (m != router_memory_.end()) {  // what this step's sub-steps allocated (their layout stays)
      m->second.kept.free();
      m->second.fwd.free();
      m->second.bwd.free();
    }
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
    a.elems(N * ffn_local_, dt_.act);         // experts' fc1 outputs
    a.elems(T * shared_local_, dt_.act);      // the shared expert's fc1 output
    a.elems(shared_gate_ ? T * H : 0, dt_.act);  // and its ungated output
    if (ep_ > 1) a.add(2 * static_cast<size_t>(N) * sizeof(int32_t));  // the dispatcher's plan (row indices)
    return a.bytes();
  }

  // Router 2*T*H*E, and per routed token fc1 + fc2 (4*H*Fl); under ep the rows
  // processed here are the group's tokens routed to this rank's experts, as many
  // as its own when the routing is balanced. Folded, a rank routes its sequence
  // shard and its experts take whole rows.
  // A capacity bounds the routed rows at E * capacity (this shard's part of it).
  // Under cp all of this is over the rank's tokens, 1/cp of the sequence.
  double forward_flops() override {
    const int64_t whole = seq_ * micro_batch_, tokens = whole / cp_.cp(), own = fold_ ? tokens / tp_.size() : tokens;
    const double T = static_cast<double>(tokens), H = static_cast<double>(hidden_);
    double rows = static_cast<double>(own * top_k_);
    if (capacity_factor_ > 0.0)
      rows = std::min(rows, static_cast<double>(experts_ * capacity(whole)) * static_cast<double>(own) /
                                static_cast<double>(whole));
    return 2.0 * static_cast<double>(own) * H * static_cast<double>(experts_) +
           4.0 * rows * H * static_cast<double>(ffn_local_) + 4.0 * T * H * static_cast<double>(shared_local_) +
           (shared_gate_ ? 2.0 * T * H : 0.0);
  }

 private:
  enum { kLnW, kLnB, kRouter, kFc1W, kFc1B, kFc2W, kFc2B, kShared1W, kShared1B, kShared2W, kShared2B, kSharedGate };
  size_t num_params() const { return shared_ffn_ > 0 ? (shared_gate_ ? kSharedGate : kShared2B) + 1 : kFc2B + 1; }

  struct Saved {
    int64_t S = 0, B = 0;
    Arena mem;    // fixed size: dropout mask, the shared expert's fc1 output (and its ungated output)
    Arena route;  // sized by the routing: token ids, gates, fc1 outputs
    size_t mask = 0, tok = 0, slot_row = 0, gate = 0, h = 0, shared_h = 0, shared_out = 0;
    bool dropped = false;
    Routing routing;     // the rows this rank dispatches (its tokens' part of the whole microbatch's routing)
    RouterRows router;   // what the router's backward needs of the whole routing, for this rank's LN rows
    ExpertRows experts;
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

  // The backward between the router's sub-steps (eager: it reads routing decisions
  // on the host): the output gradient through dropout and g, the experts' and the
  // shared expert's backward into dln_full [Tr, H] (the LN output's gradient of the
  // tokens this rank dispatched), f's backward into dl (this rank's rows; dl ==
  // dln_full but under SP unfolded), and the router's logit gradients [Tl, E] fp32
  // uploaded to dlogits. gs: where the expert and shared-expert gradients go.
  void experts_backward(loom::Rank& rank, const loom_layer_bwd_args& a, Saved& s, GradShadow& gs, const void* dy,
                        const void* xfull, const void* ln, void* dln_full, void* dl, float* dlogits) {
    const Routing& r = s.routing;
    const bool sp = tp_.sequence_parallel(), fold = fold_, full_in = sp && (!fold || shared_ffn_ > 0);
    const bool shared_apart = fold && shared_ffn_ > 0;
    const int64_t H = hidden_, Fl = ffn_local_, S = s.S, B = s.B, T = S * B, N = r.rows();
    const int64_t Sl = sp ? S / tp_.size() : S, Tl = Sl * B, Tr = fold ? Tl : T;
    loom::Device dev = rank.device();
    const int32_t act = dt_.act, gdt = gs.grad_dtype();
    const ExpertRows& xr = s.experts;
    const int64_t R = xr.rows, zero_row = r.dropped_any() ? 1 : 0;
    const bool moved = ep_ > 1;
    Arena tmp;
    const size_t dout = tmp.elems(s.dropped ? Tl * H : 0, act), dfull = tmp.elems(full_in ? T * H : 0, act),
                 xg = tmp.elems(N * H, act),
                 dyg = tmp.elems((N + zero_row) * H, act), xs = tmp.elems(moved ? R * H : 0, act),
                 dys = tmp.elems(moved ? R * H : 0, act), gates = tmp.elems(moved ? R : 0, act),
                 dgate_rows = tmp.floats(moved ? N : 0), a_out = tmp.elems(R * Fl, act), gexp = tmp.elems((R + zero_row) * H, act),
                 ones = tmp.elems(std::max(H, Fl), act), dgate = tmp.floats(R), da = tmp.elems(R * Fl, act),
                 prod = tmp.elems(R * Fl, act), shared_dfull = tmp.elems(shared_apart ? T * H : 0, act),
                 shared_dshard = tmp.elems(shared_apart ? Tl * H : 0, act);
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
    gather_rows(dev, xin, tok, tmp.at(xg), N, Tr, H);
    gather_rows(dev, fold ? dshard : d, tok, tmp.at(dyg), N, Tr, H);
    const void* xe = tmp.at(xg);
    void* dye = tmp.at(dyg);
    const void* gate_e = s.route.at(s.gate);
    if (moved) {
      to_experts(dev, a.microbatch, xe, tmp.at(xs), H, act);
      to_experts(dev, a.microbatch, dye, tmp.at(dys), H, act);
      to_experts(dev, a.microbatch, gate_e, tmp.at(gates), 1, act);
      xe = tmp.at(xs);
      dye = tmp.at(dys);
      gate_e = tmp.at(gates);
    }
    if (R > 0) dev.gelu_fwd({.n = R * Fl, .x = s.route.at(s.h), .out = tmp.at(a_out), .dtype = act});

    // fc2's input gradient before the gate, da_u = dy_row W2^T. The gate's gradient
    // is <dy_row, fc2 output row> = <da_u_row, act_row> + <dy_row, b2>: no second
    // fc2 forward. Partial over tp (each rank holds Fl of the ffn, and the bias term
    // is rank 0's), so summed over tp; whole where the experts are folded.
    const bool count_bias = !sp || tp_.rank() == 0;  // SP: the engine sums duplicated gradients over tp
    const bool count_expert_bias = fold || count_bias;  // folded: no tp sum of expert gradients
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t n = xr.count(e), r0 = xr.offset[static_cast<size_t>(e)];
      if (n == 0) continue;
      gemm(dev, false, true, n, Fl, H, advance(dye, r0 * H, act), advance(w_[kFc2W], e * Fl * H, act),
           advance(tmp.at(da), r0 * Fl, act), 0.0f, act, act);
    }
    dev.elementwise({.op = LOOM_EW_FILL, .n = std::max(H, Fl), .out = tmp.at(ones), .alpha = 1.f, .dtype = act,
                     .out_dtype = act});
    if (R > 0) {
      dev.elementwise({.op = LOOM_EW_MUL, .n = R * Fl, .x = tmp.at(da), .y = tmp.at(a_out), .out = tmp.at(prod),
                       .dtype = act, .out_dtype = act});
      gemm(dev, false, false, R, 1, Fl, tmp.at(prod), tmp.at(ones), tmp.at(dgate), 0.0f, act, LOOM_DTYPE_F32);
    }
    if (expert_bias_here())
      for (int64_t e = 0; e < local_experts_; ++e) {
        const int64_t n = xr.count(e), r0 = xr.offset[static_cast<size_t>(e)];
        if (n == 0) continue;
        gemm(dev, false, false, n, 1, H, advance(dye, r0 * H, act), advance(w_[kFc2B], e * H, act),
             tmp.at(dgate) + r0, 1.0f, act, LOOM_DTYPE_F32);
      }
    // Every tp rank of the group has the same R (its ep peers route as its tp peers').
    if (R > 0 && !fold)
      tp_group_.all_reduce(dev.native_stream(), tmp.at(dgate), tmp.at(dgate), static_cast<size_t>(R),
                           LOOM_DTYPE_F32);
    const float* dgate_src = tmp.at(dgate);  // per dispatch row, where the tokens live
    if (moved) {
      from_experts(dev, a.microbatch, tmp.at(dgate), tmp.at(dgate_rows), 1, LOOM_DTYPE_F32);
      dgate_src = tmp.at(dgate_rows);
    }
    std::vector<float> row_dgate(static_cast<size_t>(N));
    dev.copy(row_dgate.data(), dgate_src, row_dgate.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);

    // The experts' backward on the gated gradients: fc2's weight and bias from
    // gate * dy, GeLU's input gradient from gate * da_u.
    if (R > 0) {
      expand_gates(dev, gate_e, tmp.at(ones), tmp.at(gexp), R, H);
      dev.elementwise({.op = LOOM_EW_MUL, .n = R * H, .x = dye, .y = tmp.at(gexp), .out = dye, .dtype = act,
                       .out_dtype = act});
    }
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t n = xr.count(e), r0 = xr.offset[static_cast<size_t>(e)];
      if (n == 0) continue;
      const void* dy_e = advance(dye, r0 * H, act);
      gemm(dev, true, false, Fl, H, n, advance(tmp.at(a_out), r0 * Fl, act), dy_e,
           advance(gs[kFc2W], e * Fl * H, gdt), 1.0f, act, gdt);
      if (count_expert_bias) column_sum_acc(rank_, dev, dy_e, advance(gs[kFc2B], e * H, gdt), n, H, act, gdt);
    }
    if (R > 0) {
      expand_gates(dev, gate_e, tmp.at(ones), tmp.at(prod), R, Fl);
      dev.elementwise({.op = LOOM_EW_MUL, .n = R * Fl, .x = tmp.at(da), .y = tmp.at(prod), .out = tmp.at(da),
                       .dtype = act, .out_dtype = act});
      dev.gelu_bwd({.n = R * Fl, .x = s.route.at(s.h), .dy = tmp.at(da), .out = tmp.at(da), .dtype = act});
    }
    void* dxe = tmp.at(gexp);  // the expanded gates are used up
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t n = xr.count(e), r0 = xr.offset[static_cast<size_t>(e)];
      if (n == 0) continue;
      const void* dhe = advance(tmp.at(da), r0 * Fl, act);
      gemm(dev, true, false, H, Fl, n, advance(xe, r0 * H, act), dhe, advance(gs[kFc1W], e * H * Fl, gdt), 1.0f, act,
           gdt);
      column_sum_acc(rank_, dev, dhe, advance(gs[kFc1B], e * Fl, gdt), n, Fl, act, gdt);
      gemm(dev, false, true, n, H, Fl, dhe, advance(w_[kFc1W], e * H * Fl, act), advance(dxe, r0 * H, act), 0.0f,
           act, act);
    }
    // The input gradients per dispatch row, back where the tokens live (the
    // output-gradient rows there are used up), then summed per token.
    void* dxg = dxe;
    if (moved) {
      dxg = tmp.at(dyg);
      from_experts(dev, a.microbatch, dxe, dxg, H, act);
    }
    if (zero_row) fill_zero_row(dev, dxg, N, H);
    combine_rows(dev, dxg, N + zero_row, s.route.at<int32_t>(s.slot_row), dln_full, Tr, H);
    std::vector<float> gate_dlogits;  // the shared-expert gate's logit gradients of the TP region's tokens
    if (fold) {  // the routed part is this rank's shard's; the shared expert's leaves its region (f)
      if (shared_apart) {
        gate_dlogits = shared_backward(dev, gs, xfull, s.mem.at(s.shared_h), s.mem.at(s.shared_out), d,
                                       tmp.at(shared_dfull), T, count_bias, /*accumulate=*/false);
        tp_.enter_backward({.rows = T, .cols = H, .x = tmp.at(shared_dfull), .out = tmp.at(shared_dshard),
                            .dtype = act});
        add(dev, tmp.at(shared_dshard), dln_full, dln_full, Tl * H, act);
      }
    } else {
      if (shared_ffn_ > 0)
        gate_dlogits = shared_backward(dev, gs, xin, s.mem.at(s.shared_h), s.mem.at(s.shared_out), d, dln_full,
                                       T, count_bias, /*accumulate=*/true);
      // f's backward: summed over tp (reduce-scattered to the shard under SP).
      tp_.enter_backward({.rows = T, .cols = H, .x = dln_full, .out = dl, .dtype = act});
    }
    if (shared_gate_) {
      // The gate's weight and input gradients, on the rows this rank holds (its
      // shard under SP: the engine sums the duplicated weight's gradient over tp).
      const int64_t g0 = sp ? tp_.rank() * Tl : 0;
      Arena g;
      const size_t dlr = g.elems(Tl, act);
      g.allocate(rank_);
      upload_values(dev, std::vector<float>(gate_dlogits.begin() + g0, gate_dlogits.begin() + g0 + Tl), g.at(dlr));
      gemm(dev, true, false, H, 1, Tl, ln, g.at(dlr), gs[kSharedGate], 1.0f, act, gdt);
      gemm(dev, false, false, Tl, H, 1, g.at(dlr), w_[kSharedGate], dl, 1.0f, act, act);
    }

    // The router, on the rows this rank holds (its shard under SP): every tp rank
    // routed all tokens identically, so each adds the router's part of its rows
    // (folded or under cp, the gates' gradients of its own rows are all it has, and
    // all it needs).
    dev.synchronize();  // row_dgate
    const double aux_scale = aux_coeff_ * static_cast<double>(a.aux_loss_scale),
                 z_scale = z_coeff_ * static_cast<double>(a.aux_loss_scale);
    // The gates' gradients of the router's Tl tokens (TP-region tokens from row0),
    // from the dispatch rows (TP-region tokens from t0): every router token is
    // among the dispatched ones, whose slots it shares.
    const int64_t K = top_k_, row0 = sp ? tp_.rank() * Tl : 0, t0 = fold ? tp_.rank() * Tl : 0;
    std::vector<double> slot_dgate(static_cast<size_t>(Tl * K), 0.0);  // 0 for a dropped slot
    for (int64_t row = 0; row < N; ++row) {
      const int64_t t = r.row_token[static_cast<size_t>(row)] + t0 - row0;
      if (t >= 0 && t < Tl)
        slot_dgate[static_cast<size_t>(t * K + r.row_slot[static_cast<size_t>(row)] % K)] =
            row_dgate[static_cast<size_t>(row)];
    }
    const std::vector<float> dlog = router_grad(s.router, slot_dgate, aux_scale, z_scale, pre_softmax_);
    dev.copy(dlogits, dlog.data(), dlog.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
  }

  // With a capacity, which slots an expert keeps is decided over the whole
  // microbatch, so its logits are gathered to every rank that holds part of it (cp
  // ranks; tp ranks when folded). Dropless, top-k is each token's own decision.
  bool gathers_logits() const { return capacity_factor_ > 0.0; }

  // Dropless routing under cp or folding: this rank routes the Tr tokens it
  // dispatches from their logits [Tr, E] (device, fp32), exactly as routing the
  // whole microbatch would (top-k is per token; the local token order is the
  // whole one's restricted to them). What the loss terms need of the whole
  // microbatch (Tw tokens) is 2E + 1 sums (slots routed to each expert, their
  // probabilities, the z-loss terms), all-reduced over the ranks holding its
  // other tokens: cp, and tp when folded (unfolded tp ranks route the same tokens).
  void route_own_tokens(const loom::Device& dev, const loom_layer_fwd_args& a, Saved& s, const float* logits,
                        int64_t Tr, int64_t Tl, int64_t Tw) const {
    const int64_t E = experts_, K = top_k_;
    std::vector<float> host_logits(static_cast<size_t>(Tr * E));
    dev.copy(host_logits.data(), logits, host_logits.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    Routing own = route(host_logits, Tr, E, K, pre_softmax_);
    // The sums feed the loss terms only: without them (evaluation, both coefficients
    // 0; the same on every rank) the router's rows need nothing of the others.
    const bool loss_terms = a.training && (aux_coeff_ > 0.0 || z_coeff_ > 0.0);
    if (a.training) s.router = router_rows(own, own_router_rows(Tl));
    if (loss_terms) {
      std::vector<double> sums(static_cast<size_t>(2 * E + 1), 0.0);
      for (int64_t e = 0; e < E; ++e) {
        sums[static_cast<size_t>(e)] = static_cast<double>(own.routed[static_cast<size_t>(e)]);
        sums[static_cast<size_t>(E + e)] = own.prob_sum[static_cast<size_t>(e)];
      }
      for (const double l : own.lse) sums[static_cast<size_t>(2 * E)] += l * l / static_cast<double>(Tw);
      Arena buf;
      const size_t at = buf.add(sums.size() * sizeof(double));
      buf.allocate(rank_);
      double* d = buf.at<double>(at);
      dev.copy(d, sums.data(), sums.size() * sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
      if (fold_) tp_group_.all_reduce(dev.native_stream(), d, d, sums.size(), LOOM_DTYPE_F64);
      if (cp_.cp() > 1) cp_group_.all_reduce(dev.native_stream(), d, d, sums.size(), LOOM_DTYPE_F64);
      dev.copy(sums.data(), d, sums.size() * sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
      dev.synchronize();
      std::vector<int64_t> routed(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) routed[static_cast<size_t>(e)] = std::llround(sums[static_cast<size_t>(e)]);
      const std::vector<double> prob_sum(sums.begin() + E, sums.begin() + 2 * E);
      if (a.aux_loss != nullptr)
        *a.aux_loss += static_cast<float>(aux_coeff_ * load_balance(routed, prob_sum, Tw, K) +
                                          z_coeff_ * sums[static_cast<size_t>(2 * E)]);
      s.router.tokens = Tw;  // the loss terms' means are over the whole microbatch
      s.router.slots = Tw * K;
      s.router.routed = std::move(routed);
    }
    // The backward reads the dispatch only: not the probabilities (router_rows has
    // the router's rows of them), so they are not kept per microbatch.
    own.probs = {};
    own.chosen = {};
    own.lse = {};
    own.prob_sum = {};
    s.routing = std::move(own);
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
  bool router_capturable() const { return cp_.cp() == 1 || !gathers_logits(); }

  std::vector<int64_t> local_numels() const {
    const int64_t H = hidden_, E = experts_, El = local_experts_, Fl = ffn_local_, Fs = shared_local_;
    std::vector<int64_t> n = {H, H, H * E, El * H * Fl, El * Fl, El * Fl * H, El * H};
    if (shared_ffn_ > 0) n.insert(n.end(), {H * Fs, Fs, Fs * H, H});
    if (shared_gate_) n.push_back(H);
    return n;
  }

  // The dispatch order's token ids (int32) and gates (activation dtype) to the device.
  void upload_dispatch(const loom::Device& dev, const Routing& r, int32_t* tok, int32_t* slot_row, void* gate) const {
    const int64_t N = r.rows();
    dev.copy(tok, r.row_token.data(), static_cast<size_t>(N) * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
    dev.copy(slot_row, r.slot_row.data(), r.slot_row.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
    upload_values(dev, r.row_gate, gate);
  }

  // Host values to the device in the activation dtype.
  void upload_values(const loom::Device& dev, const std::vector<float>& v, void* out) const {
    const int64_t n = static_cast<int64_t>(v.size());
    if (dt_.act == LOOM_DTYPE_F32) {
      dev.copy(out, v.data(), v.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
      return;
    }
    Arena wide;
    const size_t g = wide.floats(n);
    wide.allocate(rank_);
    dev.copy(wide.at(g), v.data(), v.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
    dev.elementwise({.op = LOOM_EW_CAST, .n = n, .x = wide.at(g), .out = out, .dtype = LOOM_DTYPE_F32,
                     .out_dtype = dt_.act});
  }

  // out [rows, H] = table [table_rows, H] at ids (the device's embedding gather).
  void gather_rows(const loom::Device& dev, const void* table, const int32_t* ids, void* out, int64_t rows,
                   int64_t table_rows, int64_t H, int32_t dtype = -1) const {
    dev.embedding_fwd({.n = rows, .dim = H, .vocab_rows = table_rows, .vocab_start = 0, .ids = ids, .table = table,
                       .out = out, .dtype = dtype < 0 ? dt_.act : dtype});
  }

  // Where this rank's experts get their rows: the dispatch rows (ep = 1), or the
  // service's plan of the exchange, kept under the microbatch until release.
  ExpertRows plan_expert_rows(const loom::Device& dev, const Routing& r, int32_t microbatch) const {
    if (ep_ == 1) return {r.rows(), r.offset};
    std::vector<int64_t> local = ep_service_.plan(dev.native_stream(), microbatch, r.offset);
    return {local.back(), std::move(local)};
  }
  // rows [N, w] in dispatch order -> out [R, w] at this rank's experts, expert-major.
  void to_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out, int64_t w,
                  int32_t dtype) const {
    ep_service_.dispatch(dev.native_stream(), microbatch, rows, out, w, dtype);
  }
  // The inverse: rows [R, w] at this rank's experts -> out [N, w] in dispatch order.
  void from_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out, int64_t w,
                    int32_t dtype) const {
    ep_service_.combine(dev.native_stream(), microbatch, rows, out, w, dtype);
  }
  // out [T, H] = sum over k of rows [N, H] at slot_row[k] (the device's gather with
  // accumulate, slot 0 first): every token's top_k rows added in one fixed order,
  // so the result does not depend on thread scheduling (a scatter-add by atomics
  // would, from three rows per token on).
  // rows_in has `rows` rows: the N dispatch rows, and a zero row after them when a
  // capacity drop left slots without one.
  void combine_rows(const loom::Device& dev, const void* rows_in, int64_t rows, const int32_t* slot_row, void* out,
                    int64_t T, int64_t H) const {
    for (int64_t k = 0; k < top_k_; ++k)
      dev.embedding_fwd({.n = T, .dim = H, .vocab_rows = rows, .vocab_start = 0, .ids = slot_row + k * T,
                         .table = rows_in, .out = out, .accumulate = k > 0 ? 1 : 0, .dtype = dt_.act});
  }
  // Row `row` of rows [.., H] to zeros: what a dropped slot combines.
  void fill_zero_row(const loom::Device& dev, void* rows, int64_t row, int64_t H) const {
    fill_zero(dev, advance(rows, row * H, dt_.act), H, dt_.act);
  }
  // The most slots an expert keeps of a microbatch's T tokens (0 = dropless):
  // Megatron's get_capacity, ceil(T k / E * capacity_factor).
  int64_t capacity(int64_t T) const {
    if (capacity_factor_ <= 0.0) return 0;
    return static_cast<int64_t>(std::ceil(static_cast<double>(T * top_k_) / static_cast<double>(experts_) *
                                          capacity_factor_));
  }
  // The shared expert on all T tokens of the TP region: out [T, H] += fc2(gelu(fc1
  // xin)), partial over tp like the routed experts' (fc2's bias on tp rank 0).
  // saved_h (training) keeps fc1's output [T, Fs/tp] for the backward.
  void shared_expert_forward(const loom::Device& dev, const void* xin, void* saved_h, void* out, int64_t T,
                             bool accumulate) const {
    const int64_t H = hidden_, Fs = shared_local_;
    const int32_t act = dt_.act;
    Arena tmp;
    const size_t h = tmp.elems(saved_h ? 0 : T * Fs, act), a = tmp.elems(T * Fs, act);
    tmp.allocate(rank_);
    void* hs = saved_h ? saved_h : tmp.at(h);
    gemm(dev, false, false, T, Fs, H, xin, w_[kShared1W], hs, 0.0f, act, act);
    add_bias(dev, hs, w_[kShared1B], hs, T, Fs, act);
    dev.gelu_fwd({.n = T * Fs, .x = hs, .out = tmp.at(a), .dtype = act});
    gemm(dev, false, false, T, H, Fs, tmp.at(a), w_[kShared2W], out, accumulate ? 1.0f : 0.0f, act, act);
    if (tp_.rank() == 0) add_bias(dev, out, w_[kShared2B], out, T, H, act);
  }
  // Its backward from the whole output gradient d [T, H]: the parameters'
  // gradients, and dxin [T, H] += its input gradient (partial over tp, summed by
  // the layer's f backward). count_bias: this rank adds fc2's bias gradient.
  void shared_expert_backward(const loom::Device& dev, GradShadow& gs, const void* xin, const void* hs,
                              const void* d, void* dxin, int64_t T, bool count_bias, bool accumulate) const {
    const int64_t H = hidden_, Fs = shared_local_;
    const int32_t act = dt_.act, gdt = gs.grad_dtype();
    Arena tmp;
    const size_t a = tmp.elems(T * Fs, act), da = tmp.elems(T * Fs, act);
    tmp.allocate(rank_);
    dev.gelu_fwd({.n = T * Fs, .x = hs, .out = tmp.at(a), .dtype = act});
    gemm(dev, true, false, Fs, H, T, tmp.at(a), d, gs[kShared2W], 1.0f, act, gdt);
    if (count_bias) column_sum_acc(rank_, dev, d, gs[kShared2B], T, H, act, gdt);
    gemm(dev, false, true, T, Fs, H, d, w_[kShared2W], tmp.at(da), 0.0f, act, act);
    dev.gelu_bwd({.n = T * Fs, .x = hs, .dy = tmp.at(da), .out = tmp.at(da), .dtype = act});
    gemm(dev, true, false, H, Fs, T, xin, tmp.at(da), gs[kShared1W], 1.0f, act, gdt);
    column_sum_acc(rank_, dev, tmp.at(da), gs[kShared1B], T, Fs, act, gdt);
    gemm(dev, false, true, T, H, Fs, tmp.at(da), w_[kShared1W], dxin, accumulate ? 1.0f : 0.0f, act, act);
  }
  // The shared expert into out [T, H] (+= when accumulate), partial over tp; with
  // shared_expert_gate each token's row times sigmoid(xin_t . w_gate) (Megatron's
  // shared-expert gate; the row scaling commutes with the tp sum). saved_out
  // (training, gated) keeps the ungated rows for the gate's gradient.
  void shared_forward(const loom::Device& dev, const void* xin, void* saved_h, void* saved_out, void* out, int64_t T,
                      bool accumulate) const {
    if (!shared_gate_) {
      shared_expert_forward(dev, xin, saved_h, out, T, accumulate);
      return;
    }
    const int64_t H = hidden_;
    const int32_t act = dt_.act;
    Arena tmp;
    const size_t raw = tmp.elems(saved_out ? 0 : T * H, act), gated = tmp.elems(T * H, act),
                 gate = tmp.elems(T, act), ones = tmp.elems(H, act);
    tmp.allocate(rank_);
    void* ungated = saved_out ? saved_out : tmp.at(raw);
    shared_expert_forward(dev, xin, saved_h, ungated, T, /*accumulate=*/false);
    const std::vector<float> s = shared_gates(dev, xin, T);
    upload_values(dev, s, tmp.at(gate));
    expand_gates(dev, tmp.at(gate), tmp.at(ones), tmp.at(gated), T, H);
    dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = ungated, .y = tmp.at(gated), .out = tmp.at(gated),
                     .dtype = act, .out_dtype = act});
    if (accumulate)
      add(dev, tmp.at(gated), out, out, T * H, act);
    else
      copy_d2d(dev, out, tmp.at(gated), static_cast<size_t>(T * H) * dt_.act_bytes());
  }
  // sigmoid(xin_t . w_gate) of the T tokens (host: the router's values are read
  // there too).
  std::vector<float> shared_gates(const loom::Device& dev, const void* xin, int64_t T) const {
    Arena tmp;
    const size_t logit = tmp.floats(T);
    tmp.allocate(rank_);
    gemm(dev, false, false, T, 1, hidden_, xin, w_[kSharedGate], tmp.at(logit), 0.0f, dt_.act, LOOM_DTYPE_F32);
    std::vector<float> s(static_cast<size_t>(T));
    dev.copy(s.data(), tmp.at(logit), s.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    for (float& v : s) v = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(v))));
    return s;
  }
  // The shared expert's backward from the TP region's output gradient d [T, H]
  // (see shared_expert_backward); gated, d reaches the expert scaled by the gates
  // and the result is the gate logits' gradients of the T tokens (host; the
  // ungated rows are partial over tp, so their dot products are summed over tp),
  // empty when ungated.
  std::vector<float> shared_backward(const loom::Device& dev, GradShadow& gs, const void* xin, const void* hs,
                                     const void* saved_out, const void* d, void* dxin, int64_t T, bool count_bias,
                                     bool accumulate) const {
    if (!shared_gate_) {
      shared_expert_backward(dev, gs, xin, hs, d, dxin, T, count_bias, accumulate);
      return {};
    }
    const int64_t H = hidden_;
    const int32_t act = dt_.act;
    Arena tmp;
    const size_t gate = tmp.elems(T, act), ones = tmp.elems(H, act), scaled = tmp.elems(T * H, act),
                 prod = tmp.elems(T * H, act), dgate = tmp.floats(T);
    tmp.allocate(rank_);
    std::vector<float> s = shared_gates(dev, xin, T);
    upload_values(dev, s, tmp.at(gate));
    expand_gates(dev, tmp.at(gate), tmp.at(ones), tmp.at(scaled), T, H);
    dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = d, .y = tmp.at(scaled), .out = tmp.at(scaled), .dtype = act,
                     .out_dtype = act});
    shared_expert_backward(dev, gs, xin, hs, tmp.at(scaled), dxin, T, count_bias, accumulate);
    // d gate_t = <d_t, ungated_t>, summed over tp.
    dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = d, .y = const_cast<void*>(saved_out), .out = tmp.at(prod), .dtype = act,
                     .out_dtype = act});
    gemm(dev, false, false, T, 1, H, tmp.at(prod), tmp.at(ones), tmp.at(dgate), 0.0f, act, LOOM_DTYPE_F32);
    if (tp_.size() > 1)
      tp_group_.all_reduce(dev.native_stream(), tmp.at(dgate), tmp.at(dgate), static_cast<size_t>(T),
                           LOOM_DTYPE_F32);
    std::vector<float> dlogit(static_cast<size_t>(T));
    dev.copy(dlogit.data(), tmp.at(dgate), dlogit.size() * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    for (size_t t = 0; t < dlogit.size(); ++t) dlogit[t] *= s[t] * (1.0f - s[t]);
    return dlogit;
  }
  // out [N, width] = gate [N, 1] x ones [1, width]: each row's gate across its columns.
  void expand_gates(const loom::Device& dev, const void* gate, void* ones, void* out, int64_t N,
                    int64_t width) const {
    dev.elementwise({.op = LOOM_EW_FILL, .n = width, .out = ones, .alpha = 1.f, .dtype = dt_.act,
                     .out_dtype = dt_.act});
    gemm(dev, false, false, N, width, 1, gate, ones, out, 0.0f, dt_.act, dt_.act);
  }
  // y [N, H] = fc2(act) per expert on its rows, + fc2's bias on tp rank 0 (the
  // outputs are partial sums over tp).
  void expert_outputs(const loom::Device& dev, const void* act_in, void* y, const ExpertRows& r) const {
    const int64_t H = hidden_, Fl = ffn_local_;
    const int32_t act = dt_.act;
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t n = r.count(e), r0 = r.offset[static_cast<size_t>(e)];
      if (n == 0) continue;
      void* ye = advance(y, r0 * H, act);
      gemm(dev, false, false, n, H, Fl, advance(act_in, r0 * Fl, act), advance(w_[kFc2W], e * Fl * H, act), ye, 0.0f,
           act, act);
      if (expert_bias_here()) add_bias(dev, ye, advance(w_[kFc2B], e * H, act), ye, n, H, act);
    }
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
  // Whether this rank adds the experts' fc2 bias: tp rank 0 when the outputs are
  // partial sums over tp; every rank when the experts are folded (whole width).
  bool expert_bias_here() const { return fold_ || tp_.rank() == 0; }


  loom_rank* rank_;
  loom::Group tp_group_, ep_group_, cp_group_;
  loom::ContextSlice cp_;  // this rank's rows of the sequence (all of them with cp = 1)
  loom::ExpertParallel ep_service_;  // open when ep > 1
  bool fold_ = false;                // parallel.etp = 1 under tp > 1: experts whole, ep spanning tp ranks
  int64_t ep_ = 1, local_experts_ = 0;  // ep group size; experts held here (num_experts / ep)
  loom::TensorParallel tp_;
  std::string name_;
  int64_t hidden_ = 0, experts_ = 0, top_k_ = 0, ffn_ = 0, ffn_local_ = 0, seq_ = 0, micro_batch_ = 0;
  int64_t shared_ffn_ = 0, shared_local_ = 0;  // the shared expert's width (0 = none), and this tp rank's part
  bool shared_gate_ = false;                   // its output times sigmoid(x . w) per token
  bool pre_softmax_ = false;
  double aux_coeff_ = 0.0, z_coeff_ = 0.0, capacity_factor_ = 0.0;
  bool drop_by_probs_ = true;
  float dropout_ = 0.0f;
  Dtypes dt_;
  bool fusion_ = false;
  void* w_[kSharedGate + 1] = {};
  void* g_[kSharedGate + 1] = {};
  std::map<int32_t, Saved> saved_;
  std::map<int32_t, RouterMemory> router_memory_;  // per training microbatch, across steps
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::layer_plugin<Moe>(
    "moe", "1.4.0",
    "pre-LN mixture of GeLU experts, top-k router (dropless or with capacity), shared expert, load-balancing "
    "loss (tensor-, expert- and context-parallel)",
    {loom::opt_int("num_experts", 8, "experts in the layer").in("[1, 65536]"),
     loom::opt_int("top_k", 2, "experts each token is routed to (at most num_experts)").in("[1, 65536]"),
     loom::opt_int("ffn_hidden_size", 0, "each expert's inner width (0 = model.ffn_hidden_size)").in("[0, 4194304]"),
     loom::opt_bool("pre_softmax", false,
                    "gates = the softmax over all experts at the chosen ones (true), or the softmax over the "
                    "chosen logits only (false, Megatron's default)"),
     loom::opt_float("aux_loss_coeff", 0.01, "weight of the Switch Transformer load-balancing loss (0 = off)")
         .in("[0, inf)"),
     loom::opt_float("z_loss_coeff", 0.0, "weight of the router z-loss, mean of logsumexp(logits)^2 (0 = off)")
         .in("[0, inf)"),
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
     loom::layers::dropout_option_spec("the MoE output")}))
