// Rank groups (Megatron-Core's parallel_state.py and its RankGenerator orders): the worked
// 16-rank examples of parallel_state.py's docstring, structural properties over
// many configurations and orders, error messages, and the `loom groups` command.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cli/commands.hpp"
#include "engine/topology/rank_groups.hpp"
#include "support/json_line.hpp"

namespace {

using loom::topology::Coords;
using loom::topology::ParallelSizes;
using loom::topology::RankGroups;
using loom::topology::TopologyError;
using Groups = std::vector<std::vector<int>>;

ParallelSizes make(int world, int tp, int cp, int pp, int ep = 1, int etp = 0,
                   std::string order = "tp-cp-ep-dp-pp") {
  ParallelSizes s;
  s.world = world;
  s.tp = tp;
  s.cp = cp;
  s.pp = pp;
  s.ep = ep;
  s.etp = etp;
  s.order = std::move(order);
  return s;
}

Groups singletons(int n) {
  Groups g;
  for (int i = 0; i < n; ++i) g.push_back({i});
  return g;
}

std::string error_of(const ParallelSizes& s) {
  try {
    RankGroups::build(s);
  } catch (const TopologyError& e) {
    return e.what();
  }
  return "(no error)";
}

// ---- worked examples: 16 ranks as Megatron-LM's initialize_model_parallel docstring
// (megatron/core/parallel_state.py) lays them out, dense and with MoE folding ----

TEST(RankGroups, DenseTp4Pp2Dp2MatchesMegatronsLayout) {
  const auto rg = RankGroups::build(make(16, 4, 1, 2));
  EXPECT_EQ(rg.dp(), 2);
  EXPECT_EQ(rg.groups("tp"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(rg.groups("dp"),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  const Groups pp{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}};
  EXPECT_EQ(rg.groups("pp"), pp);
  EXPECT_EQ(rg.groups("cp"), singletons(16));
  EXPECT_EQ(rg.groups("dp-cp"), rg.groups("dp"));
  EXPECT_EQ(rg.groups("tp-dp-cp"), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(rg.groups("tp-pp"),
            (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // With two stages the first and last rank of each pipeline are its whole pp group.
  EXPECT_EQ(rg.groups("embedding"), pp);
  EXPECT_EQ(rg.groups("position_embedding"),
            (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(rg.group_of("position_embedding", 9), std::vector<int>{});
  EXPECT_EQ(rg.rank_in_group("position_embedding", 9), -1);
  EXPECT_EQ(rg.group_of("embedding", 13), (std::vector<int>{5, 13}));
  EXPECT_EQ(rg.rank_in_group("embedding", 13), 1);
}

TEST(RankGroups, MoeEtp1Pp2Ep4Edp2MatchesMegatronsLayout) {
  const auto rg = RankGroups::build(make(16, 4, 1, 2, /*ep=*/4, /*etp=*/1));
  EXPECT_EQ(rg.etp(), 1);
  EXPECT_EQ(rg.edp(), 2);
  EXPECT_EQ(rg.groups("ep"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(rg.groups("edp"),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(rg.groups("pp"),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(rg.groups("etp"), singletons(16));
  EXPECT_EQ(rg.groups("etp-ep"), rg.groups("ep"));
  EXPECT_EQ(rg.groups("etp-ep-pp"),
            (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // The dense side of the same world is the TP4-PP2-DP2 example.
  EXPECT_EQ(rg.groups("tp"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  // Folding: rank 13 is tp 1 / dp 1 densely but ep 1 / edp 1 on the expert side.
  const Coords c = rg.coords(13);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.etp, 0);
  EXPECT_EQ(c.ep, 1);
  EXPECT_EQ(c.edp, 1);
}

TEST(RankGroups, SingleStageEmbeddingIsEveryRankAlone) {
  const auto rg = RankGroups::build(make(4, 2, 1, 1));
  EXPECT_EQ(rg.groups("embedding"), singletons(4));
  EXPECT_EQ(rg.groups("position_embedding"), singletons(4));
  EXPECT_EQ(rg.etp(), 2);  // etp 0 means "same as tp"
}

TEST(RankGroups, NonDefaultOrderPutsDpFastest) {
  // dp-tp-cp-ep-pp: rank = dp + tp·dp + pp·dp·tp·cp.
  const auto rg = RankGroups::build(make(8, 2, 1, 2, 1, 0, "dp-tp-cp-ep-pp"));
  EXPECT_EQ(rg.groups("dp"), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(rg.groups("tp"), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(rg.groups("pp"), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // Rank-in-group follows the order string, not the kind's spelling: dp varies fastest.
  EXPECT_EQ(rg.groups("tp-dp"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
}

// ---- properties over many configurations ----

// Dimension sizes by order name for one generator.
struct Gen {
  std::vector<std::string> dims;
  std::map<std::string, int> size;
};

std::vector<std::string> full_order(const std::string& order) {
  std::vector<std::string> d;
  std::stringstream ss(order);
  for (std::string t; std::getline(ss, t, '-');) d.push_back(t);
  for (const char* n : {"tp", "cp", "ep", "dp", "pp"})
    if (std::find(d.begin(), d.end(), n) == d.end()) d.push_back(n);
  return d;
}

// The rank of a coordinate tuple, straight from the spec's formula generalised to
// any order: coordinates weighted by the product of the sizes before them.
int spec_rank(const Gen& g, const std::map<std::string, int>& coord) {
  int rank = 0, stride = 1;
  for (const auto& d : g.dims) {
    rank += coord.at(d) * stride;
    stride *= g.size.at(d);
  }
  return rank;
}

std::map<std::string, int> dense_coord(const Coords& c) {
  return {{"tp", c.tp}, {"cp", c.cp}, {"ep", 0}, {"dp", c.dp}, {"pp", c.pp}};
}
std::map<std::string, int> expert_coord(const Coords& c) {
  return {{"tp", c.etp}, {"cp", 0}, {"ep", c.ep}, {"dp", c.edp}, {"pp", c.pp}};
}

struct KindSpec {
  std::string kind;
  bool expert;
  std::set<std::string> masked;  // generator dimension names
};

const std::vector<KindSpec>& kind_specs() {
  static const std::vector<KindSpec> k = {
      {"tp", false, {"tp"}},           {"cp", false, {"cp"}},
      {"dp", false, {"dp"}},           {"pp", false, {"pp"}},
      {"dp-cp", false, {"dp", "cp"}},  {"tp-pp", false, {"tp", "pp"}},
      {"tp-dp-cp", false, {"tp", "dp", "cp"}},
      {"tp-dp", false, {"tp", "dp"}},  {"tp-cp", false, {"tp", "cp"}},
      {"ep", true, {"ep"}},            {"etp", true, {"tp"}},
      {"edp", true, {"dp"}},           {"etp-ep", true, {"tp", "ep"}},
      {"etp-ep-pp", true, {"tp", "ep", "pp"}}};
  return k;
}

void check_properties(const RankGroups& rg, const std::string& label) {
  SCOPED_TRACE(label);
  const auto& s = rg.sizes();
  const int world = rg.world();
  const auto dims = full_order(s.order);
  const Gen dense{dims, {{"tp", s.tp}, {"cp", s.cp}, {"ep", 1}, {"dp", rg.dp()}, {"pp", s.pp}}};
  const Gen expert{dims, {{"tp", rg.etp()}, {"cp", 1}, {"ep", s.ep}, {"dp", rg.edp()}, {"pp", s.pp}}};
  ASSERT_EQ(s.tp * s.cp * rg.dp() * s.pp, world);
  ASSERT_EQ(rg.etp() * s.ep * rg.edp() * s.pp, world);

  // Coordinates: in range, matching the rank formula, and round-tripping.
  std::vector<Coords> co(world);
  std::vector<std::map<std::string, int>> dense_co(world), expert_co(world);
  for (int r = 0; r < world; ++r) {
    co[r] = rg.coords(r);
    dense_co[r] = dense_coord(co[r]);
    expert_co[r] = expert_coord(co[r]);
    ASSERT_EQ(spec_rank(dense, dense_coord(co[r])), r);
    ASSERT_EQ(spec_rank(expert, expert_coord(co[r])), r);
    ASSERT_EQ(rg.rank_of(co[r]), r);
    ASSERT_LT(co[r].tp, s.tp);
    ASSERT_LT(co[r].dp, rg.dp());
    ASSERT_LT(co[r].edp, rg.edp());
  }

  for (const auto& k : kind_specs()) {
    SCOPED_TRACE(k.kind);
    const Gen& g = k.expert ? expert : dense;
    int expected_size = 1;
    for (const auto& d : k.masked) expected_size *= g.size.at(d);
    const auto& groups = rg.groups(k.kind);
    ASSERT_EQ(static_cast<int>(groups.size()) * expected_size, world);
    std::vector<int> seen(world, 0);
    for (const auto& grp : groups) {
      ASSERT_EQ(static_cast<int>(grp.size()), expected_size);
      const auto& c0 = (k.expert ? expert_co : dense_co)[grp[0]];
      for (std::size_t i = 0; i < grp.size(); ++i) {
        const int r = grp[i];
        ++seen[r];
        const auto& c = (k.expert ? expert_co : dense_co)[r];
        // Members differ only in masked coordinates, and their position in the
        // group enumerates the masked ones fastest-first in order.
        int pos = 0, stride = 1;
        for (const auto& d : g.dims) {
          if (k.masked.count(d)) {
            pos += c.at(d) * stride;
            stride *= g.size.at(d);
          } else {
            ASSERT_EQ(c.at(d), c0.at(d)) << "rank " << r << " differs in " << d;
          }
        }
        ASSERT_EQ(pos, static_cast<int>(i));
        ASSERT_EQ(rg.group_of(k.kind, r), grp);
        ASSERT_EQ(rg.rank_in_group(k.kind, r), static_cast<int>(i));
      }
    }
    for (int r = 0; r < world; ++r) ASSERT_EQ(seen[r], 1) << "rank " << r;
  }

  // A tp group and a dp group share at most one rank.
  for (const auto& t : rg.groups("tp"))
    for (const auto& d : rg.groups("dp")) {
      int common = 0;
      for (int r : t) common += std::count(d.begin(), d.end(), r);
      ASSERT_LE(common, 1);
    }

  // tp-dp-cp of a rank = every rank on its pipeline stage.
  for (int r = 0; r < world; ++r) {
    std::vector<int> stage;
    for (int q = 0; q < world; ++q)
      if (co[q].pp == co[r].pp) stage.push_back(q);
    auto got = rg.group_of("tp-dp-cp", r);
    std::sort(got.begin(), got.end());
    ASSERT_EQ(got, stage);
  }

  // Embedding groups: first and last of each pipeline; position: the first.
  const auto& pp = rg.groups("pp");
  ASSERT_EQ(rg.groups("embedding").size(), pp.size());
  for (std::size_t i = 0; i < pp.size(); ++i) {
    const auto& e = rg.groups("embedding")[i];
    ASSERT_EQ(e.front(), pp[i].front());
    ASSERT_EQ(e.back(), pp[i].back());
    ASSERT_EQ(e.size(), s.pp > 1 ? 2u : 1u);
    ASSERT_EQ(rg.groups("position_embedding")[i], std::vector<int>{pp[i].front()});
  }
  for (int r = 0; r < world; ++r) {
    const bool first = co[r].pp == 0, last = co[r].pp == s.pp - 1;
    ASSERT_EQ(rg.rank_in_group("embedding", r) >= 0, first || last);
    ASSERT_EQ(rg.rank_in_group("position_embedding", r) >= 0, first);
  }
}

TEST(RankGroups, PropertiesHoldAcrossConfigurationsAndOrders) {
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "pp-tp-cp-ep-dp", "dp-tp-cp-ep-pp",
                                           "cp-tp-dp-ep-pp", "ep-dp-cp-tp-pp", "tp-cp-ep-pp-dp"};
  int built = 0, rejected_pp = 0;
  for (int world : {1, 4, 6, 8, 12, 16, 24})
    for (int tp : {1, 2, 3, 4})
      for (int cp : {1, 2})
        for (int pp : {1, 2, 3, 4})
          for (int ep : {1, 2, 4})
            for (int etp : {0, 1, 2})
              for (const auto& order : orders) {
                const auto s = make(world, tp, cp, pp, ep, etp, order);
                const int e = etp == 0 ? tp : etp;
                const bool fits = world % (tp * cp * pp) == 0 && world % (e * ep * pp) == 0;
                std::ostringstream label;
                label << "world " << world << " tp " << tp << " cp " << cp << " pp " << pp << " ep " << ep
                      << " etp " << etp << " order " << order;
                if (!fits) {
                  EXPECT_NE(error_of(s).find("is not divisible by"), std::string::npos) << label.str();
                  continue;
                }
                // With pp not last, the two generators agree on pp groups only when
                // the dims below pp have the same product on both sides.
                if (order == "tp-cp-ep-pp-dp" && pp > 1 && tp * cp != e * ep) {
                  EXPECT_NE(error_of(s).find("different pp groups"), std::string::npos) << label.str();
                  ++rejected_pp;
                  continue;
                }
                const auto rg = RankGroups::build(s);
                check_properties(rg, label.str());
                if (::testing::Test::HasFatalFailure()) return;
                ++built;
              }
  EXPECT_GT(built, 500);
  EXPECT_GT(rejected_pp, 0);
}

TEST(RankGroups, OrderMayOmitSizeOneDimensions) {
  const auto rg = RankGroups::build(make(8, 2, 1, 2, 1, 0, "tp-dp-pp"));
  EXPECT_EQ(rg.groups("dp"), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  check_properties(rg, "tp-dp-pp");
}

// ---- errors ----

TEST(RankGroups, NonDividingWorldNamesTheProduct) {
  EXPECT_NE(error_of(make(6, 2, 1, 4)).find("world size 6 is not divisible by tp·cp·pp = 2·1·4 = 8"),
            std::string::npos)
      << error_of(make(6, 2, 1, 4));
  EXPECT_NE(error_of(make(16, 4, 1, 2, 3, 1)).find("world size 16 is not divisible by etp·ep·pp = 1·3·2 = 6"),
            std::string::npos)
      << error_of(make(16, 4, 1, 2, 3, 1));
  // etp defaults to tp, so the expert product uses it.
  EXPECT_NE(error_of(make(8, 2, 1, 1, 8)).find("etp·ep·pp = 2·8·1 = 16"), std::string::npos);
}

TEST(RankGroups, BadOrderNamesTheValidForm) {
  for (const std::string order : {"tp-xx-pp", "tp-tp-dp", "tp--dp", "", "TP-cp-ep-dp-pp"}) {
    const auto msg = error_of(make(4, 2, 1, 1, 1, 0, order));
    EXPECT_NE(msg.find("bad order string '" + order + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tp-cp-ep-dp-pp"), std::string::npos) << msg;
  }
  // Leaving out a dimension whose size is not 1 is refused, naming it.
  const auto msg = error_of(make(8, 2, 1, 2, 1, 0, "tp-pp"));
  EXPECT_NE(msg.find("leaves out dp, whose size is 2"), std::string::npos) << msg;
}

TEST(RankGroups, MismatchedPipelineGroupsAreRefused) {
  // pp below dp: dense pp stride tp = 2, expert pp stride etp·ep = 4.
  const auto msg = error_of(make(16, 2, 1, 2, 4, 1, "tp-cp-ep-pp-dp"));
  EXPECT_NE(msg.find("different pp groups"), std::string::npos) << msg;
}

TEST(RankGroups, BadSizesKindsAndRanksThrow) {
  EXPECT_NE(error_of(make(4, 0, 1, 1)).find("tp must be at least 1"), std::string::npos);
  EXPECT_NE(error_of(make(0, 1, 1, 1)).find("world size must be at least 1"), std::string::npos);
  const auto rg = RankGroups::build(make(4, 2, 1, 1));
  EXPECT_THROW(rg.groups("xp"), TopologyError);
  EXPECT_THROW(rg.group_of("tp", 4), TopologyError);
  EXPECT_THROW(rg.coords(-1), TopologyError);
  Coords c;
  c.tp = 2;
  EXPECT_THROW(rg.rank_of(c), TopologyError);
  EXPECT_EQ(RankGroups::kinds().size(), 16u);
  for (const auto& k : RankGroups::kinds()) EXPECT_NO_THROW(rg.groups(k)) << k;
}

// ---- loom groups ----

struct Run {
  int rc;
  std::string out, err;
};

Run run_groups(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  std::ostringstream out, err;
  auto* old_out = std::cout.rdbuf(out.rdbuf());
  auto* old_err = std::cerr.rdbuf(err.rdbuf());
  int rc = -1;
  try {
    rc = loom::cli::cmd_groups(static_cast<int>(argv.size()), argv.data());
  } catch (...) {
    std::cout.rdbuf(old_out);
    std::cerr.rdbuf(old_err);
    throw;
  }
  std::cout.rdbuf(old_out);
  std::cerr.rdbuf(old_err);
  return {rc, out.str(), err.str()};
}

TEST(CmdGroups, JsonForTp4Pp2Dp2) {
  const auto run = run_groups({"--world-size", "16", "--tp", "4", "--pp", "2", "--cp", "1", "--json"});
  ASSERT_EQ(run.rc, 0) << run.err;
  EXPECT_EQ(run.err, "");
  const nlohmann::ordered_json j = loom::testing::json_line(run.out);
  ASSERT_TRUE(j.is_object()) << run.out;
  ASSERT_EQ(j.size(), 2u) << run.out;
  EXPECT_EQ(j.begin().key(), "world_size");
  EXPECT_EQ(j.at("world_size"), 16);
  const nlohmann::ordered_json& groups = j.at("groups");
  EXPECT_EQ(groups.at("tp"), nlohmann::ordered_json::parse("[[0,1,2,3],[4,5,6,7],[8,9,10,11],[12,13,14,15]]"));
  EXPECT_EQ(groups.at("dp"), nlohmann::ordered_json::parse("[[0,4],[1,5],[2,6],[3,7],[8,12],[9,13],[10,14],[11,15]]"));

  // Every kind, in kinds() order, with exactly the library's groups.
  const auto rg = RankGroups::build(make(16, 4, 1, 2));
  ASSERT_EQ(groups.size(), RankGroups::kinds().size());
  std::size_t k = 0;
  for (const auto& [kind, value] : groups.items()) {
    EXPECT_EQ(kind, RankGroups::kinds()[k]);
    EXPECT_EQ(value.get<Groups>(), rg.groups(RankGroups::kinds()[k])) << kind;
    ++k;
  }
}

TEST(CmdGroups, JsonForFourRanksExactly) {
  const auto run = run_groups({"--world-size", "4", "--tp", "2", "--pp", "1", "--cp", "1", "--json"});
  ASSERT_EQ(run.rc, 0) << run.err;
  EXPECT_EQ(loom::testing::json_line(run.out),
            nlohmann::ordered_json::parse(
                R"({"world_size": 4, "groups": {"tp": [[0,1],[2,3]], "cp": [[0],[1],[2],[3]], )"
                R"("dp": [[0,2],[1,3]], "pp": [[0],[1],[2],[3]], "dp-cp": [[0,2],[1,3]], )"
                R"("tp-pp": [[0,1],[2,3]], "tp-dp-cp": [[0,1,2,3]], "tp-dp": [[0,1,2,3]], )"
                R"("tp-cp": [[0,1],[2,3]], "embedding": [[0],[1],[2],[3]], )"
                R"("position_embedding": [[0],[1],[2],[3]], "ep": [[0],[1],[2],[3]], )"
                R"("etp": [[0,1],[2,3]], "edp": [[0,2],[1,3]], "etp-ep": [[0,1],[2,3]], )"
                R"("etp-ep-pp": [[0,1],[2,3]]}})"))
      << run.out;
}

TEST(CmdGroups, TableShowsSizesGroupsAndLayout) {
  const auto run = run_groups({"--world-size=16", "--tp=4", "--pp=2", "--ep=4", "--etp=1"});
  ASSERT_EQ(run.rc, 0) << run.err;
  EXPECT_NE(run.out.find("dense   tp 4  cp 1  pp 2  dp 2"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("expert  etp 1  ep 4  pp 2  edp 2"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("[0,4] [1,5] [2,6] [3,7] [8,12]"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("etp-ep-pp"), std::string::npos);
  EXPECT_NE(run.out.find("layout"), std::string::npos);
  EXPECT_NE(run.out.find("expert layout"), std::string::npos);
  EXPECT_NE(run.out.find("pp1"), std::string::npos);
  // No picture for big worlds.
  const auto big = run_groups({"--world-size", "128", "--tp", "8"});
  ASSERT_EQ(big.rc, 0);
  EXPECT_EQ(big.out.find("layout"), std::string::npos);
}

TEST(CmdGroups, ExitCodes) {
  const auto impossible = run_groups({"--world-size", "6", "--tp", "2", "--pp", "4"});
  EXPECT_EQ(impossible.rc, 1);
  EXPECT_EQ(impossible.out, "");
  EXPECT_NE(impossible.err.find("tp·cp·pp = 2·1·4 = 8"), std::string::npos) << impossible.err;
  EXPECT_EQ(std::count(impossible.err.begin(), impossible.err.end(), '\n'), 1);

  EXPECT_EQ(run_groups({"--world-size", "16", "--tp", "4", "--order", "tp-dp-zz"}).rc, 1);
  for (const auto& bad : std::vector<std::vector<std::string>>{
           {"--tp", "2"}, {"--world-size", "x"}, {"--world-size", "4", "--tp", "0"},
           {"--world-size", "4", "--bogus"}, {"--world-size", "4", "extra"}, {"--world-size"}}) {
    const auto r = run_groups(bad);
    EXPECT_EQ(r.rc, 2) << bad.front();
    EXPECT_NE(r.err.find("loom groups --help"), std::string::npos) << r.err;
  }
  const auto help = run_groups({"--help"});
  EXPECT_EQ(help.rc, 0);
  EXPECT_EQ(help.out.rfind("usage: loom groups", 0), 0u);
}

}  // namespace
