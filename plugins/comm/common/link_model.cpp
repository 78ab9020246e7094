#include "link_model.hpp"

#include <cctype>
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <thread>

namespace loom::comm_common {

namespace {

std::string trim(const std::string& s) {
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
double parse_quantity(const std::string& text, const std::string& entry, std::initializer_list<Unit> units,
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
constexpr double kMinBytesPerS = 1e6, kMaxLatencyS = 1.0;

double parse_bandwidth(const std::string& text, const std::string& entry) {
  const double v =
      parse_quantity(text, entry, {{"GB/s", 1e9}, {"MB/s", 1e6}, {"Gb/s", 1e9 / 8}, {"Mb/s", 1e6 / 8}}, false,
                     "bandwidth", "a positive number with a unit: GB/s, MB/s, Gb/s or Mb/s (e.g. 25GB/s)");
  if (v < kMinBytesPerS)
    throw std::invalid_argument("link '" + entry + "': bandwidth '" + text + "' is below the 1MB/s this model takes");
  return v;
}

double parse_latency(const std::string& text, const std::string& entry) {
  const double v = parse_quantity(text, entry, {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}}, true, "latency",
                                  "a number >= 0 with a unit: ns, us, ms or s (e.g. 10us)");
  if (v > kMaxLatencyS)
    throw std::invalid_argument("link '" + entry + "': latency '" + text + "' is above the 1s this model takes");
  return v;
}

// The group kinds the engine creates (loom_group_desc.kind), and "*" for any other.
bool known_kind(const std::string& kind) {
  static const char* kKinds[] = {"*",         "world",   "tp",    "cp",      "dp",         "pp",
                                 "ep",        "etp",     "edp",   "dp-cp",   "tp-dp-cp",   "tp-dp",
                                 "tp-cp",     "tp-pp",   "etp-ep", "etp-ep-pp", "embedding", "position_embedding"};
  for (const char* k : kKinds)
    if (kind == k) return true;
  return false;
}

int ceil_log2(int p) {
  int steps = 0;
  while ((1 << steps) < p) ++steps;
  return steps;
}

}  // namespace

double collective_seconds(const Link& link, CollectiveKind kind, int members, double bytes) {
  if (members <= 1 || link.ideal()) return 0;
  const double p = members;
  switch (kind) {
    case CollectiveKind::AllReduce: return 2 * (p - 1) * link.transfer_s(bytes / p);
    case CollectiveKind::AllGather:
    case CollectiveKind::ReduceScatter:
    case CollectiveKind::AllToAll: return (p - 1) * link.transfer_s(bytes);
    case CollectiveKind::Broadcast: return ceil_log2(members) * link.transfer_s(bytes);
    case CollectiveKind::Barrier: return 2 * ceil_log2(members) * link.latency_s;
  }
  return 0;
}

LinkModel LinkModel::parse(const std::string& spec) {
  LinkModel m;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t end = std::min(spec.find(';', pos), spec.size());
    const std::string entry = trim(spec.substr(pos, end - pos));
    pos = end + 1;
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument("link '" + entry + "' must be KIND=BANDWIDTH[,LATENCY], e.g. dp=25GB/s,10us");
    const std::string kind = trim(entry.substr(0, eq)), value = entry.substr(eq + 1);
    if (kind.empty()) throw std::invalid_argument("link '" + entry + "' names no group kind (tp, dp, pp, ..., or *)");
    if (!known_kind(kind))
      throw std::invalid_argument("link '" + entry + "': '" + kind + "' is not a group kind; valid: tp, cp, dp, pp, "
                                  "ep, etp, edp, dp-cp, tp-dp-cp, tp-dp, tp-cp, tp-pp, etp-ep, etp-ep-pp, embedding, "
                                  "position_embedding, world, or * for any other");
    const size_t comma = value.find(',');
    Link link;
    link.bytes_per_s = parse_bandwidth(trim(value.substr(0, comma)), entry);
    if (comma != std::string::npos) link.latency_s = parse_latency(trim(value.substr(comma + 1)), entry);
    if (!m.links_.emplace(kind, link).second)
      throw std::invalid_argument("link '" + entry + "': group kind '" + kind + "' is given twice");
  }
  return m;
}

Link LinkModel::link(const std::string& kind) const {
  auto it = links_.find(kind);
  if (it == links_.end()) it = links_.find("*");
  return it == links_.end() ? Link{} : it->second;
}

void wait_until(std::chrono::steady_clock::time_point start, double seconds) {
  if (seconds <= 0) return;
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double>(seconds)));
}

}  // namespace loom::comm_common
