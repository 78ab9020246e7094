// Shared helpers for tests that train small models in-process.
#pragma once

#include "engine/manifest/manifest.hpp"
#include "engine/model/model.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/data.hpp"
#include "engine/train/run_plan.hpp"
#include "engine/train/trainer.hpp"

#include <boost/filesystem.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace loom::testing {

// A tiny GPT on the synthetic addition task: fast enough for CI and sanitizers.
inline std::string tiny_manifest() {
  return R"(
[run]
steps = 10
seed = 7
log_every = 1000
[model]
hidden_size = 32
num_heads = 4
num_layers = 2
seq_length = 16
tie_embeddings = true
[batch]
micro_batch_size = 2
global_batch_size = 8
[optimizer]
lr = 1e-2
warmup_steps = 2
weight_decay = 0.1
clip_grad = 1.0
[data]
kind = "synthetic"
digits = 2
)";
}

// `base` followed by `extra` (overrides of a test case on top of its common ones).
inline std::vector<std::string> with_overrides(std::vector<std::string> base, const std::vector<std::string>& extra) {
  base.insert(base.end(), extra.begin(), extra.end());
  return base;
}

// tiny_manifest() with a small layer/moe configured (4 experts, top 2); a test puts
// it in the model with model.block = ["attention", "moe"].
inline std::string tiny_moe_manifest() {
  return tiny_manifest() + R"(
[model.layer.moe]
num_experts = 4
top_k = 2
ffn_hidden_size = 32
)";
}

inline train::RunPlan plan_from(const std::string& text, const std::vector<std::string>& overrides) {
  return train::make_plan(manifest::Manifest::parse(text, "test.toml", overrides), plugins::registry());
}

// What planning the tiny manifest with `overrides` refuses ("" when it plans).
inline std::string tiny_plan_refusal(const std::vector<std::string>& overrides) {
  try {
    plan_from(tiny_manifest(), overrides);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Runs fn(rank, data, dims) on the one rank of `plan` (its device and comm plugins),
// with the plan's data source and the model dimensions at tp = 1: what tests that build
// a model::Model by hand need.
inline void on_one_rank(const train::RunPlan& plan,
                        const std::function<void(runtime::RankRuntime&, const train::DataSource&,
                                                 const loom_model_dims&)>& fn) {
  auto data = train::make_data_source(plan.config);
  runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.comm_plugin = plan.comm;
  lc.sizes = plan.sizes;
  runtime::launch(lc, [&](runtime::RankRuntime& rt) {
    fn(rt, *data, model::model_dims(plan.config, data->vocab_size(), 1));
  });
}

// Per step: the mean loss and rank 0's parameters (dp replicas are identical).
struct Trace {
  std::vector<double> loss;
  std::vector<std::vector<float>> params;  // after each step, rank 0
  std::vector<std::pair<size_t, size_t>> tensors;  // (offset, numel) of each parameter in params
  std::vector<std::string> names;
  train::TrainResult result;
};

// The model's parameters (CPU device: host memory) as fp32; bf16 ones widened exactly.
inline std::vector<float> params_as_float(const model::Model& m) {
  std::vector<float> p(m.numel());
  if (m.param_dtype() == LOOM_DTYPE_BF16) {
    const uint16_t* h = static_cast<const uint16_t*>(m.params());
    for (size_t i = 0; i < p.size(); ++i) {
      const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
      std::memcpy(&p[i], &bits, sizeof(float));
    }
  } else {
    std::memcpy(p.data(), m.params(), m.numel() * sizeof(float));
  }
  return p;
}

inline Trace run_and_trace(const std::string& text, const std::vector<std::string>& overrides,
                           train::TrainOptions opts = {}) {
  train::RunPlan plan = plan_from(text, overrides);
  Trace t;
  std::mutex mu;
  auto user_cb = opts.on_step;
  opts.on_step = [&](int64_t step, int rank, const model::Model& m) {
    if (user_cb) user_cb(step, rank, m);
    if (rank != 0) return;
    if (t.tensors.empty())
      for (const auto& e : m.param_entries()) {
        t.tensors.emplace_back(e.offset, e.numel);
        t.names.push_back(e.name);
      }
    std::vector<float> p = params_as_float(m);
    std::lock_guard<std::mutex> lock(mu);
    t.params.push_back(std::move(p));
  };
  t.result = train::train(plan, opts);
  for (const auto& s : t.result.steps) t.loss.push_back(s.loss);
  return t;
}

inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = std::fabs(double(a[i]) - double(b[i])) / std::max(1e-3, std::fabs(double(b[i])));
    worst = std::max(worst, d);
  }
  return worst;
}

// The worst, over parameter tensors, of the norm-wise relative difference
// ||a - b|| / ||b||: the measure of "the same training" that stays meaningful for
// elements near zero, where element-wise relative error is ill-conditioned.
inline double max_tensor_rel_diff(const Trace& t, size_t step, const std::vector<float>& other,
                                  std::string* worst_name = nullptr) {
  double worst = 0;
  for (size_t k = 0; k < t.tensors.size(); ++k) {
    const auto [off, n] = t.tensors[k];
    double num = 0, den = 0;
    for (size_t i = off; i < off + n; ++i) {
      const double d = double(other[i]) - double(t.params[step][i]);
      num += d * d;
      den += double(t.params[step][i]) * double(t.params[step][i]);
    }
    const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
    if (rel > worst) {
      worst = rel;
      if (worst_name) *worst_name = t.names[k];
    }
  }
  return worst;
}

// A fresh scratch directory under the build tree.
inline std::string scratch_dir(const std::string& name) {
  boost::filesystem::path p = boost::filesystem::temp_directory_path() /
                              ("loom-test-" + name + "-" + std::to_string(::getpid()));
  boost::filesystem::remove_all(p);
  boost::filesystem::create_directories(p);
  return p.string();
}

}  // namespace loom::testing
