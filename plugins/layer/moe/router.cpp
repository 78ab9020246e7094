// layer/moe's router: top-k routing, capacity, loss terms (see router.hpp).
#include "router.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

namespace loom::layers::moe {

namespace {

// The unweighted load-balancing term of a routing of `tokens` tokens in `sequences`
// groups (1: the microbatch's Switch Transformer term; its sequences: the mean of
// each sequence's): E * sum_e f_e P_e with f_e = routed[e] / (n * top_k), P_e =
// prob_sum[e] / n over a group's n = tokens / sequences tokens, routed and prob_sum
// [sequences, E].
double load_balance(const std::vector<int64_t>& routed, const std::vector<double>& prob_sum, int64_t tokens,
                    int64_t top_k, int64_t sequences) {
  const size_t experts = routed.size() / static_cast<size_t>(sequences);
  const double n = static_cast<double>(tokens / sequences);
  double aux = 0;
  for (size_t i = 0; i < routed.size(); ++i)
    aux += (static_cast<double>(routed[i]) / (n * static_cast<double>(top_k))) * (prob_sum[i] / n);
  return aux * static_cast<double>(experts) / static_cast<double>(sequences);
}

// Megatron's guard against an all-zero sum of sigmoids.
constexpr double kSigmoidSumFloor = 1e-20;

// One token's scores (the softmax over all experts, or each expert's sigmoid) and
// load-balancing probabilities lb (the softmax, or the sigmoids over their sum)
// from its logits and their logsumexp: the forward and the backward alike.
void score_row(bool sigmoid, const float* l, double lse, int64_t experts, double* scores, double* lb) {
  if (!sigmoid) {
    for (int64_t e = 0; e < experts; ++e) lb[e] = scores[e] = std::exp(static_cast<double>(l[e]) - lse);
    return;
  }
  double sum = 0;
  for (int64_t e = 0; e < experts; ++e) sum += (scores[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e]))));
  for (int64_t e = 0; e < experts; ++e) lb[e] = scores[e] / (sum + kSigmoidSumFloor);
}

double logsumexp(const float* l, int64_t experts) {
  double mx = l[0];
  for (int64_t e = 1; e < experts; ++e) mx = std::max<double>(mx, l[e]);
  double sum = 0;
  for (int64_t e = 0; e < experts; ++e) sum += std::exp(static_cast<double>(l[e]) - mx);
  return mx + std::log(sum);
}

// Sorts `order` (expert indices) to put the top_k by `key` first; ties: lower index.
void top_first(std::vector<int32_t>& order, int64_t top_k, const double* key) {
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int32_t a, int32_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
}

// The experts a token may take with groups (Megatron's group_limited_topk): the
// experts of its group_topk groups whose top_k / group_topk best keys sum highest
// (DeepSeek-V3), or whose best key is highest (group_by_best: DeepSeek-V2's
// group_limited_greedy) (ties: the lower group), in index order.
std::vector<int32_t> group_candidates(const RouterConfig& c, const double* key) {
  const int64_t per_group = c.experts / c.groups, best = c.group_by_best ? 1 : c.top_k / c.group_topk;
  std::vector<double> group_score(static_cast<size_t>(c.groups));
  std::vector<double> members(static_cast<size_t>(per_group));
  for (int64_t g = 0; g < c.groups; ++g) {
    std::copy_n(key + g * per_group, per_group, members.begin());
    std::partial_sort(members.begin(), members.begin() + best, members.end(), std::greater<double>());
    group_score[static_cast<size_t>(g)] = std::accumulate(members.begin(), members.begin() + best, 0.0);
  }
  std::vector<int32_t> groups(static_cast<size_t>(c.groups));
  std::iota(groups.begin(), groups.end(), 0);
  top_first(groups, c.group_topk, group_score.data());
  std::sort(groups.begin(), groups.begin() + c.group_topk);
  std::vector<int32_t> candidates;
  for (int64_t i = 0; i < c.group_topk; ++i)
    for (int64_t e = 0; e < per_group; ++e) candidates.push_back(static_cast<int32_t>(groups[i] * per_group + e));
  return candidates;
}

