// The step-time estimate of `loom plan --perf` (engine/train/perf_model.hpp):
//   - the pipeline simulation with per-chunk times and p2p transfers, against a
//     1F1B timeline worked out by hand;
//   - the layers' collectives costed by the alpha-beta formulas, written out here;
//   - a step composed from a given compute profile: compute per microbatch, the dp
//     buckets' reductions in line or hidden behind the last backward, the optimizer
//     step on the distributed optimizer's shard, the pipeline's stages;
//   - the estimate beside the measured step time of the same layouts on this
//     machine (generous bounds: the CI machine's two cores are shared).
#include "support/json_line.hpp"
#include "support/train_fixture.hpp"

#include "engine/pipeline/schedule.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/topology/rank_groups.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/perf_model.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <numeric>

namespace loom::cli {
int cmd_plan(int argc, char** argv);
}

namespace {

using loom::testing::plan_from;
using loom::testing::tiny_manifest;
using loom::testing::tiny_moe_manifest;
using loom::testing::with_overrides;

// pp 2, 4 microbatches, forward 10, backward 20, transfer 3. Stage 0 runs F1 F2 B1 F3
// B2 F4 B3 B4, stage 1 F1 B1 F2 B2 F3 B3 F4 B4 (one warm-up forward on stage 0). A
// transfer starts once sent and posted; receives posted early (as each stage begins
// the step before) are always posted before the data is sent here:
//   s0 F1 [0,10]  F2 [10,20]            s1 F1 [13,23] B1 [23,43]
//   s0 B1 [46,66] (s1's B1 + 3)         s1 F2 [43,53] B2 [53,73]
//   s0 F3 [66,76] B2 [76,96]            s1 F3 [79,89] B3 [89,109]
//   s0 F4 [96,106] B3 [112,132]         s1 F4 [109,119] B4 [119,139]
//   s0 B4 [142,162]
// Posted when the step is reached, s1's F2 (sent at 20, reached at 43) pays the whole
// transfer [43,46]: s1 F2 [46,56] B2 [56,76]; s0 B2 [79,99] F4 [99,109]; s1 F3 [79,89]
// B3 [89,109] F4 [112,122] B4 [122,142]; s0 B3 [112,132] B4 [145,165].
// Without the transfer: (m + pp - 1)(f + b) = 150.
TEST(PerfModel, PipelineSimulationTakesChunkTimesAndTransfers) {
  const loom::pipeline::PipelineOrders o = plan_from(tiny_manifest(), {"parallel.pp=2"}).orders;  // 1F1B
  ASSERT_EQ(o.microbatches, 4);
  loom::pipeline::SimCosts costs;
  costs.forward_of = {10, 10};
  costs.backward_of = {20, 20};
  EXPECT_EQ(loom::pipeline::simulate(o, costs).makespan, 150);
  costs.transfer = 3;
  const loom::pipeline::Timeline when_reached = loom::pipeline::simulate(o, costs);
  EXPECT_EQ(when_reached.makespan, 165);
  EXPECT_EQ(when_reached.ranks[1][2].start, 46) << "stage 1's second forward waits the whole transfer out";
  EXPECT_EQ(when_reached.ranks[0][7].start, 145);
  costs.receives_posted_early = true;
  const loom::pipeline::Timeline t = loom::pipeline::simulate(o, costs);
  EXPECT_EQ(t.makespan, 162);
  ASSERT_EQ(t.ranks[0].size(), 8u);
  EXPECT_EQ(t.ranks[0][2].start, 46) << "stage 0's first backward waits for stage 1's plus the transfer";
  EXPECT_EQ(t.ranks[1][0].start, 13);
  EXPECT_EQ(t.ranks[1][6].start, 109);
  // Per-chunk times: a slower last stage stretches the steady state.
  costs.transfer = 0;
  costs.receives_posted_early = false;
  costs.forward_of = {10, 15};
  costs.backward_of = {20, 30};
  EXPECT_GT(loom::pipeline::simulate(o, costs).makespan, 150);
  costs.forward_of = {10};
  EXPECT_THROW(loom::pipeline::simulate(o, costs), loom::pipeline::ScheduleError) << "one entry per global chunk";
}

TEST(PerfModel, LayerCollectivesCostWhatTheRingFormulasSay) {
  loom::topology::ParallelSizes sizes;
  sizes.world = 8;
  sizes.tp = 2;
  sizes.cp = 4;
  const loom::topology::RankGroups groups = loom::topology::RankGroups::build(sizes);
  loom::runtime::CommStats stats;
  stats["tp"]["all_reduce"] = {4, 1000, 4000, 0};     // 4 calls of 1000 bytes
  stats["cp"]["all_gather"] = {2, 800, 3200, 0};      // 2 calls gathering 1600 bytes: 400 per member
  stats["cp"]["reduce_scatter"] = {2, 800, 3200, 0};
  const loom::LinkModel links = loom::LinkModel::parse("tp=1GB/s,1us; cp=2GB/s,5us");
  const double alpha_tp = 1e-6, beta_tp = 1e9, alpha_cp = 5e-6, beta_cp = 2e9;
  const double tp = 4 * 2 * (2 - 1) * (alpha_tp + 1000.0 / (2 * beta_tp));  // 2(p-1)(α + n/(pβ))
  const double cp = 2 * 2 * (4 - 1) * (alpha_cp + 400.0 / beta_cp);         // (p-1)(α + c/β), both ops
  EXPECT_NEAR(loom::train::modelled_comm_seconds(stats, links, groups), tp + cp, 1e-12);
  EXPECT_EQ(loom::train::modelled_comm_seconds(stats, loom::LinkModel(), groups), 0) << "ideal links cost nothing";
  // A collective lasts at least its modelled time (comm/local): what the link adds
  // is the model beyond what the calls took without it, never less than nothing.
  const loom::train::CommSeconds measured = {{"tp", {{"all_reduce", tp / 4}}}, {"cp", {{"all_gather", 1.0}}}};
  EXPECT_NEAR(loom::train::modelled_comm_seconds(stats, links, groups, measured), tp * 3 / 4 + cp / 2, 1e-12);
}

// A profile given, not measured: the estimate is then exact arithmetic.
loom::train::ComputeProfile given_profile(const loom::train::RunPlan& plan, const loom::train::MemoryPlan& mp) {
  loom::train::ComputeProfile p;
  p.device = plan.config.device.kind;
  p.tp = plan.sizes.tp;
  p.cp = plan.sizes.cp;
  p.dp = plan.sizes.world / (plan.sizes.tp * plan.sizes.cp);
  p.threads = 1;
  p.forward_flops_s = 4e-3;
  p.backward_flops_s = 8e-3;
  p.optimizer_s = 1e-3;
  for (const loom::train::RankMemory& r : mp.ranks) {
    if (r.tp_rank != 0 || r.cp_rank != 0 || r.dp_rank != 0) continue;
    p.layers += std::accumulate(r.chunk_layers().begin(), r.chunk_layers().end(), 0);
    p.layer_flops += std::accumulate(r.chunk_forward_flops().begin(), r.chunk_forward_flops().end(), 0.0);
    p.buffer_elements += r.buffer_numel;
  }
  return p;
}

const std::vector<std::string> kDp2 = {"parallel.dp=2", "optimizer.bucket_size=2000",
                                       "comm.options.links=\"dp=0.1GB/s,10us\""};

TEST(PerfModel, AStepIsComputeThenTheBucketsThenTheOptimizer) {
  const loom::train::RunPlan plan = plan_from(tiny_manifest(), kDp2);
  const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
  const loom::train::ComputeProfile profile = given_profile(plan, mp);
  const loom::LinkModel links = loom::train::plan_links(plan);
  const loom::train::PerfEstimate e = loom::train::estimate_step(plan, mp, profile, links, 2);
  ASSERT_EQ(e.stages.size(), 1u);
  const loom::train::StageEstimate& s = e.stages[0];
  const double m = static_cast<double>(plan.microbatches);  // 8 / (2 x 2)
  EXPECT_DOUBLE_EQ(s.forward_s, m * 4e-3);
  EXPECT_DOUBLE_EQ(s.backward_s, m * 8e-3);
  // Each bucket all-reduced over 2 ranks: 2 (p - 1)(α + n / (p β)) = 2 (10 us + n / 2 / 0.1 GB/s).
  const loom::train::RankMemory& r = mp.ranks[0];
  ASSERT_GE(r.layout().buckets.size(), 3u);
  double buckets = 0;
  for (const auto& b : r.layout().buckets) buckets += 2 * (10e-6 + double(b.size()) * 4 / 2 / 0.1e9);
  EXPECT_NEAR(s.grad_reduce_s, buckets, 1e-12);
  EXPECT_NEAR(s.grad_reduce_exposed_s, buckets, 1e-12) << "in line: the step waits for every bucket";
  EXPECT_NEAR(s.optimizer_s, 1e-3, 1e-12) << "ddp steps the whole buffer, as measured";
  EXPECT_NEAR(s.step_s, s.forward_s + s.backward_s + s.grad_reduce_exposed_s + s.optimizer_s + s.bookkeeping_s, 1e-12);
  EXPECT_NEAR(e.tokens_per_s, 8.0 * 16 / s.step_s, 1e-6);

  // Overlapped: the buckets start during the last backward; the last one cannot.
  const loom::train::RunPlan op = plan_from(tiny_manifest(), with_overrides(kDp2, {"optimizer.overlap_grad_reduce=true"}));
  const loom::train::PerfEstimate eo = loom::train::estimate_step(op, mp, profile, links, 2);
  const loom::train::StageEstimate& so = eo.stages[0];
  EXPECT_NEAR(so.grad_reduce_s, buckets, 1e-12);
  EXPECT_LT(so.grad_reduce_exposed_s, buckets);
  const auto& last = r.layout().buckets.back();
  EXPECT_GE(so.grad_reduce_exposed_s, 2 * (10e-6 + double(last.size()) * 4 / 2 / 0.1e9) - 1e-12);
  EXPECT_NEAR(s.step_s - so.step_s, buckets - so.grad_reduce_exposed_s, 1e-12);

  // The distributed optimizer: reduce-scatter, a half-size step, the all-gather.
  const loom::train::RunPlan dist = plan_from(tiny_manifest(), with_overrides(kDp2, {"optimizer.strategy=\"distributed\""}));
  const loom::train::MemoryPlan dmp = loom::train::plan_memory(dist);
  const loom::train::PerfEstimate ed = loom::train::estimate_step(dist, dmp, profile, links, 2);
  const loom::train::StageEstimate& sd = ed.stages[0];
  double scatter = 0;
  for (const auto& b : dmp.ranks[0].layout().buckets) scatter += 10e-6 + double(b.size()) * 4 / 2 / 0.1e9;
  EXPECT_NEAR(sd.grad_reduce_s, scatter, 1e-12);
  EXPECT_NEAR(sd.param_gather_s, scatter, 1e-12) << "fp32 parameters gathered as the gradients were scattered";
  EXPECT_NEAR(sd.param_gather_exposed_s, sd.param_gather_s, 1e-12);
  EXPECT_NEAR(sd.optimizer_s, 1e-3 * double(dmp.ranks[0].buffer_numel / 2) / double(profile.buffer_elements), 1e-12);
}

// A profile measured at another world size on these cores had other threads per rank:
// the part in proportion to FLOPs scales with them, the part fixed per layer does not.
TEST(PerfModel, AProfileOfOtherThreadsPerRankScalesTheArithmetic) {
  const loom::train::RunPlan plan = plan_from(tiny_manifest(), kDp2);  // 2 ranks on 2 cores: 1 thread each
  const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
  loom::train::ComputeProfile alone = given_profile(plan, mp);
  alone.dp = 1;  // measured as one rank with both cores
  alone.threads = 2;
  alone.forward_fixed_s = 1e-3;
  const loom::LinkModel links = loom::train::plan_links(plan);
  const loom::train::PerfEstimate e = loom::train::estimate_step(plan, mp, alone, links, 2);
  const double m = static_cast<double>(plan.microbatches);
  EXPECT_EQ(e.threads, 1);
  EXPECT_DOUBLE_EQ(e.thread_scale, 2);
  EXPECT_DOUBLE_EQ(e.contention, 1) << "one busy thread per core, as when measured";
  EXPECT_DOUBLE_EQ(e.stages[0].forward_s, m * (1e-3 + 2 * 4e-3));
  EXPECT_DOUBLE_EQ(e.stages[0].backward_s, m * 2 * 8e-3);
  loom::train::ComputeProfile shared = alone;  // measured as this layout runs
  shared.dp = 2;
  shared.threads = 1;
  const loom::train::PerfEstimate same = loom::train::estimate_step(plan, mp, shared, links, 2);
  EXPECT_DOUBLE_EQ(same.thread_scale, 1);
  EXPECT_DOUBLE_EQ(same.stages[0].forward_s, m * (1e-3 + 4e-3));
}

// A model measured with fewer of its blocks (one that fits only split into stages, or
// --measure-blocks): each layer costs the fixed time per layer and its FLOPs' share.
// The layers' distinct FLOPs must be the measured ones: another hidden size is refused.
TEST(PerfModel, AProfileOfFewerBlocksCostsEachLayerByItsFlops) {
  const std::vector<std::string> four = {"model.num_layers=4"};
  const loom::train::RunPlan plan = plan_from(tiny_manifest(), four);
  const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
  const loom::train::RunPlan two = plan_from(tiny_manifest(), {"model.num_layers=2"});
  const loom::train::MemoryPlan mp2 = loom::train::plan_memory(two);
  loom::train::ComputeProfile p = given_profile(two, mp2);
  p.forward_fixed_s = 1e-3;
  p.threads = loom::train::threads_per_rank(plan, 2);  // as this layout runs
  p.blocks = 2;
  p.model_blocks = 4;
  const std::vector<double>& each = mp2.ranks[0].layer_forward_flops();
  ASSERT_EQ(each.size(), 6u) << "embedding, 2 x (attention, mlp), lm_head";
  p.distinct_layer_flops = {each.begin(), each.end()};
  std::sort(p.distinct_layer_flops.begin(), p.distinct_layer_flops.end());
  p.distinct_layer_flops.erase(std::unique(p.distinct_layer_flops.begin(), p.distinct_layer_flops.end()),
                               p.distinct_layer_flops.end());
  const loom::train::PerfEstimate e = loom::train::estimate_step(plan, mp, p, loom::train::plan_links(plan), 2);
  const double m = static_cast<double>(plan.microbatches);
  const double flops4 = std::accumulate(mp.ranks[0].layer_forward_flops().begin(), mp.ranks[0].layer_forward_flops().end(), 0.0);
  ASSERT_EQ(mp.ranks[0].layer_forward_flops().size(), 10u);
  EXPECT_NEAR(e.stages[0].forward_s, m * (1e-3 * 10 / 6 + 4e-3 * flops4 / p.layer_flops), 1e-12);
  EXPECT_NEAR(e.stages[0].backward_s, m * 8e-3 * flops4 / p.layer_flops, 1e-12);
  EXPECT_GT(flops4 / p.layer_flops, 1.5) << "the two blocks more cost their FLOPs";
  // Without the layers' FLOPs (a profile written before them) the model must be the same.
  loom::train::ComputeProfile old = p;
  old.distinct_layer_flops.clear();
  EXPECT_THROW(loom::train::estimate_step(plan, mp, old, loom::train::plan_links(plan), 2), loom::Error);
  const loom::train::RunPlan wider = plan_from(tiny_manifest(), with_overrides(four, {"model.hidden_size=64"}));
  try {
    loom::train::estimate_step(wider, loom::train::plan_memory(wider), p, loom::train::plan_links(wider), 2);
    ADD_FAILURE() << "a profile of another hidden size was taken";
  } catch (const loom::Error& err) {
    EXPECT_NE(std::string(err.what()).find("another model"), std::string::npos) << err.what();
  }
  // A profile's time edited out of range (1e308 s) is refused, not an estimate of inf.
  loom::train::ComputeProfile huge = p;
  huge.forward_flops_s = 1e308;
  EXPECT_THROW(loom::train::estimate_step(plan, mp, huge, loom::train::plan_links(plan), 2), loom::Error);
  // A saved profile edited out of range or out of step with itself is refused.
  nlohmann::ordered_json edited = loom::train::profile_to_json(p);
  edited["forward_flops_s"] = 1e300;
  EXPECT_THROW(loom::train::profile_from_json(edited), loom::Error);
  edited = loom::train::profile_to_json(p);
  edited["layer_flops"] = 1;
  EXPECT_THROW(loom::train::profile_from_json(edited), loom::Error);
  edited = loom::train::profile_to_json(p);
  edited["blocks"] = 100;
  EXPECT_THROW(loom::train::profile_from_json(edited), loom::Error);
  // Kept in the saved profile.
  const loom::train::ComputeProfile back = loom::train::profile_from_json(loom::train::profile_to_json(p));
  EXPECT_EQ(back.distinct_layer_flops, p.distinct_layer_flops);
  EXPECT_EQ(back.blocks, 2);
  EXPECT_EQ(back.model_blocks, 4);
}

TEST(PerfModel, PipelineStagesSplitTheModelAndWaitInTheBubble) {
  const loom::train::RunPlan plan =
      plan_from(tiny_manifest(), {"parallel.pp=2", "model.num_layers=4",
                                  "comm.options.links=\"pp=1GB/s,20us; embedding=2GB/s,30us\""});
  const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
  const loom::train::ComputeProfile profile = given_profile(plan, mp);
  const loom::train::PerfEstimate e = loom::train::estimate_step(plan, mp, profile, loom::train::plan_links(plan), 2);
  ASSERT_EQ(e.stages.size(), 2u);
  const double m = static_cast<double>(plan.microbatches);
  // The stages' compute adds up to the whole model's (shares of its FLOPs), to rounding to ns.
  EXPECT_NEAR(e.stages[0].forward_s + e.stages[1].forward_s, m * 4e-3, 1e-6);
  EXPECT_NEAR(e.stages[0].backward_s + e.stages[1].backward_s, m * 8e-3, 1e-6);
  // 1F1B: stage 0 waits at least for the other stage's first forward and backward
  // of microbatch 1 and the transfers between (20 us + the hidden state per hop).
  const double hop = 20e-6 + double(mp.hidden_state_bytes) / 1e9;
  const double f1 = e.stages[1].forward_s / m, b1 = e.stages[1].backward_s / m;
  EXPECT_GE(e.stages[0].pipeline_wait_s, f1 + b1 + 2 * hop - 1e-6);
  // The tied embedding summed over the first and last stage: 2 (α + n / (2 β)).
  const double tied = double(mp.ranks[0].tied_numel) * 4;
  ASSERT_GT(tied, 0);
  EXPECT_NEAR(e.stages[0].embedding_s, 2 * (30e-6 + tied / 2 / 2e9), 1e-12);
  EXPECT_NEAR(e.stages[1].embedding_s, e.stages[0].embedding_s, 1e-12);
  EXPECT_GE(e.step_s, std::max(e.stages[0].step_s, e.stages[1].step_s));
}

// The estimate beside the measured step of the same layouts, the links making the
// communication a large part of the step. The bounds are generous (a factor 1.6 each
// way): the CI machine's two cores are shared with other tests; scripts/bench-perf.sh
// prints the table on a quiet machine.
TEST(PerfModel, EstimateTracksTheMeasuredStepTime) {
  const std::vector<std::string> base = {
      "model.hidden_size=64",  "model.num_layers=4",        "model.seq_length=32", "batch.micro_batch_size=2",
      "batch.global_batch_size=16", "optimizer.bucket_size=20000",
      "comm.options.links=\"dp=0.05GB/s,50us; pp=0.2GB/s,50us; tp=1GB/s,20us\""};
  const int cores = loom::runtime::usable_cores();
  struct Case {
    const char* name;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {{"dp 2", {"parallel.dp=2"}},
                                   {"dp 2 overlapped", {"parallel.dp=2", "optimizer.overlap_grad_reduce=true"}},
                                   {"pp 2", {"parallel.pp=2"}},
                                   {"tp 2", {"parallel.tp=2"}}};
  for (const Case& c : cases) {
    const loom::train::RunPlan plan = plan_from(tiny_manifest(), with_overrides(base, c.sets));
    const loom::train::MemoryPlan mp = loom::train::plan_memory(plan);
    const int threads = loom::train::threads_per_rank(plan, cores);
    bool close = false;
    for (int attempt = 0; attempt < 3 && !close; ++attempt) {
      const loom::train::ComputeProfile profile = loom::train::measure_compute(plan, threads);
      const double estimate = loom::train::estimate_step(plan, mp, profile, loom::train::plan_links(plan), cores).step_s;
      const double measured = loom::train::measure_step_s(plan, 8);
      std::cout << "[ perf ] " << c.name << ": estimate " << estimate * 1e3 << " ms/step, measured " << measured * 1e3
                << " (ratio " << estimate / measured << ")\n";
      close = estimate > measured / 1.6 && estimate < measured * 1.6;
    }
    EXPECT_TRUE(close) << c.name << ": the estimate was never within a factor 1.6 of the measured step";
  }
}

// The CLI: `loom plan --perf --json` and `--search`, and what it refuses.
std::string& last_stderr() {
  static std::string s;
  return s;
}

int plan_cli(std::vector<std::string> words, std::string* out) {
  words.insert(words.begin(), "plan");
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = loom::cli::cmd_plan(static_cast<int>(argv.size()) - 1, argv.data() + 1);
  *out = ::testing::internal::GetCapturedStdout();
  last_stderr() = ::testing::internal::GetCapturedStderr();
  return rc;
}

// --search keeps what the manifest says of its own pipeline (an uneven split, valid at
// its pp), and with --world takes a manifest whose own layout cannot be (ep 4 over one
// dp rank) for the model it names: the search replaces the layout anyway.
TEST(PerfModel, SearchKeepsTheManifestsPipelineSplitAndReplacesALayoutThatCannotBe) {
  const std::string dir = loom::testing::scratch_dir("perf_search");
  const std::string path = dir + "/tiny.toml";
  std::ofstream(path) << tiny_manifest();
  std::string out;
  ASSERT_EQ(plan_cli({path, "--perf", "--search", "--world", "4", "--json", "--set", "model.num_layers=6", "--set",
                      "parallel.pp=4", "--set", "parallel.dp=1", "--set", "pipeline.first_chunk_layers=1", "--set",
                      "pipeline.last_chunk_layers=1"},
                     &out),
            0)
      << out << last_stderr();
  nlohmann::ordered_json tree = loom::testing::json_line(out);
  bool own = false;
  for (const auto& r : tree.at("ranked")) own = own || (r.at("pp") == 4 && r.at("vpp") == 1);
  EXPECT_TRUE(own) << "the manifest's own layout (chunks 1, 2, 2, 1) was refused: " << out;

  const std::vector<std::string> moe = {"--set", "model.block=[\"attention\", \"moe\"]", "--set",
                                        "model.layer.moe.num_experts=4", "--set", "parallel.ep=4", "--set",
                                        "parallel.dp=1", "--set", "model.num_layers=2"};
  std::vector<std::string> words = {path, "--perf", "--search", "--world", "4", "--json"};
  words.insert(words.end(), moe.begin(), moe.end());
  ASSERT_EQ(plan_cli(words, &out), 0) << out << last_stderr();
  tree = loom::testing::json_line(out);
  ASSERT_FALSE(tree.at("ranked").empty()) << out;
  for (const auto& r : tree.at("ranked")) EXPECT_EQ(r.at("dp").get<int>() * r.at("cp").get<int>() % 4, 0) << r.dump();
  words.erase(words.begin() + 3, words.begin() + 5);  // without --world: the manifest's own layout, refused
  EXPECT_EQ(plan_cli(words, &out), 1);
  EXPECT_NE((out + last_stderr()).find("parallel.ep (4) must divide"), std::string::npos) << out << last_stderr();
}

TEST(PerfModel, PlanPerfPrintsTheEstimateAndSearchRanksTheLayouts) {
  const std::string dir = loom::testing::scratch_dir("perf_cli");
  const std::string path = dir + "/tiny.toml";
  std::ofstream(path) << tiny_manifest();
  std::string out;
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "parallel.dp=2", "--links", "dp=1GB/s,10us"}, &out), 0) << out;
  nlohmann::ordered_json tree = loom::testing::json_line(out);
  EXPECT_GT(tree.at("step_ms").get<double>(), 0);
  ASSERT_EQ(tree.at("stages").size(), 1u);
  EXPECT_GT(tree.at("stages")[0].at("grad_reduce_ms").get<double>(), 0) << "--links costs the dp reduction";
  EXPECT_EQ(tree.at("measured_at").at("dp"), 2) << "measured with both ranks sharing the cores";

  ASSERT_EQ(plan_cli({path, "--perf", "--search", "--world", "4", "--json", "--set", "model.num_layers=4"}, &out), 0)
      << out;
  tree = loom::testing::json_line(out);
  EXPECT_EQ(tree.at("world"), 4);
  const auto& ranked = tree.at("ranked");
  ASSERT_GE(ranked.size(), 3u) << out;
  double previous = 0;
  for (const auto& r : ranked) {
    EXPECT_EQ(r.at("tp").get<int>() * r.at("cp").get<int>() * r.at("pp").get<int>() * r.at("dp").get<int>(), 4);
    EXPECT_GE(r.at("step_ms").get<double>(), previous) << "fastest first";
    previous = r.at("step_ms").get<double>();
  }
  // Sequence parallelism and interleaving are among the candidates.
  bool sp = false, vpp2 = false;
  for (const auto& r : ranked) sp = sp || r.at("sequence_parallel") == true, vpp2 = vpp2 || r.at("vpp") == 2;
  EXPECT_TRUE(sp && vpp2) << out;
  // Four transformer layers cannot make four pipeline stages of two virtual chunks.
  bool pp4_vpp2_refused = false;
  for (const auto& r : tree.at("refused")) {
    EXPECT_FALSE(r.at("refused").get<std::string>().empty());
    pp4_vpp2_refused = pp4_vpp2_refused || (r.at("pp") == 4 && r.at("vpp") == 2);
  }
  EXPECT_TRUE(pp4_vpp2_refused) << out;

  // A profile saved, then estimating other links and overlap settings from it; a
  // profile of another model is refused.
  const std::string prof = dir + "/profile.json";
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "parallel.dp=2", "--save-profile", prof}, &out), 0) << out;
  const double measured_step = loom::testing::json_line(out).at("step_ms").get<double>();
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "parallel.dp=2", "--profile", prof}, &out), 0) << out;
  EXPECT_DOUBLE_EQ(loom::testing::json_line(out).at("step_ms").get<double>(), measured_step) << "the same profile";
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "parallel.dp=2", "--profile", prof, "--links", "dp=0.1GB/s"},
                     &out), 0) << out;
  EXPECT_GT(loom::testing::json_line(out).at("step_ms").get<double>(), measured_step) << "a slow dp link costs time";
  EXPECT_EQ(plan_cli({path, "--perf", "--profile", prof, "--set", "parallel.dp=2", "--set", "model.hidden_size=64"},
                     &out), 1);
  EXPECT_NE(last_stderr().find("another model"), std::string::npos) << last_stderr();
  // Settings that change a layer's time but not its FLOPs are the profile's too.
  for (const char* other : {"model.num_heads=2", "device.param_dtype=\"bf16\"", "model.recompute_granularity=\"full\"",
                            "model.layer.attention.norm=\"rmsnorm\""}) {
    EXPECT_EQ(plan_cli({path, "--perf", "--profile", prof, "--set", "parallel.dp=2", "--set", other}, &out), 1) << other;
    EXPECT_NE(last_stderr().find("another model: it was measured with"), std::string::npos) << last_stderr();
  }
  EXPECT_EQ(plan_cli({path, "--perf", "--profile", prof, "--set", "parallel.tp=2"}, &out), 1);
  EXPECT_NE(last_stderr().find("measured at tp 1"), std::string::npos) << last_stderr();
  std::ofstream(dir + "/bad.json") << "{\"loom_compute_profile\": 1, \"device\": \"cpu\", \"tp\": -1}";
  EXPECT_EQ(plan_cli({path, "--perf", "--profile", dir + "/bad.json"}, &out), 1);
  EXPECT_NE(last_stderr().find("\"tp\" must be"), std::string::npos) << last_stderr();
  // A count past what a manifest allows (it was cast to int): refused with its range.
  std::ofstream(dir + "/huge.json") << "{\"loom_compute_profile\": 1, \"device\": \"cpu\", \"tp\": 1e12}";
  EXPECT_EQ(plan_cli({path, "--perf", "--profile", dir + "/huge.json"}, &out), 1);
  EXPECT_NE(last_stderr().find("\"tp\" must be a whole number from 1 to 1048576, not 1e+12"), std::string::npos)
      << last_stderr();
  EXPECT_EQ(plan_cli({path, "--perf", "--profile", prof, "--save-profile", prof}, &out), 2);

  EXPECT_EQ(plan_cli({path, "--search"}, &out), 2) << "--search without --perf";
  EXPECT_EQ(plan_cli({path, "--perf", "--check", "4"}, &out), 2) << "too few steps after the warm-up";
  EXPECT_EQ(plan_cli({path, "--perf", "--search", "--check", "5"}, &out), 2);
  EXPECT_EQ(plan_cli({path, "--perf", "--links", "dp=fast"}, &out), 2) << out;
  EXPECT_NE(last_stderr().find("dp=fast"), std::string::npos) << last_stderr();
  EXPECT_EQ(plan_cli({path, "--perf", "--links", ""}, &out), 2) << "an empty --links";
  EXPECT_EQ(plan_cli({path, "--perf", "--search", "--world", "2147483647"}, &out), 2) << "beyond any parallel size";
  EXPECT_EQ(plan_cli({path, "--perf", "--search", "--world", "4294967298"}, &out), 2) << "not cut to 32 bits";
  EXPECT_EQ(plan_cli({path, "--perf", "--check", "100001"}, &out), 2);
  // Collectives of a kind with no link (and no "*") are said to cost nothing.
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "parallel.cp=2", "--links", "tp=1GB/s"}, &out), 0) << out;
  EXPECT_NE(out.find("no link for cp"), std::string::npos) << out;
  // An interleaved pipeline is measured without its stages (a schedule pp 1 takes).
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "model.num_layers=4", "--set", "parallel.pp=2", "--set",
                      "parallel.vpp=2", "--set", "pipeline.schedule=\"interleaved\""},
                     &out), 0)
      << out << last_stderr();
  // --measure-blocks: a model of 2 of the 4 blocks measured, the rest costed by FLOPs.
  const std::string prof2 = dir + "/profile_two_blocks.json";
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "model.num_layers=4", "--measure-blocks", "2",
                      "--save-profile", prof2},
                     &out), 0)
      << out << last_stderr();
  tree = loom::testing::json_line(out);
  EXPECT_EQ(tree.at("measured_at").at("blocks"), 2);
  EXPECT_EQ(tree.at("measured_at").at("model_blocks"), 4);
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "model.num_layers=8", "--profile", prof2}, &out), 0)
      << "a profile of fewer blocks estimates a deeper model of the same blocks: " << last_stderr();
  // A model that fits a 16 MiB device only split into 2 stages (14 MiB a rank; 26 MiB
  // whole) is measured with the most of its blocks that fit one rank.
  ASSERT_EQ(plan_cli({path, "--perf", "--json", "--set", "model.hidden_size=128", "--set", "model.num_layers=8",
                      "--set", "parallel.pp=2", "--set", "device.options.memory_mb=16"},
                     &out), 0)
      << out << last_stderr();
  tree = loom::testing::json_line(out);
  EXPECT_GE(tree.at("measured_at").at("blocks").get<int>(), 1);
  EXPECT_LT(tree.at("measured_at").at("blocks").get<int>(), 8);
  EXPECT_EQ(plan_cli({path, "--perf", "--set", "model.hidden_size=128", "--set", "parallel.pp=2", "--set",
                      "device.options.memory_mb=3"},
                     &out), 1);
  EXPECT_NE(last_stderr().find("even with one transformer block"), std::string::npos) << last_stderr();
  EXPECT_EQ(plan_cli({path, "--perf", "--set", "model.num_layers=4", "--measure-blocks", "5"}, &out), 2);
  EXPECT_NE(last_stderr().find("the model has 4"), std::string::npos) << last_stderr();
  // Recomputing some blocks ("block" method) is a share fewer blocks cannot hold.
  EXPECT_EQ(plan_cli({path, "--perf", "--set", "model.num_layers=4", "--set", "model.recompute_granularity=\"full\"",
                      "--set", "model.recompute_method=\"block\"", "--set", "model.recompute_num_layers=1",
                      "--measure-blocks", "2"},
                     &out), 1);
  EXPECT_NE(last_stderr().find("cannot measure that share"), std::string::npos) << last_stderr();
  // The first block of each of 2 stages recomputed: the measuring run, one chunk of the
  // 4 blocks, recomputes 2 of them; a profile of that is refused for 1 stage (1 block).
  const std::string recompute_prof = dir + "/profile_recompute.json";
  const std::vector<std::string> block_recompute = {"--set", "model.num_layers=4", "--set",
                                                    "model.recompute_granularity=\"full\"", "--set",
                                                    "model.recompute_method=\"block\"", "--set",
                                                    "model.recompute_num_layers=1"};
  std::vector<std::string> save = {path, "--perf", "--set", "parallel.pp=2", "--set", "parallel.dp=1",
                                   "--save-profile", recompute_prof};
  save.insert(save.end(), block_recompute.begin(), block_recompute.end());
  ASSERT_EQ(plan_cli(save, &out), 0) << out << last_stderr();
  std::ifstream saved(recompute_prof);
  const nlohmann::json profile = nlohmann::json::parse(saved);
  EXPECT_EQ(profile.at("model").at("blocks recomputed (model.recompute_method = block)"), "2") << profile.dump();
  std::vector<std::string> one_stage = {path, "--perf", "--set", "parallel.dp=2", "--profile", recompute_prof};
  one_stage.insert(one_stage.end(), block_recompute.begin(), block_recompute.end());
  EXPECT_EQ(plan_cli(one_stage, &out), 1);
  EXPECT_NE(last_stderr().find("blocks recomputed (model.recompute_method = block) = 2, this run has 1"),
            std::string::npos)
      << last_stderr();
  // The count alone decides: 2 blocks of 1 stage cost what 1 block of each of 2 stages does.
  std::vector<std::string> one_stage_two = one_stage;
  one_stage_two.back() = "model.recompute_num_layers=2";
  EXPECT_EQ(plan_cli(one_stage_two, &out), 0) << last_stderr();
  // Every block (2 of each of 2 stages) is "all", whatever the count per stage.
  std::vector<std::string> all_blocks = save;
  all_blocks.back() = "model.recompute_num_layers=2";
  ASSERT_EQ(plan_cli(all_blocks, &out), 0) << out << last_stderr();
  std::ifstream saved_all(recompute_prof);
  EXPECT_EQ(nlohmann::json::parse(saved_all).at("model").at("blocks recomputed (model.recompute_method = block)"),
            "all 4");
  // --search measures each share of recomputed blocks once: the manifest's own split
  // (2 stages of 2 blocks, 1 recomputed in each) is ranked, not refused for a profile
  // of another split.
  std::vector<std::string> search = {path, "--perf", "--json", "--search", "--world", "2"};
  search.insert(search.end(), block_recompute.begin(), block_recompute.end());
  ASSERT_EQ(plan_cli(search, &out), 0) << out << last_stderr();
  bool pp2_ranked = false;
  tree = loom::testing::json_line(out);
  for (const auto& r : tree.at("ranked"))
    pp2_ranked = pp2_ranked || (r.at("pp") == 2 && r.at("vpp") == 1);
  EXPECT_TRUE(pp2_ranked) << out;
  EXPECT_EQ(plan_cli({path, "--perf", "--measure-blocks", "0"}, &out), 2);
  EXPECT_EQ(plan_cli({path, "--perf", "--measure-blocks", "1", "--profile", prof2}, &out), 2);
  EXPECT_EQ(plan_cli({path, "--measure-blocks", "1"}, &out), 2) << "without --perf";
  // A world no layout can serve fails with a reason on stderr.
  EXPECT_EQ(plan_cli({path, "--perf", "--search", "--world", "3"}, &out), 1);
  EXPECT_NE(last_stderr().find("no layout of 3 rank(s)"), std::string::npos) << last_stderr();
  boost::filesystem::remove_all(dir);
}

}  // namespace
