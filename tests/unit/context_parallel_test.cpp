// Context parallelism (parallel.cp): every cp rank holds two chunks of each sequence
// (an early and a late one), attends to the keys of the whole sequence gathered over
// cp, and the gradients are averaged over dp-cp. Proven by equivalence with the
// serial run, step by step, from the same seed: alone and with tp + sequence
// parallelism, dp and the distributed optimizer, pipeline stages, and dropout (whose
// masks follow positions in the whole sequence). The cp replicas stay identical, a
// resume is bit-exact (and reshards over dp x cp), `loom plan` sizes the run, and a
// layer that cannot take a slice is refused naming itself.
#include "support/rank_trace.hpp"

#include "engine/model/param_plan.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/checkpoint.hpp"

#include <gtest/gtest.h>

#include <boost/filesystem.hpp>

#include <map>
#include <mutex>
#include <set>

namespace {

using loom::testing::RankTrace;

// Sequences of 32 so cp = 4 has chunks of 4 positions and cp 2 x tp 2 (SP) shards
// of 8 rows; Adam's eps small so the comparison is of the parallel arithmetic.
std::string manifest() { return loom::testing::tiny_manifest() + "\n[parallel]\n"; }

RankTrace run(std::vector<std::string> o, loom::train::TrainOptions opts = {}) {
  o.insert(o.begin(), {"model.seq_length=32", "data.digits=4", "optimizer.eps=1e-6"});
  return loom::testing::run_all_ranks(manifest(), o, std::move(opts));
}


// Every rank's buffer equals that of its cp rank 0 peer (same tp, dp, pp): the
// replicas stay replicas.
void expect_cp_replicas_identical(const RankTrace& t) {
  for (int p = 0; p < t.pp; ++p)
    for (int d = 0; d < t.dp; ++d)
      for (int x = 0; x < t.tp; ++x)
        for (int c = 1; c < t.cp; ++c) {
          const int a = loom::testing::rank_of(t, x, d, p), b = loom::testing::rank_of(t, x, d, p, c);
          ASSERT_EQ(t.params.at(a).size(), t.params.at(b).size());
          for (size_t s = 0; s < t.params.at(a).size(); ++s)
            EXPECT_EQ(t.params.at(a)[s], t.params.at(b)[s]) << "rank " << b << " differs from rank " << a
                                                            << " after step " << s + 1;
        }
}

TEST(ContextParallel, Cp2MatchesSerial) {
  const RankTrace serial = run({}), cp2 = run({"parallel.cp=2"});
  loom::testing::expect_trains_as_serial(serial, cp2);
  expect_cp_replicas_identical(cp2);
  // The two ranks really split the work: K/V gathered and their gradients scattered over cp.
  const auto& comm = cp2.result.steps.back().comm;  // group kind -> op -> counter
  ASSERT_TRUE(comm.count("cp")) << "no traffic over cp";
  EXPECT_GT(comm.at("cp").count("all_gather") ? comm.at("cp").at("all_gather").bytes : 0u, 0u);
  EXPECT_GT(comm.at("cp").count("reduce_scatter") ? comm.at("cp").at("reduce_scatter").bytes : 0u, 0u);
  EXPECT_TRUE(comm.count("dp-cp")) << "gradients are not averaged over dp-cp";
}

// Rotary embeddings (no position table): each token is rotated by its position in the
// whole sequence, so the chunks a cp rank holds (one early, one late) and the shards
// of cp 2 x tp 2 with SP rotate as the serial run does.
TEST(ContextParallel, RopeCp2AndCp2Tp2SequenceParallelMatchSerial) {
  const std::vector<std::string> rope = {"model.layer.embedding.position_embedding=rope",
                                         "model.layer.attention.position_embedding=rope"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), rope.begin(), rope.end());
    return run(o);
  };
  const RankTrace serial = with({});
  loom::testing::expect_trains_as_serial(serial, with({"parallel.cp=2"}));
  loom::testing::expect_trains_as_serial(serial, with({"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"}));
  // Llama 3.1's scaled frequencies (rope_scaling = "llama3", a table every rank builds
  // alike): each chunk still rotates by its positions. The test's settings scale the
  // head's lower frequencies, so the run differs from unscaled rope.
  const std::vector<std::string> scaled = {"model.layer.attention.rope_scaling=\"llama3\"",
                                           "model.layer.attention.rope_original_max_position=16",
                                           "model.layer.attention.rope_high_freq_factor=8.0"};
  auto with_scaled = [&](std::vector<std::string> o) {
    o.insert(o.end(), scaled.begin(), scaled.end());
    return with(o);
  };
  const RankTrace scaled_serial = with_scaled({});
  EXPECT_NE(scaled_serial.loss.back(), serial.loss.back()) << "the scaling changed nothing";
  loom::testing::expect_trains_as_serial(scaled_serial, with_scaled({"parallel.cp=2"}));
  loom::testing::expect_trains_as_serial(scaled_serial, with_scaled({"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"}));
  // YaRN's (rope_scaling = "yarn"): its table, and its attention factor (0.1 ln 4 + 1)
  // in the softmax scale, on every rank alike.
  const std::vector<std::string> yarn = {"model.layer.attention.rope_scaling=\"yarn\"",
                                         "model.layer.attention.rope_scaling_factor=4.0",
                                         "model.layer.attention.rope_original_max_position=16"};
  auto with_yarn = [&](std::vector<std::string> o) {
    o.insert(o.end(), yarn.begin(), yarn.end());
    return with(o);
  };
  const RankTrace yarn_serial = with_yarn({});
  EXPECT_NE(yarn_serial.loss.back(), serial.loss.back()) << "the scaling changed nothing";
  loom::testing::expect_trains_as_serial(yarn_serial, with_yarn({"parallel.cp=2", "parallel.tp=2",
                                                                 "parallel.sequence_parallel=true"}));
  // Grouped-query attention (the gathered K/V are the repeated heads) too.
  const std::vector<std::string> gqa = {"model.layer.attention.num_query_groups=2"};
  auto grouped = [&](std::vector<std::string> o) {
    o.insert(o.end(), gqa.begin(), gqa.end());
    return with(o);
  };
  loom::testing::expect_trains_as_serial(grouped({}), grouped({"parallel.cp=2"}));
  // And with each head's q and k normalised (qk_norm) before the rotation, in Qwen3's
  // shape (RMSNorm, no biases). (The biases that reach the keys before the norm,
  // LayerNorm's k_norm.bias and qkv.bias's k part, get gradients that nearly cancel
  // over the positions; summed in the cp run's order and scaled up by Adam they end
  // 1e-5 to 3e-5 apart from the serial run's after a few steps.)
  auto normalised = [&](std::vector<std::string> o) {
    o.insert(o.end(), {"model.layer.attention.qk_norm=true", "model.layer.attention.norm=rmsnorm",
                       "model.layer.attention.bias=false"});
    return grouped(o);
  };
  loom::testing::expect_trains_as_serial(normalised({}), normalised({"parallel.cp=2"}));
  // Without rope and without the table the model could not tell positions apart: rope
  // must change the training.
  const RankTrace none = run({"model.layer.embedding.position_embedding=rope"});
  EXPECT_NE(none.loss.back(), serial.loss.back());
}

