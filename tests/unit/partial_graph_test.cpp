// exec/partial_graph: capturable layer steps (attention and MLP, dropout
// included, at tp = 1) are captured into device graphs after warm-up and replayed. device/cpu
// graphs have CUDA's semantics (a capture records, host code does not run again on
// replay, one graph pool), so on CPU:
//  - the run is bit-identical to exec/eager at every step, for dp, pp (1F1B and
//    interleaved, several microbatches in flight) and bf16: replay computes on
//    the addresses of the capture, so any buffer the engine moved between steps,
//    any step-dependent value baked into a graph, or a skipped replay would show;
//  - the graph count is Megatron's 2 x captured layers x microbatches per rank and
//    every later step replays all of them;
//  - dropout is captured and still draws new masks every step (the seed is read
//    from device memory when the replay runs); tp > 1 runs directly, still equal;
//  - memory follows the schedule's in-flight bound, not the microbatch count.
#include "engine/runtime/rank_runtime.hpp"
#include "support/rank_trace.hpp"

#include <gtest/gtest.h>

#include <set>

namespace {

using loom::testing::RankTrace;
using loom::testing::run_all_ranks;
using loom::testing::tiny_manifest;

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// The graph run and the eager run hold the same parameters on every rank after
// every step, bit for bit, with the same losses (validation included) and the same
// activation memory per step (a replayed step holds what its capture allocated).
// same_activation_bytes = false where a layer's activations follow its routing
// (MoE): eager then measures each step's, a graph run keeps the high-water mark.
void expect_bit_identical(const RankTrace& eager, const RankTrace& graph, bool same_activation_bytes = true) {
  ASSERT_EQ(eager.loss.size(), graph.loss.size());
  for (size_t s = 0; s < eager.loss.size(); ++s) {
    EXPECT_EQ(eager.loss[s], graph.loss[s]) << "step " << s + 1;
    EXPECT_EQ(eager.result.steps[s].val_loss, graph.result.steps[s].val_loss) << "step " << s + 1;
    if (same_activation_bytes) {
      EXPECT_EQ(eager.result.steps[s].activation_bytes, graph.result.steps[s].activation_bytes) << "step " << s + 1;
    }
  }
  ASSERT_EQ(eager.params.size(), graph.params.size());
  for (const auto& [rank, steps] : eager.params) {
    ASSERT_EQ(steps.size(), graph.params.at(rank).size());
    for (size_t s = 0; s < steps.size(); ++s)
      ASSERT_EQ(steps[s], graph.params.at(rank)[s]) << "rank " << rank << ", step " << s + 1;
  }
}

struct Counts {
  uint64_t graphs, replays, direct;
};

// Runs eager and partial_graph (with its `exec_options`) on the same manifest;
// returns each rank's exec stats.
std::map<int, loom_exec_stats> run_both(const std::vector<std::string>& overrides,
                                        const std::vector<std::string>& exec_options = {},
                                        bool same_activation_bytes = true) {
  const RankTrace eager = run_all_ranks(tiny_manifest(), with(overrides, {"exec.mode=\"eager\""}));
  const RankTrace graph =
      run_all_ranks(tiny_manifest(), with(with(overrides, {"exec.mode=\"partial_graph\""}), exec_options));
  expect_bit_identical(eager, graph, same_activation_bytes);
  EXPECT_TRUE(eager.result.exec_stats.empty());  // eager reports nothing
  return graph.result.exec_stats;
}

// Per rank with `captured` capturable layers on it, M microbatches, `steps`
// steps and w warm-up runs: 2 * captured * M graphs (one per direction and
// microbatch, as Megatron counts them), each replayed on every step after the
// warm-up, the capturing one included; `direct_per_step` other layer steps (and
// sub-steps). `router_blocks` MoE blocks whose moe_router sub-steps are captured
// add 3 graphs per microbatch each: the forward's, and the backward's two.
void expect_counts(const loom_exec_stats& s, uint64_t captured, uint64_t M, uint64_t steps, uint64_t w,
                   uint64_t direct_per_step, uint64_t router_blocks = 0) {
  const uint64_t graphs = (2 * captured + 3 * router_blocks) * M;
  EXPECT_EQ(s.graphs, graphs);
  EXPECT_EQ(s.replays, graphs * (steps - w));
  EXPECT_EQ(s.direct, graphs * w + direct_per_step * steps);
}

// tiny: 2 layers (attention + mlp each) between embedding and lm_head; global
// batch 8 of micro-batch 2 -> M = 4 microbatches per step at dp 1.
TEST(PartialGraph, SerialAndDp2AreBitIdenticalToEager) {
  auto one = run_both({"run.steps=5"});
  ASSERT_EQ(one.size(), 1u);
  expect_counts(one.at(0), 4, 4, 5, 1, 4 * 4);  // embedding + lm_head, forward + backward, 4 microbatches
  auto two = run_both({"run.steps=5", "parallel.dp=2"});
  ASSERT_EQ(two.size(), 2u);
  for (int r = 0; r < 2; ++r) expect_counts(two.at(r), 4, 2, 5, 1, 4 * 2);
  // Evaluation between steps runs its forwards directly and leaves the graphs be.
  auto eval = run_both({"run.steps=4", "run.eval_every=2"});
  EXPECT_EQ(eval.at(0).graphs, 2u * 4u * 4u);
  EXPECT_EQ(eval.at(0).replays, 2u * 4u * 4u * 3u);
}

TEST(PartialGraph, PipelineSchedulesAreBitIdenticalToEager) {
  // 1F1B, pp 2: stage 0 has embedding + layer 1, stage 1 layer 2 + lm_head.
  auto pp = run_both({"run.steps=4", "parallel.pp=2"});
  ASSERT_EQ(pp.size(), 2u);
  for (int r = 0; r < 2; ++r) expect_counts(pp.at(r), 2, 4, 4, 1, 2 * 4);
  // Interleaved, pp 2 x vpp 2 with four layers: one layer per chunk.
  auto vpp = run_both({"run.steps=4", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"});
  ASSERT_EQ(vpp.size(), 2u);
  for (int r = 0; r < 2; ++r) expect_counts(vpp.at(r), 4, 4, 4, 1, 2 * 4);
}

TEST(PartialGraph, Bf16AndWarmupAndScopes) {
  auto bf16 = run_both({"run.steps=4", "device.param_dtype=\"bf16\""});
  expect_counts(bf16.at(0), 4, 4, 4, 1, 4 * 4);
  auto w2 = run_both({"run.steps=3"}, {"exec.options.warmup_steps=2"});
  expect_counts(w2.at(0), 4, 4, 3, 2, 4 * 4);
  // Only the MLPs: the attention steps run directly.
  auto mlp = run_both({"run.steps=3"}, {"exec.options.scopes=\"mlp\""});
  expect_counts(mlp.at(0), 2, 4, 3, 1, (4 + 4) * 4);
}

// Dropout is captured too: the step's seed reaches the device by address (ABI 1.3
// seed_device) and is read when the replay runs, so every step draws new masks,
// the masks eager draws. (A seed baked into the graph would repeat step 2's masks
// and part from eager at step 3.)
TEST(PartialGraph, DropoutIsCapturedAndDrawsTheEagerMasksEveryStep) {
  auto drop = run_both({"run.steps=4", "model.layer.attention.dropout=0.1", "model.layer.mlp.dropout=0.1",
                        "model.layer.mlp.activation_dropout=0.1", "model.layer.embedding.dropout=0.1"});
  expect_counts(drop.at(0), 4, 4, 4, 1, 4 * 4);
  auto pp = run_both({"run.steps=3", "parallel.pp=2", "model.layer.attention.dropout=0.1"});
  for (int r = 0; r < 2; ++r) expect_counts(pp.at(r), 2, 4, 3, 1, 2 * 4);
}

// What captured dropouts read: the engine's device copy of each step's
// per-microbatch seeds, new every step and distinct per microbatch (a copy made
// once would repeat the first step's masks in eager and graph runs alike).
TEST(PartialGraph, EveryStepStagesNewDropoutSeedsOnTheDevice) {
  std::vector<std::vector<uint64_t>> staged;
  loom::train::TrainOptions opts;
  opts.on_step = [&](int64_t, int rank, const loom::model::Model& m) {
    if (rank == 0) staged.push_back(m.staged_dropout_seeds());
  };
  loom::testing::run_and_trace(tiny_manifest(),
                               {"run.steps=3", "exec.mode=\"partial_graph\"", "model.layer.attention.dropout=0.1"},
                               opts);
  ASSERT_EQ(staged.size(), 3u);
  for (size_t s = 0; s < staged.size(); ++s) {
    ASSERT_EQ(staged[s].size(), 4u) << "one per microbatch";
    std::set<uint64_t> distinct(staged[s].begin(), staged[s].end());
    EXPECT_EQ(distinct.size(), 4u) << "step " << s + 1;
    if (s > 0) {
      for (size_t mb = 0; mb < 4; ++mb) EXPECT_NE(staged[s][mb], staged[s - 1][mb]) << "step " << s + 1;
    }
  }
}

// tp 2: the layers' collectives are not captured; nothing is, and it still
// trains as eager does.
TEST(PartialGraph, TensorParallelLayersRunDirectly) {
  auto tp = run_both({"run.steps=3", "parallel.tp=2", "model.layer.mlp.dropout=0.1"});
  ASSERT_EQ(tp.size(), 2u);
  for (int r = 0; r < 2; ++r) expect_counts(tp.at(r), 0, 4, 3, 1, 12 * 4);  // all six layers, both ways
}

// MoE blocks (routing is decided on the host) run directly, and capture their
// static parts as moe_router sub-steps (ABI 1.7; Megatron-LM's --cuda-graph-scope moe_router): LayerNorm and
// the router GEMM in forward, LayerNorm again and the router's backward. At dp 2 x
// ep 2 their all-to-all runs eagerly between those replays, reading the logits and
// LN output where the forward's graph wrote them and handing the router's graph
// its gradients at the addresses of its capture. Bit-identical to eager.
TEST(PartialGraph, MoeRouterSubStepsAreCapturedAroundEagerExpertsAtDp2Ep2) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                                        "parallel.dp=2", "parallel.ep=2"};
  const auto stats = run_both(moe, {}, /*same_activation_bytes=*/false);
  ASSERT_EQ(stats.size(), 2u);
  // Per rank: M = 2 microbatches, 10 steps, 1 warm-up; 2 attention layers and the
  // routers of 2 moe blocks captured; per step directly: embedding, lm_head and the
  // 2 moe blocks' steps, forward and backward.
  for (const auto& [rank, s] : stats) expect_counts(s, 2, 2, 10, 1, 2 * (2 + 2) * 2, /*router_blocks=*/2);
}

// Serial, with every routing feature that reads or writes the router's memory
// between its sub-steps: capacity drops, the shared expert (on the captured LN
// output), dropout, z-loss; bf16 with its fp32 gradients accumulated by the ops
// and without (a gradient shadow inside the router's backward graph); evaluation
// between steps (its forwards must not move the addresses the training replays use).
TEST(PartialGraph, MoeRouterSubStepsWithCapacitySharedExpertDropoutBf16AndEvaluation) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]",
                                        "model.layer.moe.num_experts=4",
                                        "model.layer.moe.capacity_factor=1.0",
                                        "model.layer.moe.shared_expert_ffn_hidden_size=32",
                                        "model.layer.moe.dropout=0.1",
                                        "model.layer.moe.z_loss_coeff=0.001",
                                        "run.steps=4"};
  // M = 4: embedding, lm_head and 2 moe steps run directly, both ways.
  expect_counts(run_both(moe, {}, false).at(0), 2, 4, 4, 1, 4 * 2 * 4, 2);
  expect_counts(run_both(with(moe, {"device.param_dtype=\"bf16\""}), {}, false).at(0), 2, 4, 4, 1, 4 * 2 * 4, 2);
  expect_counts(run_both(with(moe, {"device.param_dtype=\"bf16\"", "device.grad_accumulation_fusion=false"}), {},
                         false)
                    .at(0),
                2, 4, 4, 1, 4 * 2 * 4, 2);
  const auto eval = run_both(with(moe, {"run.eval_every=2"}), {}, false);
  EXPECT_EQ(eval.at(0).graphs, (2u * 2u + 3u * 2u) * 4u);
  EXPECT_EQ(eval.at(0).replays, (2u * 2u + 3u * 2u) * 4u * 3u);
}

