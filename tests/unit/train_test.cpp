// End-to-end training on CPU: data-parallel equivalence with the serial run,
// learning, bit-exact resume (also after an interrupt), and clear errors for
// bad data and corrupt checkpoints that leave the disk untouched.
#include "support/train_fixture.hpp"

#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/optimizer_binding.hpp"
#include "engine/text/token_files.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <unistd.h>

namespace {

using loom::testing::max_rel_diff;
using loom::testing::with_overrides;
using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;
namespace fs = boost::filesystem;

// Megatron-LM's position embedding type is one per model: layers set apart (no position
// embedding at all, or two) are warned of, and not when they agree.
TEST(RunPlan, LayersSettingPositionEmbeddingApartAreWarnedOf) {
  auto warned = [](const std::vector<std::string>& overrides) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), overrides).warnings)
      if (w.find("the layers set position_embedding apart (attention = learned_absolute, embedding = rope)") !=
          std::string::npos)
        return true;
    return false;
  };
  EXPECT_TRUE(warned({"model.layer.embedding.position_embedding=\"rope\""}));
  EXPECT_FALSE(warned({}));
  EXPECT_FALSE(warned({"model.layer.embedding.position_embedding=\"rope\"",
                       "model.layer.attention.position_embedding=\"rope\""}));
}

// A chunk size for a pipeline of one chunk changes nothing: said, not silently ignored.
TEST(RunPlan, ChunkSizesWithoutAPipelineAreWarnedOf) {
  auto warned = [](const std::vector<std::string>& overrides) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), overrides).warnings)
      if (w.find("pipeline.first_chunk_layers sizes a pipeline chunk; with one chunk") != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(warned({"pipeline.first_chunk_layers=1"}));
  EXPECT_FALSE(warned({"pipeline.first_chunk_layers=1", "parallel.pp=2", "parallel.dp=1"}));
}

// Settings that change nothing are said: recomputation's options without recomputation,
// partial graphs where no layer step is captured (tp > 1), a warmup that outlasts the
// run (decay_steps = 0: the run's length), an early exit that saves nothing or never acts.
TEST(RunPlan, SettingsThatChangeNothingAreWarnedOf) {
  auto warned = [](const std::vector<std::string>& overrides, const std::string& what) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), overrides).warnings)
      if (w.find(what) != std::string::npos) return true;
    return false;
  };
  const std::string recompute = "model.recompute_num_layers chooses what full recomputation keeps";
  EXPECT_TRUE(warned({"model.recompute_num_layers=1"}, recompute));
  EXPECT_FALSE(warned({"model.recompute_num_layers=1", "model.recompute_granularity=\"full\""}, recompute));
  const std::string graphs = "captures no layer step with parallel.tp = 2";
  EXPECT_TRUE(warned({"exec.mode=\"partial_graph\"", "parallel.tp=2", "parallel.dp=1"}, graphs));
  EXPECT_FALSE(warned({"exec.mode=\"partial_graph\""}, graphs));
  const std::string warmup = "the warmup (10 steps) outlasts the run (5 steps)";
  EXPECT_TRUE(warned({"optimizer.warmup_steps=10", "run.steps=5"}, warmup));
  EXPECT_FALSE(warned({"optimizer.warmup_steps=10", "run.steps=11"}, "outlasts the run"));
  const std::string wsd_only = "optimizer.wsd_decay_steps shapes the final decay of decay_style = \"wsd\"";
  EXPECT_TRUE(warned({"optimizer.wsd_decay_steps=3"}, wsd_only));
  EXPECT_FALSE(warned({"optimizer.wsd_decay_steps=3", "optimizer.decay_style=\"wsd\""}, wsd_only));
  // A key written at its default changes nothing and says nothing (a checkpoint's
  // manifest writes every key): 0 and 0.0 alike.
  EXPECT_FALSE(warned({"optimizer.wsd_decay_steps=0"}, "optimizer.wsd_decay_steps"));
  const std::string constant = "optimizer.min_lr is where a decay ends; with optimizer.decay_style = \"constant\"";
  EXPECT_TRUE(warned({"optimizer.min_lr=1e-4", "optimizer.decay_style=\"constant\""}, constant));
  EXPECT_FALSE(warned({"optimizer.min_lr=1e-4"}, constant));
  EXPECT_FALSE(warned({"optimizer.min_lr=0", "optimizer.decay_style=\"constant\""}, constant));
  const std::string group = "pipeline.microbatch_group_size = 4 gives the same orders as 0 (pp) under schedule "
                            "parallel/pipeline.1f1b: it changes nothing";
  const std::vector<std::string> pp2 = {"parallel.pp=2", "parallel.dp=1", "pipeline.microbatch_group_size=4"};
  EXPECT_TRUE(warned(pp2, group));
  EXPECT_FALSE(warned(loom::testing::with_overrides(pp2, {"parallel.vpp=2", "pipeline.schedule=\"interleaved\"",
                                                          "model.num_layers=4"}),
                      "gives the same orders"));
  const std::string held_out = "data.val_fraction holds out a share of a file's tokens; data.kind = \"synthetic\"";
  EXPECT_TRUE(warned({"data.val_fraction=0.2"}, held_out));
  EXPECT_FALSE(warned({}, held_out));
  const std::string no_dir = "checkpoint.keep_last is set but checkpoint.dir is empty";
  EXPECT_TRUE(warned({"checkpoint.keep_last=2"}, no_dir));
  EXPECT_FALSE(warned({"checkpoint.keep_last=2", "checkpoint.dir=\"" + loom::testing::scratch_dir("kl") + "\""}, no_dir));
  EXPECT_TRUE(warned({"checkpoint.async_save=true"}, "checkpoint.async_save is set but checkpoint.dir is empty"));
  const std::string dir = "checkpoint.dir=\"" + loom::testing::scratch_dir("as") + "\"";
  const std::string in_line_only = "with checkpoint.every = 0 there are only those at a stop signal and at the end";
  EXPECT_TRUE(warned({"checkpoint.async_save=true", dir}, in_line_only));
  EXPECT_FALSE(warned({"checkpoint.async_save=true", "checkpoint.every=5", dir}, in_line_only));
  const std::string lost = "stops the run early, but checkpoint.dir is empty";
  EXPECT_TRUE(warned({"run.exit_duration_minutes=30"}, "run.exit_duration_minutes " + lost));
  EXPECT_TRUE(warned({"run.exit_interval=3", "run.steps=10"}, "run.exit_interval " + lost));
  EXPECT_FALSE(warned({"run.exit_interval=3", "run.steps=10", dir}, lost));
  const std::string never = "run.exit_interval = 10 is not below run.steps = 10, so it stops no run before its end";
  EXPECT_TRUE(warned({"run.exit_interval=10", "run.steps=10", dir}, never));
  EXPECT_FALSE(warned({"run.exit_interval=9", "run.steps=10", dir}, "stops no run"));
}

// model.init_method_std (Megatron-LM's --init-method-std): every normally initialised
// weight draws from it, the output projections scaled by 1/sqrt(2 L); 0 keeps the
// layers' own 0.02, bit for bit, as does 0.02 written out.
TEST(RunPlan, InitMethodStdSetsEveryNormalInit) {
  // Each parameter's whole initial values on one rank (fp32), by name.
  auto initial = [](const std::vector<std::string>& overrides) {
    std::map<std::string, std::vector<float>> out;
    const loom::train::RunPlan plan = loom::testing::plan_from(tiny_manifest(), overrides);
    loom::testing::on_one_rank(plan, [&](loom::runtime::RankRuntime& rt, const loom::train::DataSource&,
                                         const loom_model_dims& dims) {
      loom::model::Model model(plan.config, *plan.registry, rt, dims, plan.layers,
                               static_cast<uint64_t>(plan.config.run.seed));
      const float* p = static_cast<const float*>(model.params());
      for (const loom::model::ParamEntry& e : model.param_entries())
        out[e.name].assign(p + e.offset, p + e.offset + e.numel);
    });
    return out;
  };
  auto stddev = [](const std::vector<float>& v) {
    double sum = 0, sq = 0;
    for (float x : v) sum += x, sq += static_cast<double>(x) * x;
    const double n = static_cast<double>(v.size()), mean = sum / n;
    return std::sqrt(sq / n - mean * mean);
  };
  const std::vector<std::string> base = {"model.num_layers=8", "model.hidden_size=64", "parallel.dp=1"};
  auto with = [&](const std::string& o) {
    std::vector<std::string> v = base;
    v.push_back(o);
    return v;
  };
  const auto layers_own = initial(base), explicit_002 = initial(with("model.init_method_std=0.02")),
             small = initial(with("model.init_method_std=0.005"));
  EXPECT_EQ(layers_own, explicit_002);
  EXPECT_NEAR(stddev(layers_own.at("blocks.0.attention.qkv.weight")), 0.02, 0.02 * 0.05);
  EXPECT_NEAR(stddev(small.at("blocks.0.attention.qkv.weight")), 0.005, 0.005 * 0.05);
  EXPECT_NEAR(stddev(small.at("blocks.3.mlp.fc1.weight")), 0.005, 0.005 * 0.05);
  EXPECT_NEAR(stddev(small.at("embedding.word.weight")), 0.005, 0.005 * 0.1);
  EXPECT_NEAR(stddev(small.at("blocks.0.attention.proj.weight")), 0.005 / 4.0, 0.005 / 4.0 * 0.05)
      << "the output projections: std / sqrt(2 * 8 layers)";
  EXPECT_EQ(small.at("blocks.0.attention.ln.weight"), layers_own.at("blocks.0.attention.ln.weight"))
      << "ones stay ones";
  bool warned = false;
  for (const std::string& w :
       loom::testing::plan_from(tiny_manifest(), {"model.init_method_std=0.01", "checkpoint.init_weights=\"/x\""})
           .warnings)
    warned = warned || w.find("model.init_method_std sets the random initialisation") != std::string::npos;
  EXPECT_TRUE(warned) << "a run from given weights draws no initialisation";
}

