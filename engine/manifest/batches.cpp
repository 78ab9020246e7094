// The batch keys step by step (see batches.hpp).
#include "engine/manifest/batches.hpp"

#include <algorithm>
#include <string>

namespace loom::manifest {

bool ramps(const RunConfig::Batch& batch) {
  return batch.rampup_start > 0 && batch.rampup_start < batch.global_batch_size && batch.rampup_increment > 0;
}

int64_t global_batch_at(const RunConfig::Batch& batch, uint64_t consumed) {
  const int64_t global = batch.global_batch_size;
  if (!ramps(batch) || consumed > static_cast<uint64_t>(batch.rampup_samples)) return global;
  const double per_increment = static_cast<double>(batch.rampup_samples) /
                               static_cast<double>((global - batch.rampup_start) / batch.rampup_increment);
  const auto increments = static_cast<int64_t>(static_cast<double>(consumed) / per_increment);
  return std::min(global, batch.rampup_start + increments * batch.rampup_increment);
}

uint64_t samples_before(const RunConfig::Batch& batch, int64_t step, int64_t start_step, uint64_t start_samples) {
  uint64_t consumed = start_samples;
  int64_t at = start_step;
  while (at < step) {
    const int64_t size = global_batch_at(batch, consumed);
    const auto usize = static_cast<uint64_t>(size);
    if (size == batch.global_batch_size) return consumed + static_cast<uint64_t>(step - at) * usize;
    int64_t lo = 1, hi = step - at;  // the segment holds at least the step at `at`
    while (lo < hi) {                // the most steps whose first samples still see `size`
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (global_batch_at(batch, consumed + static_cast<uint64_t>(mid - 1) * usize) == size) lo = mid;
      else hi = mid - 1;
    }
    consumed += static_cast<uint64_t>(lo) * usize;
    at += lo;
  }
  return consumed;
}

int64_t steps_for_samples(const RunConfig::Batch& batch, int64_t train_samples, uint64_t consumed) {
  const auto total = static_cast<uint64_t>(train_samples);
  const auto global = static_cast<uint64_t>(batch.global_batch_size);
  int64_t ramp_steps = 0;
  if (ramps(batch)) {
    // The ramp's steps: those starting at or before both limits, the first step n whose
    // start is past them found by a binary search (samples_before grows with n).
    const uint64_t limit = std::min(total, static_cast<uint64_t>(batch.rampup_samples));
    if (consumed <= limit) {
      int64_t lo = 1, hi = static_cast<int64_t>((limit - consumed) / static_cast<uint64_t>(batch.rampup_start)) + 2;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (samples_before(batch, mid, 0, consumed) > limit) hi = mid;
        else lo = mid + 1;
      }
      ramp_steps = lo;
      consumed = samples_before(batch, lo, 0, consumed);
    }
  }
  return ramp_steps + static_cast<int64_t>(total > consumed ? (total - consumed) / global : 0);
}

std::vector<std::string> untrained_schedule_overrides() {
  return {"batch.rampup_batch_size=[]", "run.train_samples=0", "optimizer.decay_style=\"constant\"",
          "optimizer.weight_decay_incr_style=\"constant\""};
}

bool style_reads(const RunConfig::Optimizer& o, Mark mark) {
  switch (mark) {
    case Mark::Warmup: return true;
    case Mark::Decay: return o.decay_style != "constant";
    case Mark::WsdDecay: return o.decay_style == "wsd";
  }
  return false;
}

bool schedule_in_samples(const RunConfig::Optimizer& o, int64_t train_samples) {
  auto read = [&](int64_t value, Mark mark) { return value > 0 && style_reads(o, mark); };
  const bool samples = read(o.warmup_samples, Mark::Warmup) || read(o.decay_samples, Mark::Decay) ||
                       read(o.wsd_decay_samples, Mark::WsdDecay);
  const bool steps = read(o.warmup_steps, Mark::Warmup) || read(o.decay_steps, Mark::Decay) ||
                     read(o.wsd_decay_steps, Mark::WsdDecay);
  return samples || (train_samples > 0 && !steps);
}

ScheduleMarks schedule_marks(const RunConfig::Optimizer& o, const RunConfig::Batch& batch, int64_t run_steps,
                             int64_t train_samples) {
  ScheduleMarks m;
  m.in_samples = schedule_in_samples(o, train_samples);
  const bool s = m.in_samples;
  // In samples Megatron-LM decays to --train-samples (a last partial batch, not trained, counts).
  m.run_length = !s                ? run_steps
                 : train_samples > 0 ? train_samples
                                     : static_cast<int64_t>(samples_before(batch, run_steps, 0, 0));
  const int64_t decay = s ? o.decay_samples : o.decay_steps;
  m.decay_end = decay > 0 ? decay : m.run_length;
  m.wsd_decay = s ? o.wsd_decay_samples : o.wsd_decay_steps;
  m.warmup = o.warmup_fraction > 0 ? o.warmup_fraction * static_cast<double>(m.decay_end)
                                   : static_cast<double>(s ? o.warmup_samples : o.warmup_steps);
  return m;
}

}  // namespace loom::manifest
