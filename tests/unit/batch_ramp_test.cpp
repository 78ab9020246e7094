// batch.rampup_batch_size (Megatron-LM's --rampup-batch-size): each step's global
// batch against Megatron's calculator worked by hand, the segment search against a
// step-by-step walk, and runs with a ramp: the ramp's steps read the samples a run of
// that constant batch reads, dp 2 and pp 2 (orders per microbatch count) equal the
// serial run, and a resume mid-ramp is bit-exact.
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

#include "engine/train/batch_ramp.hpp"
#include "engine/train/checkpoint.hpp"

#include <gtest/gtest.h>

#include <boost/filesystem.hpp>

#include <random>
#include <tuple>
#include <sstream>

namespace {

namespace fs = boost::filesystem;
using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;
using loom::testing::with_overrides;

loom::manifest::RunConfig::Batch batch(int64_t global, int64_t micro, int64_t start, int64_t increment,
                                       int64_t samples) {
  loom::manifest::RunConfig::Batch b;
  b.global_batch_size = global;
  b.micro_batch_size = micro;
  b.rampup_start = start;
  b.rampup_increment = increment;
  b.rampup_samples = samples;
  return b;
}

// Global 32 from 8 by 8 over 100 samples: 3 increments, one per 100 / 3 samples.
// Megatron's int(consumed / 33.33...) grows the batch at 34 and 67 samples, and at
// exactly 100 (100 / (100 / 3) is 3.0 in double) to the global batch.
TEST(BatchRamp, EachStepsBatchIsMegatronsCalculators) {
  const loom::train::BatchRamp ramp(batch(32, 2, 8, 8, 100), 2);
  EXPECT_TRUE(ramp.ramps());
  EXPECT_EQ(ramp.global_batch_at(0), 8);
  EXPECT_EQ(ramp.global_batch_at(33), 8);
  EXPECT_EQ(ramp.global_batch_at(34), 16);
  EXPECT_EQ(ramp.global_batch_at(66), 16);
  EXPECT_EQ(ramp.global_batch_at(67), 24);
  EXPECT_EQ(ramp.global_batch_at(99), 24);
  EXPECT_EQ(ramp.global_batch_at(100), 32);
  EXPECT_EQ(ramp.global_batch_at(101), 32);
  EXPECT_EQ(ramp.microbatches_at(0), 2);  // 8 / (2 x dp 2)
  EXPECT_EQ(ramp.microbatches_at(101), 8);
  EXPECT_EQ(ramp.microbatch_counts(), (std::vector<int64_t>{2, 4, 6, 8}));
  // Steps of 8 until 40 samples, 16 until 72, 24 until 120, then 32.
  const std::vector<uint64_t> before = {0, 8, 16, 24, 32, 40, 56, 72, 96, 120, 152, 184};
  for (size_t step = 0; step < before.size(); ++step) {
    EXPECT_EQ(ramp.samples_before(static_cast<int64_t>(step), 0, 0), before[step]) << "step " << step;
    // From a resume point inside the ramp, the same.
    if (step >= 6) {
      EXPECT_EQ(ramp.samples_before(static_cast<int64_t>(step), 6, 56), before[step]) << "step " << step;
    }
  }
  // No ramp: the global batch each step.
  const loom::train::BatchRamp flat(batch(32, 2, 0, 0, 0), 2);
  EXPECT_FALSE(flat.ramps());
  EXPECT_EQ(flat.samples_before(5, 0, 0), 160u);
  EXPECT_EQ(flat.microbatch_counts(), (std::vector<int64_t>{8}));
}

// run.train_samples' steps are Megatron-LM's update_train_iters, worked by hand: the
// ramp [8, 8, 100] to 32 starts steps at 0, 8, 16, 24, 32 (8 each), 40, 56 (16), 72, 96
// (24): nine steps start at or before 100, then whole batches of 32 of what is left.
TEST(BatchRamp, TrainSamplesGiveMegatronsIterations) {
  EXPECT_EQ(loom::manifest::steps_for_samples(batch(32, 2, 0, 0, 0), 100), 3);  // the last partial batch dropped
  EXPECT_EQ(loom::manifest::steps_for_samples(batch(32, 2, 0, 0, 0), 31), 0);
  const auto ramp = batch(32, 2, 8, 8, 100);
  EXPECT_EQ(loom::manifest::steps_for_samples(ramp, 1000), 9 + (1000 - 120) / 32);
  EXPECT_EQ(loom::manifest::steps_for_samples(ramp, 120), 9);
  EXPECT_EQ(loom::manifest::steps_for_samples(ramp, 50), 6);  // steps start at 0 .. 40, the sixth ends at 56
  EXPECT_EQ(loom::manifest::steps_for_samples(ramp, 1), 1);
  // From a resume point: the steps left after k steps of the same batches are the
  // rest of the run's, at every k.
  for (int64_t total : {1, 50, 100, 120, 1000})
    for (int64_t k = 0; k <= loom::manifest::steps_for_samples(ramp, total); ++k)
      EXPECT_EQ(k + loom::manifest::steps_for_samples(ramp, total, loom::manifest::samples_before(ramp, k, 0, 0)),
                loom::manifest::steps_for_samples(ramp, total))
          << total << " samples, " << k << " steps done";
  // A run of train_samples = 40 at the tiny manifest's global batch of 8: 5 steps, its
  // written run.steps replaced (and warned of).
  const std::vector<std::string> samples = {"run.train_samples=40", "optimizer.warmup_steps=0"};
  auto run = run_and_trace(tiny_manifest(), samples);
  EXPECT_EQ(run.result.final_step, 5);
  bool warned = false;
  for (const std::string& w : loom::testing::plan_from(tiny_manifest(), samples).warnings)
    warned |= w.find("run.steps is replaced by run.train_samples = 40, which takes 5 steps") != std::string::npos;
  EXPECT_TRUE(warned);
  try {
    loom::testing::plan_from(tiny_manifest(), {"run.train_samples=7"});
    ADD_FAILURE() << "fewer samples than a global batch were accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("is less than one global batch (8): no step"), std::string::npos) << e.what();
  }
}

// A resume of a run.train_samples run at another global batch trains the samples left
// at the new batch (a last partial batch dropped): 80 samples at 8 a step stopped after
// 5 steps (40) end 2 steps of 16 later (72); 80 at 16 stopped after 2 (32) end 6 steps
// of 8 later (80).
TEST(BatchRamp, AResumeAtAnotherBatchTrainsTheSamplesLeft) {
  for (const auto& [before, after, stop, end] :
       {std::tuple<int, int, int, int64_t>{8, 16, 5, 7}, std::tuple<int, int, int, int64_t>{16, 8, 2, 8}}) {
    const std::string dir = loom::testing::scratch_dir("samples_resume");
    fs::remove_all(dir);
    const std::vector<std::string> run = {"run.train_samples=80", "optimizer.warmup_steps=0",
                                          "checkpoint.dir=\"" + dir + "\""};
    run_and_trace(tiny_manifest(), with_overrides(run, {"batch.global_batch_size=" + std::to_string(before),
                                                        "run.exit_interval=" + std::to_string(stop)}));
    loom::train::TrainOptions resume;
    resume.resume = true;
    std::ostringstream log;
    resume.log = &log;
    auto rest = run_and_trace(tiny_manifest(), with_overrides(run, {"batch.global_batch_size=" + std::to_string(after)}),
                              resume);
    EXPECT_EQ(rest.result.final_step, end) << before << " -> " << after << ": " << log.str();
    EXPECT_EQ(rest.result.end_step, end);
    ASSERT_FALSE(rest.result.steps.empty());
    EXPECT_LE(rest.result.steps.back().consumed_samples, 80u);
    EXPECT_GT(rest.result.steps.back().consumed_samples + static_cast<uint64_t>(after), 80u) << "a whole batch left";
    EXPECT_NE(log.str().find("resume: run.train_samples = 80 ends at step " + std::to_string(end)), std::string::npos)
        << log.str();
    fs::remove_all(dir);
  }
  // With the schedule in steps (a *_steps mark beside run.train_samples), its decay ends
  // at the resumed run's own last step: 5 steps of 8, then 2 of 16 (a cosine to 0).
  const std::string dir = loom::testing::scratch_dir("samples_resume_steps");
  fs::remove_all(dir);
  const std::vector<std::string> run = {"run.train_samples=80", "optimizer.warmup_steps=1",
                                        "checkpoint.dir=\"" + dir + "\""};
  run_and_trace(tiny_manifest(), with_overrides(run, {"run.exit_interval=5"}));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto rest = run_and_trace(tiny_manifest(), with_overrides(run, {"batch.global_batch_size=16"}), resume);
  ASSERT_EQ(rest.result.steps.size(), 2u);
  EXPECT_GT(rest.result.steps[0].lr, 0.0f);
  EXPECT_EQ(rest.result.steps[1].lr, 0.0f) << "min_lr at the run's last step";
  fs::remove_all(dir);
}

// The segment search equals walking step by step, for ramps of every shape.
TEST(BatchRamp, TheSegmentSearchEqualsAStepByStepWalk) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t micro = 1 + rng() % 3, dp = 1 + rng() % 3, unit = micro * dp;
    const int64_t start = unit * (1 + rng() % 4), increment = unit * (1 + rng() % 3);
    const int64_t global = start + increment * (1 + rng() % 6), samples = 1 + rng() % 2000;
    const loom::train::BatchRamp ramp(batch(global, micro, start, increment, samples), dp);
    uint64_t consumed = 0;
    for (int64_t step = 0; step < 300; ++step) {
      ASSERT_EQ(ramp.samples_before(step, 0, 0), consumed)
          << "step " << step << " of [" << start << ", " << increment << ", " << samples << "] to " << global;
      consumed += static_cast<uint64_t>(ramp.global_batch_at(consumed));
    }
  }
}

