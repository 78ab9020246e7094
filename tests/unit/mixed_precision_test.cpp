// bf16 mixed precision end to end on the CPU device (device.param_dtype = "bf16"):
// bf16 parameters and activations, gradients in device.grad_dtype, fp32 master
// weights and moments in the optimizer, fp32 loss and statistics. A bf16 run tracks
// the fp32 run from the same seed, keeps its parameters in bf16, trains the same
// model over dp (fp32 gradients: deterministic sums, as the fp32 dp tests), tp and
// pp, resumes bit-exactly, refuses a checkpoint of the other dtype, and plans (and
// uses) the memory it says. Finite-difference gradient checks are fp32 only: bf16
// rounding (2^-9 relative) is far above any useful FD step.
#include "support/rank_trace.hpp"

#include "engine/model/param_plan.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/checkpoint.hpp"

#include <gtest/gtest.h>

#include <iterator>

#include <fstream>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

namespace {

using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;
namespace fs = boost::filesystem;

const std::vector<std::string> kBf16 = {"device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\""};
// Without gradient-accumulation fusion each microbatch's gradients are rounded to
// bf16 and then summed in fp32, which is exact for a few bf16 summands: the sums do
// not depend on how microbatches are split over dp ranks, so runs at different dp
// sizes agree bit for bit in practice and the dp tests below can be strict.
const std::vector<std::string> kBf16Unfused = {"device.param_dtype=\"bf16\"", "device.grad_dtype=\"fp32\"",
                                               "device.grad_accumulation_fusion=false"};
const std::vector<std::string> kBf16Grads = {"device.param_dtype=\"bf16\"", "device.grad_dtype=\"bf16\""};

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool is_bf16_value(float f) {
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits & 0xffffu) == 0;
}

double mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return s / static_cast<double>(to - from);
}

// Loss of run `got` follows `want` step by step within rel (relative) and within
// rel / 2 on average over the run, and learns: the last five steps' mean is well
// below the first five's. Where the loss falls fastest (~0.1 a step on the tiny
// model) a bf16 trajectory a fraction of a step ahead or behind differs by a few
// percent at that step, hence a per-step bound above the average one.
void expect_tracks(const std::vector<double>& got, const std::vector<double>& want, double rel,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_GE(got.size(), 20u) << what;
  double sum_rel = 0;
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_TRUE(std::isfinite(got[s])) << what << " step " << s + 1;
    EXPECT_NEAR(got[s], want[s], rel * want[s]) << what << " step " << s + 1;
    sum_rel += std::fabs(got[s] - want[s]) / want[s];
  }
  EXPECT_LE(sum_rel / static_cast<double>(want.size()), rel / 2) << what << ": mean relative difference";
  const size_t n = got.size();
  EXPECT_LT(mean(got, n - 5, n), 0.8 * mean(got, 0, 5)) << what << ": the loss does not decrease";
}

// 30 steps: the fp32 run, the bf16 run with fp32 gradients and with bf16 gradients.
TEST(MixedPrecision, Bf16LossTracksFp32AndParametersStayBf16) {
  const std::vector<std::string> steps = {"run.steps=30"};
  const auto fp32 = run_and_trace(tiny_manifest(), steps);
  int32_t dtypes_seen[2] = {-1, -1};
  loom::train::TrainOptions opts;
  opts.on_step = [&](int64_t, int, const loom::model::Model& m) {
    dtypes_seen[0] = m.param_dtype();
    dtypes_seen[1] = m.grad_dtype();
  };
  const auto bf16 = run_and_trace(tiny_manifest(), cat(steps, kBf16), opts);
  EXPECT_EQ(dtypes_seen[0], LOOM_DTYPE_BF16);
  EXPECT_EQ(dtypes_seen[1], LOOM_DTYPE_F32);
  const auto bf16g = run_and_trace(tiny_manifest(), cat(steps, kBf16Grads), opts);
  EXPECT_EQ(dtypes_seen[1], LOOM_DTYPE_BF16);

  // Within a few percent of fp32 at every step (bf16 rounding is 2^-9 relative per op).
  expect_tracks(fp32.loss, fp32.loss, 0.0, "fp32");
  expect_tracks(bf16.loss, fp32.loss, 0.05, "bf16 params, fp32 grads");
  expect_tracks(bf16g.loss, fp32.loss, 0.05, "bf16 params, bf16 grads");
  // Step 1 runs the same initial weights (bf16-rounded) on the same batch: closer still.
  EXPECT_NEAR(bf16.loss[0], fp32.loss[0], 0.01 * fp32.loss[0]);

  // Really bf16: every parameter is a bf16 value after every step, and the run is
  // not the fp32 run (which would be trained in fp32 and merely look similar).
  for (const auto* t : {&bf16, &bf16g})
    for (size_t s = 0; s < t->params.size(); ++s)
      for (float f : t->params[s]) ASSERT_TRUE(is_bf16_value(f)) << "step " << s + 1 << ": " << f;
  size_t non_bf16 = 0;
  for (float f : fp32.params.back()) non_bf16 += is_bf16_value(f) ? 0 : 1;
  EXPECT_GT(non_bf16, fp32.params.back().size() / 2);
  EXPECT_NE(bf16.loss, fp32.loss);
  EXPECT_NE(bf16g.loss, bf16.loss);  // bf16 gradients round where fp32 ones do not
}

