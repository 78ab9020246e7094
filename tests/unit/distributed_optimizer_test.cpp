// The distributed optimizer (parallel/distributed, optimizer.strategy = "distributed"):
// the buffer layout and per-rank shard ranges on the seed's known cases and on many
// generated ones, `loom optimizer-layout --json`, step-by-step equivalence with DDP
// (dp 2, 3, 4 and tp 2 x dp 2, several buckets, shards cutting through parameters),
// bit-exact resume, refusal of shard state saved under another dp, and optimizer
// memory that falls as 1/dp.
#include "support/json_line.hpp"
#include "support/train_fixture.hpp"

#include "engine/model/buffer_layout.hpp"
#include "engine/model/shard_ranges.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string_view>

namespace loom::cli {
int cmd_optimizer_layout(int argc, char** argv);
}

namespace {

using loom::model::BufferLayout;
using loom::model::layout_buffer;
using loom::model::Range;
using loom::model::shard_ranges;
using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;
namespace fs = boost::filesystem;

const std::string kDistributed = "optimizer.strategy=\"distributed\"";

// ---------------------------------------------------------------------------
// Layout and shard ranges
// ---------------------------------------------------------------------------

// Every rule the layout and the shard ranges must obey, for one case.
void check_layout_rules(const std::vector<size_t>& numels, int dp, size_t bucket_size) {
  SCOPED_TRACE("dp=" + std::to_string(dp) + " bucket_size=" + std::to_string(bucket_size) + " params=" +
               std::to_string(numels.size()));
  const BufferLayout l = layout_buffer(numels, dp, bucket_size);
  const size_t align = std::lcm(static_cast<size_t>(dp), size_t{128});
  ASSERT_EQ(l.params.size(), numels.size());
  ASSERT_FALSE(l.buckets.empty());
  // Buckets tile the buffer; every end is a multiple of lcm(dp, 128).
  EXPECT_EQ(l.buckets.front().start, 0u);
  EXPECT_EQ(l.buckets.back().end, l.numel);
  for (size_t b = 0; b < l.buckets.size(); ++b) {
    EXPECT_GT(l.buckets[b].size(), 0u);
    EXPECT_EQ(l.buckets[b].end % align, 0u) << "bucket " << b;
    if (b > 0) {
      EXPECT_EQ(l.buckets[b].start, l.buckets[b - 1].end);
    }
  }
  // Parameters: right size, 64-aligned starts, reverse model order, no overlap,
  // each inside one bucket.
  for (size_t i = 0; i < numels.size(); ++i) {
    EXPECT_EQ(l.params[i].size(), numels[i]);
    EXPECT_EQ(l.params[i].start % 64, 0u) << "param " << i;
    if (i > 0) {
      EXPECT_GE(l.params[i - 1].start, l.params[i].end) << "params " << i - 1 << ", " << i;
    }
    int in = 0;
    for (const Range& b : l.buckets) in += (l.params[i].start >= b.start && l.params[i].end <= b.end) ? 1 : 0;
    EXPECT_EQ(in, 1) << "param " << i;
  }
  // Shards: every buffer element owned by exactly one rank; each parameter
  // element covered exactly once by the pieces; the four ranges agree.
  std::vector<int> owner(l.numel, -1);
  std::vector<std::vector<int>> covered(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) covered[i].assign(numels[i], 0);
  for (int r = 0; r < dp; ++r) {
    const auto shards = shard_ranges(l, dp, r);
    ASSERT_EQ(shards.size(), l.buckets.size());
    for (const auto& s : shards) {
      const Range& bucket = l.buckets[s.bucket];
      EXPECT_EQ(s.range.size() * static_cast<size_t>(dp), bucket.size());
      EXPECT_EQ(s.range.start, bucket.start + static_cast<size_t>(r) * s.range.size());
      for (size_t e = s.range.start; e < s.range.end; ++e) {
        EXPECT_EQ(owner[e], -1) << "element " << e << " owned twice";
        owner[e] = r;
      }
      size_t prev_end = s.range.start;
      for (const auto& p : s.params) {
        const Range& whole = l.params[p.index];
        EXPECT_GE(p.world.start, prev_end) << "pieces out of buffer order";
        prev_end = p.world.end;
        EXPECT_GT(p.world.size(), 0u);
        EXPECT_GE(p.world.start, s.range.start);
        EXPECT_LE(p.world.end, s.range.end);
        EXPECT_EQ(p.bucket.start, p.world.start - bucket.start);
        EXPECT_EQ(p.bucket.end, p.world.end - bucket.start);
        EXPECT_EQ(p.local.start, p.world.start - s.range.start);
        EXPECT_EQ(p.local.end, p.world.end - s.range.start);
        EXPECT_EQ(p.param.start, p.world.start - whole.start);
        EXPECT_EQ(p.param.end, p.world.end - whole.start);
        EXPECT_LE(p.param.end, numels[p.index]);
        for (size_t k = p.param.start; k < p.param.end; ++k) ++covered[p.index][k];
      }
    }
  }
  for (size_t e = 0; e < l.numel; ++e) ASSERT_NE(owner[e], -1) << "element " << e << " owned by nobody";
  for (size_t i = 0; i < numels.size(); ++i)
    for (size_t k = 0; k < numels[i]; ++k) ASSERT_EQ(covered[i][k], 1) << "param " << i << " element " << k;
}

// The seed's example sizes: [3, 5, 4, 4] in model order, one bucket.
TEST(DistoptLayout, KnownCaseDp2) {
  const BufferLayout l = layout_buffer({3, 5, 4, 4}, 2);
  EXPECT_EQ(l.numel, 256u);
  ASSERT_EQ(l.buckets.size(), 1u);
  EXPECT_EQ(l.buckets[0], (Range{0, 256}));
  EXPECT_EQ(l.params, (std::vector<Range>{{192, 195}, {128, 133}, {64, 68}, {0, 4}}));
  const auto r0 = shard_ranges(l, 2, 0), r1 = shard_ranges(l, 2, 1);
  ASSERT_EQ(r0.size(), 1u);
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r0[0].range, (Range{0, 128}));
  EXPECT_EQ(r1[0].range, (Range{128, 256}));
  ASSERT_EQ(r0[0].params.size(), 2u);
  EXPECT_EQ(r0[0].params[0].index, 3u);
  EXPECT_EQ(r0[0].params[1].index, 2u);
  EXPECT_EQ(r0[0].params[1].world, (Range{64, 68}));
  EXPECT_EQ(r0[0].params[1].local, (Range{64, 68}));
  EXPECT_EQ(r0[0].params[1].param, (Range{0, 4}));
  ASSERT_EQ(r1[0].params.size(), 2u);
  EXPECT_EQ(r1[0].params[0].index, 1u);
  EXPECT_EQ(r1[0].params[0].world, (Range{128, 133}));
  EXPECT_EQ(r1[0].params[0].bucket, (Range{128, 133}));
  EXPECT_EQ(r1[0].params[0].local, (Range{0, 5}));
  EXPECT_EQ(r1[0].params[0].param, (Range{0, 5}));
  EXPECT_EQ(r1[0].params[1].index, 0u);
  EXPECT_EQ(r1[0].params[1].local, (Range{64, 67}));
  check_layout_rules({3, 5, 4, 4}, 2, 0);
}

