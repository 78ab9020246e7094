// A rank's optimizer strategy bound to its model: the strategy plugin created over
// the model's flat buffers and the rank's groups, stepped with the run's
// hyperparameters and learning-rate schedule, and its state for checkpoints.
#pragma once

#include "engine/manifest/batches.hpp"
#include "engine/model/model.hpp"
#include "engine/train/run_plan.hpp"

#include <loom/loom_abi.h>

#include <cstdint>
#include <vector>

namespace loom::train {

// Where a step stands in the learning-rate schedule: its (1-based) number and the
// training samples consumed through it, its own batch included.
struct SchedulePoint {
  int64_t step = 0;
  uint64_t samples = 0;
};

// The learning rate at a step, as Megatron-LM's OptimizerParamScheduler computes it:
// linear warmup over optimizer.warmup_steps, then optimizer.decay_style (cosine,
// linear, constant, inverse-square-root, wsd) towards optimizer.min_lr at
// optimizer.decay_steps (0: run.steps), and min_lr after it (but for constant). A
// schedule in samples (manifest::ScheduleMarks) reads the *_samples marks and the
// point's samples instead. Update k uses the rate of step k; Megatron-LM steps its
// scheduler after each update, so its update k uses the rate of step k - 1 (its first,
// init_lr: 0 with a warmup).
double learning_rate(const manifest::RunConfig& config, SchedulePoint at);
// The same with the marks worked out once (schedule_marks walks a batch ramp).
double learning_rate(const manifest::RunConfig::Optimizer& o, const manifest::ScheduleMarks& marks, SchedulePoint at);
// The weight decay at a step, as Megatron-LM's OptimizerParamScheduler.get_wd:
// optimizer.weight_decay under weight_decay_incr_style = "constant"; otherwise from
// start_weight_decay to end_weight_decay over the run's length (marks.run_length,
// counted as the schedule counts), linearly or on a half cosine, end_weight_decay after.
double weight_decay(const manifest::RunConfig::Optimizer& o, const manifest::ScheduleMarks& marks, SchedulePoint at);

class OptimizerBinding {
 public:
  // Creates plan.optimizer's strategy over `model` (which must outlive it). The
  // strategy's capabilities were checked against the model before launch (preflight).
  OptimizerBinding(const RunPlan& plan, runtime::RankRuntime& rank, model::Model& model);
  ~OptimizerBinding();
  OptimizerBinding(const OptimizerBinding&) = delete;
  OptimizerBinding& operator=(const OptimizerBinding&) = delete;

  // Tells the strategy these parameters' gradients are final (ABI 1.15; indices into
  // the model's param_infos); a strategy without grads_ready reduces them in step.
  void grads_ready(const std::vector<size_t>& params);
  // Completes what the last step left running for these parameters (ABI 1.16,
  // overlap_param_gather), or for all of them; no-ops when nothing is running.
  void params_needed(const std::vector<size_t>& params);
  void params_needed_all();
  // Updates the parameters from the finalised gradients for (1-based) `step`.
  loom_optimizer_step_result step(int64_t step, double lr, double weight_decay);
  // The strategy's state (moments, master weights), as its plugin serialises it.
  std::vector<char> save_state() const;
  void load_state(const std::vector<char>& state);

  const loom_optimizer_api* api() const { return api_; }
  loom_optimizer* handle() const { return handle_; }

 private:
  const manifest::RunConfig& config_;
  runtime::RankRuntime& rank_;
  const loom_optimizer_api* api_ = nullptr;
  loom_optimizer* handle_ = nullptr;
  bool gather_running_ = false;  // the last step left its parameter all-gather running
  std::vector<size_t> all_params_;
};

}  // namespace loom::train
