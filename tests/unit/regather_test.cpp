// Resuming at another tensor, pipeline or expert layout (ABI 1.14 state_decode /
// state_import): the parameters and the optimizer state are regathered by name and
// element from the old ranks and cut for the new ones, and training continues as an
// uninterrupted run of the new layout does, to the reduction order: the losses of
// steps 6..10 and the final parameters (gathered whole, by name) within 1e-5.
#include "support/rank_trace.hpp"

#include "engine/train/checkpoint.hpp"
#include "engine/train/gather.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace {

namespace fs = boost::filesystem;

std::vector<float> as_floats(const loom::train::WholeTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == LOOM_DTYPE_BF16) {
      uint32_t bits = 0;
      std::memcpy(reinterpret_cast<char*>(&bits) + 2, t.data.data() + 2 * i, 2);
      std::memcpy(&out[i], &bits, 4);
    } else {
      std::memcpy(&out[i], t.data.data() + 4 * i, 4);
    }
  }
  return out;
}

// 5 steps at `from`, saved; resumed at `to` for steps 6..10; against 10 steps at `to`.
void check_regather(const std::vector<std::string>& model, const std::vector<std::string>& from,
                    const std::vector<std::string>& to, double tol = 1e-5) {
  const std::string dir = loom::testing::scratch_dir("regather"), ref = loom::testing::scratch_dir("regather-ref");
  auto with = [&](std::vector<std::string> o, const std::string& d, const char* steps) {
    o.insert(o.end(), model.begin(), model.end());
    o.insert(o.end(), {"optimizer.decay_steps=10", std::string(steps), "checkpoint.dir=\"" + d + "\""});
    return o;
  };
  const loom::testing::RankTrace whole = loom::testing::run_all_ranks(loom::testing::tiny_manifest(), with(to, ref, "run.steps=10"));
  loom::testing::run_all_ranks(loom::testing::tiny_manifest(), with(from, dir, "run.steps=5"));
  loom::train::TrainOptions resume;
  resume.resume = true;
  const loom::testing::RankTrace rest =
      loom::testing::run_all_ranks(loom::testing::tiny_manifest(), with(to, dir, "run.steps=10"), resume);
  ASSERT_EQ(rest.loss.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_NEAR(rest.loss[s], whole.loss[5 + s], tol * whole.loss[5 + s]) << "step " << 6 + s;
  const loom::train::WholeCheckpoint a = loom::train::gather_checkpoint(rest.result.checkpoint, loom::plugins::registry());
  const loom::train::WholeCheckpoint b = loom::train::gather_checkpoint(whole.result.checkpoint, loom::plugins::registry());
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const loom::train::WholeTensor& t : b.tensors) {
    const loom::train::WholeTensor* got = a.find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    std::vector<float> x = as_floats(*got), y = as_floats(t);
    // A vocabulary table's padding rows are never trained: a regathered run starts
    // them at zero, the uninterrupted one where initialisation and decay left them.
    if (t.shape.size() == 2 && t.shape[0] > b.vocab && t.name.find("word") != std::string::npos) {
      x.resize(static_cast<size_t>(b.vocab * t.shape[1]));
      y.resize(x.size());
    }
    EXPECT_LE(loom::testing::tensor_rel_diff(x, y), tol) << t.name;
  }
  fs::remove_all(dir);
  fs::remove_all(ref);
}

const std::vector<std::string> kFourLayers = {"model.num_layers=4"};

// Another gradient bucket size (turning optimizer.overlap_grad_reduce on sets
// Megatron-LM's 40M when none is given) may pad and shard the buffers otherwise: each
// rank maps its dp peers' files by parameter (state_load_resharded), for ddp and the
// distributed optimizer's shards, at dp 2 and with pp 2 x tp 2; when the buffers come
// out the same (40M and one bucket per chunk, on a small model) the files read as is.
TEST(Regather, AnotherBucketSizeAsOverlapSetsIt) {
  for (const char* strategy : {"optimizer.strategy=\"ddp\"", "optimizer.strategy=\"distributed\""}) {
    SCOPED_TRACE(strategy);
    check_regather({"model.hidden_size=24"}, {"parallel.dp=2", strategy},
                   {"parallel.dp=2", strategy, "optimizer.overlap_grad_reduce=true", "optimizer.bucket_size=1500"});
    check_regather({"model.hidden_size=24", "model.num_layers=4"},
                   {"parallel.dp=2", "parallel.pp=2", "parallel.tp=2", strategy, "optimizer.bucket_size=1500"},
                   {"parallel.dp=2", "parallel.pp=2", "parallel.tp=2", strategy});
    check_regather({"model.hidden_size=24"}, {"parallel.dp=2", strategy},
                   {"parallel.dp=2", strategy, "optimizer.overlap_grad_reduce=true"});
  }
}