// dp = 2 against dp = 1 with bf16 parameters and fp32 gradients, unfused: the
// gradients are summed in fp32 (deterministically, in another order), so the fp32
// master weights agree as in the fp32 dp tests (~1e-7); the bf16 copies agree except
// where a master weight sits on a rounding boundary (one bf16 ulp, 2^-8 relative, in
// a few elements). Losses agree to 1e-5 as in the fp32 tests.
TEST(MixedPrecision, Bf16Dp2MatchesDp1StepByStep) {
  const auto dp1 = run_and_trace(tiny_manifest(), cat({"parallel.dp=1"}, kBf16Unfused));
  const auto dp2 = run_and_trace(tiny_manifest(), cat({"parallel.dp=2"}, kBf16Unfused));
  ASSERT_EQ(dp1.loss.size(), 10u);
  ASSERT_EQ(dp2.loss.size(), dp1.loss.size());
  for (size_t s = 0; s < dp1.loss.size(); ++s) {
    EXPECT_NEAR(dp2.loss[s], dp1.loss[s], 1e-5 * dp1.loss[s]) << "step " << s + 1;
    std::string worst;
    EXPECT_LT(loom::testing::max_tensor_rel_diff(dp1, s, dp2.params[s], &worst), 1e-3)
        << "step " << s + 1 << " worst tensor " << worst;
    size_t differ = 0;
    for (size_t i = 0; i < dp1.params[s].size(); ++i) differ += dp1.params[s][i] != dp2.params[s][i] ? 1 : 0;
    EXPECT_LT(differ, dp1.params[s].size() / 100) << "step " << s + 1 << ": bf16 parameters that differ";
  }
}

// The same with gradient-accumulation fusion (the default): the GEMMs accumulate
// each microbatch into the fp32 gradients, whose last bits then depend on the split
// over dp ranks. Step 1 starts from the same weights (same loss); afterwards a
// master weight that lands on the other side of a bf16 rounding boundary moves its
// bf16 copy by one ulp (2^-8), and bf16 training amplifies that: measured over 10
// steps, losses within 1.3e-4 relative, bf16 tensors within 5e-3 norm-wise.
// The bounds below are 8x and 4x that; an unaveraged or missed dp reduction is
// orders of magnitude larger.
TEST(MixedPrecision, FusedBf16Dp2TracksDp1) {
  const auto dp1 = run_and_trace(tiny_manifest(), cat({"parallel.dp=1"}, kBf16));
  const auto dp2 = run_and_trace(tiny_manifest(), cat({"parallel.dp=2"}, kBf16));
  ASSERT_EQ(dp1.loss.size(), 10u);
  ASSERT_EQ(dp2.loss.size(), dp1.loss.size());
  // Step 2's loss is the first to see a dp sum: Adam's first step is sign(g), which
  // the last bits of g do not change.
  EXPECT_NEAR(dp2.loss[1], dp1.loss[1], 1e-6 * dp1.loss[1]);
  for (size_t s = 0; s < dp1.loss.size(); ++s) {
    EXPECT_NEAR(dp2.loss[s], dp1.loss[s], 1e-3 * dp1.loss[s]) << "step " << s + 1;
    std::string worst;
    EXPECT_LT(loom::testing::max_tensor_rel_diff(dp1, s, dp2.params[s], &worst), 2e-2)
        << "step " << s + 1 << " worst tensor " << worst;
  }
}

