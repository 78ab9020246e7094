// What `loom generate` and `loom eval` run: a trained model named by a checkpoint (a
// step_N directory or a checkpoint.dir; the model of the manifest it saved) or by a
// manifest (whose checkpoint.dir, once it holds a checkpoint, or checkpoint.init_weights
// holds the weights), with
// its weights as whole tensors and a run plan for the command's layout.
#pragma once

#include "engine/plugins/registry.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"

#include <functional>
#include <string>
#include <vector>

namespace loom::cli {

struct ModelSource {
  train::RunPlan plan;
  train::InitialWeights weights;
  int64_t vocab = 0;
};

// Makes the command's plan from a manifest's TOML text (its name for messages) and the
// user's --set overrides.
using PlanFor = std::function<train::RunPlan(const std::string& toml, const std::string& name,
                                             const std::vector<std::string>& overrides, plugins::Registry& registry)>;

// Throws UsageError for a path that is neither a checkpoint nor a manifest, or a
// manifest that names no weights; the plan's and the weights' errors as they come.
// --set may change the layout, micro-batch, device, communication and execution
// (parallel.*, pipeline.*, device.*, comm.*, exec.*, batch.micro_batch_size); any other
// key is a UsageError, and a model the weights do not fit is refused by name.
ModelSource load_model_source(const std::string& path, const std::vector<std::string>& overrides,
                              plugins::Registry& registry, const PlanFor& plan_for);

// The step directory a CHECKPOINT argument names: a step_N directory, or a
// checkpoint.dir's newest complete step (the ones passed over noted on stderr, with
// `doing`, e.g. "exporting"). Throws UsageError for a path that is neither.
std::string checkpoint_step_dir(const std::string& path, const std::string& doing);

}  // namespace loom::cli