TEST(Regather, Tp2Pp2ToTp1Pp4) {
  check_regather(kFourLayers, {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2"}, {"parallel.pp=4", "parallel.dp=1"});
}
TEST(Regather, Tp2Pp2ToTp4WithTheDistributedOptimizer) {
  std::vector<std::string> m = kFourLayers;
  m.push_back("optimizer.strategy=\"distributed\"");
  check_regather(m, {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2"}, {"parallel.tp=4", "parallel.dp=2"});
}
// bf16 parameters keep fp32 master weights in the optimizer state (a third array): the
// same arithmetic on one stage as on interleaved stages, so only exact master weights
// keep the bf16 run on the uninterrupted one's track.
TEST(Regather, InterleavedStagesToOneWithBf16MasterWeights) {
  std::vector<std::string> m = kFourLayers;
  m.insert(m.end(), {"device.param_dtype=\"bf16\"", "optimizer.strategy=\"distributed\""});
  check_regather(m, {"parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "pipeline.schedule=\"interleaved\""},
                 {"parallel.dp=2"});
}
TEST(Regather, Ep2ToEp1) {
  check_regather({"model.num_layers=2", "model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                  "model.layer.moe.top_k=2", "model.layer.moe.ffn_hidden_size=64",
                  "optimizer.strategy=\"distributed\""},
                 {"parallel.ep=2", "parallel.dp=2"}, {"parallel.tp=2", "parallel.dp=1"});
}

// Multi-latent attention's column-parallel up projections (heads split over tp) and
// duplicated down projections regather by name: tp 2 x pp 2 (SP) to tp 1 x pp 4.
TEST(Regather, MultiLatentAttentionTp2Pp2ToTp1Pp4) {
  check_regather({"model.num_layers=4", "model.layer.embedding.position_embedding=rope",
                  "model.layer.attention.position_embedding=rope", "model.layer.attention.multi_latent_attention=true",
                  "model.layer.attention.bias=false", "model.layer.attention.q_lora_rank=12",
                  "model.layer.attention.kv_lora_rank=10", "model.layer.attention.qk_pos_emb_head_dim=4",
                  "model.layer.attention.v_head_dim=6", "optimizer.strategy=\"distributed\""},
                 {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.sequence_parallel=true"},
                 {"parallel.pp=4", "parallel.dp=1"});
}

}  // namespace

namespace {

// The same pp with other chunks (virtual stages): each rank holds other layers.
TEST(Regather, AnotherNumberOfVirtualStages) {
  check_regather(kFourLayers, {"parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "pipeline.schedule=\"interleaved\""},
                 {"parallel.pp=2", "parallel.dp=2"});
}

}  // namespace

namespace {

// A resume continues the same model: a layer option that keeps every shape but changes
// the function (rope's base) is refused before anything runs, naming it; a
// training-only option (dropout) may change.
TEST(Resume, AnotherLayerOptionIsRefusedButTrainingOnlyOnesMayChange) {
  const std::string dir = loom::testing::scratch_dir("resume-options");
  const std::vector<std::string> rope = {"model.layer.embedding.position_embedding=rope",
                                         "model.layer.attention.position_embedding=rope",
                                         "checkpoint.dir=\"" + dir + "\""};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), rope.begin(), rope.end());
    return o;
  };
  loom::testing::run_all_ranks(loom::testing::tiny_manifest(), with({"run.steps=2"}));
  loom::train::TrainOptions resume;
  resume.resume = true;
  try {
    loom::testing::run_all_ranks(loom::testing::tiny_manifest(),
                                 with({"run.steps=3", "model.layer.attention.rotary_base=500000"}), resume);
    ADD_FAILURE() << "a resume with another rotary_base was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("holds a model with model.layer.attention.rotary_base = 10000.0, this run has "
                                         "model.layer.attention.rotary_base = 500000.0"),
              std::string::npos)
        << e.what();
  }
  const loom::testing::RankTrace t = loom::testing::run_all_ranks(
      loom::testing::tiny_manifest(), with({"run.steps=3", "model.layer.attention.dropout=0.1"}), resume);
  EXPECT_EQ(t.loss.size(), 1u);
  fs::remove_all(dir);
}

}  // namespace