TEST(DistoptLayout, KnownCaseDp3HasAPaddingOnlyShard) {
  const BufferLayout l = layout_buffer({3, 5, 4, 4}, 3);
  EXPECT_EQ(l.numel, 384u);  // lcm(3, 128) = 384
  EXPECT_EQ(l.params, (std::vector<Range>{{192, 195}, {128, 133}, {64, 68}, {0, 4}}));
  EXPECT_EQ(shard_ranges(l, 3, 0)[0].range, (Range{0, 128}));
  EXPECT_EQ(shard_ranges(l, 3, 1)[0].range, (Range{128, 256}));
  const auto r2 = shard_ranges(l, 3, 2);
  EXPECT_EQ(r2[0].range, (Range{256, 384}));
  EXPECT_TRUE(r2[0].params.empty());  // rank 2 holds only padding
  check_layout_rules({3, 5, 4, 4}, 3, 0);
}

// Several buckets, and a shard boundary that cuts a parameter in two.
TEST(DistoptLayout, BucketsAndCutParameters) {
  // 300 and 200 elements, bucket_size 250: the first bucket closes after the
  // (reversed) first placed parameter.
  const BufferLayout l = layout_buffer({300, 200, 100}, 2, 250);
  ASSERT_EQ(l.buckets.size(), 2u);
  // Reverse order: 100 at [0,100), 200 at [128,328) -> bucket [0,384); 300 at [384,684) -> [384,768).
  EXPECT_EQ(l.params, (std::vector<Range>{{384, 684}, {128, 328}, {0, 100}}));
  EXPECT_EQ(l.buckets[0], (Range{0, 384}));
  EXPECT_EQ(l.buckets[1], (Range{384, 768}));
  const auto r0 = shard_ranges(l, 2, 0), r1 = shard_ranges(l, 2, 1);
  // Bucket 0 splits at 192: parameter 1 ([128, 328)) is cut.
  EXPECT_EQ(r0[0].range, (Range{0, 192}));
  ASSERT_EQ(r0[0].params.size(), 2u);
  EXPECT_EQ(r0[0].params[1].index, 1u);
  EXPECT_EQ(r0[0].params[1].param, (Range{0, 64}));
  ASSERT_EQ(r1[0].params.size(), 1u);
  EXPECT_EQ(r1[0].params[0].world, (Range{192, 328}));
  EXPECT_EQ(r1[0].params[0].bucket, (Range{192, 328}));
  EXPECT_EQ(r1[0].params[0].local, (Range{0, 136}));
  EXPECT_EQ(r1[0].params[0].param, (Range{64, 200}));
  // Bucket 1 [384, 768) splits at 576: parameter 0 ([384, 684)) is cut.
  EXPECT_EQ(r1[1].range, (Range{576, 768}));
  ASSERT_EQ(r1[1].params.size(), 1u);
  EXPECT_EQ(r1[1].params[0].world, (Range{576, 684}));
  EXPECT_EQ(r1[1].params[0].bucket, (Range{192, 300}));
  EXPECT_EQ(r1[1].params[0].local, (Range{0, 108}));
  EXPECT_EQ(r1[1].params[0].param, (Range{192, 300}));
  check_layout_rules({300, 200, 100}, 2, 250);
}

