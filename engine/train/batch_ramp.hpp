// The global batch of each step: batch.global_batch_size, or with
// batch.rampup_batch_size = [start, increment, samples] a ramp to it, as
// Megatron-LM's --rampup-batch-size (its RampupBatchsizeNumMicroBatchesCalculator):
// the batch starts at `start` sequences and grows by `increment` each
// samples / ((global - start) / increment) training samples consumed, reaching
// the global batch once `samples` are. The batch depends on the samples consumed
// only, so a resume (consumed_samples in its checkpoint) continues the ramp.
#pragma once

#include "engine/manifest/run_config.hpp"

#include <cstdint>
#include <vector>

namespace loom::train {

class BatchRamp {
 public:
  // The run's batches for `dp` data-parallel ranks (the schema has checked that every
  // batch of the ramp splits into whole microbatches over them).
  BatchRamp(const manifest::RunConfig::Batch& batch, int64_t dp);
  BatchRamp() = default;  // one sample a step, no ramp

  bool ramps() const { return start_ > 0; }

  // The global batch (sequences) of a step that starts after `consumed` samples.
  int64_t global_batch_at(uint64_t consumed) const;
  // Each data-parallel rank's microbatches in that step.
  int64_t microbatches_at(uint64_t consumed) const { return global_batch_at(consumed) / (micro_batch_ * dp_); }

  // The samples consumed before `step`, from `start_samples` at `start_step` (a
  // checkpoint's consumed_samples, or 0 at step 0), each step consuming its batch.
  uint64_t samples_before(int64_t step, int64_t start_step, uint64_t start_samples) const;

  // Every count of microbatches per rank a step can have, ascending (the last that
  // of the whole global batch).
  std::vector<int64_t> microbatch_counts() const;

 private:
  int64_t global_ = 1, micro_batch_ = 1, dp_ = 1;
  int64_t start_ = 0, increment_ = 0;
  double samples_per_increment_ = 0;  // Megatron's rampup_samples_per_increment
  uint64_t ramp_samples_ = 0;
};

}  // namespace loom::train