// The learning rate of each decay style at the points where Megatron-LM's
// OptimizerParamScheduler has a closed form: lr 1e-3, min_lr 1e-4, 10 warmup steps,
// the decay ending at step 110, the run 200 steps long.
TEST(LearningRate, EachDecayStyleIsMegatronsSchedule) {
  const double lr = 1e-3, min_lr = 1e-4, delta = lr - min_lr;
  auto at = [&](const std::vector<std::string>& style, int64_t step) {
    const std::vector<std::string> base = {"run.steps=200", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
                                           "optimizer.warmup_steps=10", "optimizer.decay_steps=110"};
    return loom::train::learning_rate(loom::testing::plan_from(tiny_manifest(), loom::testing::with_overrides(base, style)).config,
                                      {step, 0});
  };
  const double tol = 1e-15;
  for (const char* style : {"cosine", "linear", "constant", "inverse-square-root", "wsd"}) {
    const std::vector<std::string> o = {std::string("optimizer.decay_style=\"") + style + "\"",
                                        "optimizer.wsd_decay_steps=20"};
    EXPECT_NEAR(at(o, 5), lr * 5 / 10, tol) << style << ": halfway through the warmup";
    EXPECT_NEAR(at(o, 10), lr, tol) << style << ": the warmup's end";
    EXPECT_NEAR(at(o, 111), std::string(style) == "constant" ? lr : min_lr, tol) << style << ": past decay_steps";
  }
  auto style = [](const char* s) { return std::vector<std::string>{std::string("optimizer.decay_style=\"") + s + "\""}; };
  EXPECT_NEAR(at(style("cosine"), 60), min_lr + delta / 2, tol);  // half the decay: cos(pi/2) = 0
  EXPECT_NEAR(at(style("cosine"), 110), min_lr, tol);
  EXPECT_NEAR(at(style("linear"), 35), min_lr + 0.75 * delta, tol);  // a quarter of the decay
  EXPECT_NEAR(at(style("linear"), 110), min_lr, tol);
  EXPECT_NEAR(at(style("constant"), 60), lr, tol);
  EXPECT_NEAR(at(style("inverse-square-root"), 40), lr / 2, tol);  // lr * sqrt(10 / 40)
  EXPECT_NEAR(at(style("inverse-square-root"), 90), lr / 3, tol);  // lr * sqrt(10 / 90)
  EXPECT_NEAR(at(style("inverse-square-root"), 110), lr * std::sqrt(10.0 / 110), tol);
  EXPECT_NEAR(at({"optimizer.decay_style=\"inverse-square-root\"", "optimizer.min_lr=9e-4"}, 40), 9e-4, tol);
  // wsd: lr until step 90 (20 decay steps before 110), then the decay's shape to min_lr.
  auto wsd = [](const char* shape) {
    return std::vector<std::string>{"optimizer.decay_style=\"wsd\"", "optimizer.wsd_decay_steps=20",
                                    std::string("optimizer.wsd_decay_style=\"") + shape + "\""};
  };
  for (const char* shape : {"exponential", "linear", "cosine", "minus_sqrt"}) {
    EXPECT_NEAR(at(wsd(shape), 11), lr, tol) << shape;
    EXPECT_NEAR(at(wsd(shape), 90), lr, tol) << shape << ": the last stable step";
    EXPECT_NEAR(at(wsd(shape), 110), min_lr, tol) << shape << ": the decay's end";
    EXPECT_LT(at(wsd(shape), 91), lr) << shape;
  }
  EXPECT_NEAR(at(wsd("exponential"), 100), min_lr + (2 * std::sqrt(0.5) - 1) * delta, tol);  // 2 * 0.5^(1/2) - 1
  EXPECT_NEAR(at(wsd("linear"), 95), min_lr + 0.75 * delta, tol);
  EXPECT_NEAR(at(wsd("cosine"), 100), min_lr + delta / 2, tol);
  EXPECT_NEAR(at(wsd("minus_sqrt"), 95), min_lr + delta / 2, tol);  // 1 - sqrt(1/4)
  // The default is the cosine schedule, and decay_steps 0 is the run's length.
  EXPECT_EQ(at({}, 60), at(style("cosine"), 60));
  EXPECT_NEAR(at({"optimizer.decay_steps=0", "optimizer.decay_style=\"linear\""}, 105), min_lr + 0.5 * delta, tol);
}

// Warmup-stable-decay's use: train at a constant rate, then resume from a checkpoint of
// the stable phase and anneal. The resumed run is the uninterrupted wsd run, bit for bit.
TEST(LearningRate, AWsdDecayResumedFromAConstantRunIsTheWholeWsdRun) {
  const std::string dir = loom::testing::scratch_dir("wsd");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const std::vector<std::string> wsd = {"run.steps=12", "optimizer.decay_style=\"wsd\"", "optimizer.wsd_decay_steps=4",
                                        "optimizer.min_lr=1e-3"};
  auto whole = run_and_trace(tiny_manifest(), wsd);
  auto stable = run_and_trace(tiny_manifest(), {"run.steps=8", "optimizer.decay_style=\"constant\"", ck});
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto annealed = run_and_trace(tiny_manifest(), loom::testing::with_overrides(wsd, {ck}), resume);
  ASSERT_EQ(annealed.loss.size(), 4u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(stable.loss[i], whole.loss[i]) << "step " << i + 1;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(annealed.loss[i], whole.loss[8 + i]) << "step " << 9 + i;
  EXPECT_EQ(annealed.params.back(), whole.params.back());
  fs::remove_all(dir);
}

// A schedule in samples (Megatron-LM's --lr-*-samples) places a step at the samples
// consumed through it: with a constant batch of 8, marks of 8 x the steps' give the
// step schedule's rates exactly, for every style.
TEST(LearningRate, ASampleScheduleOfAConstantBatchIsTheStepSchedule) {
  for (const char* style : {"cosine", "linear", "constant", "inverse-square-root", "wsd"}) {
    const std::vector<std::string> common = {"run.steps=200", "optimizer.min_lr=1e-4",
                                             std::string("optimizer.decay_style=\"") + style + "\""};
    const loom::manifest::RunConfig steps =
        loom::testing::plan_from(tiny_manifest(), with_overrides(common, {"optimizer.warmup_steps=10",
                                                                          "optimizer.decay_steps=110",
                                                                          "optimizer.wsd_decay_steps=20"}))
            .config;
    const loom::manifest::RunConfig samples =
        loom::testing::plan_from(tiny_manifest(),
                                 with_overrides(common, {"optimizer.warmup_steps=0", "optimizer.warmup_samples=80",
                                                         "optimizer.decay_samples=880", "optimizer.wsd_decay_samples=160"}))
            .config;
    EXPECT_FALSE(loom::manifest::schedule_marks(steps).in_samples);
    EXPECT_TRUE(loom::manifest::schedule_marks(samples).in_samples);
    for (int64_t step = 1; step <= 200; ++step)
      ASSERT_EQ(loom::train::learning_rate(steps, {step, 0}),
                loom::train::learning_rate(samples, {step, static_cast<uint64_t>(8 * step)}))
          << style << ", step " << step;
  }
}

// With a batch ramp the schedule in samples follows the data seen. The ramp [4, 2, 24]
// to 8 (one increment per 12 samples) over run.train_samples = 64: steps of 4, 4, 4,
// 6, 6, 8, then 8s, through 4, 8, 12, 18, 24, 32, 40, 48, 56, 64 samples (10 steps).
// Warmup 12 samples, a linear decay to 64 (decay_samples = 0: run.train_samples):
// each step's rate, as the run's metrics and its optimizer got it, worked by hand.
TEST(LearningRate, AScheduleInSamplesFollowsTheRampsBatches) {
  const std::vector<std::string> ramp = {"run.train_samples=64",      "batch.micro_batch_size=2",
                                         "batch.rampup_batch_size=[4, 2, 24]", "optimizer.warmup_steps=0",
                                         "optimizer.warmup_samples=12", "optimizer.min_lr=1e-3",
                                         "optimizer.decay_style=\"linear\""};
  // The optimizer's settings as the manifest holds them (single precision, as the
  // optimizer plugins take them).
  const loom::manifest::RunConfig config = loom::testing::plan_from(tiny_manifest(), ramp).config;
  const double lr = config.optimizer.lr, min_lr = config.optimizer.min_lr;
  auto run = run_and_trace(tiny_manifest(), ramp);
  const std::vector<double> through = {4, 8, 12, 18, 24, 32, 40, 48, 56, 64};
  ASSERT_EQ(run.result.steps.size(), through.size());
  for (size_t i = 0; i < through.size(); ++i) {
    const double s = through[i];
    const double expected = s <= 12 ? lr * s / 12 : min_lr + (1 - (s - 12) / (64 - 12)) * (lr - min_lr);
    EXPECT_EQ(run.result.steps[i].lr, static_cast<float>(expected)) << "step " << i + 1 << " (" << s << " samples)";
  }
  // The same run with the schedule in steps warms up over 3 steps and decays by steps.
  auto by_steps = run_and_trace(tiny_manifest(), {"run.steps=10", "batch.micro_batch_size=2",
                                                  "batch.rampup_batch_size=[4, 2, 24]", "optimizer.warmup_steps=3",
                                                  "optimizer.min_lr=1e-3", "optimizer.decay_style=\"linear\""});
  EXPECT_EQ(by_steps.result.steps[3].lr, static_cast<float>(min_lr + (1 - 1.0 / 7) * (lr - min_lr)));
  EXPECT_NE(by_steps.result.steps[3].lr, run.result.steps[3].lr);
}

// optimizer.warmup_fraction (Megatron-LM's --lr-warmup-fraction) is that share of the
// schedule up to the decay's end: 0.1 of 110 steps is the schedule of 11 warmup steps,
// rate for rate; a share that is not whole steps keeps its fraction (0.25 of 10 steps:
// 2.5), in steps and in samples alike; with a warmup of its own it is refused.
TEST(LearningRate, AWarmupFractionIsAShareOfTheSchedule) {
  auto config = [](const std::vector<std::string>& o) {
    return loom::testing::plan_from(tiny_manifest(), with_overrides({"run.steps=200", "optimizer.min_lr=1e-4"}, o))
        .config;
  };
  for (const char* style : {"cosine", "linear", "inverse-square-root", "wsd"}) {
    const std::vector<std::string> common = {std::string("optimizer.decay_style=\"") + style + "\"",
                                             "optimizer.decay_steps=110", "optimizer.wsd_decay_steps=20"};
    const auto steps = config(with_overrides(common, {"optimizer.warmup_steps=11"}));
    const auto share = config(with_overrides(common, {"optimizer.warmup_steps=0", "optimizer.warmup_fraction=0.1"}));
    for (int64_t step = 1; step <= 200; ++step)
      ASSERT_EQ(loom::train::learning_rate(steps, {step, 0}), loom::train::learning_rate(share, {step, 0}))
          << style << ", step " << step;
  }
  const auto quarter =
      config({"optimizer.warmup_steps=0", "optimizer.warmup_fraction=0.25", "optimizer.decay_steps=10",
              "optimizer.decay_style=\"linear\"", "optimizer.min_lr=0.0"});
  const double lr = quarter.optimizer.lr;
  EXPECT_EQ(loom::manifest::schedule_marks(quarter).warmup, 2.5);
  EXPECT_NEAR(loom::train::learning_rate(quarter, {2, 0}), lr * 2 / 2.5, 1e-15);
  EXPECT_NEAR(loom::train::learning_rate(quarter, {3, 0}), lr * (1 - 0.5 / 7.5), 1e-15);
  // In samples: a quarter of the run's 80 samples (10 steps of 8) is 20.
  const auto samples = loom::testing::plan_from(tiny_manifest(), {"run.train_samples=80", "optimizer.warmup_steps=0",
                                                                  "optimizer.warmup_fraction=0.25"})
                           .config;
  EXPECT_EQ(loom::manifest::schedule_marks(samples).warmup, 20.0);
  EXPECT_NEAR(loom::train::learning_rate(samples, {1, 8}), samples.optimizer.lr * 8 / 20, 1e-15);
  try {
    loom::testing::plan_from(tiny_manifest(), {"optimizer.warmup_fraction=0.1"});
    ADD_FAILURE() << "warmup_fraction beside warmup_steps was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.warmup_fraction and optimizer.warmup_steps both size the warmup"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(loom::testing::plan_from(tiny_manifest(), {"optimizer.warmup_steps=0", "optimizer.warmup_fraction=1.0"}),
               std::exception)
      << "a warmup as long as the decay";
}

// The schedule counts steps or samples, never both; run.train_samples counts samples.
// The marks' checks read the schedule's unit; keys a style never reads are warned of.
TEST(LearningRate, AScheduleCountsStepsOrSamplesNotBoth) {
  const auto refusal = loom::testing::tiny_plan_refusal;
  EXPECT_NE(refusal({"optimizer.decay_samples=100"})
                .find("optimizer.warmup_steps and optimizer.decay_samples are both set: the learning-rate schedule "
                      "counts steps or training samples, not both"),
            std::string::npos);
  // run.train_samples counts the schedule in samples unless a *_steps mark it reads is
  // written (the tiny manifest's warmup_steps = 2 is).
  auto in_samples = [](const std::vector<std::string>& o) {
    return loom::manifest::schedule_marks(loom::testing::plan_from(tiny_manifest(), o).config).in_samples;
  };
  EXPECT_FALSE(in_samples({"run.train_samples=80"}));
  EXPECT_TRUE(in_samples({"run.train_samples=80", "optimizer.warmup_steps=0"}));
  EXPECT_TRUE(in_samples({"run.train_samples=80", "optimizer.warmup_steps=0", "optimizer.warmup_samples=16"}));
  EXPECT_FALSE(in_samples({"run.train_samples=80", "optimizer.decay_style=\"wsd\"", "optimizer.wsd_decay_steps=3"}));
  EXPECT_NE(refusal({"optimizer.warmup_steps=0", "optimizer.warmup_samples=16", "optimizer.decay_samples=16"})
                .find("optimizer.decay_samples (16) must be more than the warmup (16 samples, optimizer.warmup_samples): "
                      "the decay runs from the end of the warmup to optimizer.decay_samples (Megatron's "
                      "--lr-decay-samples)"),
            std::string::npos);
  // wsd in samples: the run's 10 steps of 8 are 80 samples, 16 of them warmup.
  const std::vector<std::string> wsd = {"optimizer.warmup_steps=0", "optimizer.warmup_samples=16",
                                        "optimizer.decay_style=\"wsd\""};
  EXPECT_NE(refusal(with_overrides(wsd, {"optimizer.wsd_decay_samples=65"}))
                .find("decays over the last optimizer.wsd_decay_samples (65) samples before sample 80 "
                      "(optimizer.decay_samples, or the run's samples when 0), after the 16 warmup samples: it must "
                      "be between 1 and 64"),
            std::string::npos);
  EXPECT_EQ(refusal(with_overrides(wsd, {"optimizer.wsd_decay_samples=64"})), "");
  EXPECT_NE(refusal({"optimizer.decay_style=\"wsd\"", "optimizer.wsd_decay_steps=9"})
                .find("it must be between 1 and 8"),
            std::string::npos)
      << "steps, as before";
  auto warned = [](const std::vector<std::string>& o, const std::string& text) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), o).warnings)
      if (w.find(text) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(warned({"optimizer.warmup_steps=0", "optimizer.warmup_samples=88"},
                     "the warmup (88 samples) outlasts the run (80 samples)"));
  EXPECT_FALSE(warned({"optimizer.warmup_steps=0", "optimizer.warmup_samples=80"}, "outlasts the run"))
      << "the last step reaches optimizer.lr";
  // A samples mark the decay style does not read changes nothing, not even the unit:
  // the tiny manifest's warmup_steps = 2 stands beside it.
  EXPECT_EQ(refusal({"optimizer.wsd_decay_samples=50"}), "");
  EXPECT_FALSE(in_samples({"optimizer.wsd_decay_samples=50"}));
  EXPECT_NE(refusal({"run.steps=1125899906842625"}).find("run.steps = 1125899906842625 of batch.global_batch_size = 8 "
                                                         "are more than 2^53 training samples"),
            std::string::npos);
  EXPECT_TRUE(warned({"optimizer.decay_style=\"constant\"", "optimizer.warmup_steps=0", "optimizer.decay_samples=50"},
                     "optimizer.decay_samples is where a decay ends"));
  EXPECT_TRUE(warned({"optimizer.warmup_steps=0", "optimizer.wsd_decay_samples=50"},
                     "optimizer.wsd_decay_samples shapes the final decay"));
}