TEST(DistoptLayout, RulesHoldOnGeneratedCases) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    std::vector<size_t> numels;
    for (int i = 0; i < n; ++i) numels.push_back(1 + rng() % (rng() % 4 == 0 ? 3000 : 200));
    const int dp = 1 + static_cast<int>(rng() % 8);
    const size_t bucket_size = rng() % 3 == 0 ? 0 : 1 + rng() % 2000;
    check_layout_rules(numels, dp, bucket_size);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Expert parameters (ABI 1.4) form one region after every chunk's, whatever the
// chunk of their layer: no bucket mixes them with dense ones, each region keeps
// the reverse-order, aligned, dp-divisible rules, and params come back in model order.
TEST(DistoptLayout, ExpertParametersFormTheTail) {
  using loom::model::layout_model_buffer;
  // Model order: chunk 0 {dense 100, expert 300, dense 50}, chunk 1 {expert 70, dense 20}.
  const std::vector<int> chunk = {0, 0, 0, 1, 1};
  const std::vector<size_t> numels = {100, 300, 50, 70, 20};
  const std::vector<bool> expert = {false, true, false, true, false};
  const BufferLayout l = layout_model_buffer(chunk, numels, expert, 2, 4, 128);
  ASSERT_EQ(l.params.size(), numels.size());
  size_t dense_end = 0, expert_start = l.numel;
  for (size_t i = 0; i < numels.size(); ++i) {
    EXPECT_EQ(l.params[i].size(), numels[i]) << "param " << i;
    EXPECT_EQ(l.params[i].start % 64, 0u) << "param " << i;
    if (expert[i]) expert_start = std::min(expert_start, l.params[i].start);
    else dense_end = std::max(dense_end, l.params[i].end);
  }
  EXPECT_LE(dense_end, expert_start);
  // The expert region: reverse model order, starting a bucket.
  EXPECT_EQ(l.params[3].start, expert_start);
  EXPECT_GT(l.params[1].start, l.params[3].start);
  bool starts_bucket = false;
  for (const auto& b : l.buckets) {
    EXPECT_TRUE(b.end <= expert_start || b.start >= expert_start) << "bucket [" << b.start << ", " << b.end << ")";
    EXPECT_EQ(b.size() % 128, 0u);
    starts_bucket |= b.start == expert_start;
  }
  EXPECT_TRUE(starts_bucket);
  EXPECT_EQ(l.buckets.back().end, l.numel);
  // Without expert parameters it is the chunked layout.
  const BufferLayout dense = layout_model_buffer({0, 1}, {10, 20}, {false, false}, 2, 2);
  const BufferLayout chunked = loom::model::layout_chunked_buffer({{10}, {20}}, 2);
  EXPECT_EQ(dense.numel, chunked.numel);
  ASSERT_EQ(dense.params.size(), 2u);
  EXPECT_EQ(dense.params[1].start, chunked.params[1].start);
}

