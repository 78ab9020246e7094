// The global batch of each step (see batch_ramp.hpp).
#include "engine/train/batch_ramp.hpp"


namespace loom::train {

BatchRamp::BatchRamp(const manifest::RunConfig::Batch& batch, int64_t dp) : batch_(batch), dp_(dp) {}

std::vector<int64_t> BatchRamp::microbatch_counts() const {
  const int64_t global = batch_.global_batch_size, unit = batch_.micro_batch_size * dp_;
  std::vector<int64_t> counts;
  for (int64_t b = ramps() ? batch_.rampup_start : global; b < global; b += batch_.rampup_increment)
    counts.push_back(b / unit);
  counts.push_back(global / unit);
  return counts;
}

}  // namespace loom::train
