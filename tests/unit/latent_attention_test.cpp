// Multi-latent attention (DeepSeek-V2/V3) in DeepSeek-shaped blocks (RMSNorm, SwiGLU,
// rotary embeddings, no biases) through every layout and execution mode the other
// attention variants are checked under: tp 2 and 4 with and without sequence
// parallelism, cp 2 (alone and with tp 2 + SP), pipeline stages (interleaved too), dp 2
// with the distributed optimizer, and with DeepSeek-V3's mixture of experts (sigmoid
// router, expert bias, a shared expert) at ep 2 train as the serial run; partial graphs
// and recomputation are bit-identical to eager; bf16 tracks fp32. The layer itself
// (reference forward, finite differences, the generation cache, tp against one rank)
// is Layers.MultiLatentAttention*.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

namespace {

using loom::testing::expect_bit_identical;
using loom::testing::expect_trains_as_serial;
using loom::testing::RankTrace;

// Heads of 6 + 4 rotated q/k elements and 5 value elements (packed heads padded in v),
// latents of 12 (q) and 10 (kv); sequences of 32 so cp 2 x tp 2 (SP) has shards of 8.
const std::vector<std::string>& deepseek() {
  static const std::vector<std::string> o = {
      "model.seq_length=32",
      "data.digits=4",
      "model.layer.embedding.position_embedding=rope",
      "model.layer.attention.position_embedding=rope",
      "model.layer.attention.multi_latent_attention=true",
      "model.layer.attention.q_lora_rank=12",
      "model.layer.attention.kv_lora_rank=10",
      "model.layer.attention.qk_head_dim=6",
      "model.layer.attention.qk_pos_emb_head_dim=4",
      "model.layer.attention.v_head_dim=5",
      "model.layer.attention.norm=rmsnorm",
      "model.layer.attention.bias=false",
      "model.layer.mlp.norm=rmsnorm",
      "model.layer.mlp.activation=swiglu",
      "model.layer.mlp.bias=false",
      "model.layer.lm_head.norm=rmsnorm",
      "optimizer.eps=1e-6",
      "model.num_layers=4"};
  return o;
}

RankTrace run(std::vector<std::string> o, const std::string& manifest = loom::testing::tiny_manifest()) {
  o.insert(o.begin(), deepseek().begin(), deepseek().end());
  return loom::testing::run_all_ranks(manifest, o);
}


TEST(LatentAttention, TensorParallelMatchesSerialWithAndWithoutSp) {
  const RankTrace serial = run({});
  expect_trains_as_serial(serial, run({"parallel.tp=2"}));
  expect_trains_as_serial(serial, run({"parallel.tp=2", "parallel.sequence_parallel=true"}));
  expect_trains_as_serial(serial, run({"parallel.tp=4", "parallel.sequence_parallel=true"}));
  // q projected directly (no query latent: DeepSeek-V2-Lite); value heads wider than q
  // and k (the packed heads padded in q and k).
  for (const std::vector<std::string>& variant : {std::vector<std::string>{"model.layer.attention.q_lora_rank=0"},
                                                   std::vector<std::string>{"model.layer.attention.v_head_dim=12"}}) {
    SCOPED_TRACE(variant.front());
    const RankTrace variant_serial = run(variant);
    EXPECT_NE(variant_serial.loss.back(), serial.loss.back());
    expect_trains_as_serial(variant_serial, run(loom::testing::with_overrides(variant, {"parallel.tp=2"})));
    expect_trains_as_serial(variant_serial, run(loom::testing::with_overrides(
                                             variant, {"parallel.tp=2", "parallel.sequence_parallel=true"})));
  }
}

// Each cp rank's two chunks rotate by their positions in the whole sequence, and the
// gathered keys are the padded packed heads.
TEST(LatentAttention, ContextParallelMatchesSerial) {
  const RankTrace serial = run({});
  expect_trains_as_serial(serial, run({"parallel.cp=2"}));
  expect_trains_as_serial(serial, run({"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"}));
}

TEST(LatentAttention, PipelineAndDistributedOptimizerMatchSerial) {
  const RankTrace serial = run({});
  expect_trains_as_serial(serial, run({"parallel.pp=2", "parallel.vpp=2"}));
  expect_trains_as_serial(serial, run({"parallel.dp=2", "optimizer.strategy=\"distributed\""}));
}

TEST(LatentAttention, PartialGraphsAndRecomputationAreBitIdenticalToEager) {
  const RankTrace eager = run({});
  expect_bit_identical(eager, run({"exec.mode=\"partial_graph\""}));
  expect_bit_identical(eager, run({"model.recompute_granularity=\"full\""}));
}

TEST(LatentAttention, Bf16TracksFp32) {
  loom::testing::expect_bf16_tracks_fp32(run({}), run({"device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\""}));
}

// DeepSeek-V3's block: multi-latent attention before a mixture of experts with a
// sigmoid router, the auxiliary-loss-free expert bias and a shared expert, at ep 2 and
// tp 2 + SP as the serial run.
TEST(LatentAttention, WithDeepSeekMixtureOfExpertsMatchesSerial) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]",
                                        "model.layer.moe.norm=rmsnorm",
                                        "model.layer.moe.activation=swiglu",
                                        "model.layer.moe.bias=false",
                                        "model.layer.moe.score_function=\"sigmoid\"",
                                        "model.layer.moe.aux_loss_coeff=0.0",
                                        "model.layer.moe.expert_bias=true",
                                        "model.layer.moe.shared_expert_ffn_hidden_size=16"};
  auto with = [&](std::vector<std::string> o) {
    return run(loom::testing::with_overrides(moe, o), loom::testing::tiny_moe_manifest());
  };
  const RankTrace serial = with({});
  expect_trains_as_serial(serial, with({"parallel.dp=2", "parallel.ep=2"}));
  expect_trains_as_serial(serial, with({"parallel.tp=2", "parallel.sequence_parallel=true"}));
}

}  // namespace
