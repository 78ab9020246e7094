// Activation recomputation (model.recompute_granularity = "full", Megatron's full
// granularity): recomputed blocks keep nothing between forward and backward but
// their input (a uniform group's blocks: the group's input), and the forward runs
// again before their backward. The recomputed forward
// sees the same input and the same dropout seeds, so training is bit-identical to
// keeping the activations, in every layout (tp + SP, interleaved pipeline, dropout,
// MoE with expert parallelism and capacity, context parallelism); the activation
// memory a run holds falls, and `loom plan` predicts it.
#include "support/rank_trace.hpp"

#include "engine/model/param_plan.hpp"
#include "engine/train/memory_plan.hpp"

#include <gtest/gtest.h>

#include <map>
#include <mutex>

namespace {

using loom::testing::RankTrace;

std::string manifest() {
  return loom::testing::tiny_manifest() + R"(
[parallel]
[model.layer.moe]
num_experts = 4
top_k = 2
ffn_hidden_size = 64
)";
}

RankTrace run(std::vector<std::string> o) { return loom::testing::run_all_ranks(manifest(), o); }

// Every step's loss and every rank's parameters equal bit for bit.
void expect_bit_identical(const std::vector<std::string>& layout) {
  SCOPED_TRACE(::testing::PrintToString(layout));
  std::vector<std::string> full = layout;
  full.push_back("model.recompute_granularity=\"full\"");
  const RankTrace kept = run(layout), recomputed = run(full);
  ASSERT_EQ(recomputed.loss.size(), kept.loss.size());
  for (size_t s = 0; s < kept.loss.size(); ++s) {
    EXPECT_EQ(recomputed.loss[s], kept.loss[s]) << "loss at step " << s + 1;
    EXPECT_EQ(recomputed.result.steps[s].aux_loss, kept.result.steps[s].aux_loss) << "aux loss at step " << s + 1;
  }
  for (const auto& [rank, steps] : kept.params)
    EXPECT_EQ(recomputed.params.at(rank).back(), steps.back()) << "rank " << rank;
}

TEST(Recompute, FullTrainsBitIdenticallyToKeepingActivations) {
  expect_bit_identical({});
  expect_bit_identical({"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"});
  expect_bit_identical({"model.num_layers=4", "parallel.pp=2", "parallel.vpp=2"});
  expect_bit_identical({"parallel.cp=2", "parallel.dp=2", "optimizer.strategy=\"distributed\""});
  expect_bit_identical({"model.num_layers=4", "parallel.pp=2", "model.recompute_num_layers=1"});
}

// The masks of a recomputed forward are the forward's: they follow the step's
// seeds, not how often a layer ran.
TEST(Recompute, DropoutDrawsTheSameMasksAgain) {
  expect_bit_identical({"model.layer.embedding.dropout=0.1", "model.layer.attention.dropout=0.1",
                        "model.layer.mlp.dropout=0.1", "model.layer.mlp.activation_dropout=0.1"});
}

// MoE blocks route again in backward (the same logits, so the same routing and
// capacity drops) and exchange their tokens over ep again; the auxiliary loss is
// counted once.
TEST(Recompute, MoeBlocksRouteAndDispatchAgain) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]",
                                        "model.layer.moe.capacity_factor=0.5", "model.layer.moe.dropout=0.1"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), moe.begin(), moe.end());
    return o;
  };
  expect_bit_identical(with({}));
  expect_bit_identical(with({"parallel.dp=2", "parallel.ep=2"}));
}

// A 4-block run of 2 steps with these options, on one stage (one microbatch in
// flight): the activation memory it measured, and what `loom plan` says it holds
// and re-creates while recomputing (the plan's held bytes must be the Model's).
struct Measured {
  uint64_t run = 0, plan = 0, recompute_plan = 0;
};
Measured measure(std::vector<std::string> o) {
  o.insert(o.end(), {"model.num_layers=4", "run.steps=2"});
  loom::train::TrainResult r;
  const std::map<int, uint64_t> declared = loom::testing::declared_activation_bytes(manifest(), o, &r);
  const loom::train::MemoryPlan plan = loom::train::plan_memory(loom::testing::plan_from(manifest(), o));
  EXPECT_EQ(plan.ranks.at(0).in_flight, 1);
  EXPECT_EQ(plan.ranks.at(0).activation_bytes, declared.at(0));
  return {r.steps.back().activation_bytes, plan.ranks[0].activation_bytes, plan.ranks[0].recompute_bytes};
}