// Fusion changes only where a microbatch's gradient is rounded: the fused and the
// unfused run's second losses agree closely (the first backward differs only in
// the last bits of the gradients, which Adam's first step sign(g) hides except
// where g is near zero),
// then they track each other like two bf16 runs do; and fusion frees the bf16
// gradient copies the unfused backward allocates (the embedding table's is the
// largest: vocab x hidden bf16, plus its fp32 cast).
TEST(MixedPrecision, FusionTracksUnfusedAndNeedsLessMemory) {
  const std::vector<std::string> o = {"run.steps=20"};
  const auto fused = run_and_trace(tiny_manifest(), cat(o, kBf16));
  const auto unfused = run_and_trace(tiny_manifest(), cat(o, kBf16Unfused));
  EXPECT_NEAR(fused.loss[1], unfused.loss[1], 1e-3 * unfused.loss[1]);  // measured 1.1e-4
  expect_tracks(fused.loss, unfused.loss, 0.05, "fused vs unfused");
  ASSERT_FALSE(fused.result.steps.empty());
  EXPECT_LT(fused.result.steps.back().mem_peak, unfused.result.steps.back().mem_peak);
}

// The fp32 gradients of step 1 (rank 0's, after the step: the optimizer leaves
// them in the buffer), fused against unfused, for every parameter tensor: the
// same gradients up to the unfused path's bf16 rounding of each microbatch's
// gradient (2^-9 relative), at tp 1 and at tp 2 with sequence parallelism (every
// grad_fp32 call of the layers and parallel/tensor, tied embedding included). A
// gradient written in the wrong dtype, scaled, or accumulated twice is off by
// orders of magnitude more; some tensor must differ at all (fusion engaged).
TEST(MixedPrecision, FusedGradientsEqualUnfusedUpToBf16Rounding) {
  struct Grads {
    std::vector<float> g;
    std::vector<std::pair<size_t, size_t>> tensors;
    std::vector<std::string> names;
  };
  auto step1_grads = [](const std::vector<std::string>& o) {
    Grads out;
    std::mutex mu;
    loom::train::TrainOptions opts;
    opts.on_step = [&](int64_t step, int rank, const loom::model::Model& m) {
      if (rank != 0 || step != 1) return;
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(m.grad_dtype(), LOOM_DTYPE_F32);
      out.g.assign(static_cast<const float*>(m.grads()), static_cast<const float*>(m.grads()) + m.numel());
      for (const auto& e : m.param_entries()) {
        out.tensors.emplace_back(e.offset, e.numel);
        out.names.push_back(e.name);
      }
    };
    run_and_trace(tiny_manifest(), cat({"run.steps=1"}, o), opts);
    return out;
  };
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.dp=1"},
        std::vector<std::string>{"parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"}}) {
    SCOPED_TRACE(layout.back());
    const Grads fused = step1_grads(cat(layout, kBf16)), unfused = step1_grads(cat(layout, kBf16Unfused));
    ASSERT_EQ(fused.g.size(), unfused.g.size());
    ASSERT_FALSE(fused.tensors.empty());
    double largest = 0;
    for (size_t k = 0; k < fused.tensors.size(); ++k) {
      const auto [off, n] = fused.tensors[k];
      double num = 0, den = 0;
      for (size_t i = off; i < off + n; ++i) {
        ASSERT_TRUE(std::isfinite(fused.g[i])) << fused.names[k];
        num += std::pow(double(fused.g[i]) - double(unfused.g[i]), 2);
        den += std::pow(double(unfused.g[i]), 2);
      }
      const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      EXPECT_LT(rel, 1e-2) << fused.names[k];
      largest = std::max(largest, rel);
    }
    EXPECT_GT(largest, 1e-5) << "fused and unfused gradients are the same: was fusion used?";
    std::printf("%s: largest norm-wise difference of a gradient tensor, fused vs unfused: %.2e\n",
                layout.back().c_str(), largest);
  }
}

