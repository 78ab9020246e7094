// `loom groups`: print the rank groups Megatron's generator makes for a world and
// a set of parallel sizes, as a readable table (with a layout picture for small
// worlds) or as JSON.
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/runtime/json.hpp"
#include "engine/topology/rank_groups.hpp"

namespace loom::cli {

namespace {

using topology::RankGroups;

constexpr const char* kUsage =
    "usage: loom groups --world-size N [--tp A] [--cp B] [--pp C] [--ep E] [--etp T]\n"
    "                   [--order O] [--json]\n"
    "\n"
    "Print the communication groups of every kind (tp cp dp pp dp-cp tp-pp tp-dp-cp\n"
    "tp-dp tp-cp embedding position_embedding ep etp edp etp-ep etp-ep-pp) built with\n"
    "Megatron-LM's rank generator: dense tp*cp*dp*pp and expert etp*ep*edp*pp over the\n"
    "same world, dp = N/(tp*cp*pp), edp = N/(etp*ep*pp).\n"
    "\n"
    "  --world-size N  number of ranks (required)\n"
    "  --tp, --cp, --pp, --ep  parallel sizes (default 1)\n"
    "  --etp T         expert tensor-parallel size (default: same as --tp)\n"
    "  --order O       dimension order, fastest-varying first (default tp-cp-ep-dp-pp)\n"
    "  --json          print {\"world_size\": N, \"groups\": {kind: [[ranks]...]}}\n"
    "  --help          print this and exit\n"
    "\n"
    "Exit status: 0 ok, 1 impossible configuration, 2 bad usage.\n";

std::string join_group(const std::vector<int>& g) {
  std::string s = "[";
  for (std::size_t i = 0; i < g.size(); ++i) s += (i ? "," : "") + std::to_string(g[i]);
  return s + "]";
}

void print_json(const RankGroups& rg) {
  nlohmann::ordered_json groups = nlohmann::ordered_json::object();
  for (const auto& kind : RankGroups::kinds()) groups[kind] = rg.groups(kind);
  std::cout << runtime::dump_json({{"world_size", rg.world()}, {"groups", groups}}) << "\n";
}

// A rank grid per pipeline stage: rows enumerate one pair of coordinates, columns
// another, each cell is the global rank sitting there.
void print_grid(const RankGroups& rg, bool expert) {
  const auto& s = rg.sizes();
  const int pp = s.pp;
  const int inner = expert ? rg.etp() : s.tp;          // fastest, in the columns
  const int outer_col = expert ? s.ep : s.cp;           // also in the columns
  const int rows = expert ? rg.edp() : rg.dp();
  const char* in_name = expert ? "etp" : "tp";
  const char* oc_name = expert ? "ep" : "cp";
  const char* row_name = expert ? "edp" : "dp";

  // Map coordinates to ranks by scanning the world, which also serves any order.
  std::vector<int> cell(static_cast<std::size_t>(pp) * rows * outer_col * inner, -1);
  for (int r = 0; r < rg.world(); ++r) {
    const auto c = rg.coords(r);
    const int a = expert ? c.etp : c.tp, b = expert ? c.ep : c.cp, d = expert ? c.edp : c.dp;
    cell[((static_cast<std::size_t>(c.pp) * rows + d) * outer_col + b) * inner + a] = r;
  }
  std::vector<std::string> heads;
  for (int b = 0; b < outer_col; ++b)
    for (int a = 0; a < inner; ++a)
      heads.push_back(outer_col > 1 ? std::string(oc_name) + std::to_string(b) + "." + in_name + std::to_string(a)
                                    : std::string(in_name) + std::to_string(a));
  std::size_t w = 3;
  for (const auto& h : heads) w = std::max(w, h.size());
  const std::string row_label_pad(8, ' ');

  std::cout << "\n" << (expert ? "expert layout" : "layout") << ": one block per pp stage; rows " << row_name
            << ", columns " << (outer_col > 1 ? std::string(oc_name) + "." + in_name : std::string(in_name))
            << "; cell = global rank\n";
  for (int p = 0; p < pp; ++p) {
    std::cout << "  pp" << p << "\n" << row_label_pad;
    for (const auto& h : heads) std::cout << ' ' << std::setw(static_cast<int>(w)) << h;
    std::cout << "\n";
    for (int d = 0; d < rows; ++d) {
      std::string label = "    " + std::string(row_name) + std::to_string(d);
      std::cout << std::left << std::setw(8) << label << std::right;
      for (std::size_t col = 0; col < heads.size(); ++col)
        std::cout << ' ' << std::setw(static_cast<int>(w))
                  << cell[((static_cast<std::size_t>(p) * rows + d) * heads.size()) + col];
      std::cout << "\n";
    }
  }
}

void print_table(const RankGroups& rg) {
  const auto& s = rg.sizes();
  std::cout << "world " << rg.world() << "  order " << s.order << "\n"
            << "dense   tp " << s.tp << "  cp " << s.cp << "  pp " << s.pp << "  dp " << rg.dp() << "\n"
            << "expert  etp " << rg.etp() << "  ep " << s.ep << "  pp " << s.pp << "  edp " << rg.edp() << "\n\n";

  std::size_t kw = 0;
  for (const auto& k : RankGroups::kinds()) kw = std::max(kw, k.size());
  constexpr std::size_t kLine = 100;  // wrap long group lists under the kind name
  for (const auto& kind : RankGroups::kinds()) {
    const auto& gs = rg.groups(kind);
    std::ostringstream head;
    head << std::left << std::setw(static_cast<int>(kw)) << kind << "  " << gs.size() << " x "
         << (gs.empty() ? 0 : gs.front().size());
    std::string line = head.str();
    line.resize(std::max(line.size(), kw + 12), ' ');
    const std::size_t indent = line.size();
    std::size_t len = line.size();
    for (const auto& g : gs) {
      const std::string item = " " + join_group(g);
      if (len + item.size() > kLine && len > indent) {
        line += "\n" + std::string(indent, ' ');
        len = indent;
      }
      line += item;
      len += item.size();
    }
    std::cout << line << "\n";
  }

  if (rg.world() <= 64) {
    print_grid(rg, false);
    if (s.ep > 1 || rg.etp() != s.tp) print_grid(rg, true);
  }
}

// A positive integer option of at most the largest world; 0 or negatives are usage
// errors, not topologies.
int positive(const Args& a, const std::string& name, long long fallback) {
  const long long v = a.get_int(name, fallback);
  if (v < 1 || v > topology::kMaxWorld)
    throw UsageError(name + " must be between 1 and " + std::to_string(topology::kMaxWorld) + ", got " +
                     std::to_string(v));
  return static_cast<int>(v);
}

}  // namespace

int cmd_groups(int argc, char** argv) {
  topology::ParallelSizes sizes;
  bool json = false;
  try {
    Args a(argc, argv, {"--json"}, {"--world-size", "--tp", "--cp", "--pp", "--ep", "--etp", "--order"});
    if (a.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (!a.positionals().empty())
      throw UsageError("unexpected argument '" + a.positionals().front() + "'");
    if (!a.has("--world-size")) throw UsageError("--world-size is required");
    sizes.world = positive(a, "--world-size", 1);
    sizes.tp = positive(a, "--tp", 1);
    sizes.cp = positive(a, "--cp", 1);
    sizes.pp = positive(a, "--pp", 1);
    sizes.ep = positive(a, "--ep", 1);
    sizes.etp = a.has("--etp") ? positive(a, "--etp", 1) : 0;
    if (auto o = a.get("--order")) sizes.order = *o;
    json = a.flag("--json");
  } catch (const UsageError& e) {
    std::cerr << "loom groups: " << e.what() << "; see 'loom groups --help'\n";
    return 2;
  }

  try {
    const auto rg = RankGroups::build(sizes);
    if (json)
      print_json(rg);
    else
      print_table(rg);
  } catch (const topology::TopologyError& e) {
    std::cerr << "loom groups: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace loom::cli