// sliding_window: every context-parallel chunk's queries slide the window over the
// gathered keys at their positions in the whole sequence (a window of 6 crosses the
// chunk edges at cp 2 and cp 4, where chunks are 8 rows), with rope; with tp 2 + SP,
// pp 2 and partial graphs too. The window changes training. (With grouped queries as
// well, an MLP LayerNorm bias at cp 4 and at cp 2 x tp 2 ends 1e-5 to 2e-5 from the
// serial run's, with or without a window: summation order, which Adam scales up.)
TEST(ContextParallel, SlidingWindowMatchesSerialAtEveryLayout) {
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), {"model.layer.attention.sliding_window=6", "model.layer.embedding.position_embedding=rope",
                       "model.layer.attention.position_embedding=rope"});
    return run(o);
  };
  const RankTrace serial = with({});
  const RankTrace unwindowed = run({"model.layer.embedding.position_embedding=rope",
                                    "model.layer.attention.position_embedding=rope"});
  EXPECT_NE(serial.loss.back(), unwindowed.loss.back()) << "the window changed nothing";
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{"parallel.cp=2"},
                                             {"parallel.cp=4"},
                                             {"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"},
                                             {"parallel.pp=2"},
                                             {"exec.mode=\"partial_graph\""}}) {
    SCOPED_TRACE(layout.front() + (layout.size() > 1 ? " ..." : ""));
    loom::testing::expect_trains_as_serial(serial, with(layout));
  }
}

