// Models whose transformer blocks differ (model.blocks + model.block_pattern: DeepSeek-V3's
// dense first layers before MoE ones, Gemma's local attention between global layers):
// each kind lands where the pattern says, every parallel layout trains as the serial
// run (pipeline stages and virtual chunks holding different kinds, tp + SP, cp, ep, the
// distributed optimizer), partial graphs and recomputation are bit-identical to eager,
// checkpoints compare what the blocks are rather than how the manifest writes them, and
// `loom plan --perf` measures a model of fewer blocks with one of each kind.
#include <gtest/gtest.h>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "engine/interop/hugging_face.hpp"
#include "engine/manifest/schema.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/perf_model.hpp"
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

namespace {

namespace fs = boost::filesystem;
using loom::testing::expect_bit_identical;
using loom::testing::expect_trains_as_serial;
using loom::testing::RankTrace;

// Three kinds of block over 4 blocks: a dense MLP after global attention, the default
// block (attention + MoE), and local attention (a window of 5 of the 32 tokens) before
// a dense MLP. Under pp 2 x vpp 2 each of the four chunks holds one block.
const std::vector<std::string>& mixed() {
  static const std::vector<std::string> o = {"model.seq_length=32",
                                             "data.digits=4",
                                             "optimizer.eps=1e-6",  // design-notes: what "equal" means
                                             "model.num_layers=4",
                                             "model.block=[\"attention\", \"moe\"]",
                                             "model.blocks.dense=[\"attention\", \"mlp\"]",
                                             "model.blocks.local=[\"local\", \"mlp\"]",
                                             "model.layer.local.plugin=\"attention\"",
                                             "model.layer.local.sliding_window=5",
                                             "model.block_pattern=[\"dense\", \"block\", \"local\", \"block\"]"};
  return o;
}

RankTrace run(const std::vector<std::string>& extra) {
  return loom::testing::run_all_ranks(loom::testing::tiny_moe_manifest(),
                                      loom::testing::with_overrides(mixed(), extra));
}


TEST(BlockPattern, PlacesEachKindWhereThePatternSays) {
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_moe_manifest(), mixed());
  std::vector<std::string> got;
  for (const auto& l : plan.layers) got.push_back(l.instance + ":" + l.plugin);
  const std::vector<std::string> want = {
      "embedding:embedding",           "blocks.0.attention:attention", "blocks.0.mlp:mlp",
      "blocks.1.attention:attention",  "blocks.1.moe:moe",             "blocks.2.local:attention",
      "blocks.2.mlp:mlp",              "blocks.3.attention:attention", "blocks.3.moe:moe",
      "lm_head:lm_head"};
  EXPECT_EQ(got, want);
  EXPECT_EQ(plan.config.model.block_key(0), "model.blocks.dense");
  EXPECT_EQ(plan.config.model.block_key(1), "model.block");
  // "NAME*N" is N in a row; the composition is the same however it is written.
  const loom::train::RunPlan runs = loom::testing::plan_from(
      loom::testing::tiny_moe_manifest(),
      loom::testing::with_overrides(mixed(), {"model.block_pattern=[\"dense*2\", \"block*2\"]"}));
  std::vector<std::string> plugins;
  for (const auto& l : runs.layers) plugins.push_back(l.plugin);
  EXPECT_EQ(plugins, (std::vector<std::string>{"embedding", "attention", "mlp", "attention", "mlp", "attention", "moe",
                                               "attention", "moe", "lm_head"}));
  EXPECT_EQ(loom::manifest::schema::block_composition(toml::parse(runs.manifest.to_toml())),
            "[attention, mlp] x 2, [attention, moe] x 2");
  // A kind the pattern never places is a warning; the pattern decides the model.
  const loom::train::RunPlan unused = loom::testing::plan_from(
      loom::testing::tiny_moe_manifest(),
      loom::testing::with_overrides(mixed(), {"model.block_pattern=[\"dense*2\", \"block*2\"]"}));
  ASSERT_FALSE(unused.warnings.empty());
  EXPECT_NE(unused.warnings.back().find("model.blocks.local is set but model.block_pattern places no 'local' block"),
            std::string::npos)
      << unused.warnings.back();
}

