// Schedule plugins that are wrong on purpose, for the engine's schedule checks.
// Each is a plain 1F1B or GPipe order with one deliberate fault:
//
//   pipeline.deadlock       1F1B with the warmups reversed (rank r warms up min(r, M)
//                           forwards): rank 0 wants rank 1's first backward before it
//                           sends the forward rank 1 is waiting for.
//   pipeline.chunk_swap     GPipe whose forwards run the last chunk first: rank 0's
//                           chunk 2 waits for a forward that starts at its own chunk 1.
//   pipeline.backward_first 1F1B, but the last rank starts with a backward.
//   pipeline.short          1F1B minus its last entry.
//   pipeline.extra_forward  1F1B whose last backward became a forward.
//   pipeline.bad_entry      1F1B with a chunk beyond vpp.
#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <utility>

namespace {

// Warmup w, then (forward, backward) pairs, then w backwards, for one chunk.
loom::ScheduleOrder pairs(int32_t m, int32_t w) {
  loom::ScheduleOrder s;
  s.warmup = w;
  for (int32_t i = 0; i < w; ++i) s.order.push_back(1);
  for (int32_t i = w; i < m; ++i) {
    s.order.push_back(1);
    s.order.push_back(-1);
  }
  for (int32_t i = 0; i < w; ++i) s.order.push_back(-1);
  return s;
}

loom::ScheduleOrder plain(const loom_schedule_args& a) {
  return pairs(a.microbatches, std::min(a.pp - a.rank - 1, a.microbatches));
}

loom::ScheduleOrder deadlock(const loom::Options&, const loom_schedule_args& a) {
  return pairs(a.microbatches, std::min(a.rank, a.microbatches));
}

loom::ScheduleOrder chunk_swap(const loom::Options&, const loom_schedule_args& a) {
  loom::ScheduleOrder s;
  s.warmup = a.vpp * a.microbatches;
  for (int32_t c = a.vpp; c >= 1; --c)
    for (int32_t i = 0; i < a.microbatches; ++i) s.order.push_back(c);
  for (int32_t c = a.vpp; c >= 1; --c)
    for (int32_t i = 0; i < a.microbatches; ++i) s.order.push_back(-c);
  return s;
}

loom::ScheduleOrder backward_first(const loom::Options&, const loom_schedule_args& a) {
  loom::ScheduleOrder s = plain(a);
  if (a.rank == a.pp - 1) std::swap(s.order[0], s.order[1]);
  return s;
}

loom::ScheduleOrder short_order(const loom::Options&, const loom_schedule_args& a) {
  loom::ScheduleOrder s = plain(a);
  s.order.pop_back();
  return s;
}

loom::ScheduleOrder extra_forward(const loom::Options&, const loom_schedule_args& a) {
  loom::ScheduleOrder s = plain(a);
  s.order.back() = 1;
  return s;
}

loom::ScheduleOrder bad_entry(const loom::Options&, const loom_schedule_args& a) {
  loom::ScheduleOrder s = plain(a);
  s.order[0] = a.vpp + 1;
  return s;
}

}  // namespace

LOOM_PLUGIN_LIBRARY(
    loom::schedule_plugin<deadlock>("pipeline.deadlock", "0.0.1", "test: 1F1B with reversed warmups (deadlocks)"),
    loom::schedule_plugin<chunk_swap>("pipeline.chunk_swap", "0.0.1", "test: last chunk's forwards first (deadlocks)"),
    loom::schedule_plugin<backward_first>("pipeline.backward_first", "0.0.1",
                                          "test: the last rank starts with a backward"),
    loom::schedule_plugin<short_order>("pipeline.short", "0.0.1", "test: one entry short"),
    loom::schedule_plugin<extra_forward>("pipeline.extra_forward", "0.0.1", "test: one forward too many"),
    loom::schedule_plugin<bad_entry>("pipeline.bad_entry", "0.0.1", "test: a chunk beyond vpp"))
