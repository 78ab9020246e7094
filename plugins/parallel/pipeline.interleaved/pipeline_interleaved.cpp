// parallel/pipeline.interleaved: Megatron-LM's interleaved 1F1B (vpp > 1).
//
// Every rank holds vpp model chunks; local chunk c of rank r is global stage
// (c - 1) * pp + r. Forwards follow Megatron's schedule table (microbatches in
// groups of N = pipeline.microbatch_group_size, 0 meaning pp; per group chunk 1 for
// each microbatch, then chunk 2, ...); rank r runs W = (pp - r - 1) * 2 + (vpp - 1) * N
// warmup forwards (at most M * vpp), then forward/backward pairs, then the last W
// backwards. Refuses what Megatron refuses: pp = 1, N outside [pp, M], and
// M mod N in 1..pp-1.
#include <loom/cpp/plugin.hpp>

#include "../pipeline_common/schedule_math.hpp"

namespace {

loom::ScheduleOrder order(const loom::Options&, const loom_schedule_args& args) {
  return loom::pipeline_schedule::interleaved(args);
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::schedule_plugin<order>(
    "pipeline.interleaved", "1.0.0",
    "interleaved 1F1B pipeline schedule with virtual chunks (Megatron's schedule table)"))
