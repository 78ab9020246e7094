#include "engine/topology/rank_groups.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <string_view>

namespace loom::topology {

namespace {

constexpr std::array<std::string_view, 5> kAllDims = {"tp", "cp", "ep", "dp", "pp"};
constexpr const char* kOrderForm =
    "a '-'-joined list of distinct dimensions from tp, cp, ep, dp, pp, fastest-varying "
    "first, e.g. tp-cp-ep-dp-pp";

// One generator: its dimensions in order (fastest first) with their sizes.
struct Generator {
  std::vector<std::string> dims;
  std::vector<int> sizes;

  int size_of(const std::string& d) const {
    for (std::size_t i = 0; i < dims.size(); ++i)
      if (dims[i] == d) return sizes[i];
    return 1;
  }
  std::vector<int> strides() const {
    std::vector<int> s(dims.size());
    int acc = 1;
    for (std::size_t i = 0; i < dims.size(); ++i) {
      s[i] = acc;
      acc *= sizes[i];
    }
    return s;
  }
  int coord(int rank, const std::string& d) const {
    const auto st = strides();
    for (std::size_t i = 0; i < dims.size(); ++i)
      if (dims[i] == d) return (rank / st[i]) % sizes[i];
    return 0;
  }
};

std::vector<std::string> split_dashes(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const auto dash = s.find('-', start);
    out.push_back(s.substr(start, dash == std::string::npos ? std::string::npos : dash - start));
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  return out;
}

// Parses the order string. Dimensions it leaves out are appended (Megatron does the
// same), which is only harmless for size-1 dimensions; the caller checks that.
std::vector<std::string> parse_order(const std::string& order) {
  const auto bad = [&](const std::string& why) {
    return TopologyError("bad order string '" + order + "': " + why + "; expected " + kOrderForm);
  };
  std::vector<std::string> dims;
  for (const auto& tok : split_dashes(order)) {
    if (tok.empty()) throw bad("empty dimension name");
    if (std::find(kAllDims.begin(), kAllDims.end(), tok) == kAllDims.end())
      throw bad("unknown dimension '" + tok + "'");
    if (std::find(dims.begin(), dims.end(), tok) != dims.end())
      throw bad("dimension '" + tok + "' appears twice");
    dims.push_back(tok);
  }
  for (const auto d : kAllDims)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) dims.emplace_back(d);
  return dims;
}

// Megatron's generate_masked_orthogonal_rank_groups: the masked dimensions vary
// inside a group (rank-in-group enumerates them fastest-first in order), the
// unmasked ones select the group (enumerated the same way).
std::vector<std::vector<int>> masked_groups(const Generator& g, const std::vector<bool>& mask) {
  const auto stride = g.strides();
  std::vector<int> in_shape, in_stride, out_shape, out_stride;
  for (std::size_t i = 0; i < g.dims.size(); ++i) {
    (mask[i] ? in_shape : out_shape).push_back(g.sizes[i]);
    (mask[i] ? in_stride : out_stride).push_back(stride[i]);
  }
  const auto offset = [](int index, const std::vector<int>& shape, const std::vector<int>& st) {
    int r = 0;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      r += (index % shape[i]) * st[i];
      index /= shape[i];
    }
    return r;
  };
  int group_size = 1, num_groups = 1;
  for (int s : in_shape) group_size *= s;
  for (int s : out_shape) num_groups *= s;
  std::vector<std::vector<int>> groups(num_groups);
  for (int gi = 0; gi < num_groups; ++gi) {
    const int base = offset(gi, out_shape, out_stride);
    groups[gi].reserve(group_size);
    for (int ri = 0; ri < group_size; ++ri) groups[gi].push_back(base + offset(ri, in_shape, in_stride));
  }
  return groups;
}

std::vector<std::vector<int>> kind_groups(const Generator& g, const std::vector<std::string>& masked) {
  std::vector<bool> mask(g.dims.size(), false);
  for (std::size_t i = 0; i < g.dims.size(); ++i)
    mask[i] = std::find(masked.begin(), masked.end(), g.dims[i]) != masked.end();
  return masked_groups(g, mask);
}

Generator make_generator(const std::vector<std::string>& dims, int tp, int cp, int ep, int dp, int pp) {
  Generator g;
  g.dims = dims;
  for (const auto& d : dims)
    g.sizes.push_back(d == "tp" ? tp : d == "cp" ? cp : d == "ep" ? ep : d == "dp" ? dp : pp);
  return g;
}

