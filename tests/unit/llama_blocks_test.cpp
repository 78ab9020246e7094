// Llama-style blocks (RMSNorm before every sublayer and the head, SwiGLU MLPs, no
// biases, rotary embeddings instead of a position table, grouped-query attention)
// through the layouts and execution modes the GPT-2 blocks are checked under:
// pipeline and data parallelism with the distributed optimizer train as the serial
// run; partial CUDA-graph-style replays and activation recomputation are bit-identical
// to eager; bf16 tracks fp32. (tp with and without SP: TensorParallel.LlamaBlocks*
// and TensorParallel.GroupedQueryAttention*, TensorParallel.QkNorm*; cp:
// ContextParallel.Rope*.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/plugins/registry.hpp"
#include "engine/train/preflight.hpp"
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

namespace {

using loom::testing::expect_bit_identical;
using loom::testing::RankTrace;

const std::vector<std::string>& llama() {
  static const std::vector<std::string> o = {
      "model.layer.embedding.position_embedding=rope", "model.layer.attention.position_embedding=rope",
      "model.layer.attention.num_query_groups=2",      "model.layer.attention.norm=rmsnorm",
      "model.layer.attention.bias=false",              "model.layer.mlp.norm=rmsnorm",
      "model.layer.mlp.activation=swiglu",             "model.layer.mlp.bias=false",
      "model.layer.lm_head.norm=rmsnorm",              "optimizer.eps=1e-6",
      "model.num_layers=4"};
  return o;
}

RankTrace run(std::vector<std::string> o) {
  o.insert(o.begin(), llama().begin(), llama().end());
  return loom::testing::run_all_ranks(loom::testing::tiny_manifest(), o);
}


TEST(LlamaBlocks, PipelineAndDistributedOptimizerMatchSerial) {
  const RankTrace serial = run({});
  loom::testing::expect_trains_as_serial(serial, run({"parallel.pp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({"parallel.pp=2", "parallel.vpp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({"parallel.dp=2", "optimizer.strategy=\"distributed\""}));
}

TEST(LlamaBlocks, PartialGraphsAndRecomputationAreBitIdenticalToEager) {
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{}, std::vector<std::string>{"parallel.dp=2"}}) {
    const RankTrace eager = run(layout);
    std::vector<std::string> graphs = layout, recompute = layout;
    graphs.push_back("exec.mode=\"partial_graph\"");
    recompute.push_back("model.recompute_granularity=\"full\"");
    expect_bit_identical(eager, run(graphs));
    expect_bit_identical(eager, run(recompute));
  }
}

// bf16 parameters and activations with fp32 gradients track the fp32 run (the CPU
// test's bounds for the GPT-2 blocks: 5% per step).
TEST(LlamaBlocks, Bf16TracksFp32) {
  loom::testing::expect_bf16_tracks_fp32(run({}), run({"device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\""}));
}

// Qwen3's blocks (Llama's with each head's q and k RMSNorm-ed, qk_norm): the pipeline
// and the distributed optimizer train as the serial run, partial graphs and
// recomputation are bit-identical to eager, bf16 tracks fp32.
TEST(LlamaBlocks, WithQkNormTheLayoutsModesAndBf16HoldAsWithout) {
  const std::string qk = "model.layer.attention.qk_norm=true";
  const RankTrace serial = run({qk});
  loom::testing::expect_trains_as_serial(serial, run({qk, "parallel.pp=2", "parallel.vpp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({qk, "parallel.dp=2", "optimizer.strategy=\"distributed\""}));
  expect_bit_identical(serial, run({qk, "exec.mode=\"partial_graph\""}));
  expect_bit_identical(serial, run({qk, "model.recompute_granularity=\"full\""}));
  loom::testing::expect_tracks(serial, run({qk, "device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\""}), 0.01,
                               0.05, 0.05);
  EXPECT_NE(serial.loss.back(), run({}).loss.back()) << "qk_norm changed nothing";
}

// Qwen2's blocks (Llama's with biases on q, k and v alone: add_qkv_bias, Megatron-LM's
// --add-qkv-bias): tp 2 with and without SP (the bias split with the grouped
// columns), the pipeline and the distributed optimizer train as the serial run;
// partial graphs and recomputation are bit-identical to eager.
TEST(LlamaBlocks, WithQkvBiasTheLayoutsAndModesHoldAsWithout) {
  const std::string bias = "model.layer.attention.add_qkv_bias=true";
  const RankTrace serial = run({bias});
  loom::testing::expect_trains_as_serial(serial, run({bias, "parallel.tp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({bias, "parallel.tp=2", "parallel.sequence_parallel=true"}));
  loom::testing::expect_trains_as_serial(serial, run({bias, "parallel.pp=2", "parallel.vpp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({bias, "parallel.dp=2", "optimizer.strategy=\"distributed\""}));
  expect_bit_identical(serial, run({bias, "exec.mode=\"partial_graph\""}));
  expect_bit_identical(serial, run({bias, "model.recompute_granularity=\"full\""}));
  EXPECT_NE(serial.loss.back(), run({}).loss.back()) << "add_qkv_bias changed nothing";
  // The biases are q, k and v's: the projection has none.
  const loom::train::RunPlan plan =
      loom::testing::plan_from(loom::testing::tiny_manifest(), loom::testing::with_overrides(llama(), {bias}));
  bool qkv = false, proj = false;
  for (const auto& [name, values] : loom::testing::full_params(serial, 0)) {
    qkv = qkv || name.find("attention.qkv.bias") != std::string::npos;
    proj = proj || name.find("attention.proj.bias") != std::string::npos;
  }
  EXPECT_TRUE(qkv);
  EXPECT_FALSE(proj);
  (void)plan;
}

// A device plugin without the ops an option needs (one built before ABI 1.10) is
// refused when the layers are created, naming the option and the ops: `loom validate`
// says it, not the first step.
TEST(LlamaBlocks, ADeviceWithoutTheOpsAnOptionNeedsIsRefusedBeforeTheRun) {
  loom::testing::plan_from(loom::testing::tiny_manifest(), {});  // loads the plugins
  const loom::plugins::LoadedPlugin& cpu = loom::plugins::registry().get("device", "cpu");
  auto* ops = const_cast<loom_device_ops*>(cpu.device()->ops);
  auto refusal = [&](std::vector<std::string> o) {
    o.insert(o.begin(), llama().begin(), llama().end());
    try {
      const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
      loom::train::preflight(plan, plan.sizes.world);  // what loom validate runs: creates every rank's layers
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  {
    const auto saved = ops->rmsnorm_fwd;
    ops->rmsnorm_fwd = nullptr;
    const std::string msg = refusal({});
    ops->rmsnorm_fwd = saved;
    EXPECT_NE(msg.find("norm = \"rmsnorm\" needs the device ops rmsnorm_fwd and rmsnorm_bwd"), std::string::npos)
        << msg;
  }
  {
    const auto saved = ops->swiglu_bwd;
    ops->swiglu_bwd = nullptr;
    const std::string msg = refusal({"model.layer.attention.norm=layernorm", "model.layer.mlp.norm=layernorm",
                                     "model.layer.lm_head.norm=layernorm"});
    ops->swiglu_bwd = saved;
    EXPECT_NE(msg.find("activation = \"swiglu\" needs the device ops swiglu_fwd and swiglu_bwd"), std::string::npos)
        << msg;
  }
  {
    const auto saved = ops->rope_fwd;
    ops->rope_fwd = nullptr;
    const std::string msg = refusal({});
    ops->rope_fwd = saved;
    EXPECT_NE(msg.find("position_embedding = \"rope\" needs the device ops rope_fwd and rope_bwd"), std::string::npos)
        << msg;
  }
  EXPECT_EQ(refusal({}), "") << "with every op back, the Llama blocks plan";
}

}  // namespace