const std::vector<std::string> kRamp = {"run.steps=12", "batch.global_batch_size=16",
                                        "batch.rampup_batch_size=[4, 4, 40]"};

// The ramp's first steps (4 sequences each) read and train what a
// run of global batch 4 does, bit for bit; then the batch grows (the metrics say
// which) and the run goes elsewhere.
TEST(BatchRamp, TheRampsStepsAreThoseOfItsBatches) {
  auto ramped = run_and_trace(tiny_manifest(), kRamp);
  auto small = run_and_trace(tiny_manifest(), {"run.steps=12", "batch.global_batch_size=4"});
  ASSERT_EQ(ramped.result.steps.size(), 12u);
  std::vector<int64_t> batches;
  for (const auto& s : ramped.result.steps) batches.push_back(s.global_batch);
  // 40 / 3 samples per increment: 4 before 14 are consumed (16 after 4 steps), 8 before
  // 27 (32 after 6), 12 until 40 (44 after 7), then 16.
  EXPECT_EQ(batches, (std::vector<int64_t>{4, 4, 4, 4, 8, 8, 12, 16, 16, 16, 16, 16}));
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_EQ(ramped.loss[s], small.loss[s]) << "step " << s + 1;
    EXPECT_EQ(ramped.params[s], small.params[s]) << "step " << s + 1;
  }
  EXPECT_NE(ramped.loss[4], small.loss[4]) << "the batch grew at step 5";
  EXPECT_GT(ramped.result.steps[8].tokens_per_s, 0);
}

