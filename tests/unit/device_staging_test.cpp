// A device that keeps its memory apart from the host's, with a comm plugin that takes
// host buffers only (comm/local): the engine copies each collective's device buffers
// through host memory (runtime::DeviceStaging). device/cpu_staged (tests/staged_device)
// is device/cpu declaring its memory as its own, so the staging runs here as it would
// for device/cuda on one GPU:
//   - every layout trains bit-identically to device/cpu (the same reductions in the
//     same order): dp with ddp and with the distributed optimizer and both overlaps
//     (started collectives, run in line when staged), tp 2 + SP, cp 2, pp 2 with the
//     tied embedding, ep 2 (MoE all-to-all-v);
//   - bytes were staged (the path ran), and the plan says the run stages.
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

#include "engine/runtime/comm_stats.hpp"

#include <gtest/gtest.h>

namespace {

using loom::testing::RankTrace;
using loom::testing::run_all_ranks;
using loom::testing::tiny_manifest;

const std::string kStaged = std::string("plugins.search_paths=[\"") + LOOM_TEST_BUILD_DIR +
                            "/tests/staged_device/plugins\"]";

std::vector<std::string> with(std::vector<std::string> v, const std::vector<std::string>& extra) {
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

std::string moe_manifest() {
  return tiny_manifest() + R"(
[model.layer.moe]
num_experts = 4
top_k = 2
ffn_hidden_size = 32
)";
}

void expect_same_training(const std::string& manifest, const std::vector<std::string>& layout) {
  const std::vector<std::string> base = with({"run.steps=3", kStaged}, layout);
  const uint64_t before = loom::runtime::DeviceStaging::staged_bytes();
  const RankTrace host = run_all_ranks(manifest, base);
  EXPECT_EQ(loom::runtime::DeviceStaging::staged_bytes(), before) << "device/cpu's memory is the host's: no staging";
  const RankTrace staged = run_all_ranks(manifest, with(base, {"device.kind=\"cpu_staged\""}));
  EXPECT_GT(loom::runtime::DeviceStaging::staged_bytes(), before) << "no collective was staged";
  ASSERT_EQ(staged.loss.size(), host.loss.size());
  for (size_t s = 0; s < host.loss.size(); ++s) {
    EXPECT_EQ(staged.loss[s], host.loss[s]) << "loss at step " << s + 1;
    EXPECT_EQ(staged.result.steps[s].grad_norm, host.result.steps[s].grad_norm) << "gradient norm at step " << s + 1;
  }
  ASSERT_EQ(staged.params.size(), host.params.size());
  for (const auto& [rank, steps] : host.params)
    for (size_t s = 0; s < steps.size(); ++s)
      EXPECT_TRUE(staged.params.at(rank)[s] == steps[s]) << "rank " << rank << " parameters at step " << s + 1;
}

TEST(DeviceStaging, DataParallelTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.dp=2"});
}

TEST(DeviceStaging, TheDistributedOptimizerWithBothOverlapsTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.dp=2", "optimizer.strategy=\"distributed\"",
                                         "optimizer.bucket_size=1500", "optimizer.overlap_grad_reduce=true",
                                         "optimizer.overlap_param_gather=true"});
}

TEST(DeviceStaging, TensorAndSequenceParallelTrainAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.tp=2", "parallel.sequence_parallel=true"});
}

TEST(DeviceStaging, ContextParallelTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.cp=2"});
}

TEST(DeviceStaging, APipelineWithATiedEmbeddingTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.pp=2"});
}

TEST(DeviceStaging, ExpertParallelAllToAllTrainsAsOnTheHost) {
  expect_same_training(moe_manifest(), {"model.block=[\"attention\", \"moe\"]", "parallel.dp=2", "parallel.ep=2"});
}

TEST(DeviceStaging, ThePlanSaysTheRunStages) {
  auto staging_warning = [](const std::vector<std::string>& overrides) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), overrides).warnings)
      if (w.find("every collective copies its buffers through host memory") != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(staging_warning({kStaged, "device.kind=\"cpu_staged\"", "parallel.dp=2"}));
  EXPECT_FALSE(staging_warning({kStaged, "device.kind=\"cpu_staged\"", "parallel.dp=1"})) << "one rank: nothing to stage";
  EXPECT_FALSE(staging_warning({kStaged, "parallel.dp=2"})) << "device/cpu: host memory";
}

}  // namespace
