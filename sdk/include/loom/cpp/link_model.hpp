// An alpha-beta network model: what each collective and point-to-point transfer costs
// on a given link. comm/local's option `links` makes every collective last at least
// this long, so a run on one machine (ranks as threads, shared memory) shows what a
// cluster's communication costs; `loom plan --perf` estimates step times with it.
// Header-only, so a comm plugin built out of tree can use it too.
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

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string>

namespace loom {

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
inline double collective_seconds(const Link& link, CollectiveKind kind, int members, double bytes);

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

namespace link_detail {

inline std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

struct Unit {
  const char* name;
  double scale;
};

// A number followed by one of `units` (e.g. "25GB/s", "10us"), scaled; `what`
// names the quantity in the error, with `rule` saying what is valid.
inline double parse_quantity(const std::string& text, const std::string& entry, std::initializer_list<Unit> units,
                      bool zero_ok, const char* what, const char* rule) {
  size_t used = 0;
  double v = 0;
  try {
    // Decimal only (stod would also take hexadecimal).
    if (text.find_first_of("xX") == std::string::npos) v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = trim(text.substr(used));
  double scale = 0;
  for (const Unit& u : units)
    if (unit == u.name) scale = u.scale;
  if (used == 0 || scale == 0 || !std::isfinite(v) || v < 0 || (v == 0 && !zero_ok))
    throw std::invalid_argument("link '" + entry + "': " + what + " '" + text + "' must be " + rule);
  return v * scale;
}

// Bounds that keep every modelled time finite and a run's wait sane: a link of at
// least 1 MB/s, a latency of at most 1 s.
inline constexpr double kMinBytesPerS = 1e6, kMaxLatencyS = 1.0;

inline double parse_bandwidth(const std::string& text, const std::string& entry) {
  const double v =
      parse_quantity(text, entry, {{"GB/s", 1e9}, {"MB/s", 1e6}, {"Gb/s", 1e9 / 8}, {"Mb/s", 1e6 / 8}}, false,
                     "bandwidth", "a positive number with a unit: GB/s, MB/s, Gb/s or Mb/s (e.g. 25GB/s)");
  if (v < kMinBytesPerS)
    throw std::invalid_argument("link '" + entry + "': bandwidth '" + text + "' is below the 1MB/s this model takes");
  return v;
}

inline double parse_latency(const std::string& text, const std::string& entry) {
  const double v = parse_quantity(text, entry, {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}}, true, "latency",
                                  "a number >= 0 with a unit: ns, us, ms or s (e.g. 10us)");
  if (v > kMaxLatencyS)
    throw std::invalid_argument("link '" + entry + "': latency '" + text + "' is above the 1s this model takes");
  return v;
}

// The group kinds the engine creates (loom_group_desc.kind), and "*" for any other.
inline bool known_kind(const std::string& kind) {
  static const char* kKinds[] = {"*",         "world",   "tp",    "cp",      "dp",         "pp",
                                 "ep",        "etp",     "edp",   "dp-cp",   "tp-dp-cp",   "tp-dp",
                                 "tp-cp",     "tp-pp",   "etp-ep", "etp-ep-pp", "embedding", "position_embedding"};
  for (const char* k : kKinds)
    if (kind == k) return true;
  return false;
}

inline int ceil_log2(int p) {
  int steps = 0;
  while ((1 << steps) < p) ++steps;
  return steps;
}

}  // namespace link_detail

inline double collective_seconds(const Link& link, CollectiveKind kind, int members, double bytes) {
  if (members <= 1 || link.ideal()) return 0;
  const double p = members;
  switch (kind) {
    case CollectiveKind::AllReduce: return 2 * (p - 1) * link.transfer_s(bytes / p);
    case CollectiveKind::AllGather:
    case CollectiveKind::ReduceScatter:
    case CollectiveKind::AllToAll: return (p - 1) * link.transfer_s(bytes);
    case CollectiveKind::Broadcast: return link_detail::ceil_log2(members) * link.transfer_s(bytes);
    case CollectiveKind::Barrier: return 2 * link_detail::ceil_log2(members) * link.latency_s;
  }
  return 0;
}

inline LinkModel LinkModel::parse(const std::string& spec) {
  LinkModel m;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t end = std::min(spec.find(';', pos), spec.size());
    const std::string entry = link_detail::trim(spec.substr(pos, end - pos));
    pos = end + 1;
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument("link '" + entry + "' must be KIND=BANDWIDTH[,LATENCY], e.g. dp=25GB/s,10us");
    const std::string kind = link_detail::trim(entry.substr(0, eq)), value = entry.substr(eq + 1);
    if (kind.empty()) throw std::invalid_argument("link '" + entry + "' names no group kind (tp, dp, pp, ..., or *)");
    if (!link_detail::known_kind(kind))
      throw std::invalid_argument("link '" + entry + "': '" + kind + "' is not a group kind; valid: tp, cp, dp, pp, "
                                  "ep, etp, edp, dp-cp, tp-dp-cp, tp-dp, tp-cp, tp-pp, etp-ep, etp-ep-pp, embedding, "
                                  "position_embedding, world, or * for any other");
    const size_t comma = value.find(',');
    Link link;
    link.bytes_per_s = link_detail::parse_bandwidth(link_detail::trim(value.substr(0, comma)), entry);
    if (comma != std::string::npos) link.latency_s = link_detail::parse_latency(link_detail::trim(value.substr(comma + 1)), entry);
    if (!m.links_.emplace(kind, link).second)
      throw std::invalid_argument("link '" + entry + "': group kind '" + kind + "' is given twice");
  }
  return m;
}

inline Link LinkModel::link(const std::string& kind) const {
  auto it = links_.find(kind);
  if (it == links_.end()) it = links_.find("*");
  return it == links_.end() ? Link{} : it->second;
}

}  // namespace loom