// Per token: the z-loss term, the load-balancing probabilities and counts, and
// the routing: its top_k experts by routing key (the logits under the softmax,
// whose order they share outside groups; the probs with pre_softmax or the
// sigmoids when groups sum them), within its best groups when grouped, and
// their gates: the softmax's chosen probs renormalised (or not, pre_softmax), the
// chosen sigmoids over their sum (top_k > 1), times the scaling factor.
void choose_experts(const RouterConfig& c, const float* bias, Routing& r) {
  const int64_t tokens = r.tokens, experts = r.experts, top_k = r.top_k;
  std::vector<double> scores(static_cast<size_t>(experts)), lb(scores.size()), key(scores.size());
  std::vector<int32_t> all(static_cast<size_t>(experts)), order;
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = r.logits.data() + t * experts;
    const int64_t balance = (t % r.sequences) * experts;  // the token's load-balancing group (its sequence)
    const double lse = r.lse[static_cast<size_t>(t)] = logsumexp(l, experts);
    r.z += lse * lse / static_cast<double>(tokens);
    score_row(c.sigmoid, l, lse, experts, scores.data(), lb.data());
    for (int64_t e = 0; e < experts; ++e) {
      r.prob_sum[static_cast<size_t>(balance + e)] += lb[static_cast<size_t>(e)];
      key[static_cast<size_t>(e)] = c.sigmoid || (c.pre_softmax && c.groups > 0) ? scores[static_cast<size_t>(e)] : l[e];
      // Megatron adds the bias to the fp32 scores: the choice compares those sums.
      if (c.expert_bias) key[static_cast<size_t>(e)] = static_cast<float>(scores[static_cast<size_t>(e)]) + bias[e];
    }
    order = c.groups > 0 ? group_candidates(c, key.data()) : all;
    top_first(order, top_k, key.data());
    double chosen_sum = 0;
    for (int64_t k = 0; k < top_k; ++k) chosen_sum += scores[static_cast<size_t>(order[static_cast<size_t>(k)])];
    const bool normalise = c.sigmoid ? top_k > 1 : !c.pre_softmax;
    const double denominator = c.sigmoid ? chosen_sum + kSigmoidSumFloor : chosen_sum;
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = order[static_cast<size_t>(k)];
      double gate = normalise ? scores[static_cast<size_t>(e)] / denominator : scores[static_cast<size_t>(e)];
      if (c.scaling > 0) gate *= c.scaling;
      r.chosen[static_cast<size_t>(t * top_k + k)] = e;
      r.slot_gate[static_cast<size_t>(t * top_k + k)] = static_cast<float>(gate);
      ++r.kept_slots[static_cast<size_t>(e)];
    }
    if (c.groups == 0 && !c.expert_bias) {  // the load-balancing top-k is the routing
      for (int64_t k = 0; k < top_k; ++k) ++r.routed[static_cast<size_t>(balance + order[static_cast<size_t>(k)])];
    } else if (c.aux_coeff > 0) {  // (only the load-balancing term reads these counts)
      order = all;
      top_first(order, top_k, lb.data());
      for (int64_t k = 0; k < top_k; ++k) ++r.routed[static_cast<size_t>(balance + order[static_cast<size_t>(k)])];
    }
  }
}

