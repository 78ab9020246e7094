// loom plan MANIFEST [--set key=value]... [--json]
// Per-rank memory from the layer plugins' declarations alone: parameters,
// gradients, optimizer state and an activation estimate, without running the
// model or allocating parameter memory.
#include "engine/cli/args.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/cli/report.hpp"
#include "engine/files/read.hpp"
#include "engine/files/temporaries.hpp"
#include "engine/model/param_plan.hpp"
#include "engine/runtime/json.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/layout_search.hpp"
#include "engine/train/perf_model.hpp"
#include "engine/train/preflight.hpp"
#include "engine/train/run_plan.hpp"
#include "engine/topology/rank_groups.hpp"

#include <boost/filesystem.hpp>

#include <cstdio>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <optional>
#include <iostream>
#include <map>
#include <set>
#include <string>

namespace loom::cli {
int cmd_plan(int argc, char** argv);
}  // namespace loom::cli

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom plan MANIFEST [--set key.path=value]... [--json]\n"
    "                          [--perf [--links SPEC] [--profile FILE | --save-profile FILE]\n"
    "                                  [--measure-blocks N]\n"
    "                                  [--check STEPS | --search [--world N]]]\n"
    "Plans each rank's memory from the layer plugins' parameter declarations, without\n"
    "running the model: parameters and gradients (device.param_dtype / grad_dtype, flat\n"
    "buffers with Megatron's padding), optimizer state (optimizer.strategy: ddp keeps it\n"
    "whole, distributed shards it over dp) and an activation estimate per microbatch.\n"
    "  --perf     estimate the step time instead: the model's compute is measured on this\n"
    "             machine's device (2 x 8 steps at the layout's tp and cp, the pipeline's\n"
    "             stages folded into dp; on a CPU with as many ranks as the layout has),\n"
    "             communication is modelled on the links (comm.options.links, or --links),\n"
    "             the pipeline schedule played out, gradient reduction and parameter\n"
    "             gathers overlapped as optimizer.overlap_* say. A model that fits only\n"
    "             split into pipeline stages is measured with the most of its transformer\n"
    "             blocks that fit, each layer then costed by its FLOPs\n"
    "  --measure-blocks  measure a model of N of the manifest's transformer blocks (its\n"
    "             shapes, fewer layers) and cost the rest by their FLOPs: a deep model\n"
    "             measured sooner\n"
    "  --links    the network to model, e.g. \"tp=450GB/s,2us; dp=25GB/s,10us; *=12.5GB/s,10us\"\n"
    "  --check    then run the manifest for STEPS (5 or more) steps, on --links when given\n"
    "             and the comm plugin models links, writing nothing, and print the\n"
    "             measured step time beside the estimate\n"
    "  --search   rank every layout (tp x cp x pp x dp; with and without sequence\n"
    "             parallelism; pipelines 1F1B or interleaved over 2 virtual stages) of the\n"
    "             world size that the model can run and that fits the device's memory by\n"
    "             estimated step time (the rest as the manifest says)\n"
    "  --world    the world size to search (default: the manifest's)\n"
    "  --save-profile  write the measured compute to FILE (JSON)\n"
    "  --profile  estimate from FILE instead of measuring: compute measured elsewhere (a GPU\n"
    "             node) for the same model, device, tp and cp, with other links, dp, pp or\n"
    "             overlap settings; --search then ranks the layouts of that tp and cp\n";