TEST(DistoptLayout, BadRankIsRejected) {
  const BufferLayout l = layout_buffer({3, 5}, 2);
  EXPECT_THROW(shard_ranges(l, 2, 2), std::invalid_argument);
  EXPECT_THROW(shard_ranges(l, 2, -1), std::invalid_argument);
  EXPECT_THROW(shard_ranges(l, 3, 0), std::invalid_argument);  // 128 does not split into 3
}

// ---------------------------------------------------------------------------
// loom optimizer-layout
// ---------------------------------------------------------------------------

struct CliResult {
  int rc;
  std::string out, err;
};

CliResult run_cli(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::ostringstream out, err;
  std::streambuf* old_out = std::cout.rdbuf(out.rdbuf());
  std::streambuf* old_err = std::cerr.rdbuf(err.rdbuf());
  int rc = -1;
  try {
    rc = loom::cli::cmd_optimizer_layout(static_cast<int>(argv.size()), argv.data());
  } catch (...) {
    std::cout.rdbuf(old_out);
    std::cerr.rdbuf(old_err);
    throw;
  }
  std::cout.rdbuf(old_out);
  std::cerr.rdbuf(old_err);
  return {rc, out.str(), err.str()};
}

TEST(DistoptCli, JsonOfTheKnownCase) {
  const CliResult r = run_cli({"--param-numels", "3,5,4,4", "--dp", "2", "--json"});
  EXPECT_EQ(r.rc, 0) << r.err;
  const nlohmann::ordered_json expected = nlohmann::ordered_json::parse(
      R"({"buffer_numel": 256, "buckets": [{"start": 0, "end": 256}], )"
      R"("params": [{"index": 0, "start": 192, "end": 195}, {"index": 1, "start": 128, "end": 133}, )"
      R"({"index": 2, "start": 64, "end": 68}, {"index": 3, "start": 0, "end": 4}], )"
      R"("ranks": [)"
      R"({"rank": 0, "shards": [{"bucket": 0, "range": [0, 128], "params": [)"
      R"({"index": 3, "world": [0, 4], "bucket": [0, 4], "local": [0, 4], "param": [0, 4]}, )"
      R"({"index": 2, "world": [64, 68], "bucket": [64, 68], "local": [64, 68], "param": [0, 4]}]}]}, )"
      R"({"rank": 1, "shards": [{"bucket": 0, "range": [128, 256], "params": [)"
      R"({"index": 1, "world": [128, 133], "bucket": [128, 133], "local": [0, 5], "param": [0, 5]}, )"
      R"({"index": 0, "world": [192, 195], "bucket": [192, 195], "local": [64, 67], "param": [0, 3]}]}]})"
      R"(]})");
  EXPECT_EQ(loom::testing::json_line(r.out), expected) << r.out;
}