// The weight decay's schedule (Megatron-LM's --weight-decay-incr-style) at the points
// with a closed form, over the run's 100 steps (or its 800 samples), and as the
// optimizer gets it: a run whose schedule starts and ends at 0.05 trains as a constant
// 0.05 does, bit for bit; one from 0 to 0.2 does not, and records each step's value.
TEST(WeightDecay, EachIncrementStyleIsMegatronsSchedule) {
  auto config = [](const std::vector<std::string>& o) {
    return loom::testing::plan_from(tiny_manifest(), with_overrides({"run.steps=100", "optimizer.start_weight_decay=0.02",
                                                                      "optimizer.end_weight_decay=0.1"},
                                                                     o))
        .config;
  };
  auto at = [](const loom::manifest::RunConfig& c, int64_t step, uint64_t samples = 0) {
    return loom::train::weight_decay(c.optimizer, loom::manifest::schedule_marks(c), {step, samples});
  };
  const double tol = 1e-15;
  const auto linear = config({"optimizer.weight_decay_incr_style=\"linear\""});
  EXPECT_NEAR(at(linear, 25), 0.02 + 0.25 * 0.08, tol);
  EXPECT_NEAR(at(linear, 100), 0.1, tol);
  EXPECT_NEAR(at(linear, 101), 0.1, tol) << "past the run: the end";
  const auto cosine = config({"optimizer.weight_decay_incr_style=\"cosine\""});
  EXPECT_NEAR(at(cosine, 50), 0.06, tol);  // half: cos(pi / 2) = 0
  EXPECT_NEAR(at(cosine, 100), 0.1, tol);
  EXPECT_NEAR(at(cosine, 25), 0.02 + 0.5 * (std::cos(M_PI * 0.75) + 1) * 0.08, tol);
  EXPECT_NEAR(at(config({"optimizer.weight_decay=0.3"}), 25), 0.3, tol) << "constant: optimizer.weight_decay";
  // In samples: the run is 800 (100 steps of 8), a quarter of it 200.
  const auto in_samples =
      config({"optimizer.weight_decay_incr_style=\"linear\"", "optimizer.warmup_steps=0", "optimizer.warmup_samples=8"});
  EXPECT_NEAR(at(in_samples, 3, 200), 0.02 + 0.25 * 0.08, tol);

  auto flat = run_and_trace(tiny_manifest(), {"run.steps=4", "optimizer.weight_decay=0.05"});
  auto same = run_and_trace(tiny_manifest(), {"run.steps=4", "optimizer.weight_decay_incr_style=\"linear\"",
                                              "optimizer.start_weight_decay=0.05", "optimizer.end_weight_decay=0.05"});
  auto rising = run_and_trace(tiny_manifest(), {"run.steps=4", "optimizer.weight_decay_incr_style=\"linear\"",
                                                "optimizer.start_weight_decay=0.0", "optimizer.end_weight_decay=0.2"});
  EXPECT_EQ(same.params.back(), flat.params.back());
  EXPECT_NE(rising.params.back(), flat.params.back());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rising.result.steps[i].weight_decay, static_cast<float>(0.2 * static_cast<double>(i + 1) / 4)) << i;
    EXPECT_EQ(flat.result.steps[i].weight_decay, 0.05f);
  }
  // Keys a style never reads are warned of.
  auto warned = [](const std::vector<std::string>& o, const std::string& text) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), o).warnings)
      if (w.find(text) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(warned({"optimizer.end_weight_decay=0.2"}, "optimizer.end_weight_decay is an end of a weight-decay schedule"));
  EXPECT_FALSE(warned({"optimizer.weight_decay_incr_style=\"cosine\"", "optimizer.start_weight_decay=0.0",
                       "optimizer.end_weight_decay=0.2"},
                      "is an end of a weight-decay schedule"));
  // A schedule names both its ends (Megatron asserts it): the defaults would train with none.
  try {
    loom::testing::plan_from(tiny_manifest(),
                             {"optimizer.weight_decay_incr_style=\"cosine\"", "optimizer.end_weight_decay=0.2"});
    ADD_FAILURE() << "a schedule without its start was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.weight_decay_incr_style = \"cosine\" goes from "
                                         "optimizer.start_weight_decay to optimizer.end_weight_decay: set both"),
              std::string::npos)
        << e.what();
  }
}

// A collective timeout below a millisecond waits a millisecond: rounded down it was 0,
// which means no timeout at all.
TEST(RunPlan, ASubMillisecondTimeoutIsOneMillisecond) {
  EXPECT_EQ(loom::train::launch_config(loom::testing::plan_from(tiny_manifest(), {"comm.timeout_s=0.0001"})).timeout_ms, 1);
  EXPECT_EQ(loom::train::launch_config(loom::testing::plan_from(tiny_manifest(), {"comm.timeout_s=2.0005"})).timeout_ms,
            2001);
}

// The same global batch over 1, 2 and 4 data-parallel ranks trains the same model.
//
// Parameters are compared per tensor, norm-wise (||a - b|| / ||b|| <= 1e-5): Adam's
// update lr * g / (|g| + eps) has slope ~lr / (4 eps) for gradients near eps, so
// fp32 summation-order noise makes individual near-zero elements differ by more
// than 1e-5 of their own tiny size while the tensor agrees to ~3e-7. The averaged
// gradients are compared too, relative to each step's largest gradient.
// The comm plugin's declared reach (ABI 1.9 LOOM_COMM_*), checked before launch by
// capability, not by plugin name: a one-process-per-rank plugin needs mpirun; a GPU's
// tensors to a plugin of host buffers go through host copies, which the plan says.
TEST(RunPlan, TheCommPluginMustReachTheRanksAndTheirMemory) {
  auto refusal = [](const std::vector<std::string>& overrides) -> loom::manifest::Diagnostic {
    try {
      (void)loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
    } catch (const loom::manifest::ManifestError& e) {
      for (const auto& d : e.diagnostics())
        if (d.key == "comm.backend") return d;
    }
    return {};
  };
  (void)loom::testing::plan_from(loom::testing::tiny_manifest(), {});  // loads the plugins
  if (loom::plugins::registry().find("comm", "mpi") != nullptr) {
    const loom::manifest::Diagnostic d = refusal({"comm.backend=\"mpi\"", "parallel.dp=2"});
    EXPECT_NE(d.message.find("comm/mpi needs one process per rank; start the run with mpirun -np 2"),
              std::string::npos) << d.message;
  }
  if (loom::plugins::registry().find("device", "cuda") != nullptr) {  // CUDA builds
    EXPECT_EQ(refusal({"device.kind=\"cuda\"", "parallel.dp=2"}).message, "") << "staged, not refused";
    auto staging_warning = [](const std::vector<std::string>& overrides) {
      for (const std::string& w : loom::testing::plan_from(loom::testing::tiny_manifest(), overrides).warnings)
        if (w.find("comm/local exchanges host memory and device/cuda keeps tensors in memory of its own") != std::string::npos)
          return true;
      return false;
    };
    EXPECT_TRUE(staging_warning({"device.kind=\"cuda\"", "parallel.dp=2"}));
    EXPECT_FALSE(staging_warning({"device.kind=\"cuda\"", "parallel.dp=1"})) << "one rank exchanges nothing";
  }
  EXPECT_EQ(refusal({"parallel.dp=2"}).message, "");  // comm/local with device/cpu: host memory
}

// optimizer.strategy names any parallel plugin with an optimizer table (ABI 1.9 opened
// it): one that does not exist, or provides another table, is refused at the key.
TEST(RunPlan, TheOptimizerStrategyIsAnyOptimizerPlugin) {
  auto message = [](const std::string& strategy) -> std::string {
    try {
      (void)loom::testing::plan_from(loom::testing::tiny_manifest(), {"optimizer.strategy=\"" + strategy + "\""});
    } catch (const loom::manifest::ManifestError& e) {
      for (const auto& d : e.diagnostics())
        if (d.key == "optimizer.strategy") return d.message;
    }
    return "";
  };
  EXPECT_EQ(message("ddp"), "");
  EXPECT_EQ(message("distributed"), "");
  EXPECT_NE(message("adam").find("no plugin parallel/adam is loaded"), std::string::npos) << message("adam");
  EXPECT_NE(message("tensor").find("plugin parallel/tensor is not an optimizer strategy"), std::string::npos)
      << message("tensor");
}

