// Every rank's parameters after every step, and the full (unpartitioned) tensors
// reassembled from them, for equivalence tests of model-parallel layouts: each
// parameter is found by name on the pipeline stage that holds it and its tp
// slices are put back together, so any tp x pp layout compares with the serial run.
#pragma once

#include "support/train_fixture.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace loom::testing {

struct RankTrace {
  std::vector<double> loss;
  train::TrainResult result;
  std::map<int, std::vector<std::vector<float>>> params;  // rank -> step -> flat buffer
  std::map<int, std::vector<model::ParamEntry>> entries;
  std::map<int, std::vector<model::StateValues>> states;  // rank -> step -> the layers' state (ABI 1.23)
  int tp = 1, cp = 1, dp = 1, pp = 1, ep = 1, etp = 1;
};

inline RankTrace run_all_ranks(const std::string& manifest, const std::vector<std::string>& overrides,
                               train::TrainOptions opts = {}) {
  RankTrace t;
  std::mutex mu;
  opts.on_step = [&](int64_t, int rank, const model::Model& m) {
    std::vector<float> p = params_as_float(m);  // CPU device: host memory; bf16 widened
    std::lock_guard<std::mutex> lock(mu);
    t.params[rank].push_back(std::move(p));
    t.states[rank].push_back(m.layer_states().snapshot());
    if (!t.entries.count(rank)) t.entries[rank] = m.param_entries();
  };
  train::RunPlan plan = plan_from(manifest, overrides);
  t.tp = plan.sizes.tp;
  t.cp = plan.sizes.cp;
  t.pp = plan.sizes.pp;
  t.dp = plan.dp;
  t.ep = plan.sizes.ep;
  t.etp = plan.sizes.etp > 0 ? plan.sizes.etp : plan.sizes.tp;
  t.result = train::train(plan, opts);
  for (const auto& s : t.result.steps) t.loss.push_back(s.loss);
  return t;
}

// How a parameter is matched across layouts: a tied one by its tie key (its name
// depends on which layer holds it on a stage), the others by name.
inline std::string param_key(const model::ParamEntry& e) {
  return e.tie_key.empty() ? e.name : "tied:" + e.tie_key;
}

// Global rank of (tp, dp, pp) coordinates (cp rank 0, or cp_rank) for the default
// order tp-cp-ep-dp-pp.
inline int rank_of(const RankTrace& t, int tp_rank, int dp_rank, int pp_rank, int cp_rank = 0) {
  return tp_rank + cp_rank * t.tp + dp_rank * t.tp * t.cp + pp_rank * t.tp * t.cp * t.dp;
}

