// A network model for measuring on one machine: each collective and point-to-point
// transfer takes at least the time a given link would take, so a run on one machine
// (ranks as threads, shared memory) shows what a cluster's communication costs.
//
// Links are per group kind ("tp", "dp", "pp", "ep", "cp", "dp-cp", ...; "*" for any
// other), written as  "tp=450GB/s,2us; dp=25GB/s,10us; *=12.5GB/s,10us": bandwidth
// β in GB/s or Gb/s (decimal), latency α in ns, us, ms or s (default 0). Costs are
// those of the ring algorithms NCCL uses for large messages (the alpha-beta model):
//   all-reduce       2(p-1) (α + n/(p β))        n = the buffer's bytes
//   all-gather       (p-1) (α + c/β)              c = one member's piece
//   reduce-scatter   (p-1) (α + c/β)
//   all-to-all       (p-1) (α + c/β)              c = the piece sent to each peer
//   broadcast        ⌈log2 p⌉ (α + n/β)           a binomial tree
//   barrier          2 ⌈log2 p⌉ α
//   send → recv      α + n/β                      the receive completes no earlier
// Links are independent: transfers on one link do not slow another, and a rank's
// successive sends do not queue behind each other.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <string>

namespace loom::comm_common {

struct Link {
  double bytes_per_s = 0;  // 0: an ideal link (no modelled time)
  double latency_s = 0;
  bool ideal() const { return bytes_per_s <= 0 && latency_s <= 0; }
  // Seconds to move `bytes` once over the link.
  double transfer_s(double bytes) const { return latency_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0); }
};

enum class CollectiveKind { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier };

// Seconds collective `kind` takes over `link` among `members` ranks; `bytes` as in
// the table above (the buffer for all-reduce and broadcast, one piece otherwise).
double collective_seconds(const Link& link, CollectiveKind kind, int members, double bytes);

class LinkModel {
 public:
  LinkModel() = default;  // every link ideal
  // Parses the spec above; throws std::invalid_argument saying what is wrong.
  static LinkModel parse(const std::string& spec);
  // The link of a group kind: its own, else "*", else ideal.
  Link link(const std::string& kind) const;
  bool empty() const { return links_.empty(); }

 private:
  std::map<std::string, Link> links_;
};

// Sleeps until `start` + `seconds` (returns at once when that has passed).
void wait_until(std::chrono::steady_clock::time_point start, double seconds);

}  // namespace loom::comm_common