TEST(ContextParallel, Cp4MatchesSerial) {
  const RankTrace par = run({"parallel.cp=4"});
  loom::testing::expect_trains_as_serial(run({}), par);
  expect_cp_replicas_identical(par);
}

// tp 4 with SP: a rank's shard is half a context chunk, so shards start inside
// chunks (ContextSlice::runs cut mid-chunk, embedding positions and dropout
// offsets from there); and tp 2 without SP, where every tp rank holds the cp slice.
TEST(ContextParallel, Cp2WithTp4SequenceParallelAndTp2WithoutMatchSerial) {
  const RankTrace sp = run({"parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true",
                            "model.layer.embedding.dropout=0.1"});
  loom::testing::expect_trains_as_serial(run({"model.layer.embedding.dropout=0.1"}), sp);
  expect_cp_replicas_identical(sp);
  loom::testing::expect_trains_as_serial(run({}), run({"parallel.cp=2", "parallel.tp=2"}));
}

// Evaluation sums loss and counts over cp, and a sample is an exact match only
// when every one of its cp slices is right: validation loss, token accuracy and
// exact-match rate equal the serial run's. (A slice without answer tokens is
// vacuously right, so counting slices instead of samples would report matches the
// serial run does not have: with 1-digit sums in 16 positions, cp 4's rank 0 holds
// positions 0-1 and 14-15, none of them an answer.)
TEST(ContextParallel, EvaluationMatchesSerial) {
  const std::vector<std::string> eval = {"run.eval_every=5", "run.eval_batches=8", "model.seq_length=16",
                                         "data.digits=1"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), eval.begin(), eval.end());
    return run(o);
  };
  const RankTrace serial = with({});
  for (const RankTrace& par : {with({"parallel.cp=2"}), with({"parallel.cp=4", "parallel.pp=2"})}) {
    int evaluations = 0;
    for (size_t s = 0; s < serial.result.steps.size(); ++s) {
      const auto &a = serial.result.steps[s], &b = par.result.steps[s];
      ASSERT_EQ(a.evaluated, b.evaluated) << "step " << s + 1;
      if (!a.evaluated) continue;
      ++evaluations;
      EXPECT_NEAR(b.val_loss, a.val_loss, 1e-5 * a.val_loss) << "step " << s + 1;
      EXPECT_EQ(b.token_accuracy, a.token_accuracy) << "step " << s + 1;
      EXPECT_EQ(b.exact_match, a.exact_match) << "step " << s + 1;
      EXPECT_GT(a.token_accuracy, 0.0);
    }
    EXPECT_EQ(evaluations, 2);
  }
}

TEST(ContextParallel, Cp2WithTp2SequenceParallelMatchesSerial) {
  const RankTrace par = run({"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"});
  loom::testing::expect_trains_as_serial(run({}), par);
  expect_cp_replicas_identical(par);
}

TEST(ContextParallel, Cp2Dp2WithTheDistributedOptimizerMatchesSerial) {
  const RankTrace par = run({"parallel.cp=2", "parallel.dp=2", "optimizer.strategy=\"distributed\""});
  loom::testing::expect_trains_as_serial(run({}), par);
  expect_cp_replicas_identical(par);
}

TEST(ContextParallel, Cp2Pp2MatchesSerial) {
  const RankTrace serial = run({"model.num_layers=4"});
  loom::testing::expect_trains_as_serial(serial, run({"model.num_layers=4", "parallel.cp=2", "parallel.pp=2"}));
  loom::testing::expect_trains_as_serial(serial, run({"model.num_layers=4", "parallel.cp=2", "parallel.pp=2", "parallel.vpp=2"}));
}

