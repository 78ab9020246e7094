// What the batch keys mean step by step: the global batch of each step (a
// batch.rampup_batch_size ramp, as Megatron-LM's --rampup-batch-size and its
// RampupBatchsizeNumMicroBatchesCalculator), the samples consumed before a step, and
// the steps run.train_samples makes (Megatron-LM's --train-samples), and the marks of
// the learning-rate schedule in steps or samples. In the manifest layer because
// run.steps is resolved from them when the manifest is read, and the schema checks the
// schedule's marks.
#pragma once

#include "engine/manifest/run_config.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::manifest {

// Whether the batch ramps (a start below the global batch).
bool ramps(const RunConfig::Batch& batch);

// The global batch (sequences) of a step that starts after `consumed` training
// samples: start + int(consumed / (samples / increments)) * increment (in double, as
// Megatron's float division), the global batch once consumed > samples.
int64_t global_batch_at(const RunConfig::Batch& batch, uint64_t consumed);

// The samples consumed before `step`, from `start_samples` at `start_step`, each step
// consuming its batch (segment by segment of one batch size: a binary search each).
uint64_t samples_before(const RunConfig::Batch& batch, int64_t step, int64_t start_step, uint64_t start_samples);

// The steps of run.train_samples (Megatron-LM's update_train_iters) after `consumed`
// samples (a resume's; 0 = the whole run): on the ramp, each step that starts at or
// before both the ramp's and the run's samples; then whole global batches of what is
// left (a last partial batch dropped).
int64_t steps_for_samples(const RunConfig::Batch& batch, int64_t train_samples, uint64_t consumed = 0);

// The learning-rate and weight-decay schedule's marks in its unit. It counts training
// samples (as Megatron-LM's OptimizerParamScheduler does with --lr-*-samples) when an
// optimizer.*_samples mark the decay style reads is set, or when the run's length is
// run.train_samples and no *_steps mark is (Megatron's --train-samples), and steps
// otherwise. A step's place in it is the step's number or the samples consumed through
// the step (its own batch included), so with a constant batch B a schedule of
// warmup_samples = W * B is the schedule of warmup_steps = W (inverse-square-root's
// max(warmup, 1) counts in the unit: with no warmup it differs).
struct ScheduleMarks {
  bool in_samples = false;
  double warmup = 0;  // optimizer.warmup_*, or warmup_fraction x decay_end (not always whole)
  int64_t decay_end = 0;  // optimizer.decay_*, or the run's length (steps or samples) when 0
  int64_t wsd_decay = 0;
  int64_t run_length = 0;  // run.steps, or run.train_samples (the samples of run.steps) in samples
  const char* unit() const { return in_samples ? "samples" : "steps"; }
  // Where a step stands: its (1-based) number, or the samples consumed through it.
  int64_t position(int64_t step, uint64_t samples) const {
    return in_samples ? static_cast<int64_t>(samples) : step;
  }
};

// The marks a schedule can set, in steps or samples.
enum class Mark { Warmup, Decay, WsdDecay };
bool schedule_in_samples(const RunConfig::Optimizer& o, int64_t train_samples);
// Whether optimizer.decay_style reads a mark: the warmup always, the decay's end but
// under "constant", the final decay under "wsd" only.
bool style_reads(const RunConfig::Optimizer& o, Mark mark);
// run_steps: run.steps as resolved; train_samples: run.train_samples (0 = none).
ScheduleMarks schedule_marks(const RunConfig::Optimizer& o, const RunConfig::Batch& batch, int64_t run_steps,
                             int64_t train_samples);
inline ScheduleMarks schedule_marks(const RunConfig& c) {
  return schedule_marks(c.optimizer, c.batch, c.run.steps, c.run.train_samples);
}

// The --set overrides that make a copy of a training manifest one that trains no
// schedule (generation, evaluation, the steps loom plan --perf measures), whose own
// batches replace the run's: no batch ramp, no run length in samples, constant rates
// (a schedule's checks read the run's length in the batches such a copy changes).
std::vector<std::string> untrained_schedule_overrides();

}  // namespace loom::manifest