// 1F1B at pp 2 with a moe block on each stage: several microbatches' router
// memory in flight at once, each at its own addresses.
TEST(PartialGraph, MoeRouterSubStepsUnderPipelineParallelism) {
  const auto pp = run_both({"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                            "model.layer.moe.capacity_factor=1.0", "run.steps=4", "parallel.pp=2"},
                           {}, false);
  ASSERT_EQ(pp.size(), 2u);
  // Per stage: 1 attention, 1 moe router; directly: embedding or lm_head and the moe step.
  for (int r = 0; r < 2; ++r) expect_counts(pp.at(r), 1, 4, 4, 1, 2 * 2 * 4, 1);
}

// exec.options.scopes picks sub-steps by their scope: "moe_router" captures only the
// routers (attention runs directly); "attention" leaves the routers' parts direct.
TEST(PartialGraph, ScopesSelectTheMoeRouterSubSteps) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                                        "run.steps=3"};
  // Directly per microbatch: embedding, lm_head, 2 attention, 2 moe steps, both ways.
  expect_counts(run_both(moe, {"exec.options.scopes=\"moe_router\""}, false).at(0), 0, 4, 3, 1, 6 * 2 * 4, 2);
  // The 2 routers' 3 sub-steps per microbatch run directly beside the 4 other steps.
  expect_counts(run_both(moe, {"exec.options.scopes=\"attention\""}, false).at(0), 2, 4, 3, 1,
                (4 * 2 + 3 * 2) * 4, 0);
}