// Partial graphs under cp: the MLP (token-wise) is captured and replayed, the
// attention (a collective over cp) runs directly; bit-identical to eager.
TEST(ContextParallel, PartialGraphsEqualEagerBitForBit) {
  const RankTrace eager = run({"parallel.cp=2"}), graphs = run({"parallel.cp=2", "exec.mode=\"partial_graph\""});
  ASSERT_EQ(graphs.loss.size(), eager.loss.size());
  for (size_t s = 0; s < eager.loss.size(); ++s) EXPECT_EQ(graphs.loss[s], eager.loss[s]) << "step " << s + 1;
  EXPECT_EQ(graphs.params.at(1).back(), eager.params.at(1).back());
  EXPECT_GT(graphs.result.exec_stats.at(0).graphs, 0u) << "nothing was captured";
  EXPECT_GT(graphs.result.exec_stats.at(0).direct, 0u) << "attention under cp must run directly";
}

// bf16 under cp: dK/dV are summed over cp in bf16 (the serial run sums them once),
// so cp computes the serial bf16 step to bf16 rounding, not bit for bit. Measured
// when this was written: the first loss equal (the forward rounds the same), its
// gradient norm 2.1e-5 relative apart, the losses of 10 steps within 8.1e-5; the
// bounds are about 10x those.
TEST(ContextParallel, Bf16TracksSerialBf16) {
  const std::vector<std::string> bf16 = {"device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\""};
  std::vector<std::string> cp = bf16;
  cp.push_back("parallel.cp=2");
  loom::testing::expect_tracks(run(bf16), run(cp), 1e-5, 2e-4, 1e-3);
}

// Dropout draws each element's mask from its place in the whole sequence, so a
// cp run (with tp + SP too) masks exactly what the serial run masks. The MLP's
// activation dropout is inside the TP region, where each tp rank has a stream of
// its own (Megatron's model-parallel RNG): cp then keeps the masks of the same tp
// layout without cp.
TEST(ContextParallel, DropoutMasksFollowPositionsInTheWholeSequence) {
  const std::vector<std::string> drop = {"model.layer.embedding.dropout=0.1", "model.layer.attention.dropout=0.1",
                                         "model.layer.mlp.dropout=0.1"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), drop.begin(), drop.end());
    return o;
  };
  const RankTrace serial = run(with({})), no_drop = run({});
  ASSERT_GT(std::fabs(serial.loss[0] - no_drop.loss[0]), 1e-4) << "dropout changed nothing";
  loom::testing::expect_trains_as_serial(serial, run(with({"parallel.cp=2"})));
  loom::testing::expect_trains_as_serial(serial, run(with({"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"})));
  const std::string act = "model.layer.mlp.activation_dropout=0.1";
  loom::testing::expect_trains_as_serial(run(with({act})), run(with({act, "parallel.cp=2"})));
  const std::vector<std::string> tp2 = {act, "parallel.tp=2", "parallel.sequence_parallel=true"};
  std::vector<std::string> cp_tp2 = tp2;
  cp_tp2.push_back("parallel.cp=2");
  loom::testing::expect_trains_as_serial(run(with(tp2)), run(with(cp_tp2)));
}

