// Pipeline parallelism through the whole engine: pp = 2, pp = 4, interleaved,
// uneven splits, with tp, dp and the distributed optimizer, train the same model
// as the serial run step by step (each parameter found on the stage holding it,
// its tp slices reassembled); the tied word embedding stays identical on the first
// and last stage; the schedules agree with each other; the real in-flight counts
// equal the schedule's bound; `trace_file` records every forward and backward.
#include "support/rank_trace.hpp"

#include "engine/pipeline/schedule.hpp"
#include "engine/topology/layer_split.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

namespace {

using loom::testing::RankTrace;

// Four transformer layers so pp = 4 and pp = 2 x vpp = 2 have a layer per chunk.
std::string manifest() { return loom::testing::tiny_manifest() + "\n[parallel]\n"; }
std::vector<std::string> with_layers(std::vector<std::string> o) {
  o.push_back("model.num_layers=4");
  return o;
}


RankTrace run(std::vector<std::string> overrides) {
  return loom::testing::run_all_ranks(manifest(), with_layers(std::move(overrides)));
}

TEST(Pipeline, Pp2MatchesSerial) { loom::testing::expect_trains_as_serial(run({}), run({"parallel.pp=2"})); }

TEST(Pipeline, Pp4MatchesSerial) { loom::testing::expect_trains_as_serial(run({}), run({"parallel.pp=4"})); }

TEST(Pipeline, InterleavedPp2Vpp2MatchesSerial) {
  loom::testing::expect_trains_as_serial(run({}), run({"parallel.pp=2", "parallel.vpp=2"}));
}

TEST(Pipeline, UnevenSplitMatchesSerial) {
  // Chunks of 1 and 3 layers: the first stage also carries the embedding.
  loom::testing::expect_trains_as_serial(run({}), run({"parallel.pp=2", "pipeline.first_chunk_layers=1"}));
}

TEST(Pipeline, UntiedPp2IsBitIdenticalToSerial) {
  // Nothing is summed in another order without tying, so nothing may differ.
  const RankTrace serial = run({"model.tie_embeddings=false"});
  const RankTrace par = run({"model.tie_embeddings=false", "parallel.pp=2"});
  loom::testing::expect_trains_as_serial(serial, par, 0.0);
}

TEST(Pipeline, Pp2Tp2Dp2MatchesSerial) {
  // eps = 1e-6 for the tp split, as in the tensor-parallel tests (docs/design-notes.md).
  loom::testing::expect_trains_as_serial(run({"optimizer.eps=1e-6"}),
                       run({"optimizer.eps=1e-6", "parallel.pp=2", "parallel.tp=2", "parallel.dp=2"}));
}

TEST(Pipeline, Pp2WithDistributedOptimizerMatchesSerial) {
  loom::testing::expect_trains_as_serial(run({}), run({"parallel.pp=2", "parallel.dp=2", "optimizer.strategy=\"distributed\""}));
}

TEST(Pipeline, GpipeAndOneFOneBGiveTheSameTraining) {
  // Both run each chunk's backwards in microbatch order, so the gradient sums are
  // the same sums: bit-identical.
  loom::testing::expect_trains_as_serial(run({"parallel.pp=2"}), run({"parallel.pp=2", "pipeline.schedule=\"gpipe\""}), 0.0);
}

TEST(Pipeline, TiedEmbeddingCopiesStayIdentical) {
  const RankTrace t = run({"parallel.pp=2", "parallel.dp=2", "optimizer.strategy=\"distributed\""});
  for (int dp = 0; dp < 2; ++dp) {
    const int first = loom::testing::rank_of(t, 0, dp, 0), last = loom::testing::rank_of(t, 0, dp, 1);
    auto find = [&](int rank) -> const loom::model::ParamEntry& {
      for (const auto& e : t.entries.at(rank))
        if (e.tie_key == "word_embedding") return e;
      ADD_FAILURE() << "rank " << rank << " holds no tied word embedding";
      return t.entries.at(rank).front();
    };
    const auto& a = find(first);
    const auto& b = find(last);
    EXPECT_TRUE(a.shared_across_stages);
    EXPECT_TRUE(b.shared_across_stages);
    EXPECT_NE(a.name, b.name) << "one copy is the embedding's, the other the output layer's";
    for (size_t s = 0; s < t.loss.size(); ++s) {
      const float* pa = t.params.at(first)[s].data() + a.offset;
      const float* pb = t.params.at(last)[s].data() + b.offset;
      ASSERT_EQ(std::vector<float>(pa, pa + a.numel), std::vector<float>(pb, pb + b.numel)) << "step " << s + 1;
    }
  }
}

// The most (chunk, microbatch) forwards a rank's order keeps awaiting their
// backward: the schedule's bound (warmup + 1 for 1F1B and interleaved).
void expect_in_flight_bound(const std::vector<std::string>& overrides, const std::string& schedule) {
  std::vector<std::string> o = with_layers(overrides);
  const RankTrace t = loom::testing::run_all_ranks(manifest(), o);
  const auto plan = loom::testing::plan_from(manifest(), o);
  const int pp = plan.sizes.pp, vpp = static_cast<int>(plan.manifest.get_int("parallel.vpp"));
  const int M = static_cast<int>(plan.microbatches);
  const auto orders = loom::pipeline::compute_orders(*plan.schedule, nullptr, pp, vpp, M, 0);
  for (int r = 0; r < pp; ++r) {
    const int bound = schedule == "gpipe" ? M * vpp : std::min(orders.warmup[r] + 1, M * vpp);
    for (int g = 0; g < plan.sizes.world; ++g) {
      if (g / (plan.sizes.tp * plan.dp) != r) continue;  // ranks of stage r
      EXPECT_EQ(t.result.peak_in_flight.at(g), bound) << schedule << " rank " << g << " (stage " << r << ")";
      EXPECT_GT(t.result.peak_activation_bytes.at(g), 0u);
    }
  }
}

TEST(Pipeline, InFlightCountsEqualTheScheduleBound) {
  expect_in_flight_bound({"parallel.pp=2"}, "1f1b");
  expect_in_flight_bound({"parallel.pp=4"}, "1f1b");
  expect_in_flight_bound({"parallel.pp=2", "parallel.vpp=2"}, "interleaved");
  expect_in_flight_bound({"parallel.pp=2", "pipeline.schedule=\"gpipe\""}, "gpipe");
}

TEST(Pipeline, FewerActivationsInFlightWith1F1BThanGpipe) {
  // 8 microbatches per step on 2 stages: gpipe keeps all 8 on stage 0, 1F1B 2.
  std::vector<std::string> o = with_layers({"parallel.pp=2", "batch.global_batch_size=16", "run.steps=2"});
  const RankTrace onef = loom::testing::run_all_ranks(manifest(), o);
  o.push_back("pipeline.schedule=\"gpipe\"");
  const RankTrace gpipe = loom::testing::run_all_ranks(manifest(), o);
  EXPECT_EQ(onef.result.peak_in_flight.at(0), 2);
  EXPECT_EQ(gpipe.result.peak_in_flight.at(0), 8);
  EXPECT_LT(onef.result.peak_activation_bytes.at(0), gpipe.result.peak_activation_bytes.at(0));
}

TEST(Pipeline, TraceRecordsEveryForwardAndBackward) {
  const std::string path = loom::testing::scratch_dir("pipeline-trace") + "/trace.json";
  loom::train::TrainOptions opts;
  opts.trace_file = path;
  const std::vector<std::string> o = with_layers({"parallel.pp=2", "parallel.vpp=2", "run.steps=2"});
  const RankTrace t = loom::testing::run_all_ranks(manifest(), o, opts);
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const nlohmann::ordered_json events = nlohmann::ordered_json::parse(in);
  ASSERT_TRUE(events.is_array());
  auto count = [&](const std::string& key, const std::string& value) {
    return static_cast<size_t>(std::count_if(events.begin(), events.end(), [&](const nlohmann::ordered_json& e) {
      return e.contains(key) && e.at(key) == value;
    }));
  };
  // 2 steps x 2 ranks x 2 chunks x 4 microbatches of each.
  EXPECT_EQ(count("cat", "forward"), 32u);
  EXPECT_EQ(count("cat", "backward"), 32u);
  EXPECT_EQ(count("cat", "optimizer"), 4u);
  EXPECT_GT(count("cat", "p2p"), 0u);
  // The tied embedding's gradient sum, once per step on each of the two stages.
  EXPECT_EQ(count("name", "embedding all_reduce"), 4u);
  // Each rank's track, and its comm track with the receives it posted early: of its
  // 4 (chunk, direction) pairs all but the first chunk's forward or the last's
  // backward receive, 4 microbatches each.
  EXPECT_EQ(count("name", "thread_name"), 4u);
  EXPECT_EQ(count("name", "pp recv"), 2u * 2u * 3u * 4u);
}

TEST(Pipeline, RunRefusesADeadlockingScheduleBeforeAnyRankStarts) {
  // The deliberately broken schedule plugin from tests/pipeline: every order is well
  // formed, together they deadlock. `loom run` must say so, not hang.
  const std::string m = manifest() + "pp = 2\n[plugins]\nsearch_paths = [\"" LOOM_TEST_BUILD_DIR
                        "/tests/pipeline/plugins\"]\n[pipeline]\nschedule = \"deadlock\"\n";
  std::vector<int64_t> steps_run;
  loom::train::TrainOptions opts;
  opts.on_step = [&](int64_t step, int, const loom::model::Model&) { steps_run.push_back(step); };
  try {
    loom::train::train(loom::testing::plan_from(m, with_layers({})), opts);
    FAIL() << "a deadlocking schedule was run";
  } catch (const loom::pipeline::ScheduleError& e) {
    EXPECT_EQ(e.kind(), loom::pipeline::ScheduleError::Kind::deadlock);
    EXPECT_NE(std::string(e.what()).find("schedule parallel/pipeline.deadlock deadlocks"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(steps_run.empty());
}

TEST(Pipeline, LayerSplitRule) {
  using loom::topology::blocks_per_chunk;
  EXPECT_EQ(blocks_per_chunk(8, 2, 2, 0, 0), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(blocks_per_chunk(7, 4, 1, 1, 0), (std::vector<int>{1, 2, 2, 2}));
  EXPECT_EQ(blocks_per_chunk(6, 4, 1, 1, 1), (std::vector<int>{1, 2, 2, 1}));
  EXPECT_THROW(blocks_per_chunk(7, 4, 1, 2, 0), std::invalid_argument);  // 5 over 3 chunks
  EXPECT_THROW(blocks_per_chunk(3, 2, 1, 4, 0), std::invalid_argument);  // more than the model has
  // pipeline.chunk_layers: each chunk's count as given; the first and last may hold none.
  EXPECT_EQ(blocks_per_chunk(8, 2, 2, 0, 0, {0, 3, 3, 2}), (std::vector<int>{0, 3, 3, 2}));
  EXPECT_EQ(blocks_per_chunk(5, 2, 1, 0, 0, {5, 0}), (std::vector<int>{5, 0}));
  auto why = [&](int blocks, int pp, int vpp, const std::vector<int>& each) {
    try {
      blocks_per_chunk(blocks, pp, vpp, 0, 0, each);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(why(8, 2, 2, {4, 4}).find("there are pp * vpp = 4 chunks"), std::string::npos);
  EXPECT_NE(why(8, 2, 2, {2, 2, 2, 1}).find("they add up to 7, but the model has 8 transformer layers"),
            std::string::npos);
  EXPECT_NE(why(8, 2, 2, {4, 0, 2, 2}).find("chunk 1 would hold nothing"), std::string::npos);
  try {
    loom::testing::plan_from(manifest(), with_layers({"parallel.pp=4", "pipeline.first_chunk_layers=2"}));
    FAIL() << "an uneven split that does not add up was accepted";
  } catch (const loom::manifest::ManifestError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("pipeline.first_chunk_layers"), std::string::npos) << what;
    EXPECT_NE(what.find("not a positive multiple of 3"), std::string::npos) << what;
  }
}

}  // namespace