loom::testing::RankTrace run_ranks(std::vector<std::string> o) {
  o.push_back("run.steps=20");
  return loom::testing::run_all_ranks(tiny_manifest() + "\n[parallel]\n", o);
}

// tp = 2 and pp = 2 in bf16 track the fp32 serial run as the bf16 serial run does.
TEST(MixedPrecision, Bf16Tp2AndPp2TrackFp32) {
  const auto fp32 = run_ranks({});
  const auto serial = run_ranks(kBf16);
  expect_tracks(serial.loss, fp32.loss, 0.05, "bf16 serial");
  const auto tp2 = run_ranks(cat({"parallel.tp=2"}, kBf16));
  expect_tracks(tp2.loss, fp32.loss, 0.05, "bf16 tp=2");
  const auto tp2sp = run_ranks(cat({"parallel.tp=2", "parallel.sequence_parallel=true"}, kBf16Grads));
  expect_tracks(tp2sp.loss, fp32.loss, 0.05, "bf16 tp=2 sp, bf16 grads");
  const auto pp2 = run_ranks(cat({"parallel.pp=2"}, kBf16));
  expect_tracks(pp2.loss, fp32.loss, 0.05, "bf16 pp=2");
  // The bf16 parameters of every stage and tp slice are bf16 values.
  for (const auto* t : {&tp2, &pp2, &tp2sp})
    for (const auto& [rank, steps] : t->params)
      for (float f : steps.back()) ASSERT_TRUE(is_bf16_value(f)) << "rank " << rank;
}

// Without tied embeddings a pipeline sums nothing in another order: pp = 2 in bf16
// (bf16 hidden states and gradients sent between stages) is bit-identical to the
// bf16 serial run, parameters and losses.
TEST(MixedPrecision, Bf16UntiedPp2IsBitIdenticalToSerial) {
  for (const auto& dtypes : {kBf16, kBf16Grads}) {
    const auto serial = run_ranks(cat({"model.tie_embeddings=false"}, dtypes));
    const auto pp2 = run_ranks(cat({"model.tie_embeddings=false", "parallel.pp=2"}, dtypes));
    ASSERT_EQ(pp2.loss.size(), serial.loss.size());
    for (size_t s = 0; s < serial.loss.size(); ++s) {
      EXPECT_EQ(pp2.loss[s], serial.loss[s]) << "step " << s + 1;
      const auto want = loom::testing::full_params(serial, s);
      const auto got = loom::testing::full_params(pp2, s);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [key, w] : want) EXPECT_EQ(got.at(key), w) << key << " at step " << s + 1;
    }
  }
}