TEST(DistoptCli, TableHelpAndUsageErrors) {
  const CliResult t = run_cli({"--param-numels", "3,5,4,4", "--dp", "3"});
  EXPECT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("buffer 384 elements"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("padding only"), std::string::npos) << t.out;  // rank 2
  const CliResult b = run_cli({"--param-numels", "300,200,100", "--dp", "2", "--bucket-size", "250", "--json"});
  EXPECT_EQ(b.rc, 0) << b.err;
  EXPECT_EQ(loom::testing::json_line(b.out).at("buckets"),
            nlohmann::ordered_json::parse(R"([{"start": 0, "end": 384}, {"start": 384, "end": 768}])"))
      << b.out;

  const CliResult h = run_cli({"--help"});
  EXPECT_EQ(h.rc, 0);
  EXPECT_NE(h.out.find("usage: loom optimizer-layout"), std::string::npos);
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--dp", "2"}, {"--param-numels", "3,5"}, {"--param-numels", "3,,5", "--dp", "2"},
        {"--param-numels", "3,x", "--dp", "2"}, {"--param-numels", "3,0", "--dp", "2"},
        {"--param-numels", "3", "--dp", "0"}, {"--param-numels", "3", "--dp", "2", "--bucket-size", "-1"},
        {"--param-numels", "3", "--dp", "2", "--frobnicate"}, {"--param-numels", "3", "--dp", "2", "extra"}}) {
    const CliResult r = run_cli(bad);
    EXPECT_EQ(r.rc, 2) << bad.back();
    EXPECT_NE(r.err.find("loom optimizer-layout: "), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty());
  }
}

// ---------------------------------------------------------------------------
// Training: the same as DDP, step by step
// ---------------------------------------------------------------------------

