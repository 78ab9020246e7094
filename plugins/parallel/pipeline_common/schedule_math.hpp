// The orders of the built-in pipeline schedules (Megatron-LM's `megatron/core/pipeline_parallel/schedules.py`),
// shared by the parallel/pipeline.* plugins. Header-only; no CMakeLists here.
//
// An order is one rank's list of signed local chunks: +c runs the forward of local
// chunk c (1-based), -c its backward. The j-th +c is microbatch j of chunk c, and the
// j-th -c is the backward of microbatch j of chunk c, so an order never names
// microbatches: every schedule here keeps each chunk's microbatches in order.
#pragma once

#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::pipeline_schedule {

// Checks what every schedule needs: sizes at least 1 and a rank inside the pipeline.
inline void check_args(const char* plugin, const loom_schedule_args& a) {
  LOOM_REQUIRE(a.struct_size >= offsetof(loom_schedule_args, rank) + sizeof(a.rank),
               plugin << ": schedule arguments are too small (struct_size " << a.struct_size
                      << "); the engine and the plugin disagree about the ABI");
  LOOM_REQUIRE(a.pp >= 1, plugin << ": pp must be at least 1, got pp = " << a.pp);
  LOOM_REQUIRE(a.vpp >= 1, plugin << ": vpp must be at least 1, got vpp = " << a.vpp);
  LOOM_REQUIRE(a.microbatches >= 1,
               plugin << ": microbatches must be at least 1, got microbatches = " << a.microbatches);
  LOOM_REQUIRE(a.group_size >= 0,
               plugin << ": microbatch group size must be 0 (meaning pp) or positive, got "
                      << a.group_size);
  LOOM_REQUIRE(a.rank >= 0 && a.rank < a.pp,
               plugin << ": rank " << a.rank << " is outside the pipeline of pp = " << a.pp
                      << " ranks (0.." << a.pp - 1 << ")");
  const int64_t entries = int64_t{2} * a.vpp * a.microbatches;
  LOOM_REQUIRE(entries <= INT32_MAX, plugin << ": 2 * vpp * microbatches = " << entries
                                            << " entries is too long an order");
}

// The microbatch group size N: 0 means pp.
inline int32_t group_size(const loom_schedule_args& a) { return a.group_size == 0 ? a.pp : a.group_size; }

// 1F1B (PipeDream-flush, Megatron's forward_backward_pipelining_without_interleaving):
// W = min(pp - rank - 1, M) warmup forwards, then (forward, backward) pairs, then W
// backwards. With pp = 1 this is [+1, -1] * M.
inline ScheduleOrder one_f_one_b(const loom_schedule_args& a) {
  constexpr const char* kName = "parallel/pipeline.1f1b";
  check_args(kName, a);
  LOOM_REQUIRE(a.vpp == 1, kName << ": 1F1B runs one model chunk per rank and needs vpp = 1, got vpp = "
                                 << a.vpp << "; use schedule 'interleaved' (or 'gpipe') for vpp > 1");
  const int32_t m = a.microbatches;
  const int32_t w = std::min(a.pp - a.rank - 1, m);
  ScheduleOrder s;
  s.warmup = w;
  s.order.reserve(static_cast<size_t>(2 * m));
  for (int32_t i = 0; i < w; ++i) s.order.push_back(1);
  for (int32_t i = w; i < m; ++i) {
    s.order.push_back(1);
    s.order.push_back(-1);
  }
  for (int32_t i = 0; i < w; ++i) s.order.push_back(-1);
  return s;
}

// One entry of Megatron's schedule table (get_schedule_table): 0-based.
struct TableEntry {
  int32_t microbatch;
  int32_t chunk;
};

// Megatron's get_schedule_table: microbatches in groups of n; within a group, chunk 0
// for every microbatch of the group, then chunk 1, ...; the last group may be shorter.
inline std::vector<TableEntry> schedule_table(int32_t microbatches, int32_t chunks, int32_t n) {
  std::vector<TableEntry> table;
  table.reserve(static_cast<size_t>(microbatches) * static_cast<size_t>(chunks));
  for (int32_t first = 0; first < microbatches; first += n) {
    const int32_t end = std::min(first + n, microbatches);
    for (int32_t c = 0; c < chunks; ++c)
      for (int32_t mb = first; mb < end; ++mb) table.push_back({mb, c});
  }
  return table;
}