// What the manifest refuses, each naming the key and what to write.
TEST(BlockPattern, MalformedPatternsAreRefusedNamingTheKey) {
  auto refusal = [](const std::vector<std::string>& sets) {
    try {
      loom::testing::plan_from(loom::testing::tiny_moe_manifest(), loom::testing::with_overrides(mixed(), sets));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto expect_refused = [&](const std::vector<std::string>& sets, const std::string& part) {
    const std::string why = refusal(sets);
    EXPECT_NE(why.find(part), std::string::npos) << sets.front() << " -> " << why;
  };
  expect_refused({"model.block_pattern=[\"dense*3\", \"block\", \"local\"]"},
                 "model.block_pattern describes 5 block(s), but model.num_layers is 4");
  expect_refused({"model.block_pattern=[\"dens\", \"block*3\"]"},
                 "names block 'dens', which is neither model.block (\"block\") nor an entry of model.blocks "
                 "(defined: block, dense, local)");
  for (const char* bad : {"dense*0", "dense*", "*2", "dense*2x", "dense*100000", "dense*-1"})
    expect_refused({"model.block_pattern=[\"" + std::string(bad) + "\", \"block*3\"]"},
                   "must be a list of \"NAME\" or \"NAME*N\" entries (N from 1 to 65536), not \"" +
                       std::string(bad) + "\"");
  expect_refused({"model.blocks.block=[\"mlp\"]"}, "model.blocks must not define 'block' (that name is model.block's)");
  expect_refused({"model.blocks.dense=\"mlp\""}, "give each block kind an array of layer names (dense is not one)");
  expect_refused({"model.blocks.empty=[]"}, "give each block kind at least one layer (empty has none)");
  for (const char* name : {"d*2", "a b", "\"\""})
    expect_refused({"model.blocks." + std::string(name) + "=[\"mlp\"]"},
                   "name its block kinds with letters, digits, '_' and '-'");
  EXPECT_EQ(refusal({}), "");
}

TEST(BlockPattern, EveryLayoutTrainsAsTheSerialRun) {
  const RankTrace serial = run({});
  // The pattern is the model: the uniform one of model.block trains otherwise.
  EXPECT_NE(run({"model.block_pattern=[]"}).loss.back(), serial.loss.back());
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.pp=2"},
        {"parallel.pp=2", "parallel.vpp=2"},
        {"parallel.tp=2", "parallel.sequence_parallel=true"},
        {"parallel.cp=2"},
        {"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"},
        {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2"},
        // Uneven chunks (pipeline.chunk_layers): the first stage holds the embedding and
        // 1 block, the last 3; a first chunk of the embedding alone.
        {"parallel.pp=2", "pipeline.chunk_layers=[1, 3]"},
        {"parallel.pp=2", "parallel.vpp=2", "pipeline.chunk_layers=[0, 2, 1, 1]"},
        {"parallel.dp=2", "parallel.ep=2"},
        {"parallel.dp=2", "optimizer.strategy=\"distributed\"", "optimizer.overlap_grad_reduce=true"}}) {
    SCOPED_TRACE(layout.back());
    expect_trains_as_serial(serial, run(layout));
  }
}

// A pipeline stage of dense blocks only beside one of MoE blocks, under expert
// parallelism: the dense stage's ranks hold no experts to reduce over their expert
// data-parallel group.
TEST(BlockPattern, AStageWithoutExpertsTrainsAsTheSerialRunUnderExpertParallelism) {
  const std::vector<std::string> dense_first = {"model.block_pattern=[\"dense*2\", \"block*2\"]"};
  const RankTrace serial = run(dense_first);
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.pp=2", "parallel.dp=2", "parallel.ep=2"},
        {"parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "optimizer.strategy=\"distributed\""}}) {
    SCOPED_TRACE(layout.back());
    expect_trains_as_serial(serial, run(loom::testing::with_overrides(dense_first, layout)));
  }
}