TEST(DataParallel, MatchesSerialStepByStep) {
  const std::vector<std::string> common = {};
  std::vector<std::vector<float>> serial_grads;
  auto grab_grads = [](std::vector<std::vector<float>>& out) {
    return [&out](int64_t, int rank, const loom::model::Model& m) {
      if (rank != 0) return;
      const float* g = static_cast<const float*>(m.grads());
      out.emplace_back(g, g + m.numel());
    };
  };
  loom::train::TrainOptions serial_opts;
  serial_opts.on_step = grab_grads(serial_grads);
  auto with = [&](std::vector<std::string> v, const std::string& extra) {
    v.push_back(extra);
    return v;
  };
  auto serial = run_and_trace(tiny_manifest(), with(common, "parallel.dp=1"), serial_opts);
  ASSERT_EQ(serial.loss.size(), 10u);
  for (int dp : {2, 4}) {
    std::vector<std::vector<float>> grads;
    loom::train::TrainOptions opts;
    opts.on_step = grab_grads(grads);
    auto par = run_and_trace(tiny_manifest(), with(common, "parallel.dp=" + std::to_string(dp)), opts);
    ASSERT_EQ(par.loss.size(), serial.loss.size());
    ASSERT_EQ(par.params.size(), serial.params.size());
    ASSERT_EQ(grads.size(), serial_grads.size());
    for (size_t s = 0; s < serial.loss.size(); ++s) {
      EXPECT_NEAR(par.loss[s], serial.loss[s], 1e-5 * std::fabs(serial.loss[s])) << "dp=" << dp << " step " << s + 1;
      std::string worst;
      const double rel = loom::testing::max_tensor_rel_diff(serial, s, par.params[s], &worst);
      EXPECT_LT(rel, 1e-5) << "dp=" << dp << " step " << s + 1 << " worst tensor " << worst;
      float gmax = 0, gdiff = 0;
      for (size_t i = 0; i < grads[s].size(); ++i) {
        gmax = std::max(gmax, std::fabs(serial_grads[s][i]));
        gdiff = std::max(gdiff, std::fabs(grads[s][i] - serial_grads[s][i]));
      }
      EXPECT_GT(gmax, 0.f);
      EXPECT_LT(gdiff, 1e-5f * gmax) << "dp=" << dp << " step " << s + 1;
    }
  }
}

// Dropout masks follow the samples (the step's seed names a microbatch's first
// sample), not the microbatch's index on its rank: with dropout in every layer,
// dp 2 and dp 4 train as dp 1 does; and the masks are really there (a run
// without dropout differs).
TEST(DataParallel, DropoutMasksFollowTheSamplesSoAnyDpMatchesSerial) {
  const std::vector<std::string> dropout = {"model.layer.attention.dropout=0.2", "model.layer.mlp.dropout=0.2",
                                            "model.layer.mlp.activation_dropout=0.1",
                                            "model.layer.embedding.dropout=0.1"};
  auto with = [&](const std::string& dp) {
    std::vector<std::string> o = dropout;
    o.push_back(dp);
    return run_and_trace(tiny_manifest(), o);
  };
  const auto serial = with("parallel.dp=1");
  const auto plain = run_and_trace(tiny_manifest(), {"parallel.dp=1"});
  EXPECT_GT(std::fabs(serial.loss[0] - plain.loss[0]), 1e-4) << "dropout changed nothing";
  for (const std::string dp : {"parallel.dp=2", "parallel.dp=4"}) {
    const auto par = with(dp);
    ASSERT_EQ(par.loss.size(), serial.loss.size());
    for (size_t s = 0; s < serial.loss.size(); ++s) {
      EXPECT_NEAR(par.loss[s], serial.loss[s], 1e-5 * std::fabs(serial.loss[s])) << dp << " step " << s + 1;
      std::string worst;
      EXPECT_LT(loom::testing::max_tensor_rel_diff(serial, s, par.params[s], &worst), 1e-5)
          << dp << " step " << s + 1 << " worst tensor " << worst;
    }
  }
}

// The parallel run must differ from a run on different data, or the equivalence
// test above would prove nothing.
TEST(DataParallel, EquivalenceTestCanFail) {
  auto a = run_and_trace(tiny_manifest(), {"run.steps=3"});
  auto b = run_and_trace(tiny_manifest(), {"run.steps=3", "run.seed=8"});
  EXPECT_GT(max_rel_diff(a.params.back(), b.params.back()), 1e-3);
}

// 2-digit addition: the loss first falls to (2/4) ln 10 = 1.15, where the model
// knows the answer's format but not the sums; a model that learns to add goes far
// below it, and gets held-out problems exactly right. 1000 steps: when the model
// leaves the plateau is chaotic (at 600 steps seeds 7-11 scored 7% to 91% exact,
// and the ASan build's last-bit differences turned seed 7's 91% into 48%); by 1000
// every one of them scored 99-100%.
TEST(Training, LearnsTheSyntheticTask) {
  auto t = run_and_trace(tiny_manifest(),
                         {"run.steps=1000", "parallel.dp=2", "model.hidden_size=64", "optimizer.lr=3e-3",
                          "optimizer.min_lr=3e-4", "optimizer.warmup_steps=50", "batch.global_batch_size=32",
                          "batch.micro_batch_size=16", "run.eval_every=1000", "run.eval_batches=4"});
  ASSERT_EQ(t.loss.size(), 1000u);
  const double plateau = 0.5 * std::log(10.0);
  EXPECT_GT(t.loss.front(), 0.8 * std::log(13.0));  // starts near chance over the 13 tokens
  EXPECT_LT(t.loss.back(), 0.5 * plateau);
  const auto& last = t.result.steps.back();
  ASSERT_TRUE(last.evaluated);
  EXPECT_LT(last.val_loss, 0.5 * plateau);
  EXPECT_GT(last.exact_match, 0.5);  // most held-out problems fully right
}

// run.eval_batches counts microbatches of the whole evaluation, shared among the dp
// ranks as Megatron-LM's eval_iters are: the same samples at any layout, so the
// validation loss after one step is the serial one (to the reduction order of the
// step), with 3 batches over 2 or 4 ranks (a rank's extra forward is not counted)
// and under expert parallelism (whose all-to-alls need every rank's forwards).
TEST(Training, ValidationIsTheSameSamplesAtAnyDataParallelSize) {
  const std::vector<std::string> base = {"run.steps=1", "run.eval_every=1", "run.eval_batches=3",
                                         "batch.micro_batch_size=2", "batch.global_batch_size=8"};
  auto val = [&](const std::string& manifest, const std::vector<std::string>& layout) {
    const auto t = run_and_trace(manifest, loom::testing::with_overrides(base, layout));
    EXPECT_TRUE(t.result.steps.at(0).evaluated);
    return t.result.steps.at(0);
  };
  const auto serial = val(tiny_manifest(), {"parallel.dp=1"});
  const auto moe_serial = val(loom::testing::tiny_moe_manifest(), {"parallel.dp=1", "model.block=[\"attention\", \"moe\"]"});
  EXPECT_GT(serial.token_accuracy, 0.0);
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.dp=2"}, {"parallel.dp=4"}, {"parallel.dp=2", "parallel.pp=2"}}) {
    SCOPED_TRACE(layout.back());
    const auto par = val(tiny_manifest(), layout);
    EXPECT_NEAR(par.val_loss, serial.val_loss, 1e-5 * serial.val_loss);
    EXPECT_EQ(par.token_accuracy, serial.token_accuracy);
    EXPECT_EQ(par.exact_match, serial.exact_match);
  }
  const auto moe = val(loom::testing::tiny_moe_manifest(),
                       {"parallel.dp=2", "parallel.ep=2", "model.block=[\"attention\", \"moe\"]"});
  EXPECT_NEAR(moe.val_loss, moe_serial.val_loss, 1e-5 * moe_serial.val_loss);
}

TEST(Checkpoint, ResumeIsBitExact) {
  const std::string dir = loom::testing::scratch_dir("resume");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  // The schedule decays over optimizer.decay_steps (default run.steps): a run
  // split in two must fix it, as Megatron's train-iters does.
  auto full = run_and_trace(tiny_manifest(), {"run.steps=12", "optimizer.decay_steps=12", "parallel.dp=2"});
  auto first = run_and_trace(tiny_manifest(), {"run.steps=6", "optimizer.decay_steps=12", "parallel.dp=2", ck});
  ASSERT_TRUE(fs::exists(loom::train::checkpoint_path(dir, 6)));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto second = run_and_trace(tiny_manifest(), {"run.steps=12", "optimizer.decay_steps=12", "parallel.dp=2", ck}, resume);
  EXPECT_EQ(second.result.start_step, 6);
  ASSERT_EQ(second.loss.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(first.loss[i], full.loss[i]);
    EXPECT_EQ(second.loss[i], full.loss[6 + i]) << "step " << 7 + i;
  }
  EXPECT_EQ(second.params.back(), full.params.back());  // bit-identical parameters
  fs::remove_all(dir);
}

// The data continues after the samples read so far (Megatron-LM's
// consumed_train_samples): a resume with twice the global batch reads on from sample
// 4 x 8, neither repeating nor skipping, and its checkpoint records 4 x 8 + 2 x 16.
TEST(Checkpoint, AResumeWithAnotherGlobalBatchContinuesAfterTheSamplesRead) {
  const std::string dir = loom::testing::scratch_dir("consumed");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=4", "parallel.dp=2", "batch.global_batch_size=8", ck});
  EXPECT_EQ(loom::train::read_meta(loom::train::checkpoint_path(dir, 4)).consumed_samples, 32);
  std::ostringstream log;
  loom::train::TrainOptions resume;
  resume.resume = true;
  resume.log = &log;
  run_and_trace(tiny_manifest(), {"run.steps=6", "parallel.dp=2", "batch.global_batch_size=16", ck}, resume);
  EXPECT_EQ(loom::train::read_meta(loom::train::checkpoint_path(dir, 6)).consumed_samples, 64);
  EXPECT_NE(log.str().find("read 32 training samples in 4 steps"), std::string::npos) << log.str();
  EXPECT_EQ(loom::train::samples_before(6, 4, 32, 16), 64u);
  // A checkpoint from before consumed_samples was recorded read step x the global batch
  // its manifest has (16), not this run's (8).
  const std::string meta = loom::train::checkpoint_path(dir, 6) + "/meta.toml";
  std::ifstream in(meta);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const size_t at = text.find("consumed_samples");
  ASSERT_NE(at, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, at) << text.substr(text.find('\n', at) + 1);
  std::ostringstream older;
  resume.log = &older;
  run_and_trace(tiny_manifest(), {"run.steps=7", "parallel.dp=2", "batch.global_batch_size=8", ck}, resume);
  EXPECT_EQ(loom::train::read_meta(loom::train::checkpoint_path(dir, 7)).consumed_samples, 6 * 16 + 8)
      << "the checkpoint at step 6 was written with global batch 16 (its manifest's)";
  EXPECT_EQ(loom::train::sample_index(loom::train::samples_before(5, 4, 32, 16), 1, 4, 2, 2), 32u + 16u + (4 + 2) * 2);
  fs::remove_all(dir);
}

// A stop signal during an evaluation that would run for hours (eval_batches 10^8) is
// honoured between its batches: the run checkpoints the step and stops, with no
// evaluation recorded. (Before, the signal waited for the whole evaluation.)
TEST(Checkpoint, AStopSignalEndsALongEvaluation) {
  const std::string dir = loom::testing::scratch_dir("evalstop");
  fs::remove_all(dir);
  std::atomic<int> stop{0};
  loom::train::TrainOptions opts;
  opts.stop_signal = &stop;
  std::thread signal([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop = 1;
  });
  auto cut = run_and_trace(tiny_manifest(),
                           {"run.steps=10", "run.eval_every=1", "run.eval_batches=100000000",
                            "checkpoint.dir=\"" + dir + "\""},
                           opts);
  signal.join();
  EXPECT_TRUE(cut.result.interrupted);
  EXPECT_EQ(cut.result.final_step, 1);
  EXPECT_EQ(loom::train::latest_checkpoint(dir), std::optional<int64_t>(1));
  ASSERT_EQ(cut.result.steps.size(), 1u);
  EXPECT_FALSE(cut.result.steps[0].evaluated);
  fs::remove_all(dir);
}