// Checkpoints record cp: a resume at the same layout is bit-exact, one at another
// dp reshards the distributed optimizer over dp x cp, and one at another cp
// regathers parameters and state by name.
TEST(ContextParallel, ResumeIsBitExactReshardsOverDpAndKeepsCp) {
  const std::string dir = loom::testing::scratch_dir("cp-resume");
  const std::vector<std::string> layout = {"parallel.cp=2", "parallel.dp=2", "optimizer.strategy=\"distributed\"",
                                          "optimizer.decay_steps=10"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.end(), layout.begin(), layout.end());
    return o;
  };
  const RankTrace whole = run(with({}));
  run(with({"run.steps=5", "checkpoint.dir=\"" + dir + "\""}));
  EXPECT_EQ(loom::train::read_meta(loom::train::checkpoint_path(dir, 5)).cp, 2);
  loom::train::TrainOptions resume;
  resume.resume = true;
  const RankTrace rest = run(with({"checkpoint.dir=\"" + dir + "\""}), resume);
  ASSERT_EQ(rest.loss.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(rest.loss[s], whole.loss[s + 5]) << "step " << s + 6;
  for (const auto& [rank, steps] : rest.params) EXPECT_EQ(steps.back(), whole.params.at(rank).back()) << "rank " << rank;

  // dp 2 -> 1 at cp 2: the states of the four dp-cp ranks go to two.
  const std::string dir2 = loom::testing::scratch_dir("cp-reshard");
  run(with({"run.steps=5", "checkpoint.dir=\"" + dir2 + "\""}));
  const RankTrace resharded = run({"parallel.cp=2", "parallel.dp=1", "optimizer.strategy=\"distributed\"", "optimizer.decay_steps=10",
                                   "batch.micro_batch_size=4", "checkpoint.dir=\"" + dir2 + "\""},
                                  resume);
  ASSERT_EQ(resharded.loss.size(), 5u);
  for (size_t s = 0; s < 5; ++s) {
    EXPECT_NEAR(resharded.loss[s], whole.loss[s + 5], 1e-5 * whole.loss[s + 5]) << "step " << s + 6;
    // and the parameters: the Adam moments went to the right elements
    const auto want = loom::testing::full_params(whole, s + 5), got = loom::testing::full_params(resharded, s);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [key, w] : want)
      EXPECT_LE(loom::testing::tensor_rel_diff(got.at(key), w), 1e-5) << key << " at step " << s + 6;
  }

  // cp 2 -> 1: the parameters and the Adam moments regathered by name
  // and element continue the training as the uninterrupted run does.
  const std::string dir3 = loom::testing::scratch_dir("cp-regather");
  run(with({"run.steps=5", "checkpoint.dir=\"" + dir3 + "\""}));
  const RankTrace regathered = run({"parallel.cp=1", "parallel.dp=2", "optimizer.strategy=\"distributed\"",
                                    "optimizer.decay_steps=10", "checkpoint.dir=\"" + dir3 + "\""},
                                   resume);
  ASSERT_EQ(regathered.loss.size(), 5u);
  for (size_t s = 0; s < 5; ++s) {
    EXPECT_NEAR(regathered.loss[s], whole.loss[s + 5], 1e-5 * whole.loss[s + 5]) << "step " << s + 6;
    const auto want = loom::testing::full_params(whole, s + 5), got = loom::testing::full_params(regathered, s);
    for (const auto& [key, w] : want)
      EXPECT_LE(loom::testing::tensor_rel_diff(got.at(key), w), 1e-5) << key << " at step " << s + 6;
  }
  boost::filesystem::remove_all(dir3);
  boost::filesystem::remove_all(dir);
  boost::filesystem::remove_all(dir2);
}

// `loom plan` sizes a cp run as the run allocates it: the same buffers (padded for
// dp x cp), the distributed optimizer's state over dp x cp, and activations of the
// rank's seq / cp rows, smaller than without cp.
TEST(ContextParallel, PlanMatchesTheRun) {
  const std::vector<std::string> o = {"model.seq_length=32", "data.digits=4", "run.steps=1", "parallel.cp=2",
                                      "parallel.dp=2", "optimizer.strategy=\"distributed\""};
  std::map<int, std::pair<size_t, uint64_t>> measured;  // rank -> (numel, activation bytes)
  std::mutex mu;
  loom::train::TrainOptions opts;
  opts.on_step = [&](int64_t, int rank, const loom::model::Model& m) {
    std::lock_guard<std::mutex> lock(mu);
    measured[rank] = {m.numel(), m.activation_bytes()};
  };
  loom::testing::run_and_trace(manifest(), o, opts);
  const loom::train::MemoryPlan plan = loom::train::plan_memory(loom::testing::plan_from(manifest(), o));
  std::vector<std::string> serial_o = o;
  serial_o.push_back("parallel.cp=1");
  const loom::train::MemoryPlan serial = loom::train::plan_memory(loom::testing::plan_from(manifest(), serial_o));
  ASSERT_EQ(plan.ranks.size(), 4u);
  for (const auto& r : plan.ranks) {
    SCOPED_TRACE("rank " + std::to_string(r.rank));
    EXPECT_EQ(r.buffer_numel, measured.at(r.rank).first);
    EXPECT_EQ(r.buffer_numel % 4, 0u) << "buckets padded for the 4 dp-cp ranks";
    EXPECT_EQ(r.optimizer_bytes, r.buffer_numel / 4 * 8) << "fp32 Adam moments of a 1/(dp x cp) shard";
    EXPECT_EQ(r.activation_bytes, measured.at(r.rank).second);
    EXPECT_LT(r.activation_bytes, serial.ranks[0].activation_bytes);
  }
}