// dp 2 (each rank half of every ramp batch), pp 2 (the schedule's orders for 2, 4, 6
// and 8 microbatches) and the distributed optimizer with both overlaps (a bucket's
// gradients final at each step's last microbatch) train as the serial ramp does, with
// the learning rate in steps and in samples (the ramp's small steps warm up less).
// `rates`: the serial run's learning rates.
void expect_ramp_layouts_match_serial(const std::vector<std::string>& ramp, std::vector<float>* rates) {
  SCOPED_TRACE(ramp.back());
  const loom::testing::RankTrace serial = loom::testing::run_all_ranks(tiny_manifest(), ramp);
  for (const auto& step : serial.result.steps) rates->push_back(step.lr);
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.dp=2"}, std::vector<std::string>{"parallel.pp=2"},
        std::vector<std::string>{"parallel.pp=2", "parallel.dp=2", "pipeline.schedule=\"gpipe\""},
        std::vector<std::string>{"parallel.dp=2", "optimizer.strategy=\"distributed\"",
                                 "optimizer.overlap_grad_reduce=true", "optimizer.overlap_param_gather=true"}}) {
    SCOPED_TRACE(layout.back());
    const loom::testing::RankTrace par = loom::testing::run_all_ranks(tiny_manifest(), with_overrides(ramp, layout));
    ASSERT_EQ(par.loss.size(), serial.loss.size());
    for (size_t s = 0; s < serial.loss.size(); ++s) {
      EXPECT_NEAR(par.loss[s], serial.loss[s], 1e-5 * std::fabs(serial.loss[s])) << "step " << s + 1;
      const auto want = loom::testing::full_params(serial, s), got = loom::testing::full_params(par, s);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, w] : want)
        EXPECT_LE(loom::testing::tensor_rel_diff(got.at(name), w), 1e-5) << name << " at step " << s + 1;
    }
  }
}

