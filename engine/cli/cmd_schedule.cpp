// `loom schedule`: the pipeline schedule a plugin gives every rank, checked and
// simulated as a run would check it, drawn as a time diagram, or printed as JSON.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cli/args.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/json.hpp"

namespace loom::cli {

int cmd_schedule(int argc, char** argv);

namespace {

constexpr const char* kUsage =
    "usage: loom schedule --pp P --microbatches M [--vpp V] [--group-size N] [--schedule NAME]\n"
    "                     [--json] [--trace FILE] [--plugin-path DIR]...\n"
    "\n"
    "Print the pipeline schedule of every rank: the signed order a schedule plugin gives\n"
    "it (+c = forward of local chunk c, -c = its backward; the j-th +c is microbatch j),\n"
    "after the checks a run makes before it starts (each order well formed, and all of\n"
    "them simulated together with their sends and receives, so a schedule that would\n"
    "deadlock is refused naming the stuck rank and step).\n"
    "\n"
    "  --pp P            pipeline stages (required)\n"
    "  --microbatches M  microbatches per step (required)\n"
    "  --vpp V           virtual chunks per stage (default 1)\n"
    "  --group-size N    microbatches per virtual-stage group of the interleaved schedule\n"
    "                    (pipeline.microbatch_group_size; default 0, meaning pp)\n"
    "  --schedule NAME   the plugin parallel/pipeline.NAME (default 1f1b when vpp = 1,\n"
    "                    interleaved otherwise; gpipe is built in too)\n"
    "  --json            print {\"pp\", \"vpp\", \"microbatches\", \"group_size\",\n"
    "                    \"ranks\": [{\"rank\", \"warmup\", \"order\"}]}\n"
    "  --trace FILE      also write the simulated timeline as a Chrome trace (open it in\n"
    "                    Perfetto; one slot = 1 ms)\n"
    "  --plugin-path DIR also look for plugins in DIR (repeatable)\n"
    "  --help            print this and exit\n"
    "\n"
    "The diagram has a row per rank and a column per time slot; every step takes one\n"
    "slot, and a step starts once its rank is free and its inputs have arrived.\n"
    "Cells: F<microbatch> / B<microbatch> (F<microbatch>.<chunk> when vpp > 1), with\n"
    "microbatches and chunks counted from 1; blank = idle (bubble).\n"
    "\n"
    "Exit status: 0 ok, 1 refused or broken schedule, 2 bad usage.\n";

// A Chrome trace holds an event per entry (about 300 bytes each in memory, 10 s per
// 2 million to write): at most this many with --trace.
constexpr long long kMaxTraceEntries = 2'000'000;
constexpr size_t kLineWidth = 120;            // the diagram wraps into blocks of this width
constexpr long long kMaxDiagramCells = 200'000;

int positive(const Args& a, const std::string& name, long long fallback) {
  const long long v = a.get_int(name, fallback);
  if (v < 1 || v > 1'000'000) throw UsageError(name + " must be an integer in 1..1000000, got " + std::to_string(v));
  return static_cast<int>(v);
}

std::string cell_label(const pipeline::TimedStep& s, int vpp) {
  std::string l = (s.forward ? "F" : "B") + std::to_string(s.microbatch + 1);
  if (vpp > 1) l += "." + std::to_string(s.chunk);
  return l;
}

std::string order_str(const std::vector<int32_t>& order) {
  std::string s = "[";
  for (size_t i = 0; i < order.size(); ++i) s += (i ? ", " : "") + std::to_string(order[i]);
  return s + "]";
}

void print_json(const pipeline::PipelineOrders& o) {
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (int r = 0; r < o.pp; ++r)
    ranks.push_back({{"rank", r},
                     {"warmup", o.warmup[static_cast<size_t>(r)]},
                     {"order", o.order[static_cast<size_t>(r)]}});
  std::cout << runtime::dump_json({{"pp", o.pp},
                                   {"vpp", o.vpp},
                                   {"microbatches", o.microbatches},
                                   {"group_size", o.group_size},
                                   {"ranks", ranks}})
            << "\n";
}

void print_diagram(const pipeline::PipelineOrders& o, const pipeline::Timeline& t) {
  std::cout << "schedule " << o.schedule << "  pp " << o.pp << "  vpp " << o.vpp << "  microbatches "
            << o.microbatches << "  group size " << o.group_size << "\n";
  const long long cells = static_cast<long long>(t.pp) * t.makespan;
  if (cells > kMaxDiagramCells) {
    std::cout << "(diagram left out: " << t.makespan << " slots x " << t.pp
              << " ranks; write it with --trace FILE and open it in Perfetto)\n";
  } else {
    // One label per slot; a step longer than one slot continues with '-'.
    size_t w = 2;
    for (const auto& rank : t.ranks)
      for (const auto& s : rank) w = std::max(w, cell_label(s, o.vpp).size());
    w = std::max(w, std::to_string(std::max<int64_t>(t.makespan - 1, 0)).size());
    std::vector<std::vector<std::string>> grid(static_cast<size_t>(t.pp),
                                               std::vector<std::string>(static_cast<size_t>(t.makespan)));
    for (const auto& rank : t.ranks)
      for (const auto& s : rank)
        for (int64_t k = 0; k < s.duration; ++k)
          grid[static_cast<size_t>(s.rank)][static_cast<size_t>(s.start + k)] =
              k == 0 ? cell_label(s, o.vpp) : std::string(w, '-');
    const std::string head = "rank " + std::to_string(t.pp - 1);
    const size_t label_w = std::max<size_t>(head.size(), 4);
    const size_t per_block = std::max<size_t>(1, (kLineWidth - label_w) / (w + 1));
    std::cout << "cells: F = forward, B = backward of microbatch"
              << (o.vpp > 1 ? ".chunk" : "") << "; blank = idle; one slot per step\n";
    for (size_t first = 0; first < static_cast<size_t>(t.makespan); first += per_block) {
      const size_t last = std::min(static_cast<size_t>(t.makespan), first + per_block);
      std::string header = "slot";
      header.resize(label_w, ' ');
      for (size_t c = first; c < last; ++c) {
        std::string num = std::to_string(c);
        num.resize(w, ' ');
        header += ' ' + num;
      }
      while (header.back() == ' ') header.pop_back();
      std::cout << "\n" << header << "\n";
      for (int r = 0; r < t.pp; ++r) {
        std::string line = "rank " + std::to_string(r);
        line.resize(label_w, ' ');
        for (size_t c = first; c < last; ++c) {
          std::string cell = grid[static_cast<size_t>(r)][c];
          cell.resize(w, ' ');
          line += ' ' + cell;
        }
        while (!line.empty() && line.back() == ' ') line.pop_back();
        std::cout << line << "\n";
      }
    }
  }

  std::cout << "\norders (+c forward of local chunk c, -c backward; local chunk c of rank r is global chunk "
               "(c-1)*pp + r):\n";
  for (int r = 0; r < o.pp; ++r)
    std::cout << "  rank " << r << "  warmup " << o.warmup[static_cast<size_t>(r)] << "  "
              << order_str(o.order[static_cast<size_t>(r)]) << "\n";
  const long long total = static_cast<long long>(t.pp) * t.makespan;
  char frac[32];
  std::snprintf(frac, sizeof(frac), "%.4f", t.bubble_fraction());
  std::cout << "\nbubble fraction " << frac << " (" << (total - t.busy) << " idle of " << total
            << " rank-slots; " << t.makespan << " slots from first to last step)\n";
}

}  // namespace

int cmd_schedule(int argc, char** argv) {
  int pp = 1, vpp = 1, microbatches = 1, group_size = 0;
  std::string schedule, trace;
  std::vector<std::string> extra_paths;
  bool json = false;
  try {
    Args a(argc, argv, {"--json"},
           {"--pp", "--vpp", "--microbatches", "--group-size", "--schedule", "--trace", "--plugin-path"});
    if (a.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (!a.positionals().empty()) throw UsageError("unexpected argument '" + a.positionals().front() + "'");
    if (!a.has("--pp")) throw UsageError("--pp is required");
    if (!a.has("--microbatches")) throw UsageError("--microbatches is required");
    pp = positive(a, "--pp", 1);
    vpp = positive(a, "--vpp", 1);
    microbatches = positive(a, "--microbatches", 1);
    const long long n = a.get_int("--group-size", 0);
    if (n < 0 || n > 1'000'000)
      throw UsageError("--group-size must be 0 (meaning pp) or an integer up to 1000000, got " + std::to_string(n));
    group_size = static_cast<int>(n);
    schedule = a.get("--schedule").value_or(vpp == 1 ? "1f1b" : "interleaved");
    if (schedule.empty()) throw UsageError("--schedule needs a name, e.g. 1f1b, interleaved or gpipe");
    trace = a.get("--trace").value_or("");
    if (a.has("--trace") && trace.empty()) throw UsageError("--trace needs a file name");
    extra_paths = a.all("--plugin-path");
    json = a.flag("--json");
  } catch (const UsageError& e) {
    std::cerr << "loom schedule: " << e.what() << "; see 'loom schedule --help'\n";
    return 2;
  }

  if (const std::string why = pipeline::orders_too_large(pp, vpp, microbatches); !why.empty()) {
    std::cerr << "loom schedule: " << why << "\n";
    return 1;
  }
  const long long entries = 2LL * pp * vpp * microbatches;
  if (!trace.empty() && entries > kMaxTraceEntries) {
    std::cerr << "loom schedule: --trace writes an event per order entry, and pp " << pp << ", vpp " << vpp
              << ", microbatches " << microbatches << " give " << entries << " (at most " << kMaxTraceEntries
              << " with --trace); simulate it without --trace, or trace fewer microbatches\n";
    return 1;
  }

  try {
    plugins::host_api();
    plugins::Registry& reg = plugins::registry();
    const std::string name = pipeline::schedule_plugin_name(schedule);
    // What did not load (a --plugin-path that does not exist, a broken library) is
    // said, as loom run says it.
    for (const std::string& e : reg.load_dirs(plugins::Registry::search_paths(extra_paths)))
      std::cerr << "loom schedule: warning: " << e << "\n";
    const plugins::LoadedPlugin& plugin = reg.get("parallel", name);

    const pipeline::PipelineOrders orders =
        pipeline::compute_orders(plugin, nullptr, pp, vpp, microbatches, group_size);
    const pipeline::Timeline timeline = pipeline::simulate(orders);
    if (group_size > 0 && group_size != pp) {  // one the schedule does not read gives the default's orders
      bool same = false;
      try {
        same = pipeline::compute_orders(plugin, nullptr, pp, vpp, microbatches, 0).order == orders.order;
      } catch (const std::exception&) {
      }
      if (same)
        std::cerr << "loom schedule: warning: --group-size " << group_size << " gives the same orders as 0 (pp) under "
                  << orders.schedule << ": it changes nothing\n";
    }
    if (!trace.empty()) pipeline::write_chrome_trace(trace, pipeline::trace_events(timeline));
    if (json)
      print_json(orders);
    else
      print_diagram(orders, timeline);
  } catch (const pipeline::ScheduleError& e) {
    std::cerr << "loom schedule: " << e.what() << "\n";
    return 1;
  } catch (const plugins::PluginError& e) {
    std::cerr << "loom schedule: " << e.what() << "\n";
    return 1;
  } catch (const std::runtime_error& e) {
    std::cerr << "loom schedule: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace loom::cli