// A layer that does not advertise LOOM_LAYER_CONTEXT_PARALLEL (an ABI 1.5 build of
// layer/mlp, say) is refused at parallel.cp, naming the layer and its plugin.
TEST(ContextParallel, ALayerWithoutTheCapabilityIsRefused) {
  loom::train::RunPlan ok = loom::testing::plan_from(manifest(), {"parallel.cp=2"});
  EXPECT_EQ(ok.sizes.cp, 2);
  const loom::plugins::LoadedPlugin& mlp = loom::plugins::registry().get("layer", "mlp");
  loom_layer_api* table = const_cast<loom_layer_api*>(mlp.layer());
  const uint64_t saved = table->features;
  table->features = 0;
  std::string msg;
  try {
    loom::testing::plan_from(manifest(), {"parallel.cp=2"});
  } catch (const std::exception& e) {
    msg = e.what();
  }
  table->features = saved;
  EXPECT_NE(msg.find("parallel.cp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("layer 'mlp' (plugin layer/mlp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("LOOM_LAYER_CONTEXT_PARALLEL"), std::string::npos) << msg;
}

// A device without windowed attention (an ABI 1.5 build of device/cpu, say) is
// refused at parallel.cp when the run is planned, so `loom validate` reports it.
TEST(ContextParallel, ADeviceWithoutWindowedAttentionIsRefused) {
  EXPECT_EQ(loom::testing::plan_from(manifest(), {"parallel.cp=2"}).sizes.cp, 2);  // loads the plugins
  const loom::plugins::LoadedPlugin& cpu = loom::plugins::registry().get("device", "cpu");
  loom_device_api* table = const_cast<loom_device_api*>(cpu.device());
  const uint64_t saved = table->features;
  table->features &= ~LOOM_DEVICE_ATTENTION_WINDOW;
  std::string msg, serial;
  try {
    loom::testing::plan_from(manifest(), {"parallel.cp=2"});
  } catch (const std::exception& e) {
    msg = e.what();
  }
  try {
    loom::testing::plan_from(manifest(), {});
  } catch (const std::exception& e) {
    serial = e.what();
  }
  table->features = saved;
  // A tensor-parallel service before 1.6 would draw the same dropout masks on every cp rank.
  auto& tensor = const_cast<loom::plugins::LoadedPlugin&>(loom::plugins::registry().get("parallel", "tensor"));
  const uint32_t minor = tensor.abi_minor;
  tensor.abi_minor = 5;
  std::string old_service;
  try {
    loom::testing::plan_from(manifest(), {"parallel.cp=2"});
  } catch (const std::exception& e) {
    old_service = e.what();
  }
  tensor.abi_minor = minor;
  EXPECT_NE(old_service.find("parallel.cp: context parallelism needs a tensor-parallel service built for ABI 1.6"),
            std::string::npos) << old_service;
  EXPECT_NE(msg.find("parallel.cp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("device/cpu"), std::string::npos) << msg;
  EXPECT_NE(msg.find("LOOM_DEVICE_ATTENTION_WINDOW"), std::string::npos) << msg;
  EXPECT_EQ(serial, "") << "cp = 1 needs no window";
}

}  // namespace
