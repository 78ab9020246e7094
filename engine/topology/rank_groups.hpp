// Megatron-LM's rank generator (`parallel_state.py`, RankGenerator): the order string, the dense generator
// over tp·cp·dp·pp and the expert generator over etp·ep·edp·pp on the same world
// ("MoE folding"), and every group kind derived from them by mask-and-enumerate.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace loom::topology {

// The most ranks loom runs, and builds the groups of (every rank's groups are held).
constexpr int64_t kMaxWorld = int64_t{1} << 20;

struct ParallelSizes {
  int world = 1;
  int tp = 1, cp = 1, pp = 1, ep = 1;
  int etp = 0;                        // 0 = same as tp
  std::string order = "tp-cp-ep-dp-pp";
  // The expert tensor-parallel size etp resolves to.
  int expert_tp() const { return etp > 0 ? etp : tp; }
  // Whether the experts fold over other ranks than the dense tp split (MoE
  // folding: etp != tp, Megatron-Core's "MoE Parallel Folding").
  bool experts_fold_tp() const { return expert_tp() != tp; }
};

// The group a rank's parameters are replicated over, whose gradients the optimizer
// strategy averages (its `dp`) and whose size pads the gradient buckets: dp, or
// Megatron's dp-cp under context parallelism (cp ranks hold other tokens of the same
// samples, so their gradients are partial sums too).
inline const char* gradient_group_kind(int cp) { return cp > 1 ? "dp-cp" : "dp"; }

class TopologyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A rank's coordinates in both generators.
struct Coords {
  int tp = 0, cp = 0, dp = 0, pp = 0;   // dense
  int etp = 0, ep = 0, edp = 0;         // expert (pp is shared)
};

class RankGroups {
 public:
  // Throws TopologyError naming the product that does not divide the world
  // (e.g. "world size 6 is not divisible by tp·cp·pp = 2·1·4 = 8"), a bad order string,
  // or an order under which the dense and expert generators disagree on pp groups.
  static RankGroups build(const ParallelSizes& sizes);

  int world() const { return world_; }
  int dp() const { return dp_; }
  int edp() const { return edp_; }
  int etp() const { return etp_; }
  const ParallelSizes& sizes() const { return sizes_; }

  // The group kinds, in a stable display order: tp cp dp pp dp-cp tp-pp tp-dp-cp
  // tp-dp tp-cp embedding position_embedding ep etp edp etp-ep etp-ep-pp.
  static const std::vector<std::string>& kinds();
  // Every group of a kind, in the generator's enumeration order; each group lists
  // its ranks in rank-in-group order. Throws TopologyError for an unknown kind.
  const std::vector<std::vector<int>>& groups(const std::string& kind) const;
  // The group of `kind` containing `rank`, and `rank`'s position in it.
  // (embedding/position_embedding: ranks outside any such group get an empty group, -1.)
  const std::vector<int>& group_of(const std::string& kind, int rank) const;
  int rank_in_group(const std::string& kind, int rank) const;

  Coords coords(int rank) const;
  int rank_of(const Coords& c) const;  // dense coordinates to global rank

 private:
  int world_ = 1, dp_ = 1, edp_ = 1, etp_ = 1;
  ParallelSizes sizes_;
  std::map<std::string, std::vector<std::vector<int>>> groups_;
  // The order's five dimensions, fastest-varying first (unlisted size-1 ones appended).
  std::vector<std::string> dims_;
  // Per kind, per rank: {group index, position in group}; {-1, -1} when in no group.
  std::map<std::string, std::vector<std::pair<int, int>>> where_;
};

}  // namespace loom::topology