std::vector<std::string> with(std::vector<std::string> v, const std::vector<std::string>& extra) {
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

// hidden 24: layernorm and bias sizes that are not multiples of 64 (start padding);
// bucket_size 1500: several buckets, shards that cut through parameters; a global
// batch of 12 splits over dp 2, 3 and 4.
const std::vector<std::string> kEquivBase = {"model.hidden_size=24",         "run.steps=12",
                                             "batch.global_batch_size=12",   "batch.micro_batch_size=1",
                                             "optimizer.bucket_size=1500"};

TEST(Distopt, MatchesDdpStepByStep) {
  struct Case {
    int dp, tp;
  };
  for (const Case c : {Case{2, 1}, Case{3, 1}, Case{4, 1}, Case{2, 2}}) {
    SCOPED_TRACE("dp=" + std::to_string(c.dp) + " tp=" + std::to_string(c.tp));
    const auto base = with(kEquivBase, {"parallel.dp=" + std::to_string(c.dp), "parallel.tp=" + std::to_string(c.tp)});
    auto ddp = run_and_trace(tiny_manifest(), base);

    // Distopt, recording the layout and every rank's parameters (dp replicas must agree).
    std::mutex mu;
    BufferLayout layout;
    std::map<std::pair<int64_t, int>, std::vector<float>> by_rank;  // (step, global rank) -> params
    loom::train::TrainOptions opts;
    opts.on_step = [&](int64_t step, int rank, const loom::model::Model& m) {
      const float* p = static_cast<const float*>(m.params());
      std::lock_guard<std::mutex> lock(mu);
      if (rank == 0) layout = m.layout();
      by_rank[{step, rank}] = std::vector<float>(p, p + m.numel());
    };
    auto dist = run_and_trace(tiny_manifest(), with(base, {kDistributed}), opts);

    // The case exercises what it claims: several buckets, a parameter cut by a shard boundary.
    EXPECT_GE(layout.buckets.size(), 3u);
    bool cut = false;
    for (int r = 0; r < c.dp; ++r)
      for (const auto& s : shard_ranges(layout, c.dp, r))
        for (const auto& p : s.params) cut = cut || p.param.size() != layout.params[p.index].size();
    EXPECT_TRUE(cut);

    ASSERT_EQ(dist.loss.size(), 12u);
    ASSERT_EQ(ddp.loss.size(), dist.loss.size());
    ASSERT_EQ(ddp.params.size(), dist.params.size());
    ASSERT_EQ(ddp.tensors, dist.tensors);
    for (size_t s = 0; s < ddp.loss.size(); ++s) {
      EXPECT_NEAR(dist.loss[s], ddp.loss[s], 1e-5 * std::fabs(ddp.loss[s])) << "step " << s + 1;
      const double gn = ddp.result.steps[s].grad_norm;
      EXPECT_NEAR(dist.result.steps[s].grad_norm, gn, 1e-5 * gn) << "step " << s + 1;
      std::string worst;
      const double rel = loom::testing::max_tensor_rel_diff(ddp, s, dist.params[s], &worst);
      EXPECT_LT(rel, 1e-5) << "step " << s + 1 << " worst tensor " << worst;
      // Padding stays exactly zero (and never NaN).
      std::vector<char> is_param(dist.params[s].size(), 0);
      for (const auto& [off, n] : dist.tensors) std::fill(is_param.begin() + off, is_param.begin() + off + n, 1);
      size_t bad = 0;
      for (size_t i = 0; i < is_param.size(); ++i) bad += (!is_param[i] && dist.params[s][i] != 0.f) ? 1 : 0;
      EXPECT_EQ(bad, 0u) << "step " << s + 1 << ": nonzero padding elements";
      // Every dp replica holds the same parameters after the all-gather.
      const int world = c.dp * c.tp;
      for (int r = 0; r < world; ++r) {
        const int twin = r % c.tp;  // dp rank 0 with the same tp rank (order tp-cp-ep-dp-pp)
        const int64_t step = static_cast<int64_t>(s + 1);
        EXPECT_TRUE(by_rank.at({step, r}) == by_rank.at({step, twin})) << "rank " << r << " step " << s + 1;
      }
    }
    // The training moved: an optimizer that did nothing could not pass.
    EXPECT_GT(loom::testing::max_tensor_rel_diff(ddp, 0, ddp.params.back()), 1e-2);
  }
}

// ---------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------

TEST(Distopt, ResumeIsBitExact) {
  const std::string dir = loom::testing::scratch_dir("distopt-resume");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const auto base = with(kEquivBase, {kDistributed, "parallel.dp=2", "optimizer.decay_steps=12"});
  auto full = run_and_trace(tiny_manifest(), with(base, {"run.steps=12"}));
  auto first = run_and_trace(tiny_manifest(), with(base, {"run.steps=6", ck}));
  ASSERT_TRUE(fs::exists(loom::train::checkpoint_path(dir, 6)));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto second = run_and_trace(tiny_manifest(), with(base, {"run.steps=12", ck}), resume);
  EXPECT_EQ(second.result.start_step, 6);
  ASSERT_EQ(second.loss.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(first.loss[i], full.loss[i]);
    EXPECT_EQ(second.loss[i], full.loss[6 + i]) << "step " << 7 + i;
  }
  EXPECT_EQ(second.params.back(), full.params.back());  // bit-identical parameters
  fs::remove_all(dir);
}

// Builds the model of a manifest on every rank exactly as the trainer does, creates
// the optimizer strategy over its buffers and hands both to fn, with the rank's
// device memory in use just before the optimizer was created.
using OptFn = std::function<void(loom::runtime::RankRuntime&, loom::model::Model&, const loom_optimizer_api*,
                                 loom_optimizer*, uint64_t mem_before)>;

void with_optimizer(const std::vector<std::string>& overrides, const OptFn& fn) {
  const loom::train::RunPlan plan = loom::testing::plan_from(tiny_manifest(), overrides);
  const auto& m = plan.config;
  const int64_t vocab = loom::train::make_data_source(m)->vocab_size();
  loom::runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.device_options = &m.device.options;
  lc.comm_plugin = plan.comm;
  lc.comm_options = &m.comm.options;
  lc.sizes = plan.sizes;
  lc.threads = 1;
  loom::runtime::launch(lc, [&](loom::runtime::RankRuntime& rt) {
    const loom_model_dims dims = loom::model::model_dims(m, vocab, plan.sizes.tp);
    loom::model::Model model(m, *plan.registry, rt, dims, plan.layers, 7);
    std::vector<loom_param_info> infos = model.param_infos();
    loom_optimizer_create_args oa = loom::make<loom_optimizer_create_args>();
    oa.params = model.params();
    oa.grads = model.grads();
    oa.numel = model.numel();
    oa.param_dtype = LOOM_DTYPE_F32;
    oa.grad_dtype = LOOM_DTYPE_F32;
    oa.infos = infos.data();
    oa.num_params = infos.size();
    oa.dp = rt.group_or_self("dp").raw();
    oa.tp = rt.group_or_self("tp").raw();
    oa.pp = rt.group_or_self("pp").raw();
    std::vector<size_t> offsets;
    for (const Range& b : model.layout().buckets) offsets.push_back(b.start);
    offsets.push_back(model.layout().numel);
    oa.bucket_offsets = offsets.data();
    oa.num_buckets = model.layout().buckets.size();
    loom::plugins::OptionValues opts(&m.optimizer.options, plan.optimizer->options);
    const loom_optimizer_api* api = plan.optimizer->optimizer();
    const uint64_t before = rt.memory().current_bytes;
    loom_optimizer* opt = nullptr;
    loom::check(api->create(opts.raw(), &rt, &oa, &opt));
    std::unique_ptr<loom_optimizer, void (*)(loom_optimizer*)> guard(opt, api->destroy);
    fn(rt, model, api, opt, before);
  });
}

std::vector<char> save_state(const loom_optimizer_api* api, loom_optimizer* opt) {
  size_t bytes = 0;
  loom::check(api->state_size(opt, &bytes));
  std::vector<char> blob(bytes);
  loom::check(api->state_save(opt, blob.data(), bytes));
  return blob;
}

// Returns the error message of loading blob, or "" when it loaded.
std::string load_error(const loom_optimizer_api* api, loom_optimizer* opt, const std::vector<char>& blob) {
  try {
    loom::check(api->state_load(opt, blob.data(), blob.size()));
    return "";
  } catch (const loom::Error& e) {
    return e.what();
  }
}

TEST(Distopt, StateRoundTripsAndStateFromAnotherDpIsRefused) {
  // Train a few steps at dp=2 so the state is not all zeros, keep rank 0's blob.
  const std::string dir = loom::testing::scratch_dir("distopt-state");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  auto trained = run_and_trace(tiny_manifest(), {kDistributed, "parallel.dp=2", "run.steps=3", ck});
  ASSERT_EQ(trained.params.size(), 3u);
  const loom::train::RankState saved = loom::train::read_rank_file(
      loom::train::checkpoint_path(dir, 3), 0, static_cast<int64_t>(trained.params.back().size()));
  fs::remove_all(dir);
  const std::vector<char>& blob = saved.optimizer;
  ASSERT_GT(blob.size(), 64u);
  EXPECT_EQ(std::string(blob.data(), 8), "LOOMDOPT");

  // Same dp: loads, and saving again gives the same bytes.
  std::mutex mu;
  std::vector<char> resaved;
  with_optimizer({kDistributed, "parallel.dp=2"}, [&](auto& rt, auto&, auto* api, auto* opt, uint64_t) {
    if (rt.global_rank() != 0) return;
    EXPECT_EQ(load_error(api, opt, blob), "");
    std::lock_guard<std::mutex> lock(mu);
    resaved = save_state(api, opt);
  });
  EXPECT_EQ(resaved, blob);

  // Another dp: refused, naming both sizes. A blob of another strategy, a truncated
  // one, and one of the other dp rank are refused too.
  std::string other_dp, ddp_blob, truncated, wrong_rank;
  with_optimizer({kDistributed, "parallel.dp=4"}, [&](auto& rt, auto&, auto* api, auto* opt, uint64_t) {
    if (rt.global_rank() != 0) return;
    other_dp = load_error(api, opt, blob);
    ddp_blob = load_error(api, opt, std::vector<char>(blob.size() - 40, 0));
    truncated = load_error(api, opt, std::vector<char>(blob.begin(), blob.begin() + 30));
  });
  with_optimizer({kDistributed, "parallel.dp=2"}, [&](auto& rt, auto&, auto* api, auto* opt, uint64_t) {
    if (rt.global_rank() != 1) return;
    wrong_rank = load_error(api, opt, blob);
  });
  EXPECT_NE(other_dp.find("dp=2"), std::string::npos) << other_dp;
  EXPECT_NE(other_dp.find("dp=4"), std::string::npos) << other_dp;
  EXPECT_NE(other_dp.find("resharding"), std::string::npos) << other_dp;
  EXPECT_NE(ddp_blob.find("not written by parallel/distributed"), std::string::npos) << ddp_blob;
  EXPECT_NE(truncated.find("truncated"), std::string::npos) << truncated;
  EXPECT_NE(wrong_rank.find("belongs to dp rank 0"), std::string::npos) << wrong_rank;

  // Another bucket layout at the same dp: refused as another layout.
  std::string other_layout;
  with_optimizer({kDistributed, "parallel.dp=2", "optimizer.bucket_size=1000"},
                 [&](auto& rt, auto&, auto* api, auto* opt, uint64_t) {
                   if (rt.global_rank() == 0) other_layout = load_error(api, opt, blob);
                 });
  EXPECT_NE(other_layout.find("another buffer layout"), std::string::npos) << other_layout;
}

// ---------------------------------------------------------------------------
// Memory: m, v and fp32 master weights for the shard only
// ---------------------------------------------------------------------------

TEST(Distopt, OptimizerMemoryFallsAsOneOverDp) {
  std::map<std::pair<std::string, int>, std::vector<uint64_t>> bytes;  // (strategy, dp) -> per rank
  std::map<int, size_t> numel;
  std::mutex mu;
  for (const std::string strategy : {"ddp", "distributed"})
    for (int dp : {1, 2, 4}) {
      with_optimizer({"optimizer.strategy=\"" + strategy + "\"", "parallel.dp=" + std::to_string(dp)},
                     [&](auto& rt, auto& model, auto*, auto*, uint64_t before) {
                       const uint64_t used = rt.memory().current_bytes - before;
                       std::lock_guard<std::mutex> lock(mu);
                       auto& v = bytes[{strategy, dp}];
                       v.resize(static_cast<size_t>(dp));
                       v[static_cast<size_t>(rt.global_rank())] = used;
                       numel[dp] = model.numel();
                     });
    }
  for (int dp : {1, 2, 4}) {
    // m and v in fp32 for the shard; fp32 weights are their own master copy (8 + 8/d, as Megatron-LM's docs/source/api-guide/dist_optimizer.md gives).
    const double ideal = 2.0 * 4.0 * static_cast<double>(numel[dp]) / dp;
    for (uint64_t b : bytes[{"distributed", dp}]) {
      EXPECT_GE(static_cast<double>(b), ideal) << "dp=" << dp;
      EXPECT_LE(static_cast<double>(b), ideal * 1.02 + 8192) << "dp=" << dp;
    }
  }
  ASSERT_EQ(numel[2], numel[4]);  // the same buffer: lcm(2,128) = lcm(4,128)
  const double ratio =
      static_cast<double>(bytes[{"distributed", 2}][0]) / static_cast<double>(bytes[{"distributed", 4}][0]);
  EXPECT_NEAR(ratio, 2.0, 0.05);
  // DDP keeps m and v for every element: dp = 1 distopt equals it, dp > 1 is less.
  EXPECT_NEAR(static_cast<double>(bytes[{"distributed", 1}][0]), static_cast<double>(bytes[{"ddp", 1}][0]), 8192.0);
  const uint64_t dist2 = bytes[{"distributed", 2}][0], ddp2 = bytes[{"ddp", 2}][0];
  EXPECT_LT(dist2, ddp2);
}

}  // namespace
