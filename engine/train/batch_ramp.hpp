// Each step's global batch and microbatches for a data-parallel size: the batch keys
// as engine/manifest/batches.hpp reads them (batch.rampup_batch_size: Megatron-LM's
// --rampup-batch-size). The batch depends on the samples consumed only, so a resume
// (consumed_samples in its checkpoint) continues the ramp.
#pragma once

#include "engine/manifest/batches.hpp"
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

  bool ramps() const { return manifest::ramps(batch_); }

  // The global batch (sequences) of a step that starts after `consumed` samples.
  int64_t global_batch_at(uint64_t consumed) const { return manifest::global_batch_at(batch_, consumed); }
  // Each data-parallel rank's microbatches in that step.
  int64_t microbatches_at(uint64_t consumed) const {
    return global_batch_at(consumed) / (batch_.micro_batch_size * dp_);
  }

  // The samples consumed before `step`, from `start_samples` at `start_step` (a
  // checkpoint's consumed_samples, or 0 at step 0), each step consuming its batch.
  uint64_t samples_before(int64_t step, int64_t start_step, uint64_t start_samples) const {
    return manifest::samples_before(batch_, step, start_step, start_samples);
  }

  // Every count of microbatches per rank a step can have, ascending (the last that
  // of the whole global batch).
  std::vector<int64_t> microbatch_counts() const;

 private:
  manifest::RunConfig::Batch batch_;
  int64_t dp_ = 1;
};

}  // namespace loom::train