// Interleaved 1F1B (Megatron's forward_backward_pipelining_with_interleaving, turned
// into an order as convert_schedule_table_to_order does): entry j of the table is the
// j-th forward on every rank, backward j runs chunk V-1-table[j].chunk; warmup
// W = (pp - rank - 1) * 2 + (V - 1) * N capped at M * V; then W forwards, then
// (forward W + j, backward j) pairs, then the last W backwards.
inline ScheduleOrder interleaved(const loom_schedule_args& a) {
  constexpr const char* kName = "parallel/pipeline.interleaved";
  check_args(kName, a);
  const int32_t p = a.pp, v = a.vpp, m = a.microbatches, n = group_size(a);
  LOOM_REQUIRE(p > 1, kName << ": the interleaved schedule needs pp > 1, got pp = " << p
                            << "; use schedule '1f1b' (vpp = 1) or 'gpipe' without pipeline stages");
  LOOM_REQUIRE(v > 1, kName << ": the interleaved schedule needs vpp > 1 (virtual chunks per rank), got vpp = "
                            << v << "; use schedule '1f1b' for vpp = 1");
  LOOM_REQUIRE(n >= p && n <= m,
               kName << ": the microbatch group size N must satisfy pp <= N <= microbatches (Megatron's "
                     << "microbatch_group_size_per_vp_stage rule), got N = " << n << ", pp = " << p
                     << ", microbatches = " << m << "; set pipeline.microbatch_group_size (0 means pp) "
                     << "or the number of microbatches accordingly");
  const int32_t last = m % n;
  LOOM_REQUIRE(last == 0 || last >= p,
               kName << ": microbatches mod N must be 0 or at least pp (a shorter last group "
                     << "leaves dependency bubbles), got microbatches = " << m << ", N = " << n
                     << ", remainder " << last << " < pp = " << p
                     << "; use a multiple of N microbatches or a remainder of at least pp");

  const std::vector<TableEntry> table = schedule_table(m, v, n);
  const int64_t total = static_cast<int64_t>(table.size());
  const int64_t w = std::min<int64_t>(int64_t{p - a.rank - 1} * 2 + int64_t{v - 1} * n, total);
  auto fwd = [&](int64_t j) { return table[static_cast<size_t>(j)].chunk + 1; };
  auto bwd = [&](int64_t j) { return -(v - table[static_cast<size_t>(j)].chunk); };

  ScheduleOrder s;
  s.warmup = static_cast<int32_t>(w);
  s.order.reserve(static_cast<size_t>(2 * total));
  for (int64_t j = 0; j < w; ++j) s.order.push_back(fwd(j));
  for (int64_t j = w; j < total; ++j) {
    s.order.push_back(fwd(j));
    s.order.push_back(bwd(j - w));
  }
  for (int64_t j = total - w; j < total; ++j) s.order.push_back(bwd(j));
  return s;
}

// GPipe: every forward first (chunk-major: all microbatches of chunk 1, then chunk 2,
// ...), then every backward in reverse chunk order. Warmup = all forwards.
inline ScheduleOrder gpipe(const loom_schedule_args& a) {
  check_args("parallel/pipeline.gpipe", a);
  const int32_t v = a.vpp, m = a.microbatches;
  ScheduleOrder s;
  s.warmup = v * m;
  s.order.reserve(static_cast<size_t>(2 * v * m));
  for (int32_t c = 1; c <= v; ++c)
    for (int32_t i = 0; i < m; ++i) s.order.push_back(c);
  for (int32_t c = v; c >= 1; --c)
    for (int32_t i = 0; i < m; ++i) s.order.push_back(-c);
  return s;
}

}  // namespace loom::pipeline_schedule