// The tensor of `shape` that `slices` partition_dim slices of entry k make up,
// slice r held by global rank holder(r).
inline std::vector<float> assemble_slices(const RankTrace& t, size_t k, size_t step, const std::vector<int64_t>& shape,
                                          int slices, const std::function<int(int)>& holder) {
  const model::ParamEntry& e0 = t.entries.at(holder(0))[k];
  int64_t full_numel = 1;
  for (int64_t d : shape) full_numel *= d;
  std::vector<float> full(static_cast<size_t>(full_numel));
  const int dim = e0.decl.partition_dim;
  if (dim < 0 || slices == 1) {
    const auto& buf = t.params.at(holder(0))[step];
    std::copy(buf.begin() + e0.offset, buf.begin() + e0.offset + e0.numel, full.begin());
    return full;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[d];
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int stride = std::max(1, e0.decl.partition_stride);
  const int64_t block = shape[dim] / stride, part = block / slices;
  for (int r = 0; r < slices; ++r) {
    const int g = holder(r);
    const model::ParamEntry& e = t.entries.at(g)[k];
    const float* src = t.params.at(g)[step].data() + e.offset;
    for (int64_t o = 0; o < outer; ++o)
      for (int s = 0; s < stride; ++s)
        for (int64_t i = 0; i < part * inner; ++i)
          full[(o * shape[dim] + s * block + r * part) * inner + i] = *src++;
  }
  return full;
}

// The full tensor of one entry of a pp stage at a step: from dp rank 0's tp
// slices, or for an expert parameter the blocks of dim 0 that ep ranks 0.. hold,
// each from its etp slices, concatenated. In the default order the expert ranks
// of a stage are etp_rank + etp * ep_rank (+ etp * ep * edp_rank): with etp = tp,
// ep rank q is dp rank q; folded (etp = 1), ep rank q is the stage's rank q.
inline std::vector<float> assemble_tensor(const RankTrace& t, int pp_rank, size_t k, size_t step) {
  const model::ParamEntry& e0 = t.entries.at(rank_of(t, 0, 0, pp_rank))[k];
  if (!e0.expert)
    return assemble_slices(t, k, step, e0.full_shape, t.tp, [&](int r) { return rank_of(t, r, 0, pp_rank); });
  std::vector<int64_t> block = e0.full_shape;
  block[0] /= t.ep;
  std::vector<float> full;
  for (int q = 0; q < t.ep; ++q) {
    const std::vector<float> part = assemble_slices(
        t, k, step, block, t.etp, [&](int r) { return r + q * t.etp + pp_rank * t.tp * t.cp * t.dp; });
    full.insert(full.end(), part.begin(), part.end());
  }
  return full;
}

// Every parameter at a step, full tensors by param_key. A key held by several
// stages (a tied embedding) comes from the first stage holding it.
inline std::map<std::string, std::vector<float>> full_params(const RankTrace& t, size_t step) {
  std::map<std::string, std::vector<float>> out;
  for (int p = 0; p < t.pp; ++p) {
    const auto& entries = t.entries.at(rank_of(t, 0, 0, p));
    for (size_t k = 0; k < entries.size(); ++k)
      if (!out.count(param_key(entries[k]))) out[param_key(entries[k])] = assemble_tensor(t, p, k, step);
  }
  return out;
}

// The param_keys of tensors that start at zero (biases, LayerNorm shifts). After
// the first Adam step such a tensor is nothing but its update lr*g/(|g| + eps),
// whose slope near |g| = eps turns summation-order differences of the gradient
// into the largest relative differences of any step (docs/design-notes.md, "What
// equal means"); equivalence tests may give them a looser bound at step 1.
inline std::set<std::string> zero_initialised(const RankTrace& t) {
  std::set<std::string> out;
  for (int p = 0; p < t.pp; ++p)
    for (const model::ParamEntry& e : t.entries.at(rank_of(t, 0, 0, p)))
      if (e.decl.init == LOOM_INIT_ZEROS) out.insert(param_key(e));
  return out;
}

// Runs `overrides` and returns what each rank's Model declares it holds per
// microbatch (Model::activation_bytes, what `loom plan` sizes); the run's result
// goes to *result when given.
inline std::map<int, uint64_t> declared_activation_bytes(const std::string& manifest,
                                                         const std::vector<std::string>& overrides,
                                                         train::TrainResult* result = nullptr) {
  std::map<int, uint64_t> declared;
  std::mutex mu;
  train::TrainOptions opts;
  opts.on_step = [&](int64_t, int rank, const model::Model& m) {
    std::lock_guard<std::mutex> lock(mu);
    declared[rank] = m.activation_bytes();
  };
  auto trace = run_and_trace(manifest, overrides, opts);
  if (result) *result = std::move(trace.result);
  return declared;
}

// ||a - b|| / ||b|| over the elements both have: the padded vocabulary grows
// with tp (a multiple of vocab_divisor * tp), and the real rows come first.
inline double tensor_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// A parallel run trains as its serial reference (design-notes: what "equal" means):
// every loss within tol, relative, the gradient norm (below), and every whole parameter tensor
// (gathered over the ranks) within tol, norm-wise; at the first step a
// zero-initialised tensor (a bias: all Adam update then, the most amplified case)
// within 10 tol.
inline void expect_trains_as_serial(const RankTrace& serial, const RankTrace& par, double tol = 1e-5) {
  ASSERT_GE(serial.loss.size(), 10u);
  ASSERT_EQ(par.loss.size(), serial.loss.size());
  const std::set<std::string> zero_init = zero_initialised(serial);
  for (size_t s = 0; s < serial.loss.size(); ++s) {
    EXPECT_NEAR(par.loss[s], serial.loss[s], tol * std::fabs(serial.loss[s])) << "loss at step " << s + 1;
    // The norm the clipping uses counts every parameter once (tp-duplicated ones too):
    // at the first step within tol; later, its drift compounds like the parameters'.
    const double gn = serial.result.steps[s].grad_norm;
    EXPECT_NEAR(par.result.steps[s].grad_norm, gn, (s == 0 ? 1 : 10) * tol * gn) << "gradient norm at step " << s + 1;
    const auto want = full_params(serial, s), got = full_params(par, s);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [key, w] : want) {
      ASSERT_TRUE(got.count(key)) << key << " is on no rank";
      const double bound = s == 0 && zero_init.count(key) ? 10 * tol : tol;
      EXPECT_LE(tensor_rel_diff(got.at(key), w), bound) << key << " at step " << s + 1;
    }
  }
}

// Two runs of one model that must compute the same thing (partial graphs or
// recomputation against eager): every loss, and every rank's final buffer, bit for bit.
inline void expect_bit_identical(const RankTrace& a, const RankTrace& b) {
  ASSERT_EQ(a.loss.size(), b.loss.size());
  for (size_t s = 0; s < a.loss.size(); ++s) EXPECT_EQ(a.loss[s], b.loss[s]) << "loss at step " << s + 1;
  for (const auto& [rank, steps] : a.params) EXPECT_EQ(b.params.at(rank).back(), steps.back()) << "rank " << rank;
}

// A lower-precision (bf16) parallel run tracks its serial reference: the first
// loss within first_loss_tol and the first gradient norm within grad_norm_tol
// (relative: before the runs' last bits compound), every loss within loss_tol.
inline void expect_tracks(const RankTrace& reference, const RankTrace& run, double first_loss_tol,
                          double grad_norm_tol, double loss_tol) {
  ASSERT_EQ(run.loss.size(), reference.loss.size());
  ASSERT_FALSE(reference.loss.empty());
  EXPECT_NEAR(run.loss[0], reference.loss[0], first_loss_tol * reference.loss[0]);
  const double gn = reference.result.steps[0].grad_norm;
  EXPECT_NEAR(run.result.steps[0].grad_norm, gn, grad_norm_tol * gn);
  for (size_t s = 0; s < reference.loss.size(); ++s)
    EXPECT_NEAR(run.loss[s], reference.loss[s], loss_tol * reference.loss[s]) << "loss at step " << s + 1;
}

// A run with bf16 parameters and activations (fp32 gradients) tracks its fp32 twin
// within the CPU tests' bounds for the GPT-2 blocks (the first loss within 1%, every
// loss within 5%), and is not the fp32 run itself.
inline void expect_bf16_tracks_fp32(const RankTrace& fp32, const RankTrace& bf16) {
  expect_tracks(fp32, bf16, 0.01, 0.05, 0.05);
  bool differs = false;
  for (size_t s = 0; s < fp32.loss.size() && s < bf16.loss.size(); ++s) differs |= fp32.loss[s] != bf16.loss[s];
  EXPECT_TRUE(differs) << "bf16 losses equal to fp32's bit for bit: bf16 was not applied";
}

}  // namespace loom::testing
