// The global batch of each step (see batch_ramp.hpp).
#include "engine/train/batch_ramp.hpp"

#include "engine/train/data.hpp"

#include <algorithm>

namespace loom::train {

BatchRamp::BatchRamp(const manifest::RunConfig::Batch& batch, int64_t dp)
    : global_(batch.global_batch_size), micro_batch_(batch.micro_batch_size), dp_(dp) {
  if (batch.rampup_start <= 0 || batch.rampup_start >= global_) return;
  start_ = batch.rampup_start;
  increment_ = batch.rampup_increment;
  ramp_samples_ = static_cast<uint64_t>(batch.rampup_samples);
  samples_per_increment_ =
      static_cast<double>(batch.rampup_samples) / static_cast<double>((global_ - start_) / increment_);
}

int64_t BatchRamp::global_batch_at(uint64_t consumed) const {
  if (!ramps() || consumed > ramp_samples_) return global_;
  // Megatron's int(consumed_samples / rampup_samples_per_increment), in double as its
  // Python float division.
  const auto increments = static_cast<int64_t>(static_cast<double>(consumed) / samples_per_increment_);
  return std::min(global_, start_ + increments * increment_);
}

uint64_t BatchRamp::samples_before(int64_t step, int64_t start_step, uint64_t start_samples) const {
  uint64_t consumed = start_samples;
  int64_t at = start_step;
  // Segment by segment of one batch size: the steps of a segment are found by a binary
  // search (the batch only grows with the samples consumed).
  while (at < step) {
    const int64_t batch = global_batch_at(consumed);
    if (batch == global_) return train::samples_before(step, at, consumed, global_);
    const auto ub = static_cast<uint64_t>(batch);
    int64_t lo = 1, hi = step - at;  // the segment holds at least the step at `at`
    while (lo < hi) {                // the most steps whose first samples still see `batch`
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (global_batch_at(consumed + static_cast<uint64_t>(mid - 1) * ub) == batch) lo = mid;
      else hi = mid - 1;
    }
    consumed += static_cast<uint64_t>(lo) * ub;
    at += lo;
  }
  return consumed;
}

std::vector<int64_t> BatchRamp::microbatch_counts() const {
  std::vector<int64_t> counts;
  for (int64_t b = ramps() ? start_ : global_; b < global_; b += increment_) counts.push_back(b / (micro_batch_ * dp_));
  counts.push_back(global_ / (micro_batch_ * dp_));
  return counts;
}

}  // namespace loom::train