TEST(BatchRamp, DataAndPipelineParallelRampsMatchSerial) {
  std::vector<float> in_steps, in_samples;
  expect_ramp_layouts_match_serial(kRamp, &in_steps);
  expect_ramp_layouts_match_serial(
      with_overrides(kRamp, {"optimizer.warmup_steps=0", "optimizer.warmup_samples=24", "optimizer.decay_samples=150"}),
      &in_samples);
  EXPECT_NE(in_samples, in_steps) << "the schedule in samples gave the steps' rates";
}

// Partial graphs capture and replay the steps of the whole global batch only (a
// ramp's smaller steps run their layer steps directly: a pipeline's order of a
// larger count would replay its captures out of their capture order), and captured
// dropouts read each microbatch's seed where the first step put the buffer:
// bit-identical to eager, with and without a pipeline.
TEST(BatchRamp, PartialGraphsWithDropoutAreBitIdenticalToEager) {
  for (const std::string pp : {"parallel.pp=1", "parallel.pp=2"}) {
    SCOPED_TRACE(pp);
    const std::vector<std::string> dropout =
        with_overrides(kRamp, {"model.layer.mlp.dropout=0.1", "model.layer.attention.dropout=0.1", pp,
                               "run.steps=16", "batch.micro_batch_size=4"});  // 1, 2, 3, then 4 microbatches
    const loom::testing::RankTrace eager = loom::testing::run_all_ranks(tiny_manifest(), dropout);
    const loom::testing::RankTrace graphs =
        loom::testing::run_all_ranks(tiny_manifest(), with_overrides(dropout, {"exec.mode=\"partial_graph\""}));
    ASSERT_EQ(graphs.loss.size(), eager.loss.size());
    for (size_t s = 0; s < eager.loss.size(); ++s) EXPECT_EQ(graphs.loss[s], eager.loss[s]) << "step " << s + 1;
    EXPECT_EQ(loom::testing::full_params(graphs, eager.loss.size() - 1),
              loom::testing::full_params(eager, eager.loss.size() - 1));
    ASSERT_TRUE(graphs.result.exec_stats.count(0));
    EXPECT_GT(graphs.result.exec_stats.at(0).replays, 0u);
  }
}