// The capacity drop: each expert keeps at most `capacity` of its slots, those with
// the largest gates (by_probs; ties to the lower token) or its first tokens.
void drop_over_capacity(int64_t capacity, bool by_probs, Routing& r) {
  r.kept.assign(static_cast<size_t>(r.slots()), 1);
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

Routing Router::route(std::vector<float> logits, int64_t tokens, int64_t micro_batch, const float* bias) const {
  Routing r;
  r.tokens = tokens;
  r.sequences = c_.per_sequence ? micro_batch : 1;
  r.experts = c_.experts;
  r.top_k = c_.top_k;
  r.logits = std::move(logits);
  r.chosen.resize(static_cast<size_t>(tokens * c_.top_k));
  r.slot_gate.resize(static_cast<size_t>(tokens * c_.top_k));
  r.kept_slots.assign(static_cast<size_t>(c_.experts), 0);
  r.routed.assign(static_cast<size_t>(r.sequences * c_.experts), 0);
  r.prob_sum.assign(static_cast<size_t>(r.sequences * c_.experts), 0.0);
  r.lse.resize(static_cast<size_t>(tokens));
  LOOM_REQUIRE(!c_.expert_bias || bias != nullptr, "route: the expert bias is on but none was given");
  choose_experts(c_, bias, r);
  drop_over_capacity(capacity(tokens), c_.drop_by_probs, r);
  // The load-balancing term counts the routing before the drop, as Megatron's does.
  r.aux = load_balance(r.routed, r.prob_sum, tokens, c_.top_k, r.sequences);
  return r;
}

void update_expert_bias(std::vector<float>& bias, const std::vector<double>& load, float rate) {
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(load.size());
  for (size_t e = 0; e < bias.size(); ++e) {
    const float sign = mean > load[e] ? 1.0f : mean < load[e] ? -1.0f : 0.0f;
    bias[e] += sign * rate;
  }
}

RouterRows router_rows(const Routing& r, const std::vector<int64_t>& mine) {
  RouterRows rr;
  rr.tokens = r.tokens;
  rr.slots = r.slots();
  rr.experts = r.experts;
  rr.top_k = r.top_k;
  rr.routed = r.routed;
  rr.sequences = r.sequences;
  const int64_t E = r.experts, K = r.top_k;
  for (const int64_t t : mine) {
    rr.logits.insert(rr.logits.end(), r.logits.begin() + t * E, r.logits.begin() + (t + 1) * E);
    rr.chosen.insert(rr.chosen.end(), r.chosen.begin() + t * K, r.chosen.begin() + (t + 1) * K);
    rr.lse.push_back(r.lse[static_cast<size_t>(t)]);
    rr.sequence.push_back(t % r.sequences);
  }
  return rr;
}

LossTerms Router::reduce_loss_terms(loom_rank* rank, const loom::Device& dev, const Routing& own,
                                    int64_t whole_tokens, const std::vector<loom::Group>& groups) const {
  const size_t N = own.routed.size();  // sequences x experts
  std::vector<double> sums(2 * N + 1, 0.0);
  for (size_t i = 0; i < N; ++i) {
    sums[i] = static_cast<double>(own.routed[i]);
    sums[N + i] = own.prob_sum[i];
  }
  for (const double l : own.lse) sums[2 * N] += l * l / static_cast<double>(whole_tokens);
  Arena buf;
  const size_t at = buf.add(sums.size() * sizeof(double));
  buf.allocate(rank);
  double* d = buf.at<double>(at);
  dev.copy(d, sums.data(), sums.size() * sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
  for (const loom::Group& g : groups) g.all_reduce(dev.native_stream(), d, d, sums.size(), LOOM_DTYPE_F64);
  dev.copy(sums.data(), d, sums.size() * sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
  dev.synchronize();
  LossTerms terms;
  terms.routed.resize(N);
  for (size_t i = 0; i < N; ++i) terms.routed[i] = std::llround(sums[i]);
  const std::vector<double> prob_sum(sums.begin() + static_cast<std::ptrdiff_t>(N),
                                     sums.begin() + static_cast<std::ptrdiff_t>(2 * N));
  terms.loss = c_.aux_coeff * load_balance(terms.routed, prob_sum, whole_tokens, c_.top_k, own.sequences) +
               c_.z_coeff * sums[2 * N];
  return terms;
}

std::vector<float> Router::logit_gradients(const RouterRows& r, const std::vector<double>& slot_dgate,
                                           double aux_loss_scale) const {
  const double aux_scale = c_.aux_coeff * aux_loss_scale, z_scale = c_.z_coeff * aux_loss_scale;
  const int64_t n = static_cast<int64_t>(r.lse.size()), E = r.experts, K = r.top_k;
  const double T = static_cast<double>(r.tokens);
  // d aux / d lb[t, e] = E * f_e / (n S), f_e = routed[e] / (n k) over the n tokens of
  // t's load-balancing group (its sequence, of S; or the microbatch, S = 1); f_e is
  // a count: no gradient.
  const double S = static_cast<double>(r.sequences), group_tokens = T / S;
  std::vector<double> aux_dlb(r.routed.size());
  for (size_t i = 0; i < r.routed.size(); ++i)
    aux_dlb[i] = aux_scale * static_cast<double>(E) *
                 (static_cast<double>(r.routed[i]) / (group_tokens * static_cast<double>(K))) / (group_tokens * S);
  const bool normalise = c_.sigmoid ? K > 1 : !c_.pre_softmax;
  const double scaling = c_.scaling > 0 ? c_.scaling : 1.0;
  std::vector<float> dlogits(static_cast<size_t>(n * E));
  std::vector<double> s(static_cast<size_t>(E)), lb(s.size()), ds(s.size());
  for (int64_t t = 0; t < n; ++t) {
    const float* l = r.logits.data() + t * E;
    const double lse = r.lse[static_cast<size_t>(t)];
    const double* dlb = aux_dlb.data() + r.sequence[static_cast<size_t>(t)] * E;
    score_row(c_.sigmoid, l, lse, E, s.data(), lb.data());
    std::fill(ds.begin(), ds.end(), 0.0);
    // The gates: gate_k = scaling * s[e_k] (/ S, S = the chosen scores' sum).
    const int32_t* chosen = r.chosen.data() + t * K;
    const double* dg = slot_dgate.data() + t * K;
    if (normalise) {
      double sum = 0, dg_dot_s = 0;
      for (int64_t k = 0; k < K; ++k) {
        sum += s[static_cast<size_t>(chosen[k])];
        dg_dot_s += dg[k] * s[static_cast<size_t>(chosen[k])];
      }
      if (c_.sigmoid) sum += kSigmoidSumFloor;
      for (int64_t k = 0; k < K; ++k)
        ds[static_cast<size_t>(chosen[k])] += scaling * (dg[k] / sum - dg_dot_s / (sum * sum));
    } else {
      for (int64_t k = 0; k < K; ++k) ds[static_cast<size_t>(chosen[k])] += scaling * dg[k];
    }
    // The load-balancing probabilities: the softmax's are the scores; the sigmoids
    // over their sum, lb_e = s_e / (sum + floor).
    if (!c_.sigmoid) {
      for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += dlb[e];
    } else if (aux_scale != 0.0) {
      double sum = kSigmoidSumFloor, dot = 0;
      for (int64_t e = 0; e < E; ++e) {
        sum += s[static_cast<size_t>(e)];
        dot += dlb[e] * s[static_cast<size_t>(e)];
      }
      for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += dlb[e] / sum - dot / (sum * sum);
    }
    // d lse^2 / d logit_e = 2 lse softmax_e.
    const double dz = z_scale * 2.0 * lse / T;
    if (!c_.sigmoid) {
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += s[static_cast<size_t>(e)] * ds[static_cast<size_t>(e)];
      for (int64_t e = 0; e < E; ++e)
        dlogits[static_cast<size_t>(t * E + e)] =
            static_cast<float>(s[static_cast<size_t>(e)] * (ds[static_cast<size_t>(e)] - dot + dz));
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const double se = s[static_cast<size_t>(e)];
        const double softmax = dz != 0.0 ? std::exp(static_cast<double>(l[e]) - lse) : 0.0;
        dlogits[static_cast<size_t>(t * E + e)] = static_cast<float>(ds[static_cast<size_t>(e)] * se * (1.0 - se) + dz * softmax);
      }
    }
  }
  return dlogits;
}

}  // namespace loom::layers::moe