// checkpoint.dir's problems show before training: one that cannot be created fails
// the run before step 1; on resume, step_* directories that are not complete
// checkpoints (no meta.toml, a number past int64) are skipped for the newest complete
// one; the temporary directory of a save whose process is gone is removed.
TEST(Checkpoint, DirectoryProblemsShowBeforeTrainingAndIncompleteStepsAreSkipped) {
  loom::train::TrainOptions options;
  options.metrics_file = loom::testing::scratch_dir("ckdir") + ".jsonl";
  try {
    run_and_trace(tiny_manifest(), {"run.steps=3", "checkpoint.dir=\"/dev/null/ckpt\""}, options);
    FAIL() << "a checkpoint.dir that cannot be created must fail the run";
  } catch (const loom::train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.dir /dev/null/ckpt cannot be created"), std::string::npos)
        << e.what();
  }
  std::ifstream none(options.metrics_file);
  std::string line;
  EXPECT_FALSE(std::getline(none, line)) << "the run trained before failing on checkpoint.dir: " << line;
  fs::remove(options.metrics_file);

  const std::string dir = loom::testing::scratch_dir("ckskip");
  fs::remove_all(dir);
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=4", "checkpoint.every=2", ck});
  fs::create_directories(loom::train::checkpoint_path(dir, 99));                   // no meta.toml
  fs::create_directories(fs::path(dir) / "step_99999999999999999999");             // past int64
  const fs::path stale = fs::path(dir) / ".tmp-step_00000005-4194305";            // above any pid_max
  fs::create_directories(stale);
  // A save of step 4 again that stopped after moving the old one aside (gone from its
  // name): put back; an aside copy of step 2, which was saved again, removed.
  const std::string step4 = loom::train::checkpoint_path(dir, 4), step2 = loom::train::checkpoint_path(dir, 2);
  fs::rename(step4, step4 + ".old-4194305");
  fs::create_directories(step2 + ".old-4194305");
  EXPECT_EQ(loom::train::latest_checkpoint(dir), 2);
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto resumed = run_and_trace(tiny_manifest(), {"run.steps=6", ck}, resume);
  EXPECT_EQ(resumed.result.start_step, 4) << "the step moved aside was not put back";
  EXPECT_FALSE(fs::exists(stale)) << "the unfinished save of a process that is gone was left";
  EXPECT_FALSE(fs::exists(step2 + ".old-4194305")) << "a step saved again left its old copy";
  EXPECT_FALSE(fs::exists(step4 + ".old-4194305"));
  fs::remove_all(dir);
}

// checkpoint.keep_last: each save leaves the newest keep_last steps, a resume reads the
// newest, and what a stop in the middle of a removal left is cleared at the next start.
TEST(Checkpoint, KeepLastLeavesTheNewestSteps) {
  const std::string dir = loom::testing::scratch_dir("keeplast");
  fs::remove_all(dir);
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=8", "checkpoint.every=2", "checkpoint.keep_last=2", ck});
  EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{6, 8}));
  // What a stopped run left mid-removal, named by a process or (mpirun, srun) a job id.
  const fs::path stale = fs::path(dir) / ".removing-step_00000004-777.0";
  fs::create_directories(stale / "sub");
  loom::train::TrainOptions resume;
  resume.resume = true;
  std::ostringstream log;
  resume.log = &log;
  auto resumed = run_and_trace(tiny_manifest(), {"run.steps=10", "checkpoint.keep_last=1", ck}, resume);
  EXPECT_EQ(resumed.result.start_step, 8);
  EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{10}));
  EXPECT_NE(log.str().find("checkpoint.keep_last = 1: removing " + loom::train::checkpoint_path(dir, 8)),
            std::string::npos)
      << log.str();
  EXPECT_FALSE(fs::exists(stale)) << "the remains of a removal by a process that is gone were left";
  fs::remove_all(dir);
}

// Pruning removes only complete checkpoints before the step just saved: newer steps
// (another run's, say) and step_N directories without meta.toml are not its to judge.
TEST(Checkpoint, PruningTouchesOnlyCompleteStepsBeforeTheSavedOne) {
  const std::string dir = loom::testing::scratch_dir("prune");
  fs::remove_all(dir);
  for (int64_t step : {1, 2, 3, 4, 5}) {
    fs::create_directories(loom::train::checkpoint_path(dir, step));
    if (step != 4) std::ofstream(fs::path(loom::train::checkpoint_path(dir, step)) / "meta.toml") << "step = 0\n";
  }
  std::vector<std::string> failed;
  EXPECT_EQ(loom::train::CheckpointPruner(dir, 0).prune(3, &failed), std::vector<std::string>{}) << "0 keeps all";
  {
    loom::train::CheckpointPruner pruner(dir, 2);
    EXPECT_EQ(pruner.prune(3, &failed), std::vector<std::string>{loom::train::checkpoint_path(dir, 1)});
    EXPECT_TRUE(failed.empty());
    EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{2, 3, 5})) << "out of its name at once";
  }
  EXPECT_TRUE(fs::is_directory(loom::train::checkpoint_path(dir, 4))) << "an unfinished save was removed";
  {
    loom::train::CheckpointPruner pruner(dir, 1);
    EXPECT_EQ(pruner.prune(5, &failed).size(), 2u);
    EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{5}));
  }  // the pruner's end waits for the files
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind(".removing-", 0), std::string::npos) << e.path() << " left behind";
  fs::remove_all(dir);
}

// Two runs saving into one checkpoint.dir would interleave their checkpoints: while a
// run holds the directory, another is refused naming the holder's process.
TEST(Checkpoint, ASecondRunOnTheSameDirectoryIsRefused) {
  const std::string dir = loom::testing::scratch_dir("locked");
  fs::remove_all(dir);
  std::atomic<int> stop{0};
  std::string second;
  loom::train::TrainOptions first;
  first.stop_signal = &stop;
  first.on_step = [&](int64_t step, int rank, const loom::model::Model&) {
    if (step != 1 || rank != 0) return;
    try {
      run_and_trace(tiny_manifest(), {"run.steps=2", "checkpoint.dir=\"" + dir + "\""});
    } catch (const std::exception& e) {
      second = e.what();
    }
    stop = 1;
  };
  run_and_trace(tiny_manifest(), {"run.steps=10", "checkpoint.dir=\"" + dir + "\""}, first);
  EXPECT_NE(second.find("checkpoint.dir " + dir + " is in use by another run (process " +
                        std::to_string(::getpid()) + ")"),
            std::string::npos)
      << second;
  // Free again: a new run is refused for the checkpoints the first left, not the lock.
  try {
    run_and_trace(tiny_manifest(), {"run.steps=2", "checkpoint.dir=\"" + dir + "\""});
    ADD_FAILURE() << "a new run into another run's checkpoints must be refused";
  } catch (const loom::train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("holds the checkpoints of an earlier run"), std::string::npos) << e.what();
  }
  loom::train::TrainOptions resume;
  resume.resume = true;
  run_and_trace(tiny_manifest(), {"run.steps=2", "checkpoint.dir=\"" + dir + "\""}, resume);
  fs::remove_all(dir);
}

// An interrupt (the flag the SIGINT/SIGTERM handler sets) stops after the current
// step with a checkpoint; resuming finishes exactly like an uninterrupted run.
TEST(Checkpoint, InterruptThenResumeEqualsUninterrupted) {
  const std::string dir = loom::testing::scratch_dir("interrupt");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  auto full = run_and_trace(tiny_manifest(), {"run.steps=10"});
  std::atomic<int> stop{0};
  loom::train::TrainOptions opts;
  opts.stop_signal = &stop;
  // The flag is raised after step 4's stop check (as a signal arriving during
  // step 5 would be), so the run finishes step 5, checkpoints and stops.
  opts.on_step = [&](int64_t step, int, const loom::model::Model&) {
    if (step == 4) stop = 1;
  };
  auto cut = run_and_trace(tiny_manifest(), {"run.steps=10", ck}, opts);
  EXPECT_TRUE(cut.result.interrupted);
  EXPECT_EQ(cut.result.final_step, 5);
  EXPECT_EQ(loom::train::latest_checkpoint(dir), std::optional<int64_t>(5));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto rest = run_and_trace(tiny_manifest(), {"run.steps=10", ck}, resume);
  EXPECT_EQ(rest.params.back(), full.params.back());
  EXPECT_EQ(rest.loss.back(), full.loss.back());
  fs::remove_all(dir);
}

// A stop at an evaluation step leaves that evaluation to the resumed run, which runs it
// before training on: the metrics hold the validation loss an uninterrupted run has.
TEST(Checkpoint, AnEvaluationAStopCutShortIsRunOnResume) {
  const std::string dir = loom::testing::scratch_dir("pending_eval");
  const std::string metrics = dir + ".jsonl";
  fs::remove_all(dir);
  fs::remove(metrics);
  const std::vector<std::string> common = {"run.steps=10", "run.eval_every=5", "run.eval_batches=2"};
  auto full = run_and_trace(tiny_manifest(), common);
  ASSERT_EQ(full.result.steps.size(), 10u);
  ASSERT_TRUE(full.result.steps[4].evaluated);
  std::atomic<int> stop{0};
  loom::train::TrainOptions opts;
  opts.stop_signal = &stop;
  opts.metrics_file = metrics;
  opts.on_step = [&](int64_t step, int, const loom::model::Model&) {
    if (step == 4) stop = 1;  // seen after step 5, before its evaluation
  };
  const std::vector<std::string> saving = loom::testing::with_overrides(common, {"checkpoint.dir=\"" + dir + "\""});
  auto cut = run_and_trace(tiny_manifest(), saving, opts);
  ASSERT_TRUE(cut.result.interrupted);
  ASSERT_EQ(cut.result.final_step, 5);
  EXPECT_FALSE(cut.result.steps.back().evaluated);
  EXPECT_TRUE(loom::train::read_meta(loom::train::checkpoint_path(dir, 5)).evaluation_pending);
  loom::train::TrainOptions resume;
  resume.resume = true;
  resume.metrics_file = metrics;
  auto rest = run_and_trace(tiny_manifest(), saving, resume);
  EXPECT_EQ(rest.result.final_step, 10);
  EXPECT_FALSE(loom::train::read_meta(loom::train::checkpoint_path(dir, 5)).evaluation_pending)
      << "done, and still pending for a later resume";
  std::map<int64_t, double> val_loss;  // by step, from the metrics file
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) {
      EXPECT_EQ(val_loss.count(j.at("step").get<int64_t>()), 0u) << "an evaluation written twice: " << line;
      val_loss[j.at("step").get<int64_t>()] = j.at("val_loss").get<double>();
    }
  }
  ASSERT_EQ(val_loss.size(), 2u);
  EXPECT_EQ(val_loss[5], full.result.steps[4].val_loss);
  EXPECT_EQ(val_loss[10], full.result.steps[9].val_loss);
  fs::remove_all(dir);
  fs::remove(metrics);
}

// run.exit_interval (Megatron-LM's --exit-interval): each launch stops after the next
// multiple, its evaluation and checkpoint done; the launches, each the same
// --resume-if-any (the first finding no checkpoint), together equal one run.
TEST(Checkpoint, AnExitIntervalStopsEachLaunchAtAMultipleAndTheLaunchesEqualOneRun) {
  const std::string dir = loom::testing::scratch_dir("exit_interval");
  fs::remove_all(dir);
  const std::vector<std::string> common = {"run.steps=10", "parallel.dp=2", "run.eval_every=4", "run.eval_batches=2"};
  auto full = run_and_trace(tiny_manifest(), common);
  const std::vector<std::string> chunked =
      loom::testing::with_overrides(common, {"run.exit_interval=4", "checkpoint.dir=\"" + dir + "\""});
  loom::train::TrainOptions opts;
  opts.resume = opts.start_without_checkpoint = true;
  std::vector<int64_t> ends;
  for (int launch = 0; launch < 3; ++launch) {
    std::ostringstream log;
    opts.log = &log;
    auto part = run_and_trace(tiny_manifest(), chunked, opts);
    EXPECT_EQ(log.str().find("no checkpoint in " + dir + " yet; starting the run") != std::string::npos, launch == 0)
        << log.str();
    ends.push_back(part.result.final_step);
    EXPECT_FALSE(part.result.interrupted);
    ASSERT_FALSE(part.result.steps.empty());
    if (part.result.final_step < 10) {
      EXPECT_NE(part.result.exit_reason.find("run.exit_interval = 4"), std::string::npos) << part.result.exit_reason;
      EXPECT_TRUE(part.result.steps.back().evaluated) << "the exit step's evaluation is run before the stop";
      EXPECT_EQ(part.result.steps.back().val_loss,
                full.result.steps[static_cast<size_t>(part.result.final_step - 1)].val_loss);
      EXPECT_FALSE(loom::train::read_meta(loom::train::checkpoint_path(dir, part.result.final_step)).evaluation_pending);
    } else {
      EXPECT_EQ(part.result.exit_reason, "") << "the last launch ends the run";
      EXPECT_EQ(part.params.back(), full.params.back());
      EXPECT_EQ(part.loss.back(), full.loss.back());
    }
  }
  EXPECT_EQ(ends, (std::vector<int64_t>{4, 8, 10}));
  fs::remove_all(dir);
}

