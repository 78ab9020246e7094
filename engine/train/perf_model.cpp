#include "engine/train/perf_model.hpp"

#include "engine/manifest/batches.hpp"
#include "engine/manifest/schema.hpp"
#include "engine/model/param_plan.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/preflight.hpp"
#include "engine/train/trainer.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

namespace loom::train {

namespace {

constexpr int64_t kMeasuredMicrobatches = 4;  // per measured step
constexpr int kWarmupSteps = 2;               // caches, allocators and thread pools settle
constexpr int kMeasuredSteps = 6;             // after the warm-up; each phase's median is kept

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The engine's and the optimizer's own collectives, which estimate_step models from
// the plan; every other kind belongs to the layers.
bool engine_kind(const std::string& kind) {
  static const std::set<std::string> kinds = {"dp", "dp-cp", "edp", "pp", "embedding", "position_embedding", "world"};
  return kinds.count(kind) > 0;
}

struct PhaseTimes {
  double forward_s = 0, backward_s = 0, optimizer_s = 0, other_s = 0;  // per step, means
  runtime::CommStats layer_comm;                                       // per step, the last measured
  CommSeconds layer_comm_s;                                             // per step, means
  size_t buffer_elements = 0;
};

// `plan` again with `sets` applied and `steps` steps that write nothing: no
// evaluation, samples, metrics file or checkpoints, the random initialisation.
// The measured steps are those of the whole global batch: a batch ramp's smaller ones
// are not what the estimate is of, nor is the learning rate.
RunPlan quiet_copy(const RunPlan& plan, int64_t steps, std::vector<std::string> sets) {
  for (const char* s : {"run.eval_every=0", "run.sample_every=0", "run.metrics_file=\"\"", "checkpoint.dir=\"\"",
                        "checkpoint.every=0", "checkpoint.init_weights=\"\""})
    sets.push_back(s);
  for (const std::string& s : manifest::untrained_schedule_overrides()) sets.push_back(s);
  sets.push_back("run.steps=" + std::to_string(steps));
  return replan(plan, sets);
}

// The kinds of block a model.block_pattern places, in the order they first appear.
std::vector<std::string> block_kinds(const std::vector<std::string>& pattern) {
  std::vector<std::string> kinds;
  for (const std::string& k : pattern)
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
  return kinds;
}

// The blocks of a measuring run of `blocks` blocks, fewer than the model's and at
// least one of each kind: every kind once, then the rest of the pattern in its order.
// Each layer is costed by its FLOPs, so the measured model needs every kind, not the
// pattern's proportions. (A measuring run of every block keeps the pattern: block
// recomputation takes each chunk's first blocks.)
std::string measured_pattern(const std::vector<std::string>& pattern, int64_t blocks) {
  std::vector<std::string> kinds = block_kinds(pattern);
  std::vector<std::string> out = kinds;
  for (const std::string& k : pattern) {
    const auto first = std::find(kinds.begin(), kinds.end(), k);
    if (first != kinds.end()) kinds.erase(first);  // its first place is taken above
    else out.push_back(k);
  }
  out.resize(static_cast<size_t>(blocks));
  std::string text = "model.block_pattern=[";
  for (size_t i = 0; i < out.size(); ++i) text += (i > 0 ? ", \"" : "\"") + out[i] + "\"";
  return text + "]";
}

// What makes a copy of `plan` the measuring run: its tp and cp, `dp` data-parallel
// ranks, no pipeline, `blocks` transformer blocks, no links.
std::vector<std::string> measuring_sets(const RunPlan& plan, int64_t micro_batch, int threads, int dp, int64_t blocks) {
  std::vector<std::string> sets = {
      "parallel.pp=1", "parallel.vpp=1", "pipeline.schedule=\"1f1b\"", "parallel.dp=" + std::to_string(dp),
      "pipeline.first_chunk_layers=0", "pipeline.chunk_layers=[]",
      "pipeline.last_chunk_layers=0", "batch.micro_batch_size=" + std::to_string(micro_batch),
      "batch.global_batch_size=" + std::to_string(micro_batch * dp * kMeasuredMicrobatches),
      "optimizer.overlap_grad_reduce=false", "optimizer.overlap_param_gather=false",
      "device.threads=" + std::to_string(threads), "model.num_layers=" + std::to_string(blocks)};
  if (const int64_t recomputed = recomputed_blocks(plan); recomputed >= 0)
    sets.push_back("model.recompute_num_layers=" + std::to_string(recomputed >= blocks ? 0 : recomputed));
  else if (plan.config.model.recompute_num_layers > blocks)
    sets.push_back("model.recompute_num_layers=" + std::to_string(blocks));
  if (!plan.config.model.block_pattern.empty() && blocks < plan.config.model.num_layers)
    sets.push_back(measured_pattern(plan.config.model.block_pattern, blocks));
  if (plan.config.comm.options.contains("links")) sets.push_back("comm.options.links=\"\"");
  return sets;
}

// The blocks the measuring run holds: `asked`, else the model's, else (every rank
// holding every layer, a model that fits only split into pipeline stages) the most
// that fit its device; each probe is a plan, nothing runs.
int64_t measured_blocks(const RunPlan& plan, int64_t micro_batch, int threads, int dp, int64_t asked) {
  const int64_t all = plan.config.model.num_layers;
  // "block" recomputation of some blocks: a model of fewer blocks cannot hold that share.
  const manifest::RunConfig::Model& m = plan.config.model;
  const int64_t recomputed = recomputed_blocks(plan);
  const bool some_recomputed = recomputed > 0 && recomputed < all;
  const auto whole_only = [&](const std::string& why) {
    return loom::Error(why + ", and model.recompute_method = \"block\" recomputes " + std::to_string(recomputed) +
                       " of the " + std::to_string(all) + " blocks (" + std::to_string(m.recompute_num_layers) +
                       " of each pipeline chunk): a model of fewer blocks cannot measure that share; measure the whole "
                       "model where a device holds it, with --save-profile FILE, and estimate here with --profile FILE");
  };
  if (asked > 0 && asked < all && some_recomputed) throw whole_only("--measure-blocks " + std::to_string(asked));
  // A model of several kinds of block is measured with one of each at least.
  const int64_t fewest = std::max<int64_t>(1, static_cast<int64_t>(block_kinds(m.block_pattern).size()));
  if (asked > 0) {
    if (asked > all)
      throw loom::Error("measuring " + std::to_string(asked) + " transformer blocks: the model has " +
                        std::to_string(all));
    if (asked < fewest)
      throw loom::Error("measuring " + std::to_string(asked) + " transformer block(s): model.block_pattern places " +
                        std::to_string(fewest) + " kinds of block, and each is measured; measure at least " +
                        std::to_string(fewest));
    return asked;
  }
  auto problem = [&](int64_t blocks) {
    const RunPlan p = quiet_copy(plan, 1, measuring_sets(plan, micro_batch, threads, dp, blocks));
    return preflight(p, p.sizes.world).memory_problem;
  };
  const std::string whole = problem(all);
  if (whole.empty()) return all;
  if (some_recomputed) throw whole_only("measuring runs every layer on each rank and " + whole);
  const std::string one = problem(fewest);
  if (!one.empty())
    throw loom::Error("measuring the compute runs every layer on each rank (the pipeline stages folded into data "
                      "parallelism), and even with " +
                      (fewest == 1 ? std::string("one transformer block ")
                                   : std::to_string(fewest) + " transformer blocks (one of each kind) ") +
                      one + "; measure where a device holds more, with --save-profile FILE, and estimate here with "
                      "--profile FILE");
  int64_t fits = fewest, not_fit = all;  // the largest count that fits lies in [fits, not_fit)
  while (not_fit - fits > 1) {
    const int64_t mid = fits + (not_fit - fits) / 2;
    (problem(mid).empty() ? fits : not_fit) = mid;
  }
  return fits;
}

// Trains a copy of `plan` made by measuring_sets for kWarmupSteps + kMeasuredSteps
// steps and reads rank 0's timeline: the median of each phase over the steps after
// the warm-up.
PhaseTimes run_phases(const RunPlan& plan, int64_t micro_batch, int threads, int dp, int64_t blocks) {
  const RunPlan measured =
      quiet_copy(plan, kWarmupSteps + kMeasuredSteps, measuring_sets(plan, micro_batch, threads, dp, blocks));
  TrainOptions opts;
  opts.keep_trace = true;
  const TrainResult result = train(measured, opts);

  // Every rank's timeline in order; the steps after the warm-up, by optimizer step.
  std::map<int, std::vector<pipeline::TraceEvent>> by_rank;
  for (const pipeline::TraceEvent& e : result.trace)
    if (e.lane == pipeline::TraceLane::Rank) by_rank[e.rank].push_back(e);
  for (auto& [rank, events] : by_rank)
    std::sort(events.begin(), events.end(),
              [](const pipeline::TraceEvent& a, const pipeline::TraceEvent& b) { return a.start_us < b.start_us; });
  auto measured_step = [&](size_t step) { return step >= kWarmupSteps && step < result.steps.size(); };

  // Rank 0's phases per step.
  std::vector<double> forward, backward, optimizer, other;
  double fwd = 0, bwd = 0;
  size_t step = 0;
  for (const pipeline::TraceEvent& e : by_rank[0]) {
    if (e.category == "forward") fwd += e.dur_us * 1e-6;
    if (e.category == "backward") bwd += e.dur_us * 1e-6;
    if (e.category != "optimizer") continue;
    if (measured_step(step)) {
      forward.push_back(fwd);
      backward.push_back(bwd);
      optimizer.push_back(e.dur_us * 1e-6);
      other.push_back(std::max(0.0, result.steps[step].ms * 1e-3 - (fwd + bwd + e.dur_us * 1e-6)));
    }
    fwd = bwd = 0;
    ++step;
  }
  // The layers' collectives: each call's time on the rank that waited least for the
  // others (the last to arrive), which is the call's own work: a modelled link
  // replaces it, while the waiting belongs to the compute around it.
  std::map<std::pair<std::string, std::string>, std::map<int, std::vector<double>>> calls;  // (kind, op) -> rank -> times
  for (const auto& [rank, events] : by_rank) {
    size_t rank_step = 0;
    for (const pipeline::TraceEvent& e : events) {
      if (e.category == "optimizer") ++rank_step;
      if (e.category != "collective" || !measured_step(rank_step)) continue;
      const size_t space = e.name.find(' ');  // named "KIND OP"
      if (space == std::string::npos || engine_kind(e.name.substr(0, space))) continue;
      calls[{e.name.substr(0, space), e.name.substr(space + 1)}][rank].push_back(e.dur_us * 1e-6);
    }
  }
  CommSeconds comm_s;
  for (const auto& [key, ranks] : calls) {
    size_t n = SIZE_MAX;
    for (const auto& [rank, times] : ranks) n = std::min(n, times.size());
    double sum = 0;
    for (size_t j = 0; j < n; ++j) {
      double least = ranks.begin()->second[j];
      for (const auto& [rank, times] : ranks) least = std::min(least, times[j]);
      sum += least;
    }
    comm_s[key.first][key.second] = sum / kMeasuredSteps;
  }
  if (forward.empty()) throw loom::Error("loom plan --perf: the measuring run recorded no complete step");
  PhaseTimes t;
  t.forward_s = median(forward);
  t.backward_s = median(backward);
  t.optimizer_s = median(optimizer);
  t.other_s = median(other);
  for (const auto& [kind, ops] : result.steps.back().comm)
    if (!engine_kind(kind)) t.layer_comm[kind] = ops;
  t.layer_comm_s = std::move(comm_s);
  const MemoryPlan mp = plan_memory(measured);
  t.buffer_elements = mp.ranks.front().buffer_numel;
  return t;
}

// Fixed and proportional parts of a phase timed at microbatch b (full) and b/2 (half):
// time(b) = fixed + proportional.
std::pair<double, double> split_fixed(double full, double half) {
  const double proportional = std::clamp(2 * (full - half), 0.0, full);
  return {full - proportional, proportional};
}

std::string short_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

int64_t to_ns(double s) { return std::max<int64_t>(1, static_cast<int64_t>(std::llround(s * 1e9))); }

double ns_to_s(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

// The forward FLOPs of the ranks' layers, each value once (to a relative 1e-9), ascending.
std::vector<double> distinct_flops(const std::vector<const RankMemory*>& ranks) {
  std::vector<double> all;
  for (const RankMemory* r : ranks) all.insert(all.end(), r->layer_forward_flops().begin(), r->layer_forward_flops().end());
  std::sort(all.begin(), all.end());
  std::vector<double> out;
  for (double f : all)
    if (out.empty() || f - out.back() > 1e-9 * std::max(1.0, f)) out.push_back(f);
  return out;
}

std::string flops_list(const std::vector<double>& flops) {
  std::string s;
  for (double f : flops) s += (s.empty() ? "" : ", ") + short_number(f);
  return "{" + s + "}";
}

// Kind and size of the group a rank's data-parallel gradients reduce over (dense part).
std::pair<std::string, int> grad_group(const RunPlan& plan) {
  return plan.sizes.cp > 1 ? std::pair<std::string, int>{"dp-cp", plan.dp * plan.sizes.cp}
                           : std::pair<std::string, int>{"dp", plan.dp};
}

}  // namespace

double measure_step_s(const RunPlan& plan, int64_t steps, int64_t warmup, const std::string& links) {
  if (steps <= warmup) throw loom::Error("measuring a step needs more steps than the " + std::to_string(warmup) + " warm-up steps");
  std::vector<std::string> sets;
  if (!links.empty() && plan.config.comm.options.contains("links"))
    sets.push_back("comm.options.links=" + manifest::to_toml_text(toml::value<std::string>(links)));
  const TrainResult result = train(quiet_copy(plan, steps, sets), TrainOptions{});
  double sum = 0;
  int n = 0;
  for (const StepRecord& r : result.steps)
    if (r.step > warmup) sum += r.ms * 1e-3, ++n;
  if (n == 0) throw loom::Error("the measured run completed no step after its warm-up");
  return sum / n;
}

int threads_per_rank(const RunPlan& plan, int cores) {
  return plan.config.device.threads > 0 ? plan.config.device.threads : std::max(1, cores / plan.sizes.world);
}

LinkModel plan_links(const RunPlan& plan) {
  std::string text;
  if (const auto* v = plan.config.comm.options.get("links"); v != nullptr && v->is_string())
    text = v->value<std::string>().value_or("");
  try {
    return LinkModel::parse(text);
  } catch (const std::invalid_argument& e) {
    throw loom::Error(std::string("comm.options.links: ") + e.what());
  }
}


namespace {

// The ranks compute on this machine's cores: a host-memory device (device/cpu).
bool on_host_cores(const RunPlan& plan) {
  const loom_device_api* dev = plan.device != nullptr ? plan.device->device() : nullptr;
  return dev != nullptr && LOOM_HAS_SLOT(dev, loom_device_api, features) && (dev->features & LOOM_DEVICE_HOST_MEMORY) != 0;
}

}  // namespace

int64_t recomputed_blocks(const RunPlan& plan) {
  const manifest::RunConfig::Model& m = plan.config.model;
  if (m.recompute_granularity != "full" || m.recompute_method != "block") return -1;
  int64_t n = 0;
  for (const int chunk : plan.blocks_per_chunk)
    n += m.recompute_num_layers > 0 ? std::min<int64_t>(m.recompute_num_layers, chunk) : chunk;
  return n;
}

namespace {
const char* const kBlocksRecomputed = "blocks recomputed (model.recompute_method = block)";
}  // namespace

std::map<std::string, std::string> compute_settings(const RunPlan& plan) {
  static const std::set<std::string> kKeys = {
      "model.hidden_size",     "model.num_heads",          "model.ffn_hidden_size", "model.seq_length",
      "model.tie_embeddings",  "model.pre",                "model.block",           "model.post",
      "model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers", "device.param_dtype",
      "device.grad_dtype",
      "device.grad_accumulation_fusion", "exec.mode",     "batch.micro_batch_size", "parallel.sequence_parallel"};
  std::map<std::string, std::string> out;
  for (const manifest::Manifest::Entry& e : plan.manifest.entries())
    if (kKeys.count(e.key) > 0 || e.key.rfind(std::string(manifest::schema::kBlockTable) + ".", 0) == 0)
      out[e.key] = e.value;
  // Of some blocks, by pipeline chunk: the share recomputed depends on the layout, and
  // it alone decides (1 block of each of 2 stages costs what 2 blocks of 1 stage do).
  const int64_t recomputed = recomputed_blocks(plan);
  if (recomputed >= 0) {
    out.erase("model.recompute_num_layers");
    out[kBlocksRecomputed] = recomputed < plan.config.model.num_layers
                                 ? std::to_string(recomputed)
                                 : "all " + std::to_string(plan.config.model.num_layers);
  }
  // Each layer's options, as set or as its plugin declares them by default.
  const toml::table none;
  for (const model::LayerSpec& spec : plan.layers) {
    const std::string prefix = "model.layer." + spec.config + ".";
    if (out.count(prefix + "plugin") > 0) continue;
    out[prefix + "plugin"] = spec.plugin;
    const toml::table* set = plan.manifest.table().at_path("model.layer." + spec.config).as_table();
    for (const manifest::OptionDecl& d : plan.registry->get("layer", spec.plugin).options)
      out[prefix + d.name] = layer_option_text(set != nullptr ? *set : none, d);
  }
  return out;
}

ComputeProfile measure_compute(const RunPlan& plan, int threads, int64_t blocks) {
  const auto t0 = std::chrono::steady_clock::now();
  ComputeProfile p;
  p.device = plan.config.device.kind;
  p.tp = plan.sizes.tp;
  p.cp = plan.sizes.cp;
  // Ranks that share this machine's cores and memory (a host-memory device) slow each
  // other down: measure with as many running as the layout has, its pipeline stages
  // folded into dp. Ranks on devices of their own: one per (tp, cp) position, or the
  // dp that expert parallelism needs.
  p.dp = on_host_cores(plan) ? plan.sizes.world / (plan.sizes.tp * plan.sizes.cp) : std::max(1, plan.sizes.ep);
  p.threads = threads;
  p.micro_batch = plan.config.batch.micro_batch_size;
  p.microbatches = kMeasuredMicrobatches;
  p.model_blocks = plan.config.model.num_layers;
  p.model = compute_settings(plan);
  p.blocks = measured_blocks(plan, p.micro_batch, threads, p.dp, blocks);
  const PhaseTimes full = run_phases(plan, p.micro_batch, threads, p.dp, p.blocks);
  p.runs = 1;
  double f_fixed = 0, f_prop = full.forward_s, b_fixed = 0, b_prop = full.backward_s;
  if (p.micro_batch >= 2 && p.micro_batch % 2 == 0) {
    const PhaseTimes half = run_phases(plan, p.micro_batch / 2, threads, p.dp, p.blocks);
    std::tie(f_fixed, f_prop) = split_fixed(full.forward_s, half.forward_s);
    std::tie(b_fixed, b_prop) = split_fixed(full.backward_s, half.backward_s);
    p.runs = 2;
  }
  const double m = static_cast<double>(kMeasuredMicrobatches);
  p.forward_fixed_s = f_fixed / m;
  p.forward_flops_s = f_prop / m;
  p.backward_fixed_s = b_fixed / m;
  p.backward_flops_s = b_prop / m;
  p.optimizer_s = full.optimizer_s;
  p.buffer_elements = shards_optimizer_state(plan) ? full.buffer_elements / static_cast<size_t>(p.dp * p.cp) : full.buffer_elements;
  p.other_s = full.other_s;
  p.layer_comm = full.layer_comm;
  p.layer_comm_s = full.layer_comm_s;
  // The layers' FLOPs and count on one rank of the measured model (every layer).
  const MemoryPlan mp = plan_memory(quiet_copy(plan, 1, measuring_sets(plan, p.micro_batch, threads, p.dp, p.blocks)));
  const RankMemory& r = mp.ranks.front();
  for (size_t c = 0; c < r.chunk_layers().size(); ++c) {
    p.layers += r.chunk_layers()[c];
    p.layer_flops += r.chunk_forward_flops()[c];
  }
  p.distinct_layer_flops = distinct_flops({&r});
  p.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

namespace {

// Seconds of `calls` calls of `op` moving `bytes` in all (the engine's counters'
// logical bytes, comm_stats.hpp) among `p` ranks on `link`.
double op_seconds(const Link& link, const std::string& op, int p, double calls, double bytes) {
  if (calls <= 0 || p <= 1 || link.ideal()) return 0;
  const double per_call = bytes / calls;
  // The model takes the buffer (all-reduce, broadcast) or one member's piece.
  if (op == "all_reduce") return calls * collective_seconds(link, CollectiveKind::AllReduce, p, per_call);
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" || op == "all_to_all_v")
    return calls * collective_seconds(link, CollectiveKind::AllGather, p, per_call / p);
  if (op == "broadcast") return calls * collective_seconds(link, CollectiveKind::Broadcast, p, per_call);
  if (op == "barrier") return calls * collective_seconds(link, CollectiveKind::Barrier, p, 0);
  if (op == "send") return calls * link.transfer_s(per_call);
  return 0;
}

// Members of a group of `kind` in this layout; 0 when the layout has no such group.
int group_members(const topology::RankGroups& groups, const std::string& kind) {
  try {
    const std::vector<std::vector<int>>& all = groups.groups(kind);
    return all.empty() ? 0 : static_cast<int>(all.front().size());
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

std::vector<std::string> unmodelled_kinds(const RunPlan& plan, const ComputeProfile& profile, const LinkModel& links) {
  if (links.empty()) return {};
  const topology::RankGroups groups = topology::RankGroups::build(plan.sizes);
  std::set<std::string> used;
  for (const auto& [kind, ops] : profile.layer_comm) used.insert(kind);
  used.insert(grad_group(plan).first);
  if (plan.sizes.pp > 1) used.insert({"pp", "embedding"});
  if (plan.sizes.ep > 1) used.insert("edp");
  std::vector<std::string> out;
  for (const std::string& kind : used)
    if (group_members(groups, kind) > 1 && links.link(kind).ideal()) out.push_back(kind);
  return out;
}

double modelled_comm_seconds(const runtime::CommStats& stats, const LinkModel& links,
                             const topology::RankGroups& groups, const CommSeconds& measured) {
  double s = 0;
  for (const auto& [kind, ops] : stats) {
    const int p = group_members(groups, kind);
    for (const auto& [op, c] : ops) {
      const double modelled = op_seconds(links.link(kind), op, p, double(c.calls), double(c.bytes));
      double already = 0;
      if (auto k = measured.find(kind); k != measured.end())
        if (auto o = k->second.find(op); o != k->second.end()) already = o->second;
      s += std::max(0.0, modelled - already);
    }
  }
  return s;
}

nlohmann::ordered_json profile_to_json(const ComputeProfile& p) {
  nlohmann::ordered_json comm = nlohmann::ordered_json::object(), comm_s = nlohmann::ordered_json::object();
  for (const auto& [kind, ops] : p.layer_comm)
    for (const auto& [op, c] : ops) comm[kind][op] = {{"calls", c.calls}, {"elements", c.elements}, {"bytes", c.bytes}};
  for (const auto& [kind, ops] : p.layer_comm_s)
    for (const auto& [op, sec] : ops) comm_s[kind][op] = sec;
  return {{"loom_compute_profile", 1}, {"device", p.device}, {"tp", p.tp}, {"cp", p.cp}, {"dp", p.dp},
          {"threads", p.threads}, {"micro_batch", p.micro_batch}, {"microbatches", p.microbatches},
          {"forward_fixed_s", p.forward_fixed_s}, {"forward_flops_s", p.forward_flops_s},
          {"backward_fixed_s", p.backward_fixed_s}, {"backward_flops_s", p.backward_flops_s},
          {"layer_flops", p.layer_flops}, {"layers", p.layers}, {"blocks", p.blocks},
          {"model_blocks", p.model_blocks}, {"distinct_layer_flops", p.distinct_layer_flops}, {"model", p.model},
          {"optimizer_s", p.optimizer_s},
          {"buffer_elements", p.buffer_elements}, {"other_s", p.other_s}, {"layer_comm", comm},
          {"layer_comm_s", comm_s}, {"runs", p.runs}, {"wall_s", p.wall_s}};
}

ComputeProfile profile_from_json(const nlohmann::ordered_json& j) {
  if (!j.is_object() || j.value("loom_compute_profile", 0) != 1)
    throw loom::Error("not a loom compute profile (written by loom plan --perf --save-profile)");
  auto field = [&](const char* name) -> const nlohmann::ordered_json& {
    if (!j.contains(name)) throw loom::Error(std::string("compute profile: no \"") + name + "\"");
    return j.at(name);
  };
  auto number = [&](const char* name, double lo) {
    const nlohmann::ordered_json& v = field(name);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo)
      throw loom::Error(std::string("compute profile: \"") + name + "\" must be a number >= " + short_number(lo));
    return v.get<double>();
  };
  // Times of one microbatch or step: beyond a day is a file edited by hand, not a measurement.
  auto seconds = [&](const char* name) {
    const double v = number(name, 0);
    if (v > 86400) throw loom::Error(std::string("compute profile: \"") + name + "\" is " + short_number(v) +
                                     " s, beyond any measured step");
    return v;
  };
  // Counts within what a manifest allows (the schema's bounds), so they fit an int.
  auto count = [&](const char* name, double lo, double hi) {
    const double v = number(name, lo);
    if (v != std::floor(v) || v > hi)
      throw loom::Error(std::string("compute profile: \"") + name + "\" must be a whole number from " +
                        std::to_string(static_cast<long long>(lo)) + " to " + std::to_string(static_cast<long long>(hi)) +
                        ", not " + short_number(v));
    return static_cast<int64_t>(v);
  };
  constexpr double kRanks = 1 << 20, kThreads = 4096, kLayers = 1 << 16, kBatch = 1 << 30;
  ComputeProfile p;
  if (!field("device").is_string()) throw loom::Error("compute profile: \"device\" must be a string");
  p.device = j.at("device").get<std::string>();
  p.tp = static_cast<int>(count("tp", 1, kRanks));
  p.cp = static_cast<int>(count("cp", 1, kRanks));
  p.dp = static_cast<int>(count("dp", 1, kRanks));
  p.threads = static_cast<int>(count("threads", 1, kThreads));
  p.micro_batch = count("micro_batch", 1, kBatch);
  p.microbatches = count("microbatches", 1, kBatch);
  p.forward_fixed_s = seconds("forward_fixed_s");
  p.forward_flops_s = seconds("forward_flops_s");
  p.backward_fixed_s = seconds("backward_fixed_s");
  p.backward_flops_s = seconds("backward_flops_s");
  p.layer_flops = number("layer_flops", 0);
  p.layers = static_cast<int>(count("layers", 1, 1 << 24));
  if (j.contains("distinct_layer_flops")) {  // absent from profiles written before
    p.blocks = count("blocks", 1, kLayers);
    p.model_blocks = count("model_blocks", 1, kLayers);
    const nlohmann::ordered_json& d = j.at("distinct_layer_flops");
    if (!d.is_array() || d.empty()) throw loom::Error("compute profile: \"distinct_layer_flops\" must be a list of numbers");
    for (const auto& f : d) {
      if (!f.is_number() || !std::isfinite(f.get<double>()) || f.get<double>() < 0)
        throw loom::Error("compute profile: \"distinct_layer_flops\" must be a list of numbers >= 0");
      p.distinct_layer_flops.push_back(f.get<double>());
    }
    // Every kind of layer is among the measured model's at least once, the rest at most
    // the largest kind; its blocks are at most its model's.
    std::sort(p.distinct_layer_flops.begin(), p.distinct_layer_flops.end());
    const int kinds = static_cast<int>(p.distinct_layer_flops.size());
    double lo = 0;
    for (double f : p.distinct_layer_flops) lo += f;
    const double hi = lo + std::max(0, p.layers - kinds) * p.distinct_layer_flops.back();
    if (p.layers < kinds || p.layer_flops < lo * (1 - 1e-9) || p.layer_flops > hi * (1 + 1e-9))
      throw loom::Error("compute profile: \"layer_flops\" (" + short_number(p.layer_flops) + ") is not what " +
                        std::to_string(p.layers) + " layers of the FLOPs in \"distinct_layer_flops\" add up to");
    if (p.blocks > p.model_blocks) throw loom::Error("compute profile: \"blocks\" is more than \"model_blocks\"");
  }
  if (j.contains("model")) {  // absent from profiles written before
    const nlohmann::ordered_json& m = j.at("model");
    if (!m.is_object()) throw loom::Error("compute profile: \"model\" must be an object of settings");
    for (const auto& [key, value] : m.items()) {
      if (!value.is_string()) throw loom::Error("compute profile: \"model\"." + key + " must be a string");
      p.model[key] = value.get<std::string>();
    }
  }
  p.optimizer_s = seconds("optimizer_s");
  p.buffer_elements = static_cast<size_t>(count("buffer_elements", 0, 281474976710656.0));
  p.other_s = seconds("other_s");
  p.runs = static_cast<int>(count("runs", 0, kRanks));
  p.wall_s = number("wall_s", 0);
  const nlohmann::ordered_json& comm = field("layer_comm");
  const nlohmann::ordered_json& comm_s = field("layer_comm_s");
  if (!comm.is_object() || !comm_s.is_object()) throw loom::Error("compute profile: layer_comm must be objects");
  for (const auto& [kind, ops] : comm.items()) {
    if (!ops.is_object()) throw loom::Error("compute profile: layer_comm." + kind + " must be an object");
    for (const auto& [op, c] : ops.items()) {
      runtime::CommCounter& k = p.layer_comm[kind][op];
      for (const char* f : {"calls", "elements", "bytes"})
        if (!c.is_object() || !c.contains(f) || !c.at(f).is_number_unsigned())
          throw loom::Error("compute profile: layer_comm." + kind + "." + op + "." + f + " must be a count");
      k.calls = c.at("calls").get<uint64_t>();
      k.elements = c.at("elements").get<uint64_t>();
      k.bytes = c.at("bytes").get<uint64_t>();
    }
  }
  for (const auto& [kind, ops] : comm_s.items()) {
    if (!ops.is_object()) throw loom::Error("compute profile: layer_comm_s." + kind + " must be an object");
    for (const auto& [op, sec] : ops.items()) {
      if (!sec.is_number() || !std::isfinite(sec.get<double>()) || sec.get<double>() < 0)
        throw loom::Error("compute profile: layer_comm_s." + kind + "." + op + " must be seconds >= 0");
      p.layer_comm_s[kind][op] = sec.get<double>();
    }
  }
  return p;
}

PerfEstimate estimate_step(const RunPlan& plan, const MemoryPlan& mp, const ComputeProfile& profile,
                           const LinkModel& links, int cores) {
  PerfEstimate out;
  const manifest::RunConfig& config = plan.config;
  const topology::RankGroups groups = topology::RankGroups::build(plan.sizes);
  const int pp = plan.sizes.pp, vpp = plan.orders.vpp > 0 ? plan.orders.vpp : 1;
  const int64_t m = plan.microbatches;
  out.cores = std::max(1, cores);
  out.threads = threads_per_rank(plan, out.cores);
  if (profile.tp != plan.sizes.tp || profile.cp != plan.sizes.cp)
    throw loom::Error("the compute profile was measured at tp " + std::to_string(profile.tp) + ", cp " +
                      std::to_string(profile.cp) + "; this layout has tp " + std::to_string(plan.sizes.tp) + ", cp " +
                      std::to_string(plan.sizes.cp));
  if (profile.device != plan.config.device.kind)
    throw loom::Error("the compute profile was measured on device " + profile.device + "; this manifest runs on " +
                      plan.config.device.kind);

  // Each stage's rank with tp, cp and dp rank 0 (the others are alike).
  std::vector<const RankMemory*> stage(static_cast<size_t>(pp), nullptr);
  for (const RankMemory& r : mp.ranks)
    if (r.tp_rank == 0 && r.cp_rank == 0 && r.dp_rank == 0 && stage[static_cast<size_t>(r.pp_rank)] == nullptr)
      stage[static_cast<size_t>(r.pp_rank)] = &r;

  // The same model: every stage's layers and FLOPs (per rank at this tp and cp).
  double plan_flops = 0;
  int plan_layers = 0;
  for (const RankMemory* r : stage) {
    if (r == nullptr) throw loom::Error("the memory plan has no rank for a pipeline stage");
    for (size_t c = 0; c < r->chunk_layers().size(); ++c) plan_layers += r->chunk_layers()[c], plan_flops += r->chunk_forward_flops()[c];
  }
  // The settings that decide a layer's time besides its FLOPs, as measured.
  if (!profile.model.empty()) {
    const std::map<std::string, std::string> now = compute_settings(plan);
    // Profiles of block recomputation saved before the blocks recomputed were kept
    // hold the count per chunk only.
    const auto measured = [&](const std::string& key) {
      const auto it = profile.model.find(key);
      return it != profile.model.end() ? it->second : std::string();
    };
    if (now.count(kBlocksRecomputed) > 0 && profile.model.count(kBlocksRecomputed) == 0 &&
        measured("model.recompute_granularity") == "\"full\"" && measured("model.recompute_method") == "\"block\"")
      throw loom::Error("the compute profile was saved by an earlier loom, which did not keep the blocks "
                        "recomputed over all pipeline chunks (model.recompute_method = block): measure this model again");
    for (const auto& [key, measured] : profile.model) {
      // Kept beside the count by profiles of an earlier loom; the count decides.
      if (key == "model.recompute_num_layers" && now.count(kBlocksRecomputed) > 0) continue;
      const auto it = now.find(key);
      const std::string here = it != now.end() ? it->second : "(none)";
      if (here != measured)
        throw loom::Error("the compute profile is of another model: it was measured with " + key + " = " + measured +
                          ", this run has " + here + " (its time per layer differs): measure this model");
    }
    for (const auto& [key, value] : now)
      if (profile.model.count(key) == 0)
        throw loom::Error("the compute profile is of another model: it was measured without " + key +
                          ", this run has " + key + " = " + value + ": measure this model");
  }
  // Layers of the FLOPs measured (a profile of fewer blocks costs each layer by its
  // FLOPs); a profile without its layers' FLOPs must be of the whole model.
  if (!profile.distinct_layer_flops.empty()) {
    const std::vector<double> planned = distinct_flops(stage);
    bool same = planned.size() == profile.distinct_layer_flops.size();
    for (size_t i = 0; same && i < planned.size(); ++i)
      same = std::abs(planned[i] - profile.distinct_layer_flops[i]) <= 1e-9 * std::max(1.0, planned[i]);
    if (!same)
      throw loom::Error("the compute profile is of another model or micro-batch: its layers' forward FLOPs per "
                        "microbatch are " + flops_list(profile.distinct_layer_flops) + "; this one's " +
                        flops_list(planned));
  } else if (plan_layers != profile.layers ||
             std::abs(plan_flops - profile.layer_flops) > 1e-9 * std::max(1.0, plan_flops)) {
    throw loom::Error("the compute profile is of another model or micro-batch: " + std::to_string(profile.layers) +
                      " layers of " + short_number(profile.layer_flops) + " forward FLOPs per microbatch; this one has " +
                      std::to_string(plan_layers) + " of " + short_number(plan_flops));
  }

  // The layers' collectives of one microbatch on their links, shared out by layer.
  // comm/local makes a collective last at least its modelled time: what the links add
  // to the layers' collectives is the model's time beyond the measured one.
  const double layer_comm_mb = modelled_comm_seconds(profile.layer_comm, links, groups, profile.layer_comm_s) /
                               static_cast<double>(std::max<int64_t>(1, profile.microbatches));
  const double layers = std::max(1, profile.layers), flops = profile.layer_flops;
  // Contention applies to the two parts apart (see below): `busy` to the part in
  // proportion to FLOPs, `all` to the part fixed per layer.
  struct Contention {
    double all = 1, busy = 1;
  };
  auto chunk_time = [&](const RankMemory& r, size_t c, bool forward, Contention contention) {
    const double fixed = forward ? profile.forward_fixed_s : profile.backward_fixed_s;
    const double prop = forward ? profile.forward_flops_s : profile.backward_flops_s;
    const double share = flops > 0 ? r.chunk_forward_flops()[c] / flops : r.chunk_layers()[c] / layers;
    const double compute =
        contention.all * fixed * r.chunk_layers()[c] / layers + contention.busy * out.thread_scale * prop * share;
    return std::pair<double, double>{compute + 0.5 * layer_comm_mb * r.chunk_layers()[c] / layers,
                                     0.5 * layer_comm_mb * r.chunk_layers()[c] / layers};
  };

  // A rank's arithmetic spreads over its threads: a profile measured with other threads
  // per rank (another world size on these cores) scales the FLOP-proportional part.
  if (on_host_cores(plan)) out.thread_scale = static_cast<double>(std::max(1, profile.threads)) / out.threads;
  // Ranks share the cores: busy threads over cores, relative to the measuring run.
  const double measured_load = static_cast<double>(profile.tp * profile.cp * profile.dp * profile.threads);
  auto contention_at = [&](double busy_ranks) {
    const double load = busy_ranks * out.threads;
    return std::max(1.0, load / out.cores) / std::max(1.0, measured_load / out.cores);
  };

  // The pipeline: every stage's order with these chunk times (one stage: in sequence).
  struct StageRun {
    double end = 0, busy = 0, forward = 0, backward = 0, comm = 0;
    double last_backward_start = 0, last_backward_end = 0, first_forward = 0;
  };
  auto play = [&](Contention contention) {
    std::vector<StageRun> runs(static_cast<size_t>(pp));
    if (pp == 1) {
      StageRun& s = runs[0];
      for (size_t c = 0; c < stage[0]->chunk_layers().size(); ++c) {
        const auto [f, fc] = chunk_time(*stage[0], c, true, contention);
        const auto [b, bc] = chunk_time(*stage[0], c, false, contention);
        s.forward += f * m;
        s.backward += b * m;
        s.comm += (fc + bc) * m;
        s.first_forward += f;
        s.last_backward_start = s.forward + s.backward - b;
      }
      s.busy = s.end = s.forward + s.backward;
      s.last_backward_end = s.end;
      return runs;
    }
    pipeline::SimCosts costs;
    const int g_count = pp * vpp;
    costs.forward_of.resize(static_cast<size_t>(g_count));
    costs.backward_of.resize(static_cast<size_t>(g_count));
    std::vector<double> comm_of(static_cast<size_t>(g_count), 0);
    for (int g = 0; g < g_count; ++g) {
      const RankMemory& r = *stage[static_cast<size_t>(g % pp)];
      const size_t c = static_cast<size_t>(g / pp);
      const auto [f, fc] = chunk_time(r, c, true, contention);
      const auto [b, bc] = chunk_time(r, c, false, contention);
      costs.forward_of[static_cast<size_t>(g)] = to_ns(f);
      costs.backward_of[static_cast<size_t>(g)] = to_ns(b);
      comm_of[static_cast<size_t>(g)] = fc + bc;
    }
    costs.transfer = static_cast<int64_t>(std::llround(links.link("pp").transfer_s(double(mp.hidden_state_bytes)) * 1e9));
    // Where the comm plugin can start a receive (comm/local, comm/nccl; comm/mpi
    // receives when needed).
    const loom_comm_api* comm = plan.comm != nullptr ? plan.comm->comm() : nullptr;
    costs.receives_posted_early = plan.config.pipeline.overlap_p2p_comm && comm != nullptr &&
                                  LOOM_HAS_SLOT(comm, loom_comm_api, features) &&
                                  (comm->features & LOOM_COMM_START_P2P) != 0;
    const pipeline::Timeline t = pipeline::simulate(plan.orders, costs);
    for (int r = 0; r < pp; ++r) {
      StageRun& s = runs[static_cast<size_t>(r)];
      bool first = true;
      for (const pipeline::TimedStep& st : t.ranks[static_cast<size_t>(r)]) {
        const double d = ns_to_s(st.duration);
        (st.forward ? s.forward : s.backward) += d;
        if (st.forward && first) s.first_forward = d, first = false;
        if (!st.forward) s.comm += comm_of[static_cast<size_t>(st.global_chunk)];
        if (!st.forward) s.last_backward_start = ns_to_s(st.start), s.last_backward_end = ns_to_s(st.start + st.duration);
        s.end = std::max(s.end, ns_to_s(st.start + st.duration));
      }
      s.busy = s.forward + s.backward;
    }
    return runs;
  };
  const double world = plan.sizes.world;
  out.contention = contention_at(world);
  std::vector<StageRun> runs = play({out.contention, out.contention});
  if (pp > 1) {
    // Fewer ranks compute at once while the pipeline fills and drains, and the cores
    // they leave speed up arithmetic (the FLOP-proportional part); the part fixed per
    // layer (launches, wake-ups, small ops) is latency that idle cores do not shorten
    // (measured: with it relieved too, a latency-bound pp 4 on 2 cores came out at 0.68
    // of its measured step, a compute-bound one at 0.93).
    double busy = 0, span = 0;
    for (const StageRun& s : runs) busy += s.busy, span = std::max(span, s.end);
    const double utilisation = span > 0 ? busy / (pp * span) : 1;
    const double all = out.contention;
    out.contention = contention_at(world * utilisation);
    runs = play({all, out.contention});
  }

  const size_t gsize = loom::dtype_size(model::model_dtype(config.device.grad_dtype));
  const size_t psize = loom::dtype_size(model::model_dtype(config.device.param_dtype));
  const bool distributed = shards_optimizer_state(plan);
  const auto [dense_kind, dense_members] = grad_group(plan);
  const int edp = groups.edp();
  const double per_element = profile.buffer_elements > 0 ? profile.optimizer_s / double(profile.buffer_elements) : 0;
  auto small_reduce = [&](const std::string& kind, int members) {
    return collective_seconds(links.link(kind), CollectiveKind::AllReduce, members, 16);
  };
  // Per step: the stop flag (world), the loss (pp, dp) and the gradient norm (tp, pp).
  const double bookkeeping = small_reduce("world", plan.sizes.world) + 2 * small_reduce("pp", pp) +
                             small_reduce("dp", plan.dp) + small_reduce("tp", plan.sizes.tp) + profile.other_s;

  for (int s = 0; s < pp; ++s) {
    const RankMemory& r = *stage[static_cast<size_t>(s)];
    const StageRun& run = runs[static_cast<size_t>(s)];
    StageEstimate e;
    e.stage = s;
    e.forward_s = run.forward;
    e.backward_s = run.backward;
    e.layer_comm_s = run.comm;
    e.pipeline_wait_s = std::max(0.0, run.end - run.busy);
    double t = run.end;
    if (pp > 1 && r.tied_numel > 0) {
      e.embedding_s = collective_seconds(links.link("embedding"), CollectiveKind::AllReduce, 2, double(r.tied_numel * gsize));
      t += e.embedding_s;
    }
    // Gradient buckets: reduced in line after the backward, or each as soon as the
    // last microbatch's backward has produced it (the buffer holds the model in reverse).
    const double total = std::max<size_t>(1, r.buffer_numel);
    double comm_free = config.optimizer.overlap_grad_reduce ? 0 : t;
    double gather = 0;
    for (const model::Range& b : r.layout().buckets) {
      const bool expert = b.start >= r.expert_start;
      const std::string kind = expert ? "edp" : dense_kind;
      const int members = expert ? edp : dense_members;
      if (members <= 1) continue;
      const double bytes = double(b.size()) * double(gsize);
      const double cost = distributed
                              ? collective_seconds(links.link(kind), CollectiveKind::ReduceScatter, members, bytes / members)
                              : collective_seconds(links.link(kind), CollectiveKind::AllReduce, members, bytes);
      const double ready = config.optimizer.overlap_grad_reduce
                               ? run.last_backward_start +
                                     double(b.end) / total * (run.last_backward_end - run.last_backward_start)
                               : t;
      comm_free = std::max(comm_free, ready) + cost;
      e.grad_reduce_s += cost;
      if (distributed)
        gather += collective_seconds(links.link(kind), CollectiveKind::AllGather, members,
                                     double(b.size()) * double(psize) / members);
    }
    e.grad_reduce_exposed_s = std::max(0.0, comm_free - t);
    t = std::max(t, comm_free);
    const size_t stepped = distributed ? r.expert_start / static_cast<size_t>(dense_members) +
                                             (r.buffer_numel - r.expert_start) / static_cast<size_t>(std::max(1, edp))
                                       : r.buffer_numel;
    e.optimizer_s = per_element * double(stepped) * out.contention;
    e.param_gather_s = gather;
    // With overlap_param_gather the next step's first forward of the stage covers the
    // gathers but the first bucket's.
    const size_t nb = std::max<size_t>(1, r.layout().buckets.size());
    e.param_gather_exposed_s =
        config.optimizer.overlap_param_gather ? std::max(gather / nb, gather - run.first_forward) : gather;
    e.bookkeeping_s = bookkeeping;
    e.step_s = t + e.optimizer_s + e.param_gather_exposed_s + e.bookkeeping_s;
    out.step_s = std::max(out.step_s, e.step_s);
    out.stages.push_back(e);
  }

  // Only a profile's times out of any range (a file edited by hand) overflow.
  if (!std::isfinite(out.step_s))
    throw loom::Error("the step-time estimate overflows: the compute profile's times are out of range");
  const double tokens = double(config.batch.global_batch_size) * double(config.model.seq_length);
  out.tokens_per_s = out.step_s > 0 ? tokens / out.step_s : 0;
  double step_flops = 0;
  for (const RankMemory& r : mp.ranks)
    for (double f : r.chunk_forward_flops()) step_flops += 3.0 * f * double(m);
  out.flops_per_step = step_flops;
  if (config.device.peak_tflops > 0 && out.step_s > 0)
    out.mfu = step_flops / out.step_s / (config.device.peak_tflops * 1e12 * world);
  if (links.empty()) out.notes.push_back("no links given: collectives cost nothing (set comm.options.links or --links)");
  return out;
}

}  // namespace loom::train