// The blocks each pipeline chunk holds, for balancing stages of unlike blocks
// (pipeline.chunk_layers): "chunk 0 (stage 0): blocks 0-1, dense x 1, block x 1".
std::string chunk_blocks_text(const train::RunPlan& plan) {
  const int pp = plan.sizes.pp;
  std::string out;
  int first = 0;
  for (size_t g = 0; g < plan.blocks_per_chunk.size(); ++g) {
    const int n = plan.blocks_per_chunk[g];
    out += "\n    chunk " + std::to_string(g) + " (stage " + std::to_string(static_cast<int>(g) % pp) + "): ";
    if (n == 0) out += "no blocks";
    else out += n == 1 ? "block " + std::to_string(first) : "blocks " + std::to_string(first) + "-" + std::to_string(first + n - 1);
    std::vector<std::pair<std::string, int>> runs;  // the kinds in order, "block" = model.block
    for (int b = first; b < first + n; ++b) {
      const auto& pattern = plan.config.model.block_pattern;
      const std::string kind = pattern.empty() ? std::string("block") : pattern[static_cast<size_t>(b)];
      if (!runs.empty() && runs.back().first == kind) ++runs.back().second;
      else runs.emplace_back(kind, 1);
    }
    for (const auto& [kind, count] : runs) out += ", " + kind + " x " + std::to_string(count);
    first += n;
  }
  return out;
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string cell(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : std::string(width - s.size(), ' ') + s + " ";
}

std::string ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", s * 1e3);
  return buf;
}

// The network to model: --links (a usage error when it does not parse) or the
// manifest's comm.options.links.
LinkModel links_of(const Args& args, const train::RunPlan& plan) {
  const std::optional<std::string> spec = args.get("--links");
  if (!spec) return train::plan_links(plan);
  if (spec->find_first_not_of(" \t;") == std::string::npos)
    throw UsageError("--links needs a spec such as \"dp=25GB/s,10us; *=100GB/s,2us\"");
  try {
    return LinkModel::parse(*spec);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--links: ") + e.what());
  }
}

// The notes every estimate prints: links left out, how the layers' comm is shown.
std::vector<std::string> perf_notes(const train::RunPlan& plan, const train::ComputeProfile& profile,
                                    const LinkModel& links, std::vector<std::string> notes) {
  const std::vector<std::string> free = train::unmodelled_kinds(plan, profile, links);
  if (!free.empty()) {
    std::string kinds;
    for (const std::string& k : free) kinds += (kinds.empty() ? "" : ", ") + k;
    notes.push_back("no link for " + kinds + " (and no \"*\"): their collectives cost nothing in the estimate");
  }
  return notes;
}

// The compute measured on this machine, or an error that says how to estimate without it.
train::ComputeProfile measure_here(const train::RunPlan& plan, int threads, int64_t blocks) {
  try {
    return train::measure_compute(plan, threads, blocks);
  } catch (const std::exception& e) {
    const std::string why = runtime::error_message(e);
    throw loom::Error("measuring the model's compute on " + plan.config.device.kind + " here failed: " + why +
                      (why.find("--profile") != std::string::npos
                           ? ""
                           : " (measure where the device is, with --save-profile FILE, and estimate from it here "
                             "with --profile FILE)"));
  }
}

// --profile FILE: a profile written by --save-profile.
std::optional<train::ComputeProfile> read_profile(const Args& args) {
  const std::optional<std::string> path = args.get("--profile");
  if (!path) return std::nullopt;
  if (boost::filesystem::is_directory(*path))
    throw loom::Error("--profile " + *path + " is a directory; give the file --save-profile wrote");
  std::string why;
  const std::optional<std::string> text = files::read_whole_file(*path, &why, files::Pipes::Allow);
  if (!text) throw loom::Error("--profile " + *path + ": cannot read the file (" + why + ")");
  try {
    return train::profile_from_json(nlohmann::ordered_json::parse(*text));
  } catch (const nlohmann::json::exception& e) {
    throw loom::Error("--profile " + *path + ": not JSON (" + e.what() + ")");
  } catch (const loom::Error& e) {
    throw loom::Error("--profile " + *path + ": " + e.what());
  }
}

// --save-profile FILE: written whole or not at all (a temporary file renamed).
void save_profile(const Args& args, const train::ComputeProfile& p) {
  const std::optional<std::string> path = args.get("--save-profile");
  if (!path) return;
  files::WholeFile file(*path);
  {
    std::ofstream out(file.path(), file.mode());
    out << runtime::dump_json(train::profile_to_json(p)) << "\n";
    if (!out.flush()) throw loom::Error("--save-profile " + *path + ": cannot write " + file.path());
  }
  if (!file.commit()) throw loom::Error("--save-profile " + *path + ": cannot rename " + file.path() + " to it");
}

