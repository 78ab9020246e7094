// parallel/pipeline.1f1b: the one-forward-one-backward schedule (vpp = 1).
//
// Rank r first runs W = min(pp - r - 1, M) warmup forwards, then alternates one
// forward and one backward, then runs the W backwards left over. Refuses vpp != 1.
#include <loom/cpp/plugin.hpp>

#include "../pipeline_common/schedule_math.hpp"

namespace {

loom::ScheduleOrder order(const loom::Options&, const loom_schedule_args& args) {
  return loom::pipeline_schedule::one_f_one_b(args);
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::schedule_plugin<order>(
    "pipeline.1f1b", "1.0.0", "1F1B pipeline schedule: warmup forwards, forward/backward pairs, cooldown"))