// Under context parallelism a dropless router's sub-steps hold no collective (each
// cp rank routes its own tokens; the loss sums are all-reduced eagerly after the
// forward's sub-step), so they are captured; with a capacity the forward's sub-step
// gathers the logits over cp and they all run directly. Attention gathers K/V over
// cp inside its step, so it runs directly either way. Both equal eager.
TEST(PartialGraph, MoeRouterUnderContextParallelism) {
  const std::vector<std::string> moe = {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                                        "run.steps=3", "parallel.cp=2"};
  const auto dropless = run_both(moe, {}, false);
  ASSERT_EQ(dropless.size(), 2u);
  // Per rank M = 4; directly: embedding, lm_head, 2 attention and 2 moe steps, both ways.
  for (const auto& [rank, s] : dropless) expect_counts(s, 0, 4, 3, 1, 6 * 2 * 4, 2);
  const auto capacity = run_both(with(moe, {"model.layer.moe.capacity_factor=1.0"}), {}, false);
  for (const auto& [rank, s] : capacity) EXPECT_EQ(s.graphs, 0u) << "rank " << rank;
}

// exec.mode names any loaded exec plugin (third parties' too); a misspelt one is
// refused at the key, listing what is loaded and the closest name.
TEST(PartialGraph, AnUnknownExecModeNamesTheLoadedOnesAndTheClosest) {
  try {
    (void)loom::testing::plan_from(tiny_manifest(), {"exec.mode=\"partial_grpah\""});
    FAIL() << "exec.mode = partial_grpah was accepted";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("exec.mode: no plugin exec/partial_grpah is loaded (available: "), std::string::npos) << what;
    EXPECT_NE(what.find("eager"), std::string::npos) << what;
    EXPECT_NE(what.find("(did you mean \"partial_graph\"?)"), std::string::npos) << what;
  }
}