// The generators of a built RankGroups (rebuilt on demand; they are tiny).
Generator dense_of(const std::vector<std::string>& dims, const ParallelSizes& s, int dp) {
  return make_generator(dims, s.tp, s.cp, 1, dp, s.pp);
}
Generator expert_of(const std::vector<std::string>& dims, const ParallelSizes& s, int etp, int edp) {
  return make_generator(dims, etp, 1, s.ep, edp, s.pp);
}

void require_positive(const char* name, int v) {
  if (v < 1) throw TopologyError(std::string(name) + " must be at least 1, got " + std::to_string(v));
}

}  // namespace

const std::vector<std::string>& RankGroups::kinds() {
  static const std::vector<std::string> k = {
      "tp",    "cp",    "dp",        "pp",        "dp-cp",
      "tp-pp", "tp-dp-cp", "tp-dp",  "tp-cp",     "embedding",
      "position_embedding", "ep", "etp", "edp",   "etp-ep",
      "etp-ep-pp"};
  return k;
}

RankGroups RankGroups::build(const ParallelSizes& s) {
  require_positive("world size", s.world);
  require_positive("tp", s.tp);
  require_positive("cp", s.cp);
  require_positive("pp", s.pp);
  require_positive("ep", s.ep);
  if (s.etp < 0) throw TopologyError("etp must be at least 1 (or 0 for 'same as tp'), got " + std::to_string(s.etp));
  const int etp = s.expert_tp();
  const auto dims = parse_order(s.order);

  // 64-bit products so absurd sizes report a clean error instead of overflowing.
  const long long dense = 1LL * s.tp * s.cp * s.pp;
  if (s.world % dense != 0)
    throw TopologyError("world size " + std::to_string(s.world) + " is not divisible by tp·cp·pp = " +
                        std::to_string(s.tp) + "·" + std::to_string(s.cp) + "·" + std::to_string(s.pp) +
                        " = " + std::to_string(dense) + "; choose tp, cp and pp whose product divides it");
  const long long expert = 1LL * etp * s.ep * s.pp;
  if (s.world % expert != 0)
    throw TopologyError("world size " + std::to_string(s.world) + " is not divisible by etp·ep·pp = " +
                        std::to_string(etp) + "·" + std::to_string(s.ep) + "·" + std::to_string(s.pp) +
                        " = " + std::to_string(expert) + "; choose etp, ep and pp whose product divides it");

  RankGroups r;
  r.world_ = s.world;
  r.dp_ = static_cast<int>(s.world / dense);
  r.edp_ = static_cast<int>(s.world / expert);
  r.etp_ = etp;
  r.sizes_ = s;
  r.dims_ = dims;

  const auto listed = split_dashes(s.order);
  const Generator dg = dense_of(dims, s, r.dp_);
  const Generator eg = expert_of(dims, s, etp, r.edp_);
  for (const auto& d : dims) {
    if (std::find(listed.begin(), listed.end(), d) != listed.end()) continue;
    const int n = std::max(dg.size_of(d), eg.size_of(d));
    if (n != 1)
      throw TopologyError("bad order string '" + s.order + "': it leaves out " + d + ", whose size is " +
                          std::to_string(n) + "; expected " + kOrderForm);
  }

  r.groups_["tp"] = kind_groups(dg, {"tp"});
  r.groups_["cp"] = kind_groups(dg, {"cp"});
  r.groups_["dp"] = kind_groups(dg, {"dp"});
  r.groups_["pp"] = kind_groups(dg, {"pp"});
  r.groups_["dp-cp"] = kind_groups(dg, {"dp", "cp"});
  r.groups_["tp-pp"] = kind_groups(dg, {"tp", "pp"});
  r.groups_["tp-dp-cp"] = kind_groups(dg, {"tp", "dp", "cp"});
  r.groups_["tp-dp"] = kind_groups(dg, {"tp", "dp"});
  r.groups_["tp-cp"] = kind_groups(dg, {"tp", "cp"});
  // The expert generator reuses the order's names: tp means etp, dp means edp.
  r.groups_["ep"] = kind_groups(eg, {"ep"});
  r.groups_["etp"] = kind_groups(eg, {"tp"});
  r.groups_["edp"] = kind_groups(eg, {"dp"});
  r.groups_["etp-ep"] = kind_groups(eg, {"tp", "ep"});
  r.groups_["etp-ep-pp"] = kind_groups(eg, {"tp", "ep", "pp"});

  // Both halves of a layer must agree on who the pipeline neighbours are (Megatron
  // asserts the same); an order with pp in the middle and etp != tp breaks that.
  if (kind_groups(eg, {"pp"}) != r.groups_["pp"]) {
    const auto below_pp = [&](const Generator& g) {
      const auto it = std::find(g.dims.begin(), g.dims.end(), "pp");
      return g.strides()[static_cast<std::size_t>(it - g.dims.begin())];
    };
    throw TopologyError("order '" + s.order + "' gives the dense and expert generators different pp groups " +
                        "(the dimensions before pp multiply to " + std::to_string(below_pp(dg)) + " densely but " +
                        std::to_string(below_pp(eg)) + " for experts); put pp last in the order, or choose " +
                        "sizes that make those products equal");
  }

  // Embedding: the first and last stage of each pipeline share the word embedding;
  // the position embedding lives on the first stage only.
  auto& emb = r.groups_["embedding"];
  auto& pos = r.groups_["position_embedding"];
  for (const auto& g : r.groups_["pp"]) {
    emb.push_back(g.size() > 1 ? std::vector<int>{g.front(), g.back()} : std::vector<int>{g.front()});
    pos.push_back({g.front()});
  }

  for (const auto& [kind, groups] : r.groups_) {
    auto& w = r.where_[kind];
    w.assign(s.world, {-1, -1});
    for (std::size_t gi = 0; gi < groups.size(); ++gi)
      for (std::size_t pi = 0; pi < groups[gi].size(); ++pi)
        w[groups[gi][pi]] = {static_cast<int>(gi), static_cast<int>(pi)};
  }
  return r;
}