// loom plan --perf --search: the layouts ranked.
// --search --world W replaces the manifest's layout with each candidate's: a manifest
// whose own layout cannot be (ep = 4 over dp = 2) still names the model, planned at
// tp = cp = pp = 1 and dp = W when as written it is refused.
// Only a refusal of the layout alone (every problem on a parallel.* or pipeline.* key)
// is set aside; any other, or one the neutral layout meets too, is the manifest's.
train::RunPlan search_base(const Args& args) {
  std::vector<std::string> sets = args.all("--set");
  try {
    return train::make_plan(manifest::Manifest::load(args.positionals()[0], sets), plugins::registry());
  } catch (const manifest::ManifestError& e) {
    for (const manifest::Diagnostic& d : e.diagnostics())
      if (d.key.rfind("parallel.", 0) != 0 && d.key.rfind("pipeline.", 0) != 0) throw;
    const long long world = args.get_int("--world", 1);
    sets.insert(sets.end(), {"parallel.tp=1", "parallel.cp=1", "parallel.pp=1", "parallel.vpp=1",
                             "parallel.dp=" + std::to_string(world), "parallel.sequence_parallel=false",
                             "pipeline.first_chunk_layers=0", "pipeline.last_chunk_layers=0", "pipeline.chunk_layers=[]",
                             "pipeline.schedule=\"1f1b\""});
    try {
      return train::make_plan(manifest::Manifest::load(args.positionals()[0], sets), plugins::registry());
    } catch (const std::exception&) {
      throw e;
    }
  }
}