TEST(BlockPattern, PartialGraphsAndRecomputationAreBitIdenticalToEager) {
  const RankTrace eager = run({});
  expect_bit_identical(eager, run({"exec.mode=\"partial_graph\""}));
  expect_bit_identical(eager, run({"model.recompute_granularity=\"full\"", "model.recompute_method=\"uniform\"",
                                   "model.recompute_num_layers=2"}));
}

// A checkpoint holds what the blocks are: the same composition written otherwise
// resumes, another one is refused naming the first parameter that differs (as any
// other model is: Checkpoint.AnotherModelIsRefusedNamingTheParameter).
TEST(BlockPattern, CheckpointsCompareTheBlocksNotHowTheyAreWritten) {
  const fs::path dir = fs::temp_directory_path() / fs::unique_path("loom-blocks-%%%%%%");
  const std::string ck = "checkpoint.dir=\"" + dir.string() + "\"";
  const std::string schedule = "optimizer.decay_steps=10";  // the 5-step run's schedule is the 10-step one's
  const std::vector<std::string> runs = {"model.block_pattern=[\"dense*2\", \"block*2\"]"};
  const std::vector<std::string> listed = {"model.block_pattern=[\"dense\", \"dense\", \"block\", \"block\"]"};
  const RankTrace whole = run(loom::testing::with_overrides(runs, {"run.steps=10", schedule}));
  run(loom::testing::with_overrides(runs, {"run.steps=5", schedule, ck, "checkpoint.every=5"}));
  loom::train::TrainOptions resume;
  resume.resume = true;
  const RankTrace resumed = loom::testing::run_all_ranks(
      loom::testing::tiny_moe_manifest(),
      loom::testing::with_overrides(mixed(), loom::testing::with_overrides(listed, {"run.steps=10", schedule, ck})),
      resume);
  ASSERT_EQ(resumed.loss.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(resumed.loss[s], whole.loss[s + 5]) << "step " << s + 6;
  try {
    loom::testing::run_all_ranks(
        loom::testing::tiny_moe_manifest(),
        loom::testing::with_overrides(mixed(), {"model.block_pattern=[\"block*2\", \"dense*2\"]", "run.steps=10", ck}),
        resume);
    ADD_FAILURE() << "a checkpoint of other blocks was resumed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 8 is blocks.0.mlp.ln.weight in the checkpoint but "
                                         "blocks.0.moe.ln.weight in this model"),
              std::string::npos)
        << e.what();
  }
  // checkpoint.init_weights compares the blocks by what they are: the same kinds in
  // another order are another model, named as such.
  try {
    const std::string weights = (dir / "step_00000010").string();
    const loom::train::RunPlan other = loom::testing::plan_from(
        loom::testing::tiny_moe_manifest(),
        loom::testing::with_overrides(mixed(), {"model.block_pattern=[\"block*2\", \"dense*2\"]", "run.steps=1",
                                                "checkpoint.init_weights=\"" + weights + "\""}));
    loom::train::TrainOptions opts;
    opts.read_init_weights = [&](int64_t vocab) {
      return loom::interop::read_initial_weights(weights, other, vocab, loom::plugins::registry());
    };
    loom::train::train(other, opts);
    ADD_FAILURE() << "weights of other blocks were taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("holds a model whose blocks are [attention, mlp] x 2, [attention, moe] x 2, "
                                         "this run's are [attention, moe] x 2, [attention, mlp] x 2"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
  // A checkpoint from before model.block_pattern (none in its manifest) reads as
  // model.block throughout, which the same model without a pattern is.
  EXPECT_EQ(loom::manifest::schema::block_composition(toml::parse("[model]\nnum_layers = 3\n")), "[attention, mlp] x 3");
  EXPECT_EQ(loom::manifest::schema::block_composition(
                toml::parse("[model]\nnum_layers = 3\nblock = [\"attention\", \"moe\"]\nblock_pattern = []\n")),
            "[attention, moe] x 3");
}

