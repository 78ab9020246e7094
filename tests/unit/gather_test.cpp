// Gathering a checkpoint (engine/train/gather.hpp, what `loom export` reads): the whole
// tensors put together from the rank files of a layout equal those the test fixture
// assembles from every rank's live parameters at the same step (tests/support/
// rank_trace.hpp full_params), for tensor (with SP), pipeline (interleaved), context,
// data, and expert parallelism (expert tp = tp, and folded), fp32 and bf16.
#include "support/rank_trace.hpp"

#include "engine/train/gather.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <cstring>

namespace {

namespace fs = boost::filesystem;

std::string moe_manifest() {
  return loom::testing::tiny_manifest() + R"(
[parallel]
[model.layer.moe]
num_experts = 4
top_k = 2
ffn_hidden_size = 64
)";
}

float widen(const loom::train::WholeTensor& t, size_t i) {
  float f = 0;
  if (t.dtype == LOOM_DTYPE_BF16) {
    uint32_t bits = 0;
    std::memcpy(reinterpret_cast<char*>(&bits) + 2, t.data.data() + 2 * i, 2);
    std::memcpy(&f, &bits, 4);
  } else {
    std::memcpy(&f, t.data.data() + 4 * i, 4);
  }
  return f;
}

void check_gather(const std::string& manifest, std::vector<std::string> overrides) {
  const fs::path dir = fs::temp_directory_path() / fs::unique_path("loom-gather-%%%%%%");
  overrides.insert(overrides.end(), {"run.steps=3", "checkpoint.every=3", "checkpoint.dir=\"" + dir.string() + "\""});
  const loom::testing::RankTrace t = loom::testing::run_all_ranks(manifest, overrides);
  ASSERT_FALSE(t.result.checkpoint.empty());
  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(t.result.checkpoint, loom::plugins::registry());
  const auto want = loom::testing::full_params(t, t.loss.size() - 1);
  size_t compared = 0;
  for (int p = 0; p < t.pp; ++p)
    for (const loom::model::ParamEntry& e : t.entries.at(loom::testing::rank_of(t, 0, 0, p))) {
      const loom::train::WholeTensor* got = ck.find(e.name);
      if (got == nullptr && !e.tie_key.empty()) continue;  // a tied copy: gathered under its first holder's name
      ASSERT_NE(got, nullptr) << e.name;
      const std::vector<float>& w = want.at(loom::testing::param_key(e));
      ASSERT_EQ(static_cast<size_t>(got->numel()), w.size()) << e.name;
      for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(widen(*got, i), w[i]) << e.name << "[" << i << "]";
      ++compared;
    }
  EXPECT_EQ(compared, ck.tensors.size());
  fs::remove_all(dir);
}

TEST(Gather, TensorAndInterleavedPipelineParallel) {
  check_gather(loom::testing::tiny_manifest(), {"parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"});
}
TEST(Gather, SequenceAndContextParallelWithDataParallelReplicas) {
  check_gather(loom::testing::tiny_manifest(),
               {"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.dp=2",
                "model.tie_embeddings=false"});
}
TEST(Gather, Bf16Parameters) {
  check_gather(loom::testing::tiny_manifest(), {"parallel.tp=2", "parallel.pp=2", "device.param_dtype=\"bf16\""});
}
TEST(Gather, ExpertParallelWithExpertTensorParallel) {
  check_gather(moe_manifest(), {"model.block=[\"attention\", \"moe\"]", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.ep=2", "parallel.dp=2"});
}
TEST(Gather, FoldedExperts) {
  check_gather(moe_manifest(), {"model.block=[\"attention\", \"moe\"]", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.etp=1", "parallel.ep=2"});
}

}  // namespace