int print_search(const Args& args, const train::RunPlan& plan, bool json) {
  const long long asked = args.get_int("--world", plan.sizes.world);
  if (asked < 1 || asked > topology::kMaxWorld)
    throw UsageError("--world must be between 1 and " + std::to_string(topology::kMaxWorld) + ", got " + std::to_string(asked));
  const int world = static_cast<int>(asked);
  const LinkModel links = links_of(args, plan);
  auto progress = [json](const std::string& what) {
    if (!json) std::cout << what << " ..." << std::endl;
  };
  const std::optional<train::ComputeProfile> given = read_profile(args);
  const train::LayoutSearch found =
      train::search_layouts(plan, world, links, runtime::usable_cores(), progress, given ? &*given : nullptr,
                            args.get_int("--measure-blocks", 0));
  if (json) {
    using nlohmann::ordered_json;
    auto row = [](const train::LayoutChoice& c) {
      ordered_json r = {{"tp", c.tp}, {"sequence_parallel", c.sp}, {"cp", c.cp}, {"pp", c.pp}, {"vpp", c.vpp},
                        {"dp", c.dp}, {"overrides", c.overrides}};
      if (!c.refused.empty()) r["refused"] = c.refused;
      else
        r.update({{"step_ms", c.estimate.step_s * 1e3}, {"tokens_per_s", c.estimate.tokens_per_s},
                  {"mfu", c.estimate.mfu}, {"most_bytes", c.most_bytes}});
      return r;
    };
    ordered_json ranked = ordered_json::array(), refused = ordered_json::array();
    for (const train::LayoutChoice& c : found.ranked) ranked.push_back(row(c));
    for (const train::LayoutChoice& c : found.refused) refused.push_back(row(c));
    std::cout << runtime::dump_json({{"world", world}, {"ranked", ranked}, {"refused", refused}}) << "\n";
    if (found.ranked.empty()) std::cerr << "loom plan: no layout of " << world << " rank(s) can run this model\n";
    return found.ranked.empty() ? 1 : 0;
  }
  std::cout << "\nlayouts of " << world << " rank(s) for " << args.positionals()[0] << ", fastest first ("
            << found.profiles << " compute measurement(s)):\n"
            << cell("#", 3) << cell("layout", 34) << cell("step ms", 10) << cell("tokens/s", 11)
            << cell("compute ms", 11) << cell("exposed comm ms", 16) << cell("pipe wait ms", 13) << cell("MiB/rank", 10)
            << "\n";
  int n = 0;
  for (const train::LayoutChoice& c : found.ranked) {
    // The slowest stage sets the step: show its parts.
    const train::StageEstimate* s = &c.estimate.stages.front();
    for (const train::StageEstimate& e : c.estimate.stages)
      if (e.step_s > s->step_s) s = &e;
    char tok[32];
    std::snprintf(tok, sizeof(tok), "%.0f", c.estimate.tokens_per_s);
    std::cout << cell(std::to_string(++n), 3) << cell(c.name(), 34) << cell(ms(c.estimate.step_s), 10) << cell(tok, 11)
              << cell(ms(s->forward_s + s->backward_s), 11)
              << cell(ms(s->embedding_s + s->grad_reduce_exposed_s + s->param_gather_exposed_s), 16)
              << cell(ms(s->pipeline_wait_s), 13) << cell(mib(c.most_bytes), 10) << "\n";
  }
  // Every refusal with --json; here the first few of each reason, and how many more.
  if (!found.refused.empty()) std::cout << "\nnot possible (" << found.refused.size() << "):\n";
  constexpr size_t kShownPerReason = 3, kReasonsShown = 20;
  std::map<std::string, size_t> per_reason;
  size_t left_out = 0;
  for (const train::LayoutChoice& c : found.refused) {
    size_t& shown = per_reason[c.refused];
    if (shown < kShownPerReason && (shown > 0 || per_reason.size() <= kReasonsShown)) {
      std::cout << "  " << c.name() << ": " << c.refused << "\n";
      ++shown;
    } else {
      ++left_out;
    }
  }
  if (left_out > 0)
    std::cout << "  ... and " << left_out << " more (the first " << kReasonsShown << " reasons, at most "
              << kShownPerReason << " layouts each; --json lists every one)\n";
  if (found.ranked.empty()) {
    std::cerr << "loom plan: no layout of " << world << " rank(s) can run this model (the reasons above)\n";
    return 1;
  }
  std::cout << "\nfastest: loom run " << shell_word(args.positionals()[0]);
  for (const std::string& o : args.all("--set")) std::cout << " --set " << shell_word(o);
  for (const std::string& o : found.ranked.front().overrides) std::cout << " --set " << shell_word(o);
  std::cout << "\n";
  return 0;
}