// run.exit_duration_minutes (Megatron-LM's --exit-duration-in-mins): out of time, the
// run stops after the step, saved as at a stop signal (its evaluation left to the
// resumed run), and the resumed run without a limit equals one uninterrupted run;
// out of time at its last step, a run just ends.
TEST(Checkpoint, AnExitDurationStopsAfterTheStepThatRanOutOfTime) {
  const std::string dir = loom::testing::scratch_dir("exit_duration");
  fs::remove_all(dir);
  const std::vector<std::string> common = {"run.steps=6", "parallel.dp=2", "run.eval_every=1", "run.eval_batches=2"};
  auto full = run_and_trace(tiny_manifest(), common);
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  // A microsecond: spent before the first step ends.
  auto cut = run_and_trace(tiny_manifest(),
                           loom::testing::with_overrides(common, {"run.exit_duration_minutes=1e-8", ck}));
  EXPECT_FALSE(cut.result.interrupted);
  EXPECT_EQ(cut.result.final_step, 1);
  EXPECT_NE(cut.result.exit_reason.find("run.exit_duration_minutes = 1e-08"), std::string::npos)
      << cut.result.exit_reason;
  ASSERT_EQ(cut.result.steps.size(), 1u);
  EXPECT_FALSE(cut.result.steps[0].evaluated);
  EXPECT_TRUE(loom::train::read_meta(loom::train::checkpoint_path(dir, 1)).evaluation_pending);
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto rest = run_and_trace(tiny_manifest(), loom::testing::with_overrides(common, {ck}), resume);
  EXPECT_EQ(rest.result.exit_reason, "");
  EXPECT_EQ(rest.result.final_step, 6);
  EXPECT_EQ(rest.params.back(), full.params.back());
  EXPECT_EQ(rest.result.steps.back().val_loss, full.result.steps.back().val_loss);
  // Out of time at the last step, the run ends as it would have: evaluated, no exit.
  fs::remove_all(dir);
  auto last = run_and_trace(tiny_manifest(), loom::testing::with_overrides(
                                                 common, {"run.steps=1", "run.exit_duration_minutes=1e-8", ck}));
  EXPECT_EQ(last.result.exit_reason, "");
  ASSERT_EQ(last.result.steps.size(), 1u);
  EXPECT_TRUE(last.result.steps[0].evaluated);
  // A limit not reached changes nothing.
  fs::remove_all(dir);
  auto roomy = run_and_trace(tiny_manifest(),
                             loom::testing::with_overrides(common, {"run.exit_duration_minutes=600", ck}));
  EXPECT_EQ(roomy.result.final_step, 6);
  EXPECT_EQ(roomy.result.exit_reason, "");
  EXPECT_EQ(roomy.params.back(), full.params.back());
  fs::remove_all(dir);
}

std::vector<std::pair<std::string, std::string>> snapshot(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    std::string content;
    if (fs::is_regular_file(e.path())) {
      std::ifstream in(e.path().string(), std::ios::binary);
      content.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    out.emplace_back(e.path().string(), content);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Checkpoint, CorruptCheckpointIsAClearErrorAndChangesNothing) {
  const std::string dir = loom::testing::scratch_dir("corrupt");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=3", ck});
  const std::string file = loom::train::checkpoint_path(dir, 3) + "/rank_00000.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c = 0x5a;
    f.write(&c, 1);
  }
  auto before = snapshot(dir);
  loom::train::TrainOptions resume;
  resume.resume = true;
  try {
    run_and_trace(tiny_manifest(), {"run.steps=6", ck}, resume);
    FAIL() << "a corrupt checkpoint must not load";
  } catch (const std::exception& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("rank_00000.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
  }
  EXPECT_EQ(snapshot(dir), before);
  // A corrupt optimizer_bytes header field (bytes 32..39) is checked against the file's
  // size before anything is allocated (it once asked for gigabytes).
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(32);
    const uint64_t huge = uint64_t{1} << 42;
    f.write(reinterpret_cast<const char*>(&huge), sizeof(huge));
  }
  try {
    run_and_trace(tiny_manifest(), {"run.steps=6", ck}, resume);
    FAIL() << "a checkpoint whose header sizes are not the file's must not load";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("do not match the file's"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// The files of each step directory under `dir` (paths relative to it), but the
// manifest, which names the directory.
std::map<std::string, std::string> step_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& [path, content] : snapshot(dir)) {
    const std::string rel = fs::relative(path, dir).string();
    if (rel.rfind("step_", 0) == 0 && fs::is_regular_file(path) && fs::path(rel).filename() != "manifest.toml")
      out[rel] = content;
  }
  return out;
}

// Holds a checkpoint's write back until released (or 60 s pass: a test that went wrong
// fails, it does not hang).
struct HeldWrite {
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(60), [this] { return released; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }
};

// checkpoint.async_save: a checkpoint is written while training goes on (step 2's
// write is held back until both ranks have trained step 4, and its directory is not
// there before), and every step directory holds the same bytes as the in-line save's.
TEST(Checkpoint, AnAsyncSaveWritesTheSameFilesWhileTrainingGoesOn) {
  const std::string in_line = loom::testing::scratch_dir("inline"), async = loom::testing::scratch_dir("async");
  const std::vector<std::string> run = {"run.steps=7", "checkpoint.every=2", "parallel.dp=2"};
  auto with = [&run](std::vector<std::string> more) {
    more.insert(more.begin(), run.begin(), run.end());
    return more;
  };
  auto reference = run_and_trace(tiny_manifest(), with({"checkpoint.dir=\"" + in_line + "\""}));
  HeldWrite held;
  std::atomic<int> at_step_4{0};
  std::atomic<bool> step_2_seen_early{false};
  loom::train::TrainOptions opts;
  std::ostringstream log;
  opts.log = &log;
  opts.before_checkpoint_write = [&](int64_t step, int) {
    if (step == 2) held.wait();
  };
  opts.on_step = [&](int64_t step, int, const loom::model::Model&) {
    if (step != 4) return;
    if (fs::exists(loom::train::checkpoint_path(async, 2))) step_2_seen_early = true;
    if (++at_step_4 == 2) held.release();
  };
  auto background =
      run_and_trace(tiny_manifest(), with({"checkpoint.dir=\"" + async + "\"", "checkpoint.async_save=true"}), opts);
  EXPECT_EQ(at_step_4, 2);
  EXPECT_FALSE(step_2_seen_early) << "step 2 was committed before its write was let go";
  EXPECT_EQ(background.loss, reference.loss);
  EXPECT_EQ(loom::train::complete_checkpoints(async), (std::vector<int64_t>{2, 4, 6, 7}));
  const std::map<std::string, std::string> a = step_files(async), b = step_files(in_line);
  EXPECT_EQ(a.size(), b.size());
  EXPECT_EQ(a.size(), 4u * 5u) << "meta.toml, and a rank file and a .params per rank, a step";
  for (const auto& [rel, content] : b) EXPECT_TRUE(a.count(rel) && a.at(rel) == content) << rel << " differs";
  EXPECT_NE(log.str().find("checkpoint: step 2 saved in " + loom::train::checkpoint_path(async, 2)), std::string::npos);
  EXPECT_NE(log.str().find("written beside training in"), std::string::npos) << log.str();
  for (const auto& e : fs::directory_iterator(async))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path() << " left behind";
  fs::remove_all(in_line);
  fs::remove_all(async);
}

// A stop signal while a checkpoint is being written beside training: the run commits
// it, saves the step it stops at, and the resumed run is the uninterrupted one.
TEST(Checkpoint, AStopWhileAnAsyncSaveIsWrittenKeepsItAndTheStopsStep) {
  const std::string dir = loom::testing::scratch_dir("asyncstop");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  auto full = run_and_trace(tiny_manifest(), {"run.steps=8"});
  HeldWrite held;
  std::atomic<int> stop{0};
  loom::train::TrainOptions opts;
  opts.stop_signal = &stop;
  opts.before_checkpoint_write = [&](int64_t step, int) {
    if (step == 2) held.wait();
  };
  opts.on_step = [&](int64_t step, int, const loom::model::Model&) {
    if (step != 3) return;
    stop = 1;  // as a signal during step 4: the run finishes it, saves and stops
    held.release();
  };
  auto cut = run_and_trace(tiny_manifest(), {"run.steps=8", "checkpoint.every=2", "checkpoint.async_save=true", ck},
                           opts);
  EXPECT_TRUE(cut.result.interrupted);
  EXPECT_EQ(cut.result.final_step, 4);
  EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{2, 4}));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto rest = run_and_trace(tiny_manifest(), {"run.steps=8", ck}, resume);
  EXPECT_EQ(rest.result.start_step, 4);
  EXPECT_EQ(rest.params.back(), full.params.back());
  fs::remove_all(dir);
}

// A write beside training that fails fails the run, on the rank that wrote, at the
// step where its commit would be; nothing of that step is committed, the checkpoints
// before it stay, its temporary directory goes as the run fails (its space back at
// once), and the next run resumes.
TEST(Checkpoint, AFailedAsyncWriteFailsTheRunAndLeavesTheEarlierCheckpoints) {
  const std::string dir = loom::testing::scratch_dir("asyncfail");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const std::vector<std::string> run = {"run.steps=8", "checkpoint.every=2", "checkpoint.async_save=true",
                                        "parallel.dp=2", ck};
  loom::train::TrainOptions opts;
  opts.before_checkpoint_write = [](int64_t step, int rank) {
    if (step == 4 && rank == 1) throw loom::train::CheckpointError("writing rank_00001.bin failed: No space left");
  };
  try {
    run_and_trace(tiny_manifest(), run, opts);
    FAIL() << "a failed checkpoint write must fail the run";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the checkpoint of step 4, written beside training, failed: writing "
                                         "rank_00001.bin failed: No space left"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{2}));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path() << " left by the failed run";
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto rest = run_and_trace(tiny_manifest(), run, resume);
  EXPECT_EQ(rest.result.start_step, 2);
  EXPECT_EQ(loom::train::complete_checkpoints(dir), (std::vector<int64_t>{2, 4, 6, 8}));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path() << " left behind";

  // The save at the end commits the one still written beside training (step 10's write is
  // held until step 11 has trained) before its own fails: that commit is said, since a
  // --resume starts from it.
  HeldWrite held;
  std::ostringstream log;
  opts.log = &log;
  opts.resume = true;
  opts.before_checkpoint_write = [&held](int64_t step, int rank) {
    if (step == 10) held.wait();
    if (step == 11 && rank == 0) throw loom::train::CheckpointError("writing rank_00000.bin failed: No space left");
  };
  opts.on_step = [&held](int64_t step, int, const loom::model::Model&) {
    if (step == 11) held.release();
  };
  std::vector<std::string> longer = run;
  longer.push_back("run.steps=11");
  EXPECT_THROW(run_and_trace(tiny_manifest(), longer, opts), std::exception);
  EXPECT_EQ(loom::train::latest_checkpoint(dir), std::optional<int64_t>(10));
  EXPECT_NE(log.str().find("checkpoint: step 10 saved in " + loom::train::checkpoint_path(dir, 10)), std::string::npos)
      << log.str();
  fs::remove_all(dir);
}

