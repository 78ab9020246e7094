// layer/moe's router: top-k routing, capacity, loss terms (see router.hpp).
#include "router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace loom::layers::moe {

namespace {

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

// Softmax over all experts, the z-loss terms, and each token's top_k experts (ties:
// lower index) with their gates; counts the slots routed to each expert.
void choose_experts(const std::vector<float>& logits, bool pre_softmax, Routing& r) {
  const int64_t tokens = r.tokens, experts = r.experts, top_k = r.top_k;
  std::vector<int32_t> order(static_cast<size_t>(experts));
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
      r.prob_sum[static_cast<size_t>(e)] += p[e];
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
      r.slot_gate[static_cast<size_t>(t * top_k + k)] = static_cast<float>(pre_softmax ? p[e] : p[e] / chosen_sum);
      ++r.routed[static_cast<size_t>(e)];
    }
  }
}

// The capacity drop: each expert keeps at most `capacity` of its slots, those with
// the largest gates (by_probs; ties to the lower token) or its first tokens.
void drop_over_capacity(int64_t capacity, bool by_probs, Routing& r) {
  r.kept.assign(static_cast<size_t>(r.slots()), 1);
  r.kept_slots = r.routed;
  if (capacity <= 0) return;
  std::vector<std::vector<int64_t>> slots_of(static_cast<size_t>(r.experts));  // in token order
  for (int64_t slot = 0; slot < r.slots(); ++slot)
    slots_of[static_cast<size_t>(r.chosen[static_cast<size_t>(slot)])].push_back(slot);
  for (int64_t e = 0; e < r.experts; ++e) {
    std::vector<int64_t>& sl = slots_of[static_cast<size_t>(e)];
    if (static_cast<int64_t>(sl.size()) <= capacity) continue;
    if (by_probs)
      std::stable_sort(sl.begin(), sl.end(), [&](int64_t a, int64_t b) {
        return r.slot_gate[static_cast<size_t>(a)] > r.slot_gate[static_cast<size_t>(b)];
      });
    for (size_t i = static_cast<size_t>(capacity); i < sl.size(); ++i) r.kept[static_cast<size_t>(sl[i])] = 0;
    r.kept_slots[static_cast<size_t>(e)] = capacity;
  }
}

}  // namespace

int64_t Router::capacity(int64_t tokens) const {
  if (c_.capacity_factor <= 0.0) return 0;
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens * c_.top_k) / static_cast<double>(c_.experts) *
                                        c_.capacity_factor));
}

Routing Router::route(const std::vector<float>& logits, int64_t tokens) const {
  Routing r;
  r.tokens = tokens;
  r.experts = c_.experts;
  r.top_k = c_.top_k;
  r.probs.resize(static_cast<size_t>(tokens * c_.experts));
  r.chosen.resize(static_cast<size_t>(tokens * c_.top_k));
  r.slot_gate.resize(static_cast<size_t>(tokens * c_.top_k));
  r.routed.assign(static_cast<size_t>(c_.experts), 0);
  r.prob_sum.assign(static_cast<size_t>(c_.experts), 0.0);
  r.lse.resize(static_cast<size_t>(tokens));
  choose_experts(logits, c_.pre_softmax, r);
  drop_over_capacity(capacity(tokens), c_.drop_by_probs, r);
  // The load-balancing term counts the routing before the drop, as Megatron's does.
  r.aux = load_balance(r.routed, r.prob_sum, tokens, c_.top_k);
  return r;
}

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

LossTerms Router::reduce_loss_terms(loom_rank* rank, const loom::Device& dev, const Routing& own,
                                    int64_t whole_tokens, const std::vector<loom::Group>& groups) const {
  const int64_t E = c_.experts, K = c_.top_k;
  std::vector<double> sums(static_cast<size_t>(2 * E + 1), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    sums[static_cast<size_t>(e)] = static_cast<double>(own.routed[static_cast<size_t>(e)]);
    sums[static_cast<size_t>(E + e)] = own.prob_sum[static_cast<size_t>(e)];
  }
  for (const double l : own.lse) sums[static_cast<size_t>(2 * E)] += l * l / static_cast<double>(whole_tokens);
  Arena buf;
  const size_t at = buf.add(sums.size() * sizeof(double));
  buf.allocate(rank);
  double* d = buf.at<double>(at);
  dev.copy(d, sums.data(), sums.size() * sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
  for (const loom::Group& g : groups) g.all_reduce(dev.native_stream(), d, d, sums.size(), LOOM_DTYPE_F64);
  dev.copy(sums.data(), d, sums.size() * sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
  dev.synchronize();
  LossTerms terms;
  terms.routed.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) terms.routed[static_cast<size_t>(e)] = std::llround(sums[static_cast<size_t>(e)]);
  const std::vector<double> prob_sum(sums.begin() + E, sums.begin() + 2 * E);
  terms.loss = c_.aux_coeff * load_balance(terms.routed, prob_sum, whole_tokens, K) +
               c_.z_coeff * sums[static_cast<size_t>(2 * E)];
  return terms;
}

std::vector<float> Router::logit_gradients(const RouterRows& r, const std::vector<double>& slot_dgate,
                                           double aux_loss_scale) const {
  const double aux_scale = c_.aux_coeff * aux_loss_scale, z_scale = c_.z_coeff * aux_loss_scale;
  const bool pre_softmax = c_.pre_softmax;
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

}  // namespace loom::layers::moe