// A pipeline stage plans the memory of its own blocks: dense blocks then MoE ones over
// 2 stages plan, stage by stage, what a dense model's first stage and an MoE model's
// last stage do.
// One pipeline chunk holds every block whatever pipeline.chunk_layers says (a
// checkpoint trained at pp 2 sampled at pp 1): a warning, not a refusal.
TEST(BlockPattern, ChunkLayersOfOneChunkChangeNothing) {
  const loom::train::RunPlan plan = loom::testing::plan_from(
      loom::testing::tiny_moe_manifest(), loom::testing::with_overrides(mixed(), {"pipeline.chunk_layers=[1, 3]"}));
  EXPECT_EQ(plan.blocks_per_chunk, std::vector<int>{4});
  ASSERT_FALSE(plan.warnings.empty());
  EXPECT_NE(plan.warnings.back().find("pipeline.chunk_layers sizes the pipeline chunks; with one chunk (parallel.pp = 1) "
                                      "it changes nothing"),
            std::string::npos)
      << plan.warnings.back();
}

TEST(BlockPattern, EachStagePlansTheMemoryOfItsOwnBlocks) {
  auto stages = [](const std::string& pattern) {
    const std::vector<std::string> o = {"model.block_pattern=" + pattern, "parallel.pp=2", "run.steps=1"};
    return loom::train::plan_memory(
        loom::testing::plan_from(loom::testing::tiny_moe_manifest(), loom::testing::with_overrides(mixed(), o)));
  };
  const loom::train::MemoryPlan mixed_plan = stages("[\"dense*2\", \"block*2\"]");
  const loom::train::MemoryPlan dense = stages("[\"dense*4\"]"), moe = stages("[\"block*4\"]");
  ASSERT_EQ(mixed_plan.ranks.size(), 2u);
  EXPECT_EQ(loom::train::rank_total_bytes(mixed_plan.ranks[0]), loom::train::rank_total_bytes(dense.ranks[0]));
  EXPECT_EQ(loom::train::rank_total_bytes(mixed_plan.ranks[1]), loom::train::rank_total_bytes(moe.ranks[1]));
  EXPECT_NE(loom::train::rank_total_bytes(dense.ranks[1]), loom::train::rank_total_bytes(moe.ranks[1]));
  EXPECT_EQ(mixed_plan.ranks[0].expert_start, mixed_plan.ranks[0].buffer_numel) << "the dense stage holds no expert";
  EXPECT_LT(mixed_plan.ranks[1].expert_start, mixed_plan.ranks[1].buffer_numel) << "the MoE stage holds the experts";
}

// --measure-blocks: a model of fewer blocks holds one of each kind, so the estimate
// costs every layer of the whole model by FLOPs it measured.
TEST(BlockPattern, AModelOfFewerBlocksIsMeasuredWithOneOfEachKind) {
  // The local block last: the pattern's first 3 blocks are not all the kinds.
  const loom::train::RunPlan plan = loom::testing::plan_from(
      loom::testing::tiny_moe_manifest(),
      loom::testing::with_overrides(mixed(), {"model.block_pattern=[\"dense\", \"block*2\", \"local\"]"}));
  const loom::train::ComputeProfile three = loom::train::measure_compute(plan, 1, 3);
  EXPECT_EQ(three.blocks, 3);
  EXPECT_EQ(three.model_blocks, 4);
  const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
  const double step = loom::train::estimate_step(plan, mp, three, loom::train::plan_links(plan), 2).step_s;
  EXPECT_GT(step, 0.0);
  try {
    loom::train::measure_compute(plan, 1, 2);
    ADD_FAILURE() << "2 blocks measured a model of 3 kinds";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.block_pattern places 3 kinds of block, and each is measured; measure "
                                         "at least 3"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