// loom plan --perf: the estimate, and with --check the measured step beside it.
int print_perf(const Args& args, const train::RunPlan& plan, const train::MemoryPlan& mp, bool json) {
  const int64_t check_steps = args.get_int("--check", 0);
  if (args.has("--check") && (check_steps < 5 || check_steps > 100000))
    throw UsageError("--check takes 5 to 100000 steps (the first 2 warm up), got " + std::to_string(check_steps));
  const LinkModel links = links_of(args, plan);
  const int cores = runtime::usable_cores();
  const int threads = train::threads_per_rank(plan, cores);
  const std::optional<train::ComputeProfile> given = read_profile(args);
  if (!json && !given)
    std::cout << "measuring the model's compute on " << plan.config.device.kind << " at tp " << plan.sizes.tp
              << (plan.sizes.cp > 1 ? ", cp " + std::to_string(plan.sizes.cp) : "") << ", " << threads
              << " thread(s) per rank ..." << std::endl;
  const train::ComputeProfile profile = given ? *given : measure_here(plan, threads, args.get_int("--measure-blocks", 0));
  save_profile(args, profile);
  const train::PerfEstimate est = train::estimate_step(plan, mp, profile, links, cores);
  const double measured =
      check_steps > 0 ? train::measure_step_s(plan, check_steps, 2, args.get("--links").value_or("")) : 0;
  std::vector<std::string> notes = perf_notes(plan, profile, links, est.notes);
  if (check_steps > 0 && args.has("--links") && !plan.config.comm.options.contains("links"))
    notes.push_back(plan.config.comm.backend + " models no links: the --check run ran on this machine's own "
                    "communication, the estimate on --links");

  if (json) {
    using nlohmann::ordered_json;
    ordered_json stages = ordered_json::array();
    for (const train::StageEstimate& e : est.stages)
      stages.push_back({{"stage", e.stage}, {"forward_ms", e.forward_s * 1e3}, {"backward_ms", e.backward_s * 1e3},
                        {"layer_comm_ms", e.layer_comm_s * 1e3}, {"pipeline_wait_ms", e.pipeline_wait_s * 1e3},
                        {"embedding_ms", e.embedding_s * 1e3}, {"grad_reduce_ms", e.grad_reduce_s * 1e3},
                        {"grad_reduce_exposed_ms", e.grad_reduce_exposed_s * 1e3},
                        {"optimizer_ms", e.optimizer_s * 1e3}, {"param_gather_ms", e.param_gather_s * 1e3},
                        {"param_gather_exposed_ms", e.param_gather_exposed_s * 1e3},
                        {"bookkeeping_ms", e.bookkeeping_s * 1e3}, {"step_ms", e.step_s * 1e3}});
    ordered_json out = {{"step_ms", est.step_s * 1e3}, {"tokens_per_s", est.tokens_per_s},
                        {"flops_per_step", est.flops_per_step}, {"mfu", est.mfu},
                        {"cores", est.cores}, {"threads_per_rank", est.threads}, {"contention", est.contention},
                        {"thread_scale", est.thread_scale},
                        {"measured_at", {{"tp", profile.tp}, {"cp", profile.cp}, {"dp", profile.dp},
                                         {"blocks", profile.blocks}, {"model_blocks", profile.model_blocks},
                                         {"runs", profile.runs}, {"seconds", profile.wall_s}}},
                        {"stages", stages}, {"notes", notes}};
    if (check_steps > 0) out["measured_step_ms"] = measured * 1e3;
    std::cout << runtime::dump_json(out) << "\n";
    return 0;
  }
  std::cout << "step-time estimate: " << args.positionals()[0] << "\n"
            << "  world " << plan.sizes.world << " = tp " << plan.sizes.tp
            << (plan.sizes.cp > 1 ? " x cp " + std::to_string(plan.sizes.cp) : "") << " x dp " << plan.dp << " x pp "
            << plan.sizes.pp << (plan.orders.vpp > 1 ? " (vpp " + std::to_string(plan.orders.vpp) + ")" : "") << ", "
            << plan.microbatches << " microbatches per step, optimizer " << plan.config.optimizer.strategy
            << (plan.config.optimizer.overlap_grad_reduce ? ", overlap_grad_reduce" : "")
            << (plan.config.optimizer.overlap_param_gather ? ", overlap_param_gather" : "") << "\n"
            << "  compute " << (given ? "from --profile " + *args.get("--profile") + ": " : "") << "measured on "
            << profile.device << " at tp " << profile.tp << ", cp " << profile.cp << ", dp " << profile.dp
            << (profile.blocks > 0 && profile.blocks < plan.config.model.num_layers
                    ? " with " + std::to_string(profile.blocks) + " of this model's " +
                          std::to_string(plan.config.model.num_layers) +
                          " transformer blocks (each layer costed by its FLOPs)"
                    : "")
            << " ("
            << profile.runs << (profile.runs == 1 ? " run, " : " runs, ") << std::fixed << std::setprecision(2)
            << profile.wall_s << " s in all); " << est.cores << " core(s), " << est.threads
            << " thread(s) per rank";
  if (est.thread_scale != 1)
    std::cout << " (measured with " << profile.threads << ": arithmetic x" << std::setprecision(2) << est.thread_scale << ")";
  std::cout << ", contention x" << std::setprecision(2) << est.contention << "\n";
  for (const std::string& n : notes) std::cout << "  note: " << n << "\n";
  std::cout << "  step " << ms(est.step_s) << " ms, " << std::setprecision(0) << est.tokens_per_s << " tokens/s";
  if (est.mfu > 0) std::cout << ", MFU " << std::setprecision(1) << 100 * est.mfu << "%";
  std::cout << "\n";
  if (check_steps > 0)
    std::cout << "  measured " << ms(measured) << " ms/step (mean of " << check_steps - 2
              << " steps after 2 warm-up): estimate / measured = " << std::setprecision(2) << est.step_s / measured
              << "\n";
  std::cout << "\n"
            << cell("stage", 6) << cell("fwd ms", 9) << cell("bwd ms", 9) << cell("(layer comm)", 13)
            << cell("pipe wait", 10) << cell("embed", 7) << cell("grad red.", 10) << cell("(exposed)", 10)
            << cell("optim", 7) << cell("gather", 8) << cell("(exposed)", 10) << cell("other", 7)
            << cell("step ms", 9) << "\n";
  for (const train::StageEstimate& e : est.stages)
    std::cout << cell(std::to_string(e.stage), 6) << cell(ms(e.forward_s), 9) << cell(ms(e.backward_s), 9)
              << cell(ms(e.layer_comm_s), 13) << cell(ms(e.pipeline_wait_s), 10) << cell(ms(e.embedding_s), 7)
              << cell(ms(e.grad_reduce_s), 10) << cell(ms(e.grad_reduce_exposed_s), 10) << cell(ms(e.optimizer_s), 7)
              << cell(ms(e.param_gather_s), 8) << cell(ms(e.param_gather_exposed_s), 10)
              << cell(ms(e.bookkeeping_s), 7) << cell(ms(e.step_s), 9) << "\n";
  std::cout << "(layer comm): what the links add to the layers' own collectives (tp, cp, ep) beyond the time they "
               "took when measured; (exposed): what the step waits for\n";
  return 0;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  bool json = false;
  try {
    Args args(argc, argv, {"--json", "--perf", "--search"},
              {"--set", "--links", "--check", "--world", "--profile", "--save-profile", "--measure-blocks"});
    json = args.flag("--json");
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("plan takes one MANIFEST");
    const bool perf = args.flag("--perf");
    const bool search = args.flag("--search");
    if (!perf && (args.has("--links") || args.has("--check") || search || args.has("--world") ||
                  args.has("--profile") || args.has("--save-profile") || args.has("--measure-blocks")))
      throw UsageError("--links, --check, --search, --world, --profile, --save-profile and --measure-blocks go with --perf");
    if (args.has("--profile") && args.has("--save-profile"))
      throw UsageError("--save-profile writes what --perf measures; with --profile nothing is measured");
    if (args.has("--profile") && args.has("--measure-blocks"))
      throw UsageError("--measure-blocks says what to measure; with --profile nothing is measured");
    if (args.has("--measure-blocks") && args.get_int("--measure-blocks", 0) < 1)
      throw UsageError("--measure-blocks takes a number of transformer blocks, 1 or more");
    if (const auto out = args.get("--save-profile")) {
      boost::system::error_code ec;
      if (boost::filesystem::equivalent(*out, args.positionals()[0], ec) && !ec)
        throw UsageError("--save-profile " + *out + " is the manifest; write the profile elsewhere");
      if (const std::string why = files::cannot_write(*out); !why.empty())  // before measuring, not after
        throw loom::Error("--save-profile " + *out + ": " + why);
    }
    if (search && args.has("--save-profile")) throw UsageError("--save-profile saves one layout's measurement, not --search's");
    if (args.has("--world") && !search) throw UsageError("--world goes with --search");
    if (search && args.has("--check")) throw UsageError("--check measures one layout; --search ranks many");
    train::RunPlan plan = search && args.has("--world") ? search_base(args)
                                                         : train::make_plan(manifest::Manifest::load(
                                                                                args.positionals()[0], args.all("--set")),
                                                                            plugins::registry());
    const train::Preflight checked = train::preflight(plan, plan.sizes.world);
    const train::MemoryPlan& mp = checked.memory;
    const std::string& memory = checked.memory_problem;
    if (!memory.empty()) std::cerr << "warning: " << memory << "; loom run refuses it on this machine\n";
    for (const std::string& w : plan.warnings) std::cerr << "warning: " << w << "\n";
    if (args.get_int("--measure-blocks", 0) > plan.config.model.num_layers)
      throw UsageError("--measure-blocks " + std::to_string(args.get_int("--measure-blocks", 0)) +
                       ": the model has " + std::to_string(plan.config.model.num_layers) + " transformer blocks");
    if (search) return print_search(args, plan, json);
    if (perf) return print_perf(args, plan, mp, json);

    if (json) {
      using nlohmann::ordered_json;
      ordered_json ranks = ordered_json::array();
      for (const train::RankMemory& r : mp.ranks) {
        ordered_json buckets = ordered_json::array();
        for (const model::Range& b : r.layout().buckets) buckets.push_back({{"start", b.start}, {"end", b.end}});
        ranks.push_back({{"rank", r.rank},
                         {"params", r.params},
                         {"param_bytes", r.param_bytes},
                         {"grad_bytes", r.grad_bytes},
                         {"optimizer_bytes", r.optimizer_bytes},
                         {"activation_bytes", r.activation_bytes},
                         {"recompute_bytes", r.recompute_bytes},
                         {"work_bytes", r.work_bytes}, {"input_bytes", r.input_bytes}, {"workspace_bytes", r.workspace_bytes},
                         {"total_bytes", train::rank_total_bytes(r)},
                         {"bytes_per_param", r.bytes_per_param},
                         {"buffer_numel", r.buffer_numel},
                         {"tp_rank", r.tp_rank},
                         {"cp_rank", r.cp_rank},
                         {"dp_rank", r.dp_rank},
                         {"pp_rank", r.pp_rank},
                         {"in_flight", r.in_flight},
                         {"tensors", r.param_count},
                         {"buckets", buckets}});
      }
      std::cout << runtime::dump_json({{"ranks", ranks},
                                       {"world_size", mp.world},
                                       {"tp", mp.tp},
                                       {"cp", mp.cp},
                                       {"dp", mp.dp},
                                       {"pp", mp.pp},
                                       {"param_dtype", mp.param_dtype},
                                       {"grad_dtype", mp.grad_dtype},
                                       {"optimizer_strategy", mp.strategy},
                                       {"vocab", mp.vocab},
                                       {"microbatches_in_flight", mp.microbatches_in_flight},
                                       {"fits", memory.empty()},  // what loom run's check before launch says
                                       {"memory_problem", memory}})
                << "\n";
      return 0;
    }

    const bool recomputes = std::any_of(mp.ranks.begin(), mp.ranks.end(),
                                        [](const train::RankMemory& r) { return r.recompute_bytes > 0; });
    std::cout << "memory plan: " << args.positionals()[0] << "\n"
              << "  world " << mp.world << " = tp " << mp.tp << (mp.cp > 1 ? " x cp " + std::to_string(mp.cp) : "")
              << " x dp " << mp.dp << " x pp " << mp.pp << "; params "
              << mp.param_dtype
              << ", grads " << mp.grad_dtype << ", optimizer " << mp.strategy << "; vocab " << mp.vocab
              << "; bucket_size " << mp.bucket_size << (mp.bucket_size ? "" : " (one bucket)") << "\n"
              << "  activations: at the schedule's peak, up to " << mp.microbatches_in_flight
              << " microbatch-chunk(s) in flight on a rank (estimate)"
              << (recomputes ? "; recomp: more while a recompute group runs its forward again in backward" : "")
              << (plan.sizes.ep > 1 ? "\n  expert parallelism: the rows a rank's experts take depend on the routing; "
                                      "planned as balanced (dropless, a skewed router can need up to ep x its "
                                      "experts' rows: an expert capacity, model.layer.moe.capacity_factor, bounds them)"
                                    : "")
              << "\n  work: the backward's hidden-state gradient buffers and each microbatch's tokens and targets, "
                 "held for the whole run, and the largest temporaries of one layer's forward or backward"
              << (plan.blocks_per_chunk.size() > 1 ? "\n  pipeline chunks (the embedding in the first, the output "
                                                      "layer in the last):" + chunk_blocks_text(plan)
                                                    : "")
              << "\n\n";
    std::cout << cell("rank", 5) << cell("tp", 3) << cell("cp", 3) << cell("dp", 3) << cell("pp", 3) << cell("params", 12)
              << cell("buffer", 12)
              << cell("param MiB", 10) << cell("grad MiB", 10) << cell("optim MiB", 10) << cell("act MiB", 10)
              << (recomputes ? cell("recomp MiB", 11) : "") << cell("work MiB", 10) << cell("total MiB", 10) << cell("B/param", 8) << "\n";
    for (const train::RankMemory& r : mp.ranks) {
      char bpp[32];
      std::snprintf(bpp, sizeof(bpp), "%.3f", r.bytes_per_param);
      std::cout << cell(std::to_string(r.rank), 5) << cell(std::to_string(r.tp_rank), 3)
                << cell(std::to_string(r.cp_rank), 3) << cell(std::to_string(r.dp_rank), 3) << cell(std::to_string(r.pp_rank), 3)
                << cell(std::to_string(r.params), 12)
                << cell(std::to_string(r.buffer_numel), 12) << cell(mib(r.param_bytes), 10)
                << cell(mib(r.grad_bytes), 10) << cell(mib(r.optimizer_bytes), 10)
                << cell(mib(r.activation_bytes), 10) << (recomputes ? cell(mib(r.recompute_bytes), 11) : "")
                << cell(mib(r.work_bytes + r.input_bytes + r.workspace_bytes), 10) << cell(mib(train::rank_total_bytes(r)), 10)
                << cell(bpp, 8) << "\n";
    }
    // The buffer layout of each distinct (tp, pp) position (dp and cp replicas share
    // it); the distributed optimizer shards each bucket over dp x cp ranks.
    const int grad_ranks = mp.dp * mp.cp;
    std::cout << "\nbuffer layout (elements; dp" << (mp.cp > 1 ? " and cp" : "") << " replicas identical"
              << (mp.ep > 1 ? ", ep ranks holding other experts" : "") << "):\n";
    std::set<std::pair<int, int>> shown;
    for (const train::RankMemory& r : mp.ranks) {
      if (!shown.insert({r.tp_rank, r.pp_rank}).second) continue;
      std::cout << "  tp rank " << r.tp_rank << ", pp rank " << r.pp_rank << ": " << r.param_count << " tensors, " << r.params << " params, buffer "
                << r.buffer_numel << " (padding " << r.buffer_numel - r.params << "), " << r.layout().buckets.size()
                << " bucket" << (r.layout().buckets.size() == 1 ? "" : "s") << "\n";
      for (size_t i = 0; i < r.layout().buckets.size(); ++i) {
        const model::Range& b = r.layout().buckets[i];
        std::cout << "    bucket " << i << ": [" << b.start << ", " << b.end << ") " << b.size() << " elements, shard "
                  << (b.start >= r.expert_start
                          ? std::to_string(b.size() / static_cast<size_t>(mp.edp)) + " per edp rank (experts)\n"
                          : std::to_string(b.size() / static_cast<size_t>(grad_ranks)) +
                                (mp.cp > 1 ? " per dp-cp rank\n" : " per dp rank\n"));
      }
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom plan: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    return report_manifest_error(e, json);
  } catch (const std::exception& e) {
    return report_error(e, json, "plan");
  }
}

}  // namespace loom::cli
