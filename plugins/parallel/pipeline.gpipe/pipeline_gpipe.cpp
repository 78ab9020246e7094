// parallel/pipeline.gpipe: all forwards, then all backwards.
//
// Forwards run chunk by chunk (every microbatch of chunk 1, then of chunk 2, ...),
// backwards in reverse chunk order. Simple and bubble-heavy; it keeps every
// microbatch's activations alive at once, so it is mostly a reference schedule.
#include <loom/cpp/plugin.hpp>

#include "../pipeline_common/schedule_math.hpp"

namespace {

loom::ScheduleOrder order(const loom::Options&, const loom_schedule_args& args) {
  return loom::pipeline_schedule::gpipe(args);
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::schedule_plugin<order>(
    "pipeline.gpipe", "1.0.0", "GPipe pipeline schedule: every forward, then every backward"))