// Checkpoint and resume of a bf16 run: bit-identical to the uninterrupted run; the
// checkpoint stores the bf16 bytes and refuses to load into an fp32 run (and an fp32
// one into a bf16 run) with a message naming both dtypes.
TEST(MixedPrecision, Bf16ResumeIsBitExactAndDtypeMismatchIsRefused) {
  const std::string dir = loom::testing::scratch_dir("bf16-resume");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const std::vector<std::string> split = {"optimizer.decay_steps=12", "parallel.dp=2"};
  auto full = run_and_trace(tiny_manifest(), cat(cat({"run.steps=12"}, split), kBf16));
  auto first = run_and_trace(tiny_manifest(), cat(cat({"run.steps=6", ck}, split), kBf16));
  const std::string step6 = loom::train::checkpoint_path(dir, 6);
  ASSERT_TRUE(fs::exists(step6));
  EXPECT_EQ(loom::train::read_meta(step6).param_dtype, "bf16");
  {  // a meta.toml of another format (a newer engine's) is refused, not half understood
    const std::string other = loom::testing::scratch_dir("meta-format");
    fs::copy_file(step6 + "/meta.toml", other + "/meta.toml");
    std::string text;
    {
      std::ifstream in(other + "/meta.toml");
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    const size_t at = text.find("format = 1");
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, 10, "format = 2");
    std::ofstream(other + "/meta.toml", std::ios::trunc) << text;
    try {
      loom::train::read_meta(other);
      ADD_FAILURE() << "meta.toml format 2 was read";
    } catch (const loom::train::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("meta.toml format 2, this engine reads format 1"), std::string::npos)
          << e.what();
    }
    fs::remove_all(other);
  }
  // The rank file holds 2 bytes per parameter element.
  const size_t numel = first.params.back().size();
  const loom::train::RankState rs = loom::train::read_rank_file(step6, 0, static_cast<int64_t>(numel), 2);
  EXPECT_EQ(rs.params.size(), 2 * numel);
  EXPECT_THROW(loom::train::read_rank_file(step6, 0, static_cast<int64_t>(numel), 4), loom::train::CheckpointError);

  loom::train::TrainOptions resume;
  resume.resume = true;
  try {
    run_and_trace(tiny_manifest(), cat({"run.steps=12", ck}, split), resume);  // fp32 (the default)
    FAIL() << "a bf16 checkpoint was loaded into an fp32 run";
  } catch (const loom::train::CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("holds bf16 parameters"), std::string::npos) << msg;
    EXPECT_NE(msg.find("device.param_dtype = \"fp32\""), std::string::npos) << msg;
  }
  auto second = run_and_trace(tiny_manifest(), cat(cat({"run.steps=12", ck}, split), kBf16), resume);
  EXPECT_EQ(second.result.start_step, 6);
  ASSERT_EQ(second.loss.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(first.loss[i], full.loss[i]);
    EXPECT_EQ(second.loss[i], full.loss[6 + i]) << "step " << 7 + i;
  }
  EXPECT_EQ(second.params.back(), full.params.back());  // bit-identical parameters

  // An fp32 checkpoint into a bf16 run.
  const std::string dir32 = loom::testing::scratch_dir("fp32-into-bf16");
  const std::string ck32 = "checkpoint.dir=\"" + dir32 + "\"";
  run_and_trace(tiny_manifest(), {"run.steps=2", ck32});
  try {
    run_and_trace(tiny_manifest(), cat({"run.steps=4", ck32}, kBf16), resume);
    FAIL() << "an fp32 checkpoint was loaded into a bf16 run";
  } catch (const loom::train::CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("holds fp32 parameters"), std::string::npos) << msg;
    EXPECT_NE(msg.find("device.param_dtype = \"bf16\""), std::string::npos) << msg;
  }
  fs::remove_all(dir);
  fs::remove_all(dir32);
}

// Resuming a bf16 run at another dp (the parameters remapped as bf16 bytes, the
// distributed optimizer's fp32 master weights and moments resharded) continues as
// the uninterrupted run at the new dp, up to the fp32 order of the dp sums (the
// tolerance of Bf16Dp2MatchesDp1StepByStep, unfused as it is).
TEST(MixedPrecision, Bf16ResumeAtAnotherDpMatchesUninterrupted) {
  const std::string dir = loom::testing::scratch_dir("bf16-reshard");
  const std::string ck = "checkpoint.dir=\"" + dir + "\"";
  const std::vector<std::string> base =
      cat({"optimizer.decay_steps=12", "optimizer.strategy=distributed"}, kBf16Unfused);
  const auto full = run_and_trace(tiny_manifest(), cat({"run.steps=12", "parallel.dp=1"}, base));
  run_and_trace(tiny_manifest(), cat({"run.steps=6", "parallel.dp=2", ck}, base));
  loom::train::TrainOptions resume;
  resume.resume = true;
  const auto second = run_and_trace(tiny_manifest(), cat({"run.steps=12", "parallel.dp=1", ck}, base), resume);
  ASSERT_EQ(second.result.start_step, 6);
  ASSERT_EQ(second.loss.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(second.loss[i], full.loss[6 + i], 1e-5 * full.loss[6 + i]) << "step " << 7 + i;
    std::string worst;
    EXPECT_LT(loom::testing::max_tensor_rel_diff(full, 6 + i, second.params[i], &worst), 1e-3)
        << "step " << 7 + i << " worst tensor " << worst;
  }
  fs::remove_all(dir);
}

