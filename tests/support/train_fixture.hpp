// Shared helpers for tests that train small models in-process.
#pragma once

#include "engine/manifest/manifest.hpp"
#include "engine/model/model.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/train/run_plan.hpp"
#include "engine/train/trainer.hpp"

#include <boost/filesystem.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
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

inline train::RunPlan plan_from(const std::string& text, const std::vector<std::string>& overrides) {
  return train::make_plan(manifest::Manifest::parse(text, "test.toml", overrides), plugins::registry());
}

// Per step: the mean loss and rank 0's parameters (dp replicas are identical).
struct Trace {
  std::vector<double> loss;
  std::vector<std::vector<float>> params;  // after each step, rank 0
  train::TrainResult result;
};

inline Trace run_and_trace(const std::string& text, const std::vector<std::string>& overrides,
                           train::TrainOptions opts = {}) {
  train::RunPlan plan = plan_from(text, overrides);
  Trace t;
  std::mutex mu;
  auto user_cb = opts.on_step;
  opts.on_step = [&](int64_t step, int rank, const model::Model& m) {
    if (user_cb) user_cb(step, rank, m);
    if (rank != 0) return;
    std::vector<float> p(m.numel());
    std::memcpy(p.data(), m.params(), m.numel() * sizeof(float));  // CPU device: host memory
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

// A fresh scratch directory under the build tree.
inline std::string scratch_dir(const std::string& name) {
  boost::filesystem::path p = boost::filesystem::temp_directory_path() /
                              ("loom-test-" + name + "-" + std::to_string(::getpid()));
  boost::filesystem::remove_all(p);
  boost::filesystem::create_directories(p);
  return p.string();
}

}  // namespace loom::testing