// A checkpoint written before a layer plugin declared an option has no value for it in
// its manifest.toml: it ran as the option's default does, so a resume at the default
// goes on (it was refused as another model), and one at another value is refused.
// (rope_scaling_factor is compared though the tiny model has no rotary embedding: a
// resume compares every option of the layer, as set or by default.)
TEST(Checkpoint, AnOptionTheCheckpointPredatesIsItsDefault) {
  const std::string dir = loom::testing::scratch_dir("predates");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const std::vector<std::string> run = {"optimizer.decay_steps=6", ck};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), run.begin(), run.end());
    return more;
  };
  auto full = run_and_trace(tiny_manifest(), {"run.steps=6", "optimizer.decay_steps=6"});
  run_and_trace(tiny_manifest(), with({"run.steps=3"}));
  // Drop the options layer/attention declared this session from the saved manifest.
  const std::string manifest = loom::train::checkpoint_path(dir, 3) + "/manifest.toml";
  std::ifstream in(manifest);
  std::string line, kept;
  int dropped = 0;
  while (std::getline(in, line)) {
    const bool newer = line.rfind("qk_norm", 0) == 0 || line.rfind("rope_", 0) == 0;
    dropped += newer;
    if (!newer) kept += line + "\n";
  }
  in.close();
  ASSERT_GE(dropped, 6) << "the saved manifest wrote out the attention's options";
  std::ofstream(manifest) << kept;
  loom::train::TrainOptions resume;
  resume.resume = true;
  try {
    run_and_trace(tiny_manifest(), with({"run.steps=6", "model.layer.attention.rope_scaling_factor=16.0"}), resume);
    FAIL() << "a resume at another value took a checkpoint that ran at the default";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.layer.attention.rope_scaling_factor = 8.0, this run has "
                                         "model.layer.attention.rope_scaling_factor = 16.0"),
              std::string::npos)
        << e.what();
  }
  auto rest = run_and_trace(tiny_manifest(), with({"run.steps=6"}), resume);
  EXPECT_EQ(rest.loss.back(), full.loss.back());
  fs::remove_all(dir);
}

// A checkpoint records each rank's parameters (rank_NNNNN.params: names and local
// shapes). Resuming another model is refused naming the first parameter that
// differs: blocks reordered (attention after mlp: the same element count, which
// the rank file alone would have loaded into the wrong parameters), another width
// (also when resharding over another dp). A checkpoint without the files (written
// before they existed) still loads.
TEST(Checkpoint, AnotherModelIsRefusedNamingTheParameter) {
  const std::string dir = loom::testing::scratch_dir("another-model");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=2", "parallel.dp=2", ck});
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto refusal = [&](std::vector<std::string> o) -> std::string {
    o.insert(o.end(), {"run.steps=4", ck});
    try {
      run_and_trace(tiny_manifest(), o, resume);
    } catch (const std::exception& e) {  // the launcher's, naming the rank
      return e.what();
    }
    return "";
  };
  const std::string swapped = refusal({"parallel.dp=2", "model.block=[\"mlp\", \"attention\"]"});
  EXPECT_NE(swapped.find(".params: parameter 2 is blocks.0.attention.ln.weight"), std::string::npos) << swapped;
  EXPECT_NE(swapped.find("in the checkpoint but blocks.0.mlp"), std::string::npos) << swapped;
  EXPECT_NE(swapped.find("manifest.toml"), std::string::npos) << "says where the checkpoint's model is: " << swapped;
  for (const std::string dp : {"parallel.dp=2", "parallel.dp=1"}) {  // as written, and resharded
    const std::string wider = refusal({dp, "model.ffn_hidden_size=96"});
    EXPECT_NE(wider.find("has shape [32, 128] in the checkpoint but [32, 96] in this model"), std::string::npos)
        << dp << ": " << wider;
  }
  // Another model with the same shapes: fewer heads, or a given vocab instead of the data's.
  for (const std::string dp : {"parallel.dp=2", "parallel.dp=1"}) {
    const std::string heads = refusal({dp, "model.num_heads=2"});
    EXPECT_NE(heads.find("holds a model with model.num_heads = 4, this run has model.num_heads = 2"),
              std::string::npos)
        << dp << ": " << heads;
  }
  const std::string vocab = refusal({"parallel.dp=2", "model.vocab_size=20"});
  EXPECT_NE(vocab.find("has a vocabulary of 13, the run 20 (model.vocab_size, data.tokenizer's, or the data's)"), std::string::npos) << vocab;
  // run.steps below the checkpoint's step is an error, not a silent exit.
  try {
    run_and_trace(tiny_manifest(), {"run.steps=1", "parallel.dp=2", ck}, resume);
    ADD_FAILURE() << "resuming step 2 with run.steps = 1 must fail";
  } catch (const loom::train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("is at step 2, past run.steps = 1"), std::string::npos) << e.what();
  }
  // meta.toml edited to another step than its directory's name: refused naming both.
  const std::string meta = loom::train::checkpoint_path(dir, 2) + "/meta.toml";
  std::string text;
  {
    std::ifstream in(meta);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = text.find("step = 2");
  ASSERT_NE(at, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, at) << "step = 1" << text.substr(at + 8);
  const std::string edited = refusal({"parallel.dp=2"});
  EXPECT_NE(edited.find("is named after step 2 but its meta.toml says step 1 (a copy under another step's name?)"),
            std::string::npos)
      << edited;
  // The same under step 1's name: the rank files, which say step 2, are refused.
  fs::rename(loom::train::checkpoint_path(dir, 2), loom::train::checkpoint_path(dir, 1));
  const std::string files = refusal({"parallel.dp=2"});
  EXPECT_NE(files.find(" at step 2, but it is rank "), std::string::npos) << files;  // either rank may report
  EXPECT_NE(files.find("whose meta.toml says step 1"), std::string::npos) << files;
  fs::rename(loom::train::checkpoint_path(dir, 1), loom::train::checkpoint_path(dir, 2));
  // meta.toml whose world is not its tp*cp*pp*dp: named as inconsistent.
  const size_t w = text.find("world = 2");
  ASSERT_NE(w, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, w) << "world = 3" << text.substr(w + 9);
  try {
    run_and_trace(tiny_manifest(), {"run.steps=4", "parallel.dp=2", ck}, resume);
    ADD_FAILURE() << "an inconsistent meta.toml must not load";
  } catch (const loom::train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("meta.toml is inconsistent: world = 3 but tp*cp*pp*dp = 1*1*1*2 = 2"),
              std::string::npos)
        << e.what();
  }
  // Another vocabulary that pads to the same shapes (data of another tokenizer with
  // model.vocab_size = 0): its ids would mean other tokens, refused at any layout.
  const size_t v = text.find("vocab = 13");
  ASSERT_NE(v, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, v) << "vocab = 14" << text.substr(v + 10);
  const std::string other_vocab = refusal({"parallel.dp=2"});
  EXPECT_NE(other_vocab.find("has a vocabulary of 14, the run 13"), std::string::npos) << other_vocab;
  // A rank file of another run at the same step (its header agrees): refused by the
  // checksum meta.toml records, not trained on with its dp replicas diverging.
  std::ofstream(meta) << text;
  const std::string other = loom::testing::scratch_dir("another-run");
  run_and_trace(tiny_manifest(), {"run.steps=2", "parallel.dp=2", "run.seed=99", "checkpoint.dir=\"" + other + "\""});
  const std::string mine = loom::train::checkpoint_path(dir, 2) + "/rank_00001.bin";
  fs::copy_file(mine, other + "/mine.bin");
  fs::copy_file(loom::train::checkpoint_path(other, 2) + "/rank_00001.bin", mine, fs::copy_options::overwrite_existing);
  const std::string copied = refusal({"parallel.dp=2"});
  EXPECT_NE(copied.find("not the file this checkpoint saved for rank 1"), std::string::npos) << copied;
  fs::copy_file(other + "/mine.bin", mine, fs::copy_options::overwrite_existing);
  fs::remove_all(other);
  // A count of ranks that is none: corrupt, said so (not a failure deep in the layout).
  const size_t d = text.find("\ndp = 2");
  ASSERT_NE(d, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, d) << "\ndp = -2" << text.substr(d + 7);
  const std::string negative = refusal({"parallel.dp=2"});
  EXPECT_NE(negative.find("is corrupt: meta.toml has dp = -2"), std::string::npos) << negative;
  // 2^32 + 2 is no 2 (it was narrowed to 2 and resumed).
  std::ofstream(meta) << text.substr(0, d) << "\ndp = 4294967298" << text.substr(d + 7);
  const std::string wrapped = refusal({"parallel.dp=2"});
  EXPECT_NE(wrapped.find("is corrupt: meta.toml has dp = 4294967298 (a number of ranks, 1 to 1048576)"),
            std::string::npos)
      << wrapped;
  // Samples read: fewer than the steps, or more than 2^30 a step, are none a run read;
  // no strategy: none wrote the optimizer state.
  for (const std::string& bad : {std::string("consumed_samples = 0"), std::string("consumed_samples = 9223372036854775807")}) {
    const size_t c = text.find("consumed_samples = ");
    ASSERT_NE(c, std::string::npos) << text;
    std::ofstream(meta) << text.substr(0, c) << bad << text.substr(text.find('\n', c));
    const std::string samples = refusal({"parallel.dp=2"});
    EXPECT_NE(samples.find("is corrupt: meta.toml has " + bad + " after 2 steps"), std::string::npos) << samples;
  }
  const size_t st = text.find("strategy = ");
  ASSERT_NE(st, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, st) << text.substr(text.find('\n', st) + 1);
  const std::string no_strategy = refusal({"parallel.dp=2"});
  EXPECT_NE(no_strategy.find("is corrupt: meta.toml has no strategy"), std::string::npos) << no_strategy;
  std::ofstream(meta) << text;
  for (const auto& e : fs::directory_iterator(loom::train::checkpoint_path(dir, 2)))
    if (e.path().extension() == ".params") fs::remove(e.path());
  // Without the parameter lists the names cannot be checked: refused for a checkpoint
  // of this format, which writes them; one written before they existed (and before
  // meta.toml recorded rank checksums) resumes.
  const std::string incomplete = refusal({"parallel.dp=2"});
  EXPECT_NE(incomplete.find(".params is missing (this checkpoint's format writes it)"), std::string::npos) << incomplete;
  const size_t sums = text.find("rank_checksums");
  ASSERT_NE(sums, std::string::npos) << text;
  std::ofstream(meta) << text.substr(0, sums) << text.substr(text.find('\n', sums) + 1);
  auto old = run_and_trace(tiny_manifest(), {"run.steps=4", "parallel.dp=2", ck}, resume);
  EXPECT_EQ(old.result.start_step, 2);
  fs::remove_all(dir);
}

// A run killed after its last checkpoint had written the metrics of later steps (the
// last of them cut short, as by a full disk); the resumed run trains those steps again
// and its metrics file holds each step once; the cut line is gone, a whole line that is
// not a step's is kept.
TEST(Checkpoint, AResumedRunsMetricsHoldEachStepOnce) {
  const std::string dir = loom::testing::scratch_dir("metrics-resume");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  loom::train::TrainOptions options;
  options.metrics_file = dir + ".jsonl";
  run_and_trace(tiny_manifest(), {"run.steps=5", "checkpoint.every=3", ck}, options);
  fs::remove_all(loom::train::checkpoint_path(dir, 5));  // as if killed before saving step 5
  std::ofstream(options.metrics_file, std::ios::app) << "not a step's line\n{\"step\":6,\"loss\":1.2";
  options.resume = true;
  run_and_trace(tiny_manifest(), {"run.steps=6", "checkpoint.every=3", ck}, options);
  std::ifstream in(options.metrics_file);
  std::vector<int64_t> steps;
  int others = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step")) steps.push_back(j["step"].get<int64_t>());
    else ++others;
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(others, 1) << "a line that is not a step's was dropped";
  fs::remove_all(dir);
  fs::remove(options.metrics_file);
}