// A resume inside the ramp continues it from the samples consumed (the checkpoint's
// consumed_samples), bit for bit, with the learning-rate schedule in steps or in
// samples (each step's rate read from the samples consumed through it).
TEST(BatchRamp, AResumeInsideTheRampIsBitExact) {
  const std::vector<std::string> in_samples = with_overrides(
      kRamp, {"optimizer.warmup_steps=0", "optimizer.warmup_samples=20", "optimizer.decay_style=\"linear\""});
  for (const std::vector<std::string>& ramp : {kRamp, in_samples}) {
    const std::string dir = loom::testing::scratch_dir("ramp_resume");
    fs::remove_all(dir);
    auto full = run_and_trace(tiny_manifest(), ramp);
    const std::vector<std::string> saving = with_overrides(ramp, {"checkpoint.dir=\"" + dir + "\""});
    run_and_trace(tiny_manifest(), with_overrides(saving, {"run.exit_interval=6"}));
    EXPECT_EQ(loom::train::read_meta(loom::train::checkpoint_path(dir, 6)).consumed_samples, 4 * 4 + 2 * 8);
    loom::train::TrainOptions resume;
    resume.resume = true;
    std::ostringstream log;
    resume.log = &log;
    auto rest = run_and_trace(tiny_manifest(), saving, resume);
    ASSERT_EQ(rest.result.start_step, 6);
    EXPECT_EQ(rest.params.back(), full.params.back());
    EXPECT_EQ(rest.loss.back(), full.loss.back());
    for (size_t i = 0; i < rest.result.steps.size(); ++i)
      EXPECT_EQ(rest.result.steps[i].lr, full.result.steps[6 + i].lr) << "step " << 7 + i;
    EXPECT_EQ(rest.result.steps.front().global_batch, 12);
    EXPECT_EQ(log.str().find("resume: warning"), std::string::npos) << log.str();
    fs::remove_all(dir);
  }
  // A resume that moves the decay's end in samples says so in samples: 12 steps of the
  // ramp are 4 x 4 + 2 x 8 + 12 + 5 x 16 = 124 samples.
  const std::string dir = loom::testing::scratch_dir("ramp_resume_schedule");
  fs::remove_all(dir);
  const std::vector<std::string> saving = with_overrides(in_samples, {"checkpoint.dir=\"" + dir + "\""});
  run_and_trace(tiny_manifest(), with_overrides(saving, {"run.exit_interval=6"}));
  loom::train::TrainOptions resume;
  resume.resume = true;
  std::ostringstream log;
  resume.log = &log;
  run_and_trace(tiny_manifest(), with_overrides(saving, {"optimizer.decay_samples=100"}), resume);
  EXPECT_NE(log.str().find("resume:   the decay's end (optimizer.decay_samples, or the run's length when it is 0): "
                           "124 -> 100 samples"),
            std::string::npos)
      << log.str();
  // So does one at another global batch, whose run.steps take other samples.
  fs::remove_all(loom::train::checkpoint_path(dir, 12));
  std::ostringstream other_batch;
  resume.log = &other_batch;
  run_and_trace(tiny_manifest(), with_overrides(saving, {"batch.global_batch_size=32"}), resume);
  EXPECT_NE(other_batch.str().find("resume:   the decay's end (optimizer.decay_samples, or the run's length when it "
                                   "is 0): 124 -> "),
            std::string::npos)
      << other_batch.str();
  fs::remove_all(dir);
}

// A ramp that cannot work is refused naming batch.rampup_batch_size.
TEST(BatchRamp, ARampThatCannotWorkIsRefused) {
  const auto refusal = loom::testing::tiny_plan_refusal;
  EXPECT_NE(refusal({"batch.rampup_batch_size=[4, 4]"}).find("be [start, increment, samples], three integers"),
            std::string::npos);
  EXPECT_NE(refusal({"batch.rampup_batch_size=[4, 0, 10]"}).find("start and increment in [1, 1073741824], samples in "
                                                                 "[1, 2^53] (position 2)"),
            std::string::npos);
  EXPECT_NE(refusal({"batch.rampup_batch_size=[4, 4, 9007199254740993]"}).find("(position 3)"), std::string::npos);
  // Each batch size's orders are checked before launch: at most 4096 of them.
  EXPECT_NE(refusal({"batch.micro_batch_size=1", "batch.global_batch_size=8192", "batch.rampup_batch_size=[1, 1, 10]"})
                .find("the ramp passes through 8192 batch sizes, more than 4096"),
            std::string::npos);
  EXPECT_NE(refusal({"batch.rampup_batch_size=[8, 4, 10]"}).find("starts at 8 sequences, which is not below "
                                                                 "batch.global_batch_size = 8"),
            std::string::npos);
  EXPECT_NE(refusal({"batch.global_batch_size=16", "batch.rampup_batch_size=[4, 8, 10]"})
                .find("grows by 8 from 4, which does not reach batch.global_batch_size = 16"),
            std::string::npos);
  EXPECT_NE(refusal({"batch.global_batch_size=16", "parallel.dp=2", "batch.rampup_batch_size=[6, 2, 10]"})
                .find("must be multiples of batch.micro_batch_size * parallel.dp (4)"),
            std::string::npos);
  // The interleaved schedule needs microbatches in multiples of pp: the ramp's batch
  // of 2 sequences (one microbatch of 2, dp 1) is refused before launch.
  const std::string interleaved =
      refusal({"batch.global_batch_size=16", "batch.rampup_batch_size=[2, 2, 10]", "parallel.pp=2", "parallel.vpp=2",
               "model.num_layers=4", "pipeline.schedule=\"interleaved\""});
  EXPECT_NE(interleaved.find("batch.rampup_batch_size"), std::string::npos) << interleaved;
  EXPECT_EQ(refusal(kRamp), "");
}

}  // namespace