// A capture must not be a library's first call (cuBLAS and lazy kernel loading
// initialise on first use): at least one warm-up run.
TEST(PartialGraph, WarmupStepsBelowOneAreRefused) {
  try {
    run_all_ranks(tiny_manifest(), {"run.steps=1", "exec.mode=\"partial_graph\"", "exec.options.warmup_steps=0"});
    FAIL() << "warmup_steps = 0 was accepted";
  } catch (const std::exception& e) {  // the manifest check's: the option's declared range
    EXPECT_NE(std::string(e.what()).find("exec.options.warmup_steps must be between 1 and 1000, got 0"),
              std::string::npos)
        << e.what();
  }
}

// A device without a graph pool (a plugin built before ABI 1.3, whose table has
// no such feature) would hand memory a captured step freed to eager work while
// replays still write it: exec/partial_graph refuses it, naming the reason.
TEST(PartialGraph, ADeviceWithoutAGraphPoolIsRefused) {
  (void)loom::testing::plan_from(tiny_manifest(), {"exec.mode=\"partial_graph\""});  // loads the plugins
  const loom::plugins::LoadedPlugin& cpu = loom::plugins::registry().get("device", "cpu");
  loom::plugins::OptionValues dev_opts(nullptr, cpu.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.num_threads = 1;
  loom_device* dev = nullptr;
  loom::check(cpu.device()->create(dev_opts.raw(), &args, &dev));
  loom_device_api no_pool = *cpu.device();
  no_pool.features &= ~LOOM_DEVICE_GRAPH_POOL;
  loom::runtime::RankRuntime rt(0, &no_pool, dev);  // owns dev

  const loom::plugins::LoadedPlugin& pg = loom::plugins::registry().get("exec", "partial_graph");
  loom::plugins::OptionValues opts(nullptr, pg.options);
  loom_exec* exec = nullptr;
  try {
    loom::check(pg.exec()->create(opts.raw(), &rt, &exec));
    FAIL() << "a device without LOOM_DEVICE_GRAPH_POOL was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no graph pool"), std::string::npos) << e.what();
  }
  EXPECT_EQ(exec, nullptr);
  // With the pool (device/cpu as built) it is accepted.
  loom::runtime::RankRuntime ok_rt(0, cpu.device(), [&] {
    loom_device* d = nullptr;
    loom::check(cpu.device()->create(dev_opts.raw(), &args, &d));
    return d;
  }());
  loom::check(pg.exec()->create(opts.raw(), &ok_rt, &exec));
  ASSERT_NE(exec, nullptr);
  pg.exec()->destroy(exec);
}