// A step's name taken by a file or a dangling link is refused before training: a save of
// that step failed after training to it (the link) or replaced the file.
TEST(Checkpoint, AStepNameTakenByAFileIsRefusedBeforeTraining) {
  const std::string dir = loom::testing::scratch_dir("taken");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=2", ck});
  loom::train::TrainOptions resume;
  resume.resume = true;
  for (const bool link : {false, true}) {
    const std::string taken = loom::train::checkpoint_path(dir, 4);
    if (link) fs::create_symlink(dir + "/nowhere", taken);
    else std::ofstream(taken) << "not a checkpoint";
    try {
      run_and_trace(tiny_manifest(), {"run.steps=4", ck}, resume);
      ADD_FAILURE() << "a step name taken by " << (link ? "a dangling link" : "a file") << " was not refused";
    } catch (const loom::train::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("step_00000004, which is not a directory (" +
                                           std::string(link ? "a link to none" : "a file") + ")"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(fs::is_symlink(taken) || fs::is_regular_file(taken)) << "what held the name was touched";
    fs::remove(taken);
  }
  fs::remove_all(dir);
}

// A resume with another seed or data settings reads other samples than the run it
// continues would have: allowed (a new data mix), and said; an unchanged one says nothing.
TEST(Checkpoint, AResumeWithOtherDataSettingsSaysSo) {
  const std::string dir = loom::testing::scratch_dir("data-change");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=2", "optimizer.decay_steps=5", ck});
  auto resumed_log = [&](const std::vector<std::string>& changes) {
    loom::train::TrainOptions opts;
    opts.resume = true;
    std::ostringstream log;
    opts.log = &log;
    std::vector<std::string> o = {"optimizer.decay_steps=5"};
    o.insert(o.end(), changes.begin(), changes.end());
    o.insert(o.end(), {"run.steps=3", ck});
    run_and_trace(tiny_manifest(), o, opts);
    fs::remove_all(loom::train::checkpoint_path(dir, 3));
    return log.str();
  };
  const std::string changed = resumed_log({"run.seed=99"});
  EXPECT_NE(changed.find("resume: warning: run.seed: 7 -> 99 since the checkpoint"), std::string::npos) << changed;
  const std::string same = resumed_log({});
  EXPECT_EQ(same.find("resume: warning"), std::string::npos) << same;
  // The learning-rate schedule likewise, when a step still to come gets another rate:
  // raising run.steps moves a decay that ends at run.steps (decay_steps = 0); another
  // style changes it outright; a warmup that ended before the checkpoint does not.
  const std::string stretched = resumed_log({"optimizer.decay_steps=0"});
  EXPECT_NE(stretched.find("resume: warning: the learning-rate or weight-decay schedule differs from the "
                           "checkpoint's: step 3 gets lr"),
            std::string::npos)
      << stretched;
  EXPECT_NE(stretched.find("resume:   the decay's end (optimizer.decay_steps, or the run's length when it is 0): 5 -> 3 "
                           "steps"),
            std::string::npos)
      << stretched;
  const std::string style = resumed_log({"optimizer.decay_style=\"linear\""});
  EXPECT_NE(style.find("resume:   optimizer.decay_style: cosine -> linear"), std::string::npos) << style;
  const std::string warmup = resumed_log({"optimizer.warmup_steps=1"});
  EXPECT_NE(warmup.find("resume:   optimizer.warmup_steps: 2 -> 1"), std::string::npos) << "it moves the decay: " << warmup;
  const std::string min_lr = resumed_log({"optimizer.min_lr=2e-4"});
  EXPECT_NE(min_lr.find("resume:   optimizer.min_lr: 0 -> 0.0002"), std::string::npos) << min_lr;
  fs::remove_all(dir);
  // A constant rate has no decay to move: a longer constant run changes nothing of it,
  // nor does a warmup changed after it ended.
  run_and_trace(tiny_manifest(), {"run.steps=3", "optimizer.decay_style=\"constant\"", ck});
  for (const std::string& other : {std::string("run.steps=4"), std::string("optimizer.warmup_steps=1")}) {
    loom::train::TrainOptions opts;
    opts.resume = true;
    std::ostringstream log;
    opts.log = &log;
    run_and_trace(tiny_manifest(), {"run.steps=4", other, "optimizer.decay_style=\"constant\"", ck}, opts);
    EXPECT_EQ(log.str().find("resume: warning"), std::string::npos) << other << ": " << log.str();
    fs::remove_all(loom::train::checkpoint_path(dir, 4));
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumeWithoutCheckpointSaysWhere) {
  const std::string dir = loom::testing::scratch_dir("empty");
  loom::train::TrainOptions resume;
  resume.resume = true;
  try {
    run_and_trace(tiny_manifest(), {"checkpoint.dir=\"" + dir + "\""}, resume);
    FAIL();
  } catch (const loom::train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("no complete checkpoint in " + dir), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// A learning rate that blows the weights up: the run stops at the first non-finite
// loss or gradient norm, naming the step, and saves no checkpoint of it; every metrics
// line stays JSON (non-finite numbers as null).
TEST(Training, ANonFiniteLossStopsTheRunAndMetricsStayJson) {
  const std::string dir = loom::testing::scratch_dir("nonfinite");
  fs::remove_all(dir);
  loom::train::TrainOptions options;
  options.metrics_file = dir + ".jsonl";
  try {
    run_and_trace(tiny_manifest(), {"optimizer.lr=1e30", "optimizer.clip_grad=0", "run.steps=20",
                                    "checkpoint.dir=\"" + dir + "\"", "checkpoint.every=100"},
                  options);
    FAIL() << "a run whose loss is not finite must fail";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("training stops without saving this step's weights"), std::string::npos) << what;
    EXPECT_NE(what.find("optimizer.lr = 1e+30"), std::string::npos) << what;
  }
  EXPECT_FALSE(loom::train::latest_checkpoint(dir)) << "a checkpoint of non-finite weights was written";
  std::ifstream in(options.metrics_file);
  std::string line, last;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    last = line;
    EXPECT_EQ(line.find("nan"), std::string::npos) << line;
    EXPECT_EQ(line.find("inf"), std::string::npos) << line;
    EXPECT_TRUE(nlohmann::json::accept(line)) << line;
  }
  EXPECT_GE(lines, 1);
  EXPECT_LT(lines, 20) << "the run went on after a non-finite loss";
  EXPECT_NE(last.find("null"), std::string::npos) << last;
  fs::remove_all(dir);
  fs::remove(options.metrics_file);
}

// A metrics file that cannot be written (a full disk) stops the run at the first step
// it fails; a trace path that cannot be written fails before training, not after.
TEST(Training, UnwritableMetricsAndTraceAreErrors) {
  if (fs::exists("/dev/full")) {
    loom::train::TrainOptions full;
    full.metrics_file = "/dev/full";
    try {
      run_and_trace(tiny_manifest(), {"run.steps=5"}, full);
      FAIL() << "writing the metrics to /dev/full must fail the run";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("metrics file /dev/full: writing step 1 failed"), std::string::npos)
          << e.what();
    }
  }
  const std::string dir = loom::testing::scratch_dir("trace");
  fs::remove_all(dir);
  loom::train::TrainOptions trace;
  trace.trace_file = dir + "/missing/trace.json";
  trace.metrics_file = dir + ".jsonl";
  std::ofstream(trace.metrics_file) << "an earlier run's line\n";
  try {
    run_and_trace(tiny_manifest(), {"run.steps=5"}, trace);
    FAIL() << "a trace path in a missing directory must fail the run";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--trace " + trace.trace_file + ": cannot create " + trace.trace_file + ".tmp: No such file or directory"),
              std::string::npos)
        << e.what();
  }
  std::ifstream metrics(trace.metrics_file);
  std::string line;
  EXPECT_TRUE(std::getline(metrics, line) && line == "an earlier run's line") << "the metrics file was started anew";
  EXPECT_FALSE(std::getline(metrics, line)) << "the run trained before failing on its trace path: " << line;
  fs::remove(trace.metrics_file);
}

TEST(Data, BadPathIsAClearErrorAndWritesNothing) {
  const std::string dir = loom::testing::scratch_dir("badpath");
  fs::remove_all(dir);
  try {
    run_and_trace(tiny_manifest(), {"data.kind=text", "data.path=\"/nonexistent/shakespeare.txt\"",
                                    "checkpoint.dir=\"" + dir + "\""});
    FAIL();
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/shakespeare.txt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir));
}

void write_tokens(const std::string& path, const std::vector<uint16_t>& tokens, int32_t claimed, size_t drop_bytes) {
  int32_t header[256] = {};
  header[0] = 20240520;
  header[1] = 1;
  header[2] = claimed;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2 - drop_bytes);
}

TEST(Data, LlmcTokenFilesReadAndTruncationIsCaught) {
  const std::string dir = loom::testing::scratch_dir("tokens");
  std::vector<uint16_t> tokens(400);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7) % 50);
  const std::string good = dir + "/good.bin", bad = dir + "/bad.bin";
  write_tokens(good, tokens, 400, 0);
  write_tokens(bad, tokens, 400, 3);
  auto m = loom::manifest::Manifest::parse(tiny_manifest(), "t.toml", {"data.kind=tokens", "data.path=\"" + good + "\""});
  auto src = loom::train::make_data_source(loom::manifest::RunConfig::from(m));
  EXPECT_EQ(src->vocab_size(), 50);
  std::vector<int32_t> t(16), g(16);
  src->sample(loom::train::Split::Train, 3, 16, t.data(), g.data());
  for (int i = 0; i + 1 < 16; ++i) EXPECT_EQ(g[i], t[i + 1]);  // targets are the next token
  EXPECT_EQ((t[1] - t[0] + 50) % 50, 7);                        // consecutive tokens of the stream
  auto mb = loom::manifest::Manifest::parse(tiny_manifest(), "t.toml", {"data.kind=tokens", "data.path=\"" + bad + "\""});
  try {
    loom::train::make_data_source(loom::manifest::RunConfig::from(mb));
    FAIL();
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  // An empty token file says so (it read "header says 0 tokens (1024 bytes) but the
  // file has 1024 bytes"); a directory as data.path says it is one.
  const std::string empty = dir + "/empty.bin";
  write_tokens(empty, {}, 0, 0);
  for (const auto& [path, want] : {std::pair<std::string, std::string>{empty, "holds no tokens"},
                                   {dir, "is not a regular file (a directory)"}}) {
    auto me = loom::manifest::Manifest::parse(tiny_manifest(), "t.toml",
                                              {"data.kind=tokens", "data.path=\"" + path + "\""});
    try {
      loom::train::make_data_source(loom::manifest::RunConfig::from(me));
      ADD_FAILURE() << path;
    } catch (const loom::train::DataError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

TEST(Data, AdditionTaskValidationProblemsAreHeldOut) {
  auto m = loom::manifest::Manifest::parse(tiny_manifest(), "t.toml", {});
  auto src = loom::train::make_data_source(loom::manifest::RunConfig::from(m));
  ASSERT_TRUE(src->has_exact_match());
  std::set<std::string> train_problems, val_problems;
  std::vector<int32_t> t(64), g(64);
  for (uint64_t i = 0; i < 200; ++i) {
    for (auto split : {loom::train::Split::Train, loom::train::Split::Validation}) {
      src->sample(split, i, 64, t.data(), g.data());
      std::string text = src->render(t.data(), 64);
      for (size_t p = 0; p + 10 <= text.size(); p += 10)  // 2 digits: "ab+cd=efg|"
        (split == loom::train::Split::Train ? train_problems : val_problems).insert(text.substr(p, 5));
    }
  }
  ASSERT_GT(val_problems.size(), 50u);
  for (const auto& p : val_problems) EXPECT_EQ(train_problems.count(p), 0u) << p;
  // And the answers are right: a+b, written least-significant digit first.
  src->sample(loom::train::Split::Train, 0, 64, t.data(), g.data());
  int a = t[0] * 10 + t[1], b = t[3] * 10 + t[4];
  int c = t[6] + 10 * t[7] + 100 * t[8];
  EXPECT_EQ(a + b, c);
}

}  // namespace
