// Resharding on resume (issue 5): a checkpoint saved at one data-parallel size
// resumes at another. The engine reads the old ranks' files at each rank's (tp, pp)
// position, moves the parameters by entry from the old layout to the new one, and
// the optimizer strategy (state_load_resharded, ABI 1.1) maps its state by
// parameter and element. Checked here: the resharded state, gathered per
// parameter, is bit-identical to what was saved (distributed 4 -> 2, 2 -> 4, 4 -> 3;
// ddp 4 -> 3); training resumed at dp = 2 from dp = 4 continues like an
// uninterrupted dp = 2 run (also with tp = 2, and with another bucket size); and the refusals (a tp / pp change
// with a strategy built before ABI 1.14, a plugin without the slot, a C++ strategy that keeps the default).
#include "support/train_fixture.hpp"

#include "engine/model/buffer_layout.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"

#include <loom/cpp/plugin.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>

namespace {

namespace fs = boost::filesystem;
using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;

// hidden 24: sizes that need start padding; bucket_size 1500: several buckets and
// shards that cut through parameters; a global batch of 12 splits over 2, 3 and 4.
const std::vector<std::string> kBase = {"model.hidden_size=24", "batch.global_batch_size=12",
                                        "batch.micro_batch_size=1", "optimizer.bucket_size=1500",
                                        "optimizer.decay_steps=10"};

std::vector<std::string> with(std::vector<std::string> v, const std::vector<std::string>& extra) {
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}
std::string strategy(const std::string& s) { return "optimizer.strategy=\"" + s + "\""; }
std::string dp(int d) { return "parallel.dp=" + std::to_string(d); }
std::string ckpt(const std::string& dir) { return "checkpoint.dir=\"" + dir + "\""; }

// Builds the model on every rank as the trainer does, creates the optimizer over
// its buffers and hands both to fn.
using OptFn = std::function<void(loom::runtime::RankRuntime&, loom::model::Model&, const loom_optimizer_api*,
                                 loom_optimizer*, const loom::train::RunPlan&)>;

void with_optimizer(const std::vector<std::string>& overrides, const OptFn& fn) {
  const loom::train::RunPlan plan = loom::testing::plan_from(tiny_manifest(), overrides);
  const auto& m = plan.config;
  const int64_t vocab = loom::train::make_data_source(m)->vocab_size();
  loom::runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.device_options = &m.device.options;
  lc.comm_plugin = plan.comm;
  lc.comm_options = &m.comm.options;
  lc.sizes = plan.sizes;
  lc.threads = 1;
  loom::runtime::launch(lc, [&](loom::runtime::RankRuntime& rt) {
    const loom_model_dims dims = loom::model::model_dims(m, vocab, plan.sizes.tp);
    loom::model::Model model(m, *plan.registry, rt, dims, plan.layers, 7);
    std::vector<loom_param_info> infos = model.param_infos();
    loom_optimizer_create_args oa = loom::make<loom_optimizer_create_args>();
    oa.params = model.params();
    oa.grads = model.grads();
    oa.numel = model.numel();
    oa.param_dtype = LOOM_DTYPE_F32;
    oa.grad_dtype = LOOM_DTYPE_F32;
    oa.infos = infos.data();
    oa.num_params = infos.size();
    oa.dp = rt.group_or_self("dp").raw();
    oa.tp = rt.group_or_self("tp").raw();
    oa.pp = rt.group_or_self("pp").raw();
    std::vector<size_t> offsets;
    for (const loom::model::Range& b : model.layout().buckets) offsets.push_back(b.start);
    offsets.push_back(model.layout().numel);
    oa.bucket_offsets = offsets.data();
    oa.num_buckets = model.layout().buckets.size();
    loom::plugins::OptionValues opts(&m.optimizer.options, plan.optimizer->options);
    const loom_optimizer_api* api = plan.optimizer->optimizer();
    loom_optimizer* opt = nullptr;
    loom::check(api->create(opts.raw(), &rt, &oa, &opt));
    std::unique_ptr<loom_optimizer, void (*)(loom_optimizer*)> guard(opt, api->destroy);
    fn(rt, model, api, opt, plan);
  });
}

std::vector<char> save_state(const loom_optimizer_api* api, loom_optimizer* opt) {
  size_t bytes = 0;
  loom::check(api->state_size(opt, &bytes));
  std::vector<char> blob(bytes);
  loom::check(api->state_save(opt, blob.data(), bytes));
  return blob;
}

// One dp group's optimizer state gathered per parameter: [array][param][element],
// how often each element was found (must be exactly once), and how many padding
// elements held something other than zero.
struct Gathered {
  std::vector<std::vector<std::vector<float>>> arrays;
  std::vector<std::vector<int>> hits;
  size_t nonzero_padding = 0;
};

Gathered make_gathered(const std::vector<size_t>& numels, size_t num_arrays) {
  Gathered g;
  g.arrays.assign(num_arrays, {});
  for (auto& a : g.arrays)
    for (size_t n : numels) a.emplace_back(n, 0.f);
  for (size_t n : numels) g.hits.emplace_back(n, 0);
  return g;
}

template <typename T>
T take(const std::vector<char>& b, size_t& pos) {
  T v;
  EXPECT_LE(pos + sizeof(T), b.size());
  std::memcpy(&v, b.data() + pos, sizeof(T));
  pos += sizeof(T);
  return v;
}

// parallel/distributed's blob, read by its documented header (distributed.cpp): every
// element of the rank's shards goes to (parameter, element) or is padding.
void gather_distopt(const std::vector<char>& blob, Gathered& g) {
  ASSERT_GE(blob.size(), 56u);
  ASSERT_EQ(std::string(blob.data(), 8), "LOOMDOPT");
  size_t pos = 8;
  take<uint32_t>(blob, pos);  // version
  const uint32_t header = take<uint32_t>(blob, pos);
  take<uint32_t>(blob, pos);  // dp
  take<uint32_t>(blob, pos);  // rank
  take<uint64_t>(blob, pos);  // buffer numel
  const uint64_t shard_numel = take<uint64_t>(blob, pos);
  const uint32_t nb = take<uint32_t>(blob, pos), np = take<uint32_t>(blob, pos), arrays = take<uint32_t>(blob, pos);
  take<uint32_t>(blob, pos);
  ASSERT_EQ(arrays, g.arrays.size());
  ASSERT_EQ(np, g.hits.size());
  std::vector<std::pair<uint64_t, uint64_t>> shards, params;
  for (uint32_t b = 0; b < nb; ++b) {
    take<uint64_t>(blob, pos);
    take<uint64_t>(blob, pos);
    const uint64_t s0 = take<uint64_t>(blob, pos), s1 = take<uint64_t>(blob, pos);
    shards.emplace_back(s0, s1);
  }
  for (uint32_t i = 0; i < np; ++i) {
    const uint64_t off = take<uint64_t>(blob, pos), n = take<uint64_t>(blob, pos);
    params.emplace_back(off, n);
  }
  ASSERT_EQ(pos, header);
  ASSERT_EQ(blob.size(), header + arrays * shard_numel * sizeof(float));
  const float* data = reinterpret_cast<const float*>(blob.data() + header);
  size_t local = 0;
  for (const auto& [s0, s1] : shards) {
    for (uint64_t e = s0; e < s1; ++e, ++local) {
      bool in_param = false;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto [off, n] = params[i];
        if (e < off || e >= off + n) continue;
        in_param = true;
        ++g.hits[i][e - off];
        for (size_t k = 0; k < arrays; ++k) g.arrays[k][i][e - off] = data[k * shard_numel + local];
      }
      if (!in_param)
        for (size_t k = 0; k < arrays; ++k) g.nonzero_padding += data[k * shard_numel + local] != 0.f ? 1 : 0;
    }
  }
  ASSERT_EQ(local, shard_numel);
}