// What a rank holds for a microbatch between forward and backward: the run's
// measured activation memory falls, and `loom plan` says what the Model holds.
TEST(Recompute, HoldsLessActivationMemoryAndThePlanSaysHowMuch) {
  const auto [kept_run, kept_plan, kept_recompute] = measure({});
  const auto [full_run, full_plan, full_recompute] = measure({"model.recompute_granularity=\"full\""});
  EXPECT_LT(full_run, kept_run / 2) << "rank 0 holds the blocks' inputs only";
  EXPECT_LT(full_plan, kept_plan / 2);
  // Megatron's block method: the first 2 of the 4 blocks recomputed, the others
  // keep theirs; halfway between (every block saves the same bytes).
  const auto [half_run, half_plan, half_recompute] =
      measure({"model.recompute_granularity=\"full\"", "model.recompute_num_layers=2"});
  EXPECT_LT(full_run, half_run);
  EXPECT_LT(half_run, kept_run);
  EXPECT_EQ(half_plan - full_plan, kept_plan - half_plan);
  // Recomputing re-creates one block's activations at a time, whatever N is.
  EXPECT_EQ(kept_recompute, 0u);
  EXPECT_GT(full_recompute, 0u);
  EXPECT_EQ(half_recompute, full_recompute);
}

// Megatron's uniform method: every block recomputed, in groups of N blocks that
// keep only the group's input; backward runs the whole group's forward again
// before the backward of its last layer. Bit-identical in every layout (the
// groups are per pipeline stage, or virtual stage).
TEST(Recompute, UniformGroupsTrainBitIdentically) {
  const std::vector<std::string> uniform = {"model.recompute_method=\"uniform\"", "model.num_layers=4",
                                            "model.recompute_num_layers=2"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), uniform.begin(), uniform.end());
    return o;
  };
  expect_bit_identical(with({}));
  expect_bit_identical(with({"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"}));
  expect_bit_identical(with({"parallel.pp=2", "parallel.vpp=2"}));
  expect_bit_identical(with({"parallel.pp=2", "model.layer.attention.dropout=0.1", "model.layer.mlp.dropout=0.1"}));
  expect_bit_identical(with({"model.block=[\"attention\", \"moe\"]", "model.layer.moe.capacity_factor=0.5",
                             "parallel.dp=2", "parallel.ep=2"}));
  expect_bit_identical({"model.recompute_method=\"uniform\"", "model.num_layers=3", "model.recompute_num_layers=2"});
}

// A group keeps one hidden state where the block method keeps one per block (its
// input; each block's inner state between attention and MLP goes either way):
// with 4 blocks in groups of 2, 2 hidden states fewer per microbatch. The plan
// says what the Model holds, and the run measures less.
TEST(Recompute, UniformGroupsKeepOnlyTheirInputs) {
  const std::string full = "model.recompute_granularity=\"full\"";
  const auto [block_run, block_plan, block_recompute] = measure({full});
  const auto [uniform_run, uniform_plan, uniform_recompute] =
      measure({full, "model.recompute_method=\"uniform\"", "model.recompute_num_layers=2"});
  const uint64_t hidden_state = 16 /*seq*/ * 2 /*micro batch*/ * 32 /*hidden*/ * sizeof(float);
  EXPECT_EQ(block_plan - uniform_plan, 2 * hidden_state);
  EXPECT_LT(uniform_run, block_run);
  // What a group re-creates during its backward (one microbatch in flight: on top of
  // the saved peak): a block's two layers' activations and the state between them;
  // a group of two blocks twice that and the state between the blocks.
  EXPECT_GT(block_recompute, hidden_state);
  EXPECT_EQ(uniform_recompute, 2 * block_recompute + hidden_state);
  EXPECT_EQ(measure({}).recompute_plan, 0u);
}

// A recomputed forward runs inside the backward, which partial graphs cannot
// replay around: refused at the key, with what to set.
TEST(Recompute, PartialGraphsAreRefusedAtTheKey) {
  std::string msg;
  try {
    loom::testing::plan_from(manifest(), {"model.recompute_granularity=\"full\"", "exec.mode=\"partial_graph\""});
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("model.recompute_granularity"), std::string::npos) << msg;
  EXPECT_NE(msg.find("exec.mode = \"eager\""), std::string::npos) << msg;
  std::string bad;
  try {
    loom::testing::plan_from(manifest(), {"model.recompute_granularity=\"selective\""});
  } catch (const std::exception& e) {
    bad = e.what();
  }
  EXPECT_NE(bad.find("\"full\""), std::string::npos) << bad;
}

}  // namespace