const std::vector<std::vector<int>>& RankGroups::groups(const std::string& kind) const {
  auto it = groups_.find(kind);
  if (it == groups_.end()) {
    std::string valid;
    for (const auto& k : kinds()) valid += (valid.empty() ? "" : ", ") + k;
    throw TopologyError("unknown group kind '" + kind + "' (valid: " + valid + ")");
  }
  return it->second;
}

const std::vector<int>& RankGroups::group_of(const std::string& kind, int rank) const {
  static const std::vector<int> none;
  const auto& gs = groups(kind);
  if (rank < 0 || rank >= world_)
    throw TopologyError("rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world_));
  const int gi = where_.at(kind)[rank].first;
  return gi < 0 ? none : gs[gi];
}

int RankGroups::rank_in_group(const std::string& kind, int rank) const {
  groups(kind);  // validates the kind
  if (rank < 0 || rank >= world_)
    throw TopologyError("rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world_));
  return where_.at(kind)[rank].second;
}

Coords RankGroups::coords(int rank) const {
  if (rank < 0 || rank >= world_)
    throw TopologyError("rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world_));
  const Generator dg = dense_of(dims_, sizes_, dp_);
  const Generator eg = expert_of(dims_, sizes_, etp_, edp_);
  Coords c;
  c.tp = dg.coord(rank, "tp");
  c.cp = dg.coord(rank, "cp");
  c.dp = dg.coord(rank, "dp");
  c.pp = dg.coord(rank, "pp");  // build() checked that the expert side agrees
  c.etp = eg.coord(rank, "tp");
  c.ep = eg.coord(rank, "ep");
  c.edp = eg.coord(rank, "dp");
  return c;
}

int RankGroups::rank_of(const Coords& c) const {
  const Generator dg = dense_of(dims_, sizes_, dp_);
  const auto stride = dg.strides();
  int rank = 0;
  for (std::size_t i = 0; i < dg.dims.size(); ++i) {
    const auto& d = dg.dims[i];
    const int v = d == "tp" ? c.tp : d == "cp" ? c.cp : d == "dp" ? c.dp : d == "pp" ? c.pp : 0;
    if (v < 0 || v >= dg.sizes[i])
      throw TopologyError(d + " coordinate " + std::to_string(v) + " is outside 0.." +
                          std::to_string(dg.sizes[i] - 1));
    rank += v * stride[i];
  }
  return rank;
}

}  // namespace loom::topology
