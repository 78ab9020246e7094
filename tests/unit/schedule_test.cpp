// Pipeline schedules: the built-in plugins' orders against a worked example of
// Megatron-LM's interleaved 1F1B (pp 4, vpp 2, 8 microbatches; megatron/core/
// pipeline_parallel/schedules.py) and hand-derived cases, Megatron's acceptance rules, the engine's
// order validation and deadlock simulation (with deliberately broken plugins from
// tests/pipeline/), the Chrome trace, and `loom schedule`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "engine/pipeline/schedule.hpp"
#include "engine/plugins/registry.hpp"
#include "support/json_line.hpp"

namespace loom::cli {
int cmd_schedule(int argc, char** argv);
}

namespace {

using loom::pipeline::PipelineOrders;
using loom::pipeline::ScheduleError;
using Order = std::vector<int32_t>;

const std::string kBrokenDir = std::string(LOOM_TEST_BUILD_DIR) + "/tests/pipeline/plugins";

loom::plugins::Registry& registry() {
  static loom::plugins::Registry* r = [] {
    loom::plugins::host_api();
    auto* reg = new loom::plugins::Registry();
    for (const char* name : {"1f1b", "interleaved", "gpipe"})
      reg->load_file(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_parallel_pipeline_" + name + ".so");
    reg->load_file(kBrokenDir + "/loom_parallel_pipeline_broken.so");
    return reg;
  }();
  return *r;
}

PipelineOrders orders(const std::string& name, int pp, int vpp, int m, int n = 0) {
  return loom::pipeline::compute_orders(registry().get("parallel", "pipeline." + name), nullptr, pp, vpp, m, n);
}

// The error compute_orders (and then simulate) raises, or a failure when none.
ScheduleError error_of(const std::string& name, int pp, int vpp, int m, int n = 0) {
  try {
    loom::pipeline::simulate(orders(name, pp, vpp, m, n));
  } catch (const ScheduleError& e) {
    return e;
  }
  ADD_FAILURE() << name << " pp " << pp << " vpp " << vpp << " m " << m << " n " << n << " raised no error";
  return ScheduleError(ScheduleError::Kind::refused, "(no error)");
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---------------------------------------------------------------------------
// Independent references (not the plugins' code)
// ---------------------------------------------------------------------------

// Warmup forwards per rank, as Megatron-LM computes num_warmup_microbatches in
// megatron/core/pipeline_parallel/schedules.py.
int warmup_1f1b(int pp, int m, int r) { return std::min(pp - r - 1, m); }
int warmup_interleaved(int pp, int v, int m, int n, int r) {
  return std::min((pp - r - 1) * 2 + (v - 1) * n, m * v);
}

// 0-based chunk of the k-th forward of the schedule table, in closed form: full groups
// of n microbatches hold n * v entries (chunk = position in group / n); the last,
// shorter group of m mod n microbatches holds (m mod n) * v.
int table_chunk(int k, int m, int v, int n) {
  const int full = m / n;
  if (k < full * n * v) return (k % (n * v)) / n;
  return (k - full * n * v) / (m % n);
}

// An interleaved order built from that closed form: W forwards, pairs, W backwards.
Order reference_interleaved(int pp, int v, int m, int n, int r) {
  const int total = m * v, w = warmup_interleaved(pp, v, m, n, r);
  auto f = [&](int k) { return table_chunk(k, m, v, n) + 1; };
  auto b = [&](int k) { return -(v - table_chunk(k, m, v, n)); };
  Order o;
  for (int k = 0; k < w; ++k) o.push_back(f(k));
  for (int k = w; k < total; ++k) {
    o.push_back(f(k));
    o.push_back(b(k - w));
  }
  for (int k = total - w; k < total; ++k) o.push_back(b(k));
  return o;
}

// For n = pp and m a multiple of pp, Megatron's older get_model_chunk_id must agree:
// virtual microbatch k runs chunk (k mod (pp * v)) / pp forward, v - 1 - that backward.
int old_megatron_chunk(int k, int pp, int v, bool forward) {
  const int c = (k % (pp * v)) / pp;
  return forward ? c : v - 1 - c;
}

// Checks what a timeline must satisfy whatever the schedule: steps of one rank in
// order without overlap, and every step starting after its inputs finished.
void expect_consistent_timeline(const PipelineOrders& o, const loom::pipeline::Timeline& t) {
  const int pp = o.pp, gcount = o.pp * o.vpp;
  std::map<std::tuple<bool, int, int>, int64_t> finish;
  for (const auto& rank : t.ranks)
    for (const auto& s : rank) finish[{s.forward, s.global_chunk, s.microbatch}] = s.start + s.duration;
  ASSERT_EQ(finish.size(), static_cast<size_t>(2 * gcount * o.microbatches));
  for (int r = 0; r < pp; ++r) {
    const auto& steps = t.ranks[static_cast<size_t>(r)];
    ASSERT_EQ(steps.size(), o.order[static_cast<size_t>(r)].size());
    int64_t clock = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const auto& s = steps[i];
      EXPECT_EQ(s.index, static_cast<int>(i));
      EXPECT_EQ(s.entry, o.order[static_cast<size_t>(r)][i]);
      EXPECT_EQ(s.global_chunk, (s.chunk - 1) * pp + r);
      EXPECT_GE(s.start, clock) << "rank " << r << " step " << i << " overlaps its predecessor";
      clock = s.start + s.duration;
      if (s.forward && s.global_chunk > 0) {
        EXPECT_GE(s.start, (finish[{true, s.global_chunk - 1, s.microbatch}]));
      }
      if (!s.forward) {
        EXPECT_GE(s.start, (finish[{true, s.global_chunk, s.microbatch}]));
        if (s.global_chunk + 1 < gcount) {
          EXPECT_GE(s.start, (finish[{false, s.global_chunk + 1, s.microbatch}]));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// A worked example: interleaved 1F1B, pp 4, vpp 2, 8 microbatches, rank 0
// ---------------------------------------------------------------------------

TEST(ScheduleWorkedExample, InterleavedPp4Vpp2Mb8Rank0) {
  const PipelineOrders o = orders("interleaved", 4, 2, 8);
  EXPECT_EQ(o.group_size, 4);  // 0 means pp
  const Order expected = {1, 1, 1, 1, 2, 2, 2, 2, 1, 1,                       // warmup
                          1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1,           // steady 1F1B
                          -1, -1, -2, -2, -2, -2, -1, -1, -1, -1};            // cooldown
  EXPECT_EQ(o.order[0], expected);
  EXPECT_EQ(o.warmup[0], 10);
  // Every rank: the formula's warmup, a valid order, and no deadlock.
  const std::vector<int32_t> warmups = {10, 8, 6, 4};
  EXPECT_EQ(o.warmup, warmups);
  const auto t = loom::pipeline::simulate(o);
  expect_consistent_timeline(o, t);
  // The paper's bubble for interleaving with one slot per chunk step: (pp - 1) forward
  // and (pp - 1) backward slots, i.e. a makespan of 2 * v * m + 2 * (pp - 1).
  EXPECT_EQ(t.makespan, 2 * 2 * 8 + 2 * 3);
}

TEST(ScheduleWorkedExample, AListingThatBackwardsChunk1TooEarlyIsNotTheOrder) {
  // A plausible but wrong listing (…, 1, -1, 1, -1, 2, -2, …): in Megatron-LM's order the
  // steady state's first backward is of the last chunk (-2), not chunk 1.
  const Order wrong_listing = {1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, -1, 1, -1, 2, -2, 2, -2, 2, -1, 2, -1,
                              -2, -2, -1, -1, -2, -2, -1, -1, -2, -2};
  EXPECT_NE(orders("interleaved", 4, 2, 8).order[0], wrong_listing);
}

// ---------------------------------------------------------------------------
// Hand-derived orders
// ---------------------------------------------------------------------------

TEST(ScheduleOneFOneB, HandDerivedOrders) {
  const PipelineOrders a = orders("1f1b", 4, 1, 8);
  EXPECT_EQ(a.order[0], (Order{1, 1, 1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, -1, -1, -1}));
  EXPECT_EQ(a.order[2], (Order{1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, -1}));
  EXPECT_EQ(a.order[3], (Order{1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1}));
  EXPECT_EQ(a.warmup, (std::vector<int32_t>{3, 2, 1, 0}));

  // Fewer microbatches than stages: warmup capped at M.
  const PipelineOrders b = orders("1f1b", 4, 1, 2);
  EXPECT_EQ(b.order[0], (Order{1, 1, -1, -1}));
  EXPECT_EQ(b.order[1], (Order{1, 1, -1, -1}));
  EXPECT_EQ(b.order[2], (Order{1, 1, -1, -1}));
  EXPECT_EQ(b.order[3], (Order{1, -1, 1, -1}));
  EXPECT_EQ(b.warmup, (std::vector<int32_t>{2, 2, 1, 0}));

  // No pipeline: forward then backward of each microbatch.
  const PipelineOrders c = orders("1f1b", 1, 1, 3);
  EXPECT_EQ(c.order[0], (Order{1, -1, 1, -1, 1, -1}));
  EXPECT_EQ(c.warmup[0], 0);

  // 1F1B with one slot per step: (m + pp - 1) forward/backward pairs of slots.
  const auto t = loom::pipeline::simulate(a);
  EXPECT_EQ(t.makespan, 2 * (8 + 4 - 1));
  EXPECT_DOUBLE_EQ(t.bubble_fraction(), 3.0 / 11.0);
}

TEST(ScheduleInterleaved, HandDerivedOrders) {
  // pp 2, vpp 2, M 4, N 2: table (mb, chunk) = (0,0)(1,0)(0,1)(1,1)(2,0)(3,0)(2,1)(3,1).
  const PipelineOrders a = orders("interleaved", 2, 2, 4, 2);
  EXPECT_EQ(a.order[0], (Order{1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1}));
  EXPECT_EQ(a.order[1], (Order{1, 1, 2, -2, 2, -2, 1, -1, 1, -1, 2, -2, 2, -2, -1, -1}));
  EXPECT_EQ(a.warmup, (std::vector<int32_t>{4, 2}));

  // A shorter last group (Megatron allows M mod N >= pp): pp 2, vpp 2, M 5, N 3.
  const PipelineOrders b = orders("interleaved", 2, 2, 5, 3);
  EXPECT_EQ(b.order[0], (Order{1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1}));
  EXPECT_EQ(b.order[1], (Order{1, 1, 1, 2, -2, 2, -2, 2, -2, 1, -1, 1, -1, 2, -1, 2, -2, -2, -1, -1}));
  EXPECT_EQ(b.warmup, (std::vector<int32_t>{5, 3}));
  loom::pipeline::simulate(b);

  // All forwards fit in the warmup: rank 0 of pp 2, vpp 3, M 2, N 2 (W = 2 + 4 = 6 = M * V).
  const PipelineOrders c = orders("interleaved", 2, 3, 2, 2);
  EXPECT_EQ(c.order[0], (Order{1, 1, 2, 2, 3, 3, -3, -3, -2, -2, -1, -1}));
  EXPECT_EQ(c.warmup[0], 6);
}

TEST(ScheduleGpipe, HandDerivedOrders) {
  const PipelineOrders a = orders("gpipe", 2, 2, 3);
  EXPECT_EQ(a.order[0], (Order{1, 1, 1, 2, 2, 2, -2, -2, -2, -1, -1, -1}));
  EXPECT_EQ(a.order[1], a.order[0]);
  EXPECT_EQ(a.warmup, (std::vector<int32_t>{6, 6}));
  const PipelineOrders b = orders("gpipe", 3, 1, 4);
  EXPECT_EQ(b.order[2], (Order{1, 1, 1, 1, -1, -1, -1, -1}));
  const auto t = loom::pipeline::simulate(b);
  EXPECT_EQ(t.makespan, 2 * (4 + 3 - 1));
  expect_consistent_timeline(b, t);
}

// ---------------------------------------------------------------------------
// Many combinations: acceptance rules, formulas, validation, no deadlock
// ---------------------------------------------------------------------------

// The point-to-point messages pipeline::Executor issues for these orders (its
// rules, restated: a forward of global chunk g > 0 receives tag 2g from the rank of
// g - 1, then sends tag 2(g + 1) to the rank of g + 1 unless g is last; a backward
// receives tag 2g + 1 from the rank of g + 1 unless g is last, then sends tag
// 2(g - 1) + 1 to the rank of g - 1 unless g = 0), as the tag sequences sent and
// received per (sender, receiver, tag parity). comm/nccl gives each such triple one
// channel whose messages match in order, whatever their tags: the orders must send
// and receive each triple's tags in the same sequence.
using TagStreams = std::map<std::tuple<int, int, int>, std::vector<int>>;
std::pair<TagStreams, TagStreams> p2p_tag_streams(const PipelineOrders& o, bool by_parity = true) {
  TagStreams sent, received;
  const int last = o.pp * o.vpp - 1;
  for (int r = 0; r < o.pp; ++r)
    for (int32_t e : o.order[static_cast<size_t>(r)]) {
      const int g = (std::abs(e) - 1) * o.pp + r;
      auto msg = [&](int src, int dst, int tag, TagStreams& into) {
        into[{src, dst, by_parity ? tag & 1 : 0}].push_back(tag);
      };
      if (e > 0) {
        if (g > 0) msg((g - 1) % o.pp, r, 2 * g, received);
        if (g < last) msg(r, (g + 1) % o.pp, 2 * (g + 1), sent);
      } else {
        if (g < last) msg((g + 1) % o.pp, r, 2 * g + 1, received);
        if (g > 0) msg(r, (g - 1) % o.pp, 2 * (g - 1) + 1, sent);
      }
    }
  return {sent, received};
}

TEST(ScheduleAll, MessagesOfOneTagParityAreReceivedInTheOrderSent) {
  int checked = 0;
  for (int pp = 2; pp <= 5; ++pp)
    for (int v = 1; v <= 3; ++v)
      for (int m = 1; m <= 12; ++m)
        for (const char* name : {"1f1b", "gpipe", "interleaved"})
          for (int n0 = 0; n0 <= (std::string(name) == "interleaved" ? 8 : 0); ++n0) {
            const int n = n0 == 0 ? pp : n0;
            if (std::string(name) == "1f1b" && v != 1) continue;
            if (std::string(name) == "interleaved" &&
                !(v > 1 && n >= pp && n <= m && (m % n == 0 || m % n >= pp)))
              continue;
            SCOPED_TRACE(std::string(name) + " pp " + std::to_string(pp) + " vpp " + std::to_string(v) + " m " +
                         std::to_string(m) + " n " + std::to_string(n));
            const auto [sent, received] = p2p_tag_streams(orders(name, pp, v, m, n0));
            EXPECT_EQ(sent, received);
            ++checked;
          }
  EXPECT_GT(checked, 300);
  // The check can fail: one channel per pair for both parities would mix them up here.
  const auto [sent, received] = p2p_tag_streams(orders("interleaved", 2, 2, 4, 4), false);
  EXPECT_NE(sent, received);
}

TEST(ScheduleAll, EveryAcceptedCombinationValidatesAndSimulates) {
  int interleaved_accepted = 0, interleaved_refused = 0, checked_against_old_megatron = 0;
  for (int pp = 1; pp <= 5; ++pp)
    for (int v = 1; v <= 4; ++v)
      for (int m = 1; m <= 12; ++m) {
        SCOPED_TRACE("pp " + std::to_string(pp) + " vpp " + std::to_string(v) + " m " + std::to_string(m));
        // 1F1B: accepted exactly when vpp = 1.
        if (v == 1) {
          const PipelineOrders o = orders("1f1b", pp, v, m);
          for (int r = 0; r < pp; ++r) EXPECT_EQ(o.warmup[static_cast<size_t>(r)], warmup_1f1b(pp, m, r));
          expect_consistent_timeline(o, loom::pipeline::simulate(o));
        } else {
          const ScheduleError e = error_of("1f1b", pp, v, m);
          EXPECT_EQ(e.kind(), ScheduleError::Kind::refused);
        }
        // GPipe: always.
        {
          const PipelineOrders o = orders("gpipe", pp, v, m);
          for (int r = 0; r < pp; ++r) EXPECT_EQ(o.warmup[static_cast<size_t>(r)], v * m);
          expect_consistent_timeline(o, loom::pipeline::simulate(o));
        }
        // Interleaved: Megatron's rules, for every group size (0 = pp).
        for (int n0 = 0; n0 <= 12; ++n0) {
          const int n = n0 == 0 ? pp : n0;
          const bool ok = pp > 1 && v > 1 && n >= pp && n <= m && (m % n == 0 || m % n >= pp);
          if (!ok) {
            const ScheduleError e = error_of("interleaved", pp, v, m, n0);
            EXPECT_EQ(e.kind(), ScheduleError::Kind::refused) << e.what();
            ++interleaved_refused;
            continue;
          }
          ++interleaved_accepted;
          const PipelineOrders o = orders("interleaved", pp, v, m, n0);
          EXPECT_EQ(o.group_size, n);
          for (int r = 0; r < pp; ++r) {
            SCOPED_TRACE("n " + std::to_string(n) + " rank " + std::to_string(r));
            EXPECT_EQ(o.warmup[static_cast<size_t>(r)], warmup_interleaved(pp, v, m, n, r));
            EXPECT_EQ(o.order[static_cast<size_t>(r)], reference_interleaved(pp, v, m, n, r));
            if (n == pp && m % pp == 0) {
              // Same order from Megatron's older virtual-microbatch formula.
              const Order& ord = o.order[static_cast<size_t>(r)];
              int f = 0, b = 0;
              for (int32_t e : ord) {
                if (e > 0) {
                  EXPECT_EQ(e, old_megatron_chunk(f++, pp, v, true) + 1);
                } else {
                  EXPECT_EQ(-e, old_megatron_chunk(b++, pp, v, false) + 1);
                }
              }
              ++checked_against_old_megatron;
            }
          }
          expect_consistent_timeline(o, loom::pipeline::simulate(o));
        }
      }
  EXPECT_GT(interleaved_accepted, 100);
  EXPECT_GT(interleaved_refused, 100);
  EXPECT_GT(checked_against_old_megatron, 50);
}

// ---------------------------------------------------------------------------
// Refusals name the rule and the values
// ---------------------------------------------------------------------------

TEST(ScheduleRefusals, OneFOneBNeedsVpp1) {
  const ScheduleError e = error_of("1f1b", 4, 2, 8);
  EXPECT_EQ(e.kind(), ScheduleError::Kind::refused);
  EXPECT_TRUE(contains(e.what(), "needs vpp = 1, got vpp = 2")) << e.what();
  EXPECT_TRUE(contains(e.what(), "parallel/pipeline.1f1b")) << e.what();
}

TEST(ScheduleRefusals, InterleavedRules) {
  const std::string pp1 = error_of("interleaved", 1, 2, 4).what();
  EXPECT_TRUE(contains(pp1, "needs pp > 1, got pp = 1")) << pp1;
  const std::string vpp1 = error_of("interleaved", 2, 1, 4).what();
  EXPECT_TRUE(contains(vpp1, "needs vpp > 1")) << vpp1;

  const std::string small_n = error_of("interleaved", 4, 2, 8, 2).what();
  EXPECT_TRUE(contains(small_n, "pp <= N <= microbatches")) << small_n;
  EXPECT_TRUE(contains(small_n, "N = 2, pp = 4, microbatches = 8")) << small_n;

  const std::string big_n = error_of("interleaved", 2, 2, 3, 4).what();
  EXPECT_TRUE(contains(big_n, "pp <= N <= microbatches")) << big_n;
  EXPECT_TRUE(contains(big_n, "N = 4, pp = 2, microbatches = 3")) << big_n;

  // Default N = pp = 4 with fewer microbatches than that.
  const std::string few = error_of("interleaved", 4, 2, 3).what();
  EXPECT_TRUE(contains(few, "N = 4, pp = 4, microbatches = 3")) << few;

  const std::string rem = error_of("interleaved", 4, 2, 6).what();
  EXPECT_TRUE(contains(rem, "microbatches mod N must be 0 or at least pp")) << rem;
  EXPECT_TRUE(contains(rem, "microbatches = 6, N = 4, remainder 2 < pp = 4")) << rem;
  // The engine names the combination and the rank it asked for.
  EXPECT_TRUE(contains(rem, "parallel/pipeline.interleaved refuses pp 4, vpp 2, microbatches 6, group size 4 (rank 0)"))
      << rem;
}

TEST(ScheduleRefusals, EngineRefusesNonsenseSizes) {
  const ScheduleError e = error_of("gpipe", 0, 1, 4);
  EXPECT_EQ(e.kind(), ScheduleError::Kind::refused);
  EXPECT_TRUE(contains(e.what(), "must be at least 1")) << e.what();
}

// ---------------------------------------------------------------------------
// Broken plugins: order validation and the deadlock check
// ---------------------------------------------------------------------------

TEST(ScheduleDeadlock, ReversedWarmupIsRefusedNamingTheStuckRankAndStep) {
  // Rank 0 (no warmup) runs F1 then waits for rank 1's B1, while rank 1 (warmup 1)
  // waits for rank 0's F2 before it will run B1.
  const PipelineOrders o = orders("deadlock", 4, 1, 4);  // every order is well formed...
  try {
    loom::pipeline::simulate(o);  // ...but together they deadlock
    FAIL() << "no deadlock reported";
  } catch (const ScheduleError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind(), ScheduleError::Kind::deadlock);
    EXPECT_EQ(e.rank(), 0);
    EXPECT_EQ(e.step(), 1);
    EXPECT_TRUE(contains(msg, "schedule parallel/pipeline.deadlock deadlocks")) << msg;
    EXPECT_TRUE(contains(msg, "rank 0 is stuck at step 1 (order[1] = -1: backward of chunk 1, microbatch 1)")) << msg;
    EXPECT_TRUE(contains(msg, "backward output (input gradient) of global chunk 1, microbatch 1, from rank 1")) << msg;
    EXPECT_TRUE(contains(msg, "which is itself stuck at step 1 (order[1] = +1: forward of chunk 1, microbatch 2)"))
        << msg;
    EXPECT_TRUE(contains(msg, "cycle rank 0 -> rank 1 -> rank 0")) << msg;
  }
  // The same plugin with one rank has nobody to wait for.
  loom::pipeline::simulate(orders("deadlock", 1, 1, 4));
}

TEST(ScheduleDeadlock, LastChunkFirstDeadlocksAcrossTheWrap) {
  // Rank 0 starts with chunk 2 (global chunk 2), which needs global chunk 1 on rank 1,
  // which needs global chunk 0: rank 0's own chunk 1, queued behind chunk 2.
  const ScheduleError e = error_of("chunk_swap", 2, 2, 2);
  const std::string msg = e.what();
  EXPECT_EQ(e.kind(), ScheduleError::Kind::deadlock) << msg;
  EXPECT_EQ(e.rank(), 0);
  EXPECT_EQ(e.step(), 0);
  EXPECT_TRUE(contains(msg, "rank 0 is stuck at step 0 (order[0] = +2: forward of chunk 2, microbatch 1)")) << msg;
  EXPECT_TRUE(contains(msg, "forward output (activations) of global chunk 1, microbatch 1, from rank 1")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1, which is itself stuck at step 0 (order[0] = +2")) << msg;

  // Three ranks: each waits for the one before it around the wrap.
  const std::string three = error_of("chunk_swap", 3, 2, 3).what();
  EXPECT_TRUE(contains(three, "waits form the cycle rank 0 -> rank 2 -> rank 1 -> rank 0")) << three;

  // With one rank the wait is on itself.
  const ScheduleError self = error_of("chunk_swap", 1, 2, 2);
  EXPECT_EQ(self.kind(), ScheduleError::Kind::deadlock);
  EXPECT_TRUE(contains(self.what(), "global chunk 0, microbatch 1, which this rank only produces later, at step 2"))
      << self.what();
}

TEST(ScheduleValidation, BrokenOrdersNameRankAndStep) {
  const ScheduleError bf = error_of("backward_first", 3, 1, 4);
  EXPECT_EQ(bf.kind(), ScheduleError::Kind::invalid);
  EXPECT_EQ(bf.rank(), 2);
  EXPECT_EQ(bf.step(), 0);
  EXPECT_TRUE(contains(bf.what(), "schedule parallel/pipeline.backward_first, rank 2, step 0 (order[0] = -1: "
                                  "backward of chunk 1, microbatch 1): the backward comes before its forward"))
      << bf.what();

  const ScheduleError sh = error_of("short", 2, 1, 3);
  EXPECT_EQ(sh.kind(), ScheduleError::Kind::invalid);
  EXPECT_EQ(sh.rank(), 0);
  EXPECT_TRUE(contains(sh.what(), "rank 0: the order has 5 entries but pp 2, vpp 1, microbatches 3 need "
                                  "2 * vpp * microbatches = 6"))
      << sh.what();

  const ScheduleError ex = error_of("extra_forward", 2, 1, 4);
  EXPECT_EQ(ex.kind(), ScheduleError::Kind::invalid);
  EXPECT_EQ(ex.step(), 7);
  EXPECT_TRUE(contains(ex.what(), "rank 0, step 7: a 5th forward of chunk 1, but there are only 4 microbatches"))
      << ex.what();

  const ScheduleError be = error_of("bad_entry", 2, 1, 2);
  EXPECT_EQ(be.kind(), ScheduleError::Kind::invalid);
  EXPECT_TRUE(contains(be.what(), "rank 0, step 0: entry 2 is not a local chunk")) << be.what();
}

TEST(ScheduleValidation, HandMadeOrders) {
  PipelineOrders o;
  o.schedule = "parallel/pipeline.hand";
  o.pp = 2;
  o.vpp = 1;
  o.microbatches = 2;
  o.group_size = 2;
  o.order = {{1, 1, -1, -1}, {1, -1, 1, -1}};
  o.warmup = {1, 0};
  EXPECT_NO_THROW(loom::pipeline::simulate(o));
  o.warmup = {3, 0};  // more warmup forwards than there are forwards
  EXPECT_THROW(loom::pipeline::validate(o), ScheduleError);
  o.warmup = {1, 0};
  o.order[1] = {1, -1, -1, 1};  // backward of microbatch 2 before its forward
  try {
    loom::pipeline::validate(o);
    FAIL();
  } catch (const ScheduleError& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_EQ(e.step(), 2);
  }
}

// ---------------------------------------------------------------------------
// Chrome trace
// ---------------------------------------------------------------------------

using nlohmann::ordered_json;

TEST(ScheduleTrace, ChromeTraceOfASimulation) {
  const PipelineOrders o = orders("interleaved", 2, 2, 4);
  const auto t = loom::pipeline::simulate(o);
  std::ostringstream os;
  loom::pipeline::write_chrome_trace(os, loom::pipeline::trace_events(t, 1000.0));
  const ordered_json j = ordered_json::parse(os.str());
  ASSERT_TRUE(j.is_array());
  int complete = 0, names = 0;
  bool saw_first = false;
  for (const ordered_json& e : j) {
    EXPECT_EQ(e.at("pid"), 0);
    if (e.at("ph") == "M") {
      EXPECT_EQ(e.at("args").at("name"), "rank " + std::to_string(e.at("tid").get<int>()));
      ++names;
      continue;
    }
    ASSERT_EQ(e.at("ph"), "X");
    ++complete;
    EXPECT_EQ(e.at("dur"), 1000);
    const std::string cat = e.at("cat").get<std::string>();
    EXPECT_TRUE(cat == "forward" || cat == "backward") << cat;
    EXPECT_EQ(e.at("name").get<std::string>()[0], cat == "forward" ? 'F' : 'B');
    if (e.at("tid") == 0 && e.at("ts") == 0) {
      EXPECT_EQ(e.at("name"), "F mb1 c1");
      saw_first = true;
    }
  }
  EXPECT_EQ(names, 2);
  EXPECT_EQ(complete, 2 * 2 * 2 * 4);
  EXPECT_TRUE(saw_first);
  // One event per line between the brackets.
  std::istringstream lines(os.str());
  std::string line;
  std::vector<std::string> all;
  while (std::getline(lines, line)) all.push_back(line);
  ASSERT_EQ(all.size(), j.size() + 2);
  EXPECT_EQ(all.front(), "[");
  EXPECT_EQ(all.back(), "]");
  for (size_t i = 1; i + 1 < all.size(); ++i) {
    const std::string event = i + 2 < all.size() ? all[i].substr(0, all[i].size() - 1) : all[i];  // less the comma
    EXPECT_EQ(ordered_json::parse(event), j[i - 1]) << all[i];
  }

  // Arbitrary events (the runtime's trace later): names are escaped, fractions kept,
  // times to the nanosecond, a non-finite time written as 0.
  std::ostringstream os2;
  loom::pipeline::write_chrome_trace(os2, {{3, "a \"quoted\" step", "comm", 1.5, 2.25, {}},
                                           {1, "b", "comm", 0.1234567, std::nan(""), {{"bytes", 4096}}}});
  const ordered_json j2 = ordered_json::parse(os2.str());
  ASSERT_EQ(j2.size(), 4u);
  EXPECT_EQ(j2[2].at("name"), "a \"quoted\" step");
  EXPECT_EQ(j2[2].at("tid"), 3);
  EXPECT_DOUBLE_EQ(j2[2].at("ts").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(j2[2].at("dur").get<double>(), 2.25);
  EXPECT_FALSE(j2[2].contains("args"));
  EXPECT_DOUBLE_EQ(j2[3].at("ts").get<double>(), 0.123);
  EXPECT_EQ(j2[3].at("dur"), 0);
  EXPECT_EQ(j2[3].at("args"), ordered_json::parse(R"({"bytes": 4096})"));
}

// ---------------------------------------------------------------------------
// loom schedule
// ---------------------------------------------------------------------------

struct CmdRun {
  int rc;
  std::string out, err;
};

CmdRun run_schedule(std::vector<std::string> args) {
  registry();  // host API installed
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  std::ostringstream out, err;
  auto* old_out = std::cout.rdbuf(out.rdbuf());
  auto* old_err = std::cerr.rdbuf(err.rdbuf());
  int rc = -1;
  try {
    rc = loom::cli::cmd_schedule(static_cast<int>(argv.size()), argv.data());
  } catch (...) {
    std::cout.rdbuf(old_out);
    std::cerr.rdbuf(old_err);
    throw;
  }
  std::cout.rdbuf(old_out);
  std::cerr.rdbuf(old_err);
  return {rc, out.str(), err.str()};
}

TEST(ScheduleCmd, JsonMatchesTheLibrary) {
  for (const auto& [args, name, pp, vpp, m, n] :
       std::vector<std::tuple<std::vector<std::string>, std::string, int, int, int, int>>{
           {{"--pp", "2", "--vpp", "2", "--microbatches", "4", "--json"}, "interleaved", 2, 2, 4, 2},
           {{"--pp", "3", "--microbatches", "5", "--json"}, "1f1b", 3, 1, 5, 3},
           {{"--pp=4", "--vpp=2", "--microbatches=10", "--group-size=5", "--json"}, "interleaved", 4, 2, 10, 5},
           {{"--pp", "2", "--vpp", "3", "--microbatches", "2", "--schedule", "gpipe", "--json"}, "gpipe", 2, 3, 2, 2},
       }) {
    const CmdRun run = run_schedule(args);
    ASSERT_EQ(run.rc, 0) << run.err;
    EXPECT_EQ(run.err, "");
    const ordered_json j = loom::testing::json_line(run.out);
    ASSERT_EQ(j.size(), 5u);
    EXPECT_EQ(j.begin().key(), "pp");
    EXPECT_EQ(j.at("pp"), pp);
    EXPECT_EQ(j.at("vpp"), vpp);
    EXPECT_EQ(j.at("microbatches"), m);
    EXPECT_EQ(j.at("group_size"), n);
    const PipelineOrders o = orders(name, pp, vpp, m, n);
    const ordered_json& ranks = j.at("ranks");
    ASSERT_EQ(ranks.size(), static_cast<size_t>(pp));
    for (int r = 0; r < pp; ++r) {
      const ordered_json& rk = ranks[static_cast<size_t>(r)];
      EXPECT_EQ(rk.begin().key(), "rank");
      EXPECT_EQ(rk.at("rank"), r);
      EXPECT_EQ(rk.at("warmup"), o.warmup[static_cast<size_t>(r)]);
      EXPECT_EQ(rk.at("order").get<Order>(), o.order[static_cast<size_t>(r)]);
    }
  }
  // The exact shape of the line.
  const CmdRun small = run_schedule({"--pp", "2", "--microbatches", "2", "--json"});
  EXPECT_EQ(loom::testing::json_line(small.out),
            ordered_json::parse(R"({"pp": 2, "vpp": 1, "microbatches": 2, "group_size": 2, "ranks": [)"
                                R"({"rank": 0, "warmup": 1, "order": [1, 1, -1, -1]}, )"
                                R"({"rank": 1, "warmup": 0, "order": [1, -1, 1, -1]}]})"))
      << small.out;
}

TEST(ScheduleCmd, DiagramAndTrace) {
  const std::string trace = std::string(LOOM_TEST_BUILD_DIR) + "/tests/pipeline/schedule_test_trace.json";
  std::remove(trace.c_str());
  const CmdRun run = run_schedule({"--pp", "2", "--microbatches", "3", "--trace", trace});
  ASSERT_EQ(run.rc, 0) << run.err;
  // Rank 1 (last stage) alternates; rank 0 idles while waiting for B1.
  EXPECT_TRUE(contains(run.out, "schedule parallel/pipeline.1f1b  pp 2  vpp 1  microbatches 3")) << run.out;
  EXPECT_TRUE(contains(run.out, "slot   0  1  2  3  4  5  6  7\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "rank 0 F1 F2    B1 F3 B2    B3\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "rank 1    F1 B1 F2 B2 F3 B3\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "rank 0  warmup 1  [1, 1, -1, 1, -1, -1]")) << run.out;
  EXPECT_TRUE(contains(run.out, "bubble fraction 0.2500 (4 idle of 16 rank-slots")) << run.out;
  std::ifstream f(trace);
  ASSERT_TRUE(f.good()) << trace;
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_EQ(ordered_json::parse(text.str()).size(), 2u + 12u);

  const CmdRun v = run_schedule({"--pp", "4", "--vpp", "2", "--microbatches", "8"});
  ASSERT_EQ(v.rc, 0) << v.err;
  EXPECT_TRUE(contains(v.out, "rank 0 F1.1 F2.1 F3.1 F4.1 F1.2 F2.2 F3.2 F4.2")) << v.out;
  EXPECT_TRUE(contains(v.out, "rank 0  warmup 10  [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, -2,")) << v.out;
}

TEST(ScheduleCmd, ExitCodes) {
  EXPECT_EQ(run_schedule({"--help"}).rc, 0);
  EXPECT_TRUE(contains(run_schedule({"--help"}).out, "usage: loom schedule"));
  for (const auto& bad : std::vector<std::vector<std::string>>{
           {"--microbatches", "4"},                         // no --pp
           {"--pp", "2"},                                   // no --microbatches
           {"--pp", "0", "--microbatches", "4"},            // not positive
           {"--pp", "two", "--microbatches", "4"},          // not a number
           {"--pp", "2", "--microbatches", "4", "--group-size", "-1"},
           {"--pp", "2", "--microbatches", "4", "--frobnicate"},
           {"--pp", "2", "--microbatches", "4", "extra"},
       }) {
    const CmdRun r = run_schedule(bad);
    EXPECT_EQ(r.rc, 2) << bad.back() << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "loom schedule: ")) << r.err;
  }
  // Refused combinations exit 1 with the rule.
  const CmdRun refused = run_schedule({"--pp", "4", "--vpp", "2", "--microbatches", "6"});
  EXPECT_EQ(refused.rc, 1);
  EXPECT_TRUE(contains(refused.err, "microbatches mod N must be 0 or at least pp")) << refused.err;
  EXPECT_EQ(refused.out, "");
  const CmdRun vpp = run_schedule({"--pp", "4", "--vpp", "2", "--microbatches", "8", "--schedule", "1f1b"});
  EXPECT_EQ(vpp.rc, 1);
  EXPECT_TRUE(contains(vpp.err, "needs vpp = 1")) << vpp.err;
  const CmdRun unknown = run_schedule({"--pp", "2", "--microbatches", "2", "--schedule", "zigzag"});
  EXPECT_EQ(unknown.rc, 1);
  EXPECT_TRUE(contains(unknown.err, "no plugin parallel/pipeline.zigzag")) << unknown.err;
  // A third-party schedule that deadlocks is refused the same way.
  const CmdRun dl = run_schedule(
      {"--pp", "3", "--microbatches", "3", "--schedule", "deadlock", "--plugin-path", kBrokenDir, "--json"});
  EXPECT_EQ(dl.rc, 1);
  EXPECT_TRUE(contains(dl.err, "deadlocks")) << dl.err;
  EXPECT_TRUE(contains(dl.err, "rank 0 is stuck at step 1")) << dl.err;
  EXPECT_EQ(dl.out, "");
  // An unwritable trace file.
  const CmdRun tr = run_schedule({"--pp", "2", "--microbatches", "2", "--trace", "/nonexistent-dir/x.json"});
  EXPECT_EQ(tr.rc, 1);
  EXPECT_TRUE(contains(tr.err, "/nonexistent-dir/x.json")) << tr.err;
}

}  // namespace