// loom plan's bytes per parameter element and activation bytes equal what the
// bf16 run allocates (tests/unit/memory_plan_test.cpp has fp32), and the Model's
// buffers are sized by dtype.
TEST(MixedPrecision, PlanMatchesTheRealBf16Allocation) {
  struct Combo {
    std::vector<std::string> dtypes;
    size_t param_bytes, grad_bytes;
  };
  for (const Combo& c : {Combo{kBf16, 2, 4}, Combo{kBf16Grads, 2, 2}}) {
    for (const std::string layout : {"parallel.dp=1", "parallel.tp=2", "parallel.pp=2"}) {
      const std::vector<std::string> overrides = cat({"run.steps=1", layout}, c.dtypes);
      SCOPED_TRACE(layout + " grad bytes " + std::to_string(c.grad_bytes));
      struct Measured {
        size_t numel = 0, hidden_bytes = 0, hidden_numel = 0;
        uint64_t activation_bytes = 0;
      };
      std::map<int, Measured> measured;
      std::mutex mu;
      loom::train::TrainOptions opts;
      opts.on_step = [&](int64_t, int rank, const loom::model::Model& m) {
        Measured x{m.numel(), m.hidden_bytes(), m.hidden_numel(), m.activation_bytes()};
        std::lock_guard<std::mutex> lock(mu);
        measured[rank] = x;
      };
      const auto run = run_and_trace(tiny_manifest(), overrides, opts);
      const loom::train::MemoryPlan plan = loom::train::plan_memory(loom::testing::plan_from(tiny_manifest(), overrides));
      ASSERT_EQ(measured.size(), plan.ranks.size());
      for (const auto& r : plan.ranks) {
        const Measured& x = measured[r.rank];
        EXPECT_EQ(r.buffer_numel, x.numel);
        EXPECT_EQ(r.param_bytes, c.param_bytes * x.numel);
        EXPECT_EQ(r.grad_bytes, c.grad_bytes * x.numel);
        EXPECT_EQ(x.hidden_bytes, 2 * x.hidden_numel);  // bf16 hidden states
        EXPECT_EQ(r.in_flight, run.result.peak_in_flight.at(r.rank));
        if (layout != "parallel.pp=2") {
          EXPECT_EQ(r.activation_bytes, x.activation_bytes);
        }
      }
    }
  }
  // Activations halve (up to the fp32 statistics): the planned bytes of fp32 and bf16.
  const auto p32 = loom::train::plan_memory(loom::testing::plan_from(tiny_manifest(), {}));
  const auto p16 = loom::train::plan_memory(loom::testing::plan_from(tiny_manifest(), kBf16));
  EXPECT_LT(p16.ranks[0].activation_bytes, 0.6 * p32.ranks[0].activation_bytes);
  EXPECT_GT(p16.ranks[0].activation_bytes, 0.4 * p32.ranks[0].activation_bytes);
}

// Peak device memory of a run whose activations dominate is lower in bf16 than in
// fp32: bf16 adds 2 (fp32 grads) or 4 (bf16 grads: fp32 main grads too) bytes per
// parameter to parameters + gradients + optimizer (18 and 20 against 16), and
// halves every activation and hidden state.
TEST(MixedPrecision, Bf16PeakMemoryIsLowerThanFp32) {
  const std::vector<std::string> big_acts = {"run.steps=2", "model.seq_length=64", "batch.micro_batch_size=8",
                                             "batch.global_batch_size=8"};
  const auto fp32 = run_and_trace(tiny_manifest(), big_acts);
  const auto bf16 = run_and_trace(tiny_manifest(), cat(big_acts, kBf16));
  const auto bf16g = run_and_trace(tiny_manifest(), cat(big_acts, kBf16Grads));
  ASSERT_FALSE(fp32.result.steps.empty());
  const uint64_t peak32 = fp32.result.steps.back().mem_peak;
  ASSERT_GT(peak32, 0u);
  EXPECT_LT(bf16.result.steps.back().mem_peak, peak32);
  EXPECT_LT(bf16g.result.steps.back().mem_peak, peak32);
}

}  // namespace