// parallel/ddp's blob: m and v over the whole flat buffer of `layout`.
void gather_ddp(const std::vector<char>& blob, const loom::model::BufferLayout& layout, Gathered& g) {
  const size_t arrays = g.arrays.size();
  ASSERT_EQ(blob.size(), layout.numel * arrays * sizeof(float));
  const float* data = reinterpret_cast<const float*>(blob.data());
  std::vector<char> is_param(layout.numel, 0);
  for (size_t i = 0; i < layout.params.size(); ++i)
    for (size_t e = 0; e < layout.params[i].size(); ++e) {
      is_param[layout.params[i].start + e] = 1;
      ++g.hits[i][e];
      for (size_t k = 0; k < arrays; ++k) g.arrays[k][i][e] = data[k * layout.numel + layout.params[i].start + e];
    }
  for (size_t e = 0; e < layout.numel; ++e)
    for (size_t k = 0; k < arrays && !is_param[e]; ++k) g.nonzero_padding += data[k * layout.numel + e] != 0.f;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Trains 3 steps at old_dp with a checkpoint, reshards it onto new_dp through the
// engine's load_resharded, and compares, per parameter, the state and the
// parameters saved with those loaded — bit for bit.
void check_exact_reshard(const std::string& strat, int old_dp, int new_dp) {
  SCOPED_TRACE(strat + " dp " + std::to_string(old_dp) + " -> " + std::to_string(new_dp));
  const std::string dir = loom::testing::scratch_dir("reshard-exact");
  const auto base = with(kBase, {strategy(strat)});
  auto trained = run_and_trace(tiny_manifest(), with(base, {dp(old_dp), "run.steps=3", ckpt(dir)}));
  ASSERT_EQ(trained.params.size(), 3u);
  const std::string step_dir = loom::train::checkpoint_path(dir, 3);
  const std::vector<float>& old_params = trained.params.back();  // rank 0's, after step 3

  // The old layout as the old run's model had it (ddp's blob does not describe it).
  loom::model::BufferLayout old_layout;
  std::vector<size_t> numels;
  with_optimizer(with(base, {dp(old_dp)}), [&](auto& rt, auto& model, auto*, auto*, auto&) {
    if (rt.global_rank() != 0) return;
    old_layout = model.layout();
    for (const auto& e : model.param_entries()) numels.push_back(e.numel);
  });
  ASSERT_EQ(old_layout.numel, old_params.size());
  const size_t arrays = 2;  // fp32 parameters: m and v
  Gathered saved = make_gathered(numels, arrays);
  for (int r = 0; r < old_dp; ++r) {
    const loom::train::RankState s = loom::train::read_rank_file(step_dir, r, static_cast<int64_t>(old_layout.numel));
    if (strat == "distributed") gather_distopt(s.optimizer, saved);
    else if (r == 0) gather_ddp(s.optimizer, old_layout, saved);  // replicas: one copy
  }

  // Reshard onto new_dp; every rank saves its new state.
  std::mutex mu;
  std::map<int, std::vector<char>> blobs;
  loom::model::BufferLayout new_layout;
  std::vector<float> new_params;
  with_optimizer(with(base, {dp(new_dp)}), [&](auto& rt, auto& model, auto* api, auto* opt, auto& plan) {
    loom::train::load_resharded(step_dir, old_dp, old_dp, plan.sizes, rt.global_rank(), model, rt.dev(), 1500, api,
                                opt, "parallel/" + plan.optimizer->name);
    std::vector<char> blob = save_state(api, opt);
    std::lock_guard<std::mutex> lock(mu);
    blobs[rt.global_rank()] = std::move(blob);
    if (rt.global_rank() == 0) {
      new_layout = model.layout();
      const float* p = static_cast<const float*>(model.params());  // CPU device: host memory
      new_params.assign(p, p + model.numel());
    }
  });
  ASSERT_EQ(blobs.size(), static_cast<size_t>(new_dp));
  Gathered loaded = make_gathered(numels, arrays);
  for (const auto& [r, blob] : blobs) {
    if (strat == "distributed") gather_distopt(blob, loaded);
    else if (r == 0) gather_ddp(blob, new_layout, loaded);
  }

  // The case is not trivial: the layouts differ where lcm(dp, 128) differs, and the state is not zero.
  if (std::lcm(old_dp, 128) != std::lcm(new_dp, 128)) {
    EXPECT_NE(old_layout.params, new_layout.params);
  }
  size_t nonzero = 0;
  for (const auto& p : saved.arrays[0])
    for (float f : p) nonzero += f != 0.f;
  EXPECT_GT(nonzero, 100u);

  for (size_t i = 0; i < numels.size(); ++i) {
    for (size_t e = 0; e < numels[i]; ++e) {
      ASSERT_EQ(saved.hits[i][e], 1) << "saved: param " << i << " element " << e;
      ASSERT_EQ(loaded.hits[i][e], 1) << "loaded: param " << i << " element " << e;
    }
    for (size_t k = 0; k < arrays; ++k)
      EXPECT_TRUE(bit_equal(loaded.arrays[k][i], saved.arrays[k][i])) << "array " << k << " param " << i;
    // Parameters: the same values at the new offsets.
    const std::vector<float> was(old_params.begin() + old_layout.params[i].start,
                                 old_params.begin() + old_layout.params[i].end);
    const std::vector<float> now(new_params.begin() + new_layout.params[i].start,
                                 new_params.begin() + new_layout.params[i].end);
    EXPECT_TRUE(bit_equal(now, was)) << "parameters of param " << i;
  }
  EXPECT_EQ(loaded.nonzero_padding, 0u);
  std::vector<char> is_param(new_params.size(), 0);
  for (const auto& r : new_layout.params) std::fill(is_param.begin() + r.start, is_param.begin() + r.end, 1);
  size_t bad = 0;
  for (size_t e = 0; e < new_params.size(); ++e) bad += !is_param[e] && new_params[e] != 0.f;
  EXPECT_EQ(bad, 0u) << "nonzero parameter padding";
  fs::remove_all(dir);
}

TEST(Reshard, DistributedStateIsBitIdenticalPerParameter) {
  check_exact_reshard("distributed", 4, 2);
  check_exact_reshard("distributed", 2, 4);
  check_exact_reshard("distributed", 4, 3);  // lcm(3, 128) = 384: every offset moves
}

TEST(Reshard, DdpStateIsBitIdenticalPerParameter) { check_exact_reshard("ddp", 4, 3); }

// dp = 4 for 5 steps with a checkpoint, resumed at dp = 2 to step 10, against an
// uninterrupted dp = 2 run: the same training up to reduction order.
void check_resumed_training(const std::string& strat, int tp, const std::vector<std::string>& resume_extra = {}) {
  SCOPED_TRACE(strat + " tp=" + std::to_string(tp) + (resume_extra.empty() ? "" : " " + resume_extra[0]));
  const std::string dir = loom::testing::scratch_dir("reshard-train");
  const auto base = with(kBase, {strategy(strat), "parallel.tp=" + std::to_string(tp)});
  auto full = run_and_trace(tiny_manifest(), with(base, {dp(2), "run.steps=10"}));
  auto first = run_and_trace(tiny_manifest(), with(base, {dp(4), "run.steps=5", ckpt(dir)}));
  ASSERT_TRUE(fs::exists(loom::train::checkpoint_path(dir, 5)));
  loom::train::TrainOptions resume;
  resume.resume = true;
  auto second =
      run_and_trace(tiny_manifest(), with(with(base, {dp(2), "run.steps=10", ckpt(dir)}), resume_extra), resume);
  EXPECT_EQ(second.result.start_step, 5);
  ASSERT_EQ(full.loss.size(), 10u);
  ASSERT_EQ(second.loss.size(), 5u);
  ASSERT_EQ(second.names, full.names);
  if (!resume_extra.empty()) {
    EXPECT_NE(second.tensors, full.tensors);  // the other bucket size moved the parameters
  }
  // The resumed run's buffer in the uninterrupted run's layout (they differ when the bucket size does).
  auto relaid = [&](const std::vector<float>& p) {
    std::vector<float> out(full.params[0].size(), 0.f);
    for (size_t k = 0; k < full.tensors.size(); ++k)
      std::copy_n(p.begin() + static_cast<std::ptrdiff_t>(second.tensors[k].first), second.tensors[k].second,
                  out.begin() + static_cast<std::ptrdiff_t>(full.tensors[k].first));
    return out;
  };
  for (size_t i = 0; i < 5; ++i) {
    const size_t s = 5 + i;
    EXPECT_NEAR(second.loss[i], full.loss[s], 1e-5 * std::fabs(full.loss[s])) << "step " << s + 1;
    const double gn = full.result.steps[s].grad_norm;
    EXPECT_NEAR(second.result.steps[i].grad_norm, gn, 1e-5 * gn) << "step " << s + 1;
    std::string worst;
    EXPECT_LT(loom::testing::max_tensor_rel_diff(full, s, relaid(second.params[i]), &worst), 1e-5)
        << "step " << s + 1 << " worst tensor " << worst;
  }
  // Each resumed step moves the parameters by far more than the tolerance.
  EXPECT_GT(loom::testing::max_tensor_rel_diff(full, 4, full.params[5]), 1e-3);
  fs::remove_all(dir);
}

TEST(Reshard, ResumeAtDp2FromDp4ContinuesLikeDp2) {
  check_resumed_training("distributed", 1);
  check_resumed_training("ddp", 1);
}

TEST(Reshard, ResumeAtDp2FromDp4WithTensorParallelism) { check_resumed_training("distributed", 2); }

// The old layout comes from the checkpoint's own bucket size (meta.toml), so the
// resumed run may choose another one.
TEST(Reshard, ResumeWithAnotherBucketSize) {
  check_resumed_training("distributed", 1, {"optimizer.bucket_size=100"});
  check_resumed_training("ddp", 1, {"optimizer.bucket_size=100"});
}

// ---------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------

std::string resume_error(const std::vector<std::string>& overrides,
                         const std::function<void(loom::train::RunPlan&)>& edit = {}) {
  loom::train::RunPlan plan = loom::testing::plan_from(tiny_manifest(), overrides);
  if (edit) edit(plan);
  loom::train::TrainOptions opts;
  opts.resume = true;
  try {
    loom::train::train(plan, opts);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A C++ strategy that cannot reshard: it keeps OptimizerStrategy's default.
class NoReshard : public loom::OptimizerStrategy {
 public:
  NoReshard(const loom::Options&, loom::Rank&, const loom_optimizer_create_args&) {}
  float step(loom::Rank&, const loom_optimizer_step_args&) override { return 0.f; }
  size_t state_size() override { return 0; }
  void state_save(void*, size_t) override {}
  void state_load(const void*, size_t) override {}
};

TEST(Reshard, Refusals) {
  const std::string dir = loom::testing::scratch_dir("reshard-refuse");
  const auto base = with(kBase, {strategy("distributed"), ckpt(dir)});
  run_and_trace(tiny_manifest(), with(base, {dp(4), "run.steps=2"}));

  // tp or pp changes regather by element (Regather.*); with a strategy table built
  // before 1.14 (no state_import) they are refused before anything runs, naming the slot.
  for (const std::string& over : {std::string("parallel.tp=2"), std::string("parallel.pp=2")}) {
    loom::plugins::LoadedPlugin v113;
    loom_optimizer_api t113{};
    const std::string e = resume_error(with(base, {over, dp(2), "run.steps=4"}), [&](loom::train::RunPlan& plan) {
      v113 = *plan.optimizer;
      t113 = *plan.optimizer->optimizer();
      t113.struct_size = offsetof(loom_optimizer_api, state_decode);
      v113.api = &t113;
      v113.abi_minor = 13;
      plan.optimizer = &v113;
    });
    EXPECT_NE(e.find("was written at tp=1 pp=1 cp=1 ep=1 etp=1 dp=4"), std::string::npos) << e;
    EXPECT_NE(e.find("optimizer plugin parallel/distributed (ABI 1.13) cannot load state by element (state_import, "
                     "ABI 1.14)"),
              std::string::npos)
        << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }

  // A plugin table without the slot (built for ABI 1.0): refused before anything runs.
  loom::plugins::LoadedPlugin old_plugin;
  loom_optimizer_api old_table{};
  const std::string no_slot = resume_error(with(base, {dp(2), "run.steps=4"}), [&](loom::train::RunPlan& plan) {
    old_plugin = *plan.optimizer;
    old_table = *plan.optimizer->optimizer();
    old_table.struct_size = offsetof(loom_optimizer_api, state_load_resharded);
    old_plugin.api = &old_table;
    old_plugin.abi_minor = 0;
    plan.optimizer = &old_plugin;
  });
  EXPECT_NE(no_slot.find("dp=4"), std::string::npos) << no_slot;
  EXPECT_NE(no_slot.find("optimizer plugin parallel/distributed (ABI 1.0) cannot reshard"), std::string::npos) << no_slot;
  EXPECT_NE(no_slot.find("resume with parallel.dp=4"), std::string::npos) << no_slot;
  EXPECT_EQ(no_slot.find('\n'), std::string::npos) << no_slot;

  // A C++ strategy keeping the default: the slot reports UNSUPPORTED, the engine names the plugin.
  loom::plugins::LoadedPlugin cpp_plugin;
  const std::string unsupported =
      resume_error(with(base, {dp(2), "run.steps=4"}), [&](loom::train::RunPlan& plan) {
        cpp_plugin = *plan.optimizer;
        cpp_plugin.name = "noreshard";
        cpp_plugin.api = loom::optimizer_api<NoReshard>();
        plan.optimizer = &cpp_plugin;
      });
  EXPECT_NE(unsupported.find("optimizer plugin parallel/noreshard cannot reshard"), std::string::npos)
      << unsupported;
  EXPECT_NE(unsupported.find("does not implement state_load_resharded"), std::string::npos) << unsupported;
  EXPECT_NE(unsupported.find("resume with parallel.dp=4"), std::string::npos) << unsupported;
  EXPECT_EQ(unsupported.find('\n'), std::string::npos) << unsupported;

  // A state saved by another strategy is regathered by element (both hold AdamW's
  // m and v), at any dp.
  EXPECT_EQ(resume_error(with(kBase, {strategy("ddp"), ckpt(dir), dp(2), "run.steps=4"})), "");
  fs::remove_all(dir);
}

}  // namespace
