// layer/moe's router (Megatron-Core's router.py, TopKRouter, and the
// topk_routing_with_score_function and apply_router_token_dropping of its
// moe_utils.py): from a microbatch's router logits on the host, each token's
// top_k experts (within its best groups of experts, when grouped) and gates, the
// capacity drop, the load-balancing (Switch Transformer) and z (ST-MoE) loss
// terms, and the logits' gradient. The router's GEMM itself runs in moe.cpp's moe_router
// sub-step, beside LayerNorm; dispatch.hpp turns a Routing into rows per expert.
#pragma once

#include <loom/layers/layer_math.hpp>

#include <cstdint>
#include <vector>

namespace loom::layers::moe {

// The router's options (the layer's num_experts, top_k, score_function,
// pre_softmax, topk_scaling_factor, num_groups, group_topk, aux_loss_coeff,
// z_loss_coeff, capacity_factor, drop_policy).
struct RouterConfig {
  int64_t experts = 0, top_k = 0;
  bool sigmoid = false;           // scores: each expert's sigmoid (else the softmax over all experts)
  bool pre_softmax = false;       // softmax: gates = the chosen probs as they are (else renormalised over the chosen)
  double scaling = 0.0;           // > 0: the gates times this (0 = as they are)
  int64_t groups = 0;             // > 0: experts in this many groups of consecutive experts, a token's
  int64_t group_topk = 0;         //   top_k taken within its group_topk best groups, a group
  bool group_by_best = false;     //   ranked by its best score (else the sum of its top_k / group_topk best)
  bool per_sequence = false;      // the load-balancing term: each sequence's, averaged (seq_aux_loss)
  double aux_coeff = 0.0, z_coeff = 0.0;
  double capacity_factor = 0.0;   // 0 = dropless
  bool drop_by_probs = true;      // an expert over capacity keeps its largest gates (else its first tokens)
  // DeepSeek-V3's auxiliary-loss-free balancing (Megatron's moe_router_enable_expert_bias,
  // sigmoid scores only): a per-expert bias added to the scores for the choice of
  // experts (groups included), never to the gates nor to the load-balancing term.
  bool expert_bias = false;
};

// The host side of one microbatch's routing decision. The load-balancing term
// reads each token's probabilities (the softmax, or the sigmoids over their sum)
// and its top_k by them over all experts: without groups, the routing itself.
struct Routing {
  int64_t tokens = 0, experts = 0, top_k = 0;
  int64_t sequences = 1;             // load-balancing groups: the microbatch's sequences (token t's: t % sequences), or 1
  std::vector<float> logits;         // [tokens, experts]: as routed (the backward works the scores out again)
  std::vector<int32_t> chosen;       // [tokens, top_k]: expert of each slot (t * top_k + k)
  std::vector<float> slot_gate;      // [tokens, top_k]: gate of each slot
  std::vector<char> kept;            // [tokens, top_k]: 0 where the expert's capacity dropped the slot
  std::vector<int64_t> kept_slots;   // [experts]: slots each expert keeps
  std::vector<int64_t> routed;       // [sequences, experts]: the load-balancing term's slots of each expert
                                     // (with groups, counted only when aux_loss_coeff > 0)
  std::vector<double> prob_sum;      // [sequences, experts]: sums over tokens of the load-balancing probabilities
  double aux = 0;                    // the unweighted load-balancing term E * sum f_e P_e
  std::vector<double> lse;           // [tokens]: logsumexp of each token's logits
  double z = 0;                      // the unweighted z-loss term, mean of lse^2
  int64_t slots() const { return tokens * top_k; }
};

// What the router's backward needs of a routing, for the tokens whose logits this
// rank computed (mine: their indices in the routing): their logits, choices and
// logsumexp, and the whole routing's counts. Under cp or folding the routing
// covers cp * tp times this rank's tokens; only these rows are kept per microbatch.
struct RouterRows {
  int64_t tokens = 0, slots = 0;  // of the whole routing (the loss terms' means)
  int64_t experts = 0, top_k = 0;
  int64_t sequences = 1;          // load-balancing groups (Routing's)
  std::vector<int64_t> routed;    // [sequences, experts]: the load-balancing term's slots of each
  std::vector<float> logits;      // [n, experts]
  std::vector<int64_t> sequence;  // [n]: each row's load-balancing group
  std::vector<int32_t> chosen;    // [n, top_k]
  std::vector<double> lse;        // [n]
};

RouterRows router_rows(const Routing& r, const std::vector<int64_t>& mine);

// DeepSeek-V3's bias update (Megatron's get_updated_expert_bias): each expert's bias
// moves by `rate` towards the balanced load, up where the expert's routed slots over
// the global batch (`load`, [experts]) are under their mean, down where over, not at
// all where equal.
void update_expert_bias(std::vector<float>& bias, const std::vector<double>& load, float rate);

// The whole microbatch's loss-term counts of a routing spread over ranks.
struct LossTerms {
  double loss = 0;              // coeff * aux + z_coeff * z, before the engine's aux_loss_scale
  std::vector<int64_t> routed;  // [sequences, experts]: the load-balancing slots over all the ranks
};

class Router {
 public:
  Router() = default;
  explicit Router(const RouterConfig& config) : c_(config) {}

  const RouterConfig& config() const { return c_; }

  // The most slots an expert keeps of a microbatch's `tokens` (0 = dropless):
  // Megatron's get_capacity, ceil(tokens k / E * capacity_factor).
  int64_t capacity(int64_t tokens) const;

  // With a capacity, which slots an expert keeps is decided over the whole
  // microbatch, so its logits are gathered to every rank that holds part of it (cp
  // ranks; tp ranks when folded). Dropless, top-k is each token's own decision.
  bool gathers_logits() const { return c_.capacity_factor > 0.0; }

  // Whether the objective has a router loss term (the same on every rank).
  bool has_loss_terms() const { return c_.aux_coeff > 0.0 || c_.z_coeff > 0.0; }

  // Routes `tokens` rows of fp32 logits [tokens, experts] (laid out [seq,
  // micro_batch]: token t is in sequence t % micro_batch): scores, top-k, gates, and
  // the capacity drop over these tokens. bias: the experts' [experts] routing bias
  // (with expert_bias; else unread).
  Routing route(std::vector<float> logits, int64_t tokens, int64_t micro_batch, const float* bias = nullptr) const;

  // The weighted loss terms of a routing of the whole microbatch.
  double loss(const Routing& whole) const { return c_.aux_coeff * whole.aux + c_.z_coeff * whole.z; }

  // Dropless routing spread over ranks, each routing its own tokens (`own`): the
  // whole microbatch's (whole_tokens) loss terms from 2 sequences E + 1 sums (the
  // load-balancing slots of each expert and their probabilities, per load-balancing
  // group; the z-loss terms) all-reduced over `groups`, the ranks holding its other
  // tokens.
  LossTerms reduce_loss_terms(loom_rank* rank, const loom::Device& dev, const Routing& own, int64_t whole_tokens,
                              const std::vector<loom::Group>& groups) const;

  // d(objective)/d(logits) [n, experts] of the router's rows from their slots'
  // gate gradients slot_dgate [n, top_k] (0 for a dropped slot); the loss terms
  // enter with the engine's aux_loss_scale.
  std::vector<float> logit_gradients(const RouterRows& r, const std::vector<double>& slot_dgate,
                                     double aux_loss_scale) const;

 private:
  RouterConfig c_;
};

}  // namespace loom::layers::moe