// Graphs keep their memory (hidden states at fixed addresses, the layers' saved
// activations in the graph pool), but only as much as the schedule holds at
// once: with 1F1B, doubling the microbatches adds graphs, and memory only for
// the extra microbatches' token and target buffers, which eager loads too.
TEST(PartialGraph, MemoryFollowsTheScheduleNotTheMicrobatchCount) {
  auto peak = [](const std::string& mode, int global_batch) {
    const RankTrace t = run_all_ranks(tiny_manifest(), {"run.steps=3", "parallel.pp=2", "exec.mode=\"" + mode + "\"",
                                                        "batch.global_batch_size=" + std::to_string(global_batch)});
    if (mode == "partial_graph") {
      EXPECT_EQ(t.result.exec_stats.at(0).graphs, 2u * 2u * static_cast<uint64_t>(global_batch / 2));
    }
    return static_cast<int64_t>(t.result.steps.back().mem_peak);
  };
  const int64_t g4 = peak("partial_graph", 8), g8 = peak("partial_graph", 16);
  const int64_t e4 = peak("eager", 8), e8 = peak("eager", 16);
  EXPECT_GT(g4, 0);
  EXPECT_EQ(g8 - g4, e8 - e4);
  // And about what eager needs at its peak: the same activations, held over.
  EXPECT_LE(g4, e4 + e4 / 4);
}

}  // namespace
