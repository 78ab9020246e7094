#include "engine/pipeline/schedule.hpp"

#include "engine/files/temporaries.hpp"

#include "engine/plugins/registry.hpp"
#include "engine/runtime/json.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <climits>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <memory>
#include <ostream>
#include <sstream>

namespace loom::pipeline {
namespace {

std::string sizes_str(const PipelineOrders& o) {
  return "pp " + std::to_string(o.pp) + ", vpp " + std::to_string(o.vpp) + ", microbatches " +
         std::to_string(o.microbatches);
}

std::string ordinal(int n) {
  const int mod100 = n % 100;
  const char* suffix = "th";
  if (mod100 < 11 || mod100 > 13) {
    if (n % 10 == 1) suffix = "st";
    if (n % 10 == 2) suffix = "nd";
    if (n % 10 == 3) suffix = "rd";
  }
  return std::to_string(n) + suffix;
}

// "step 5 (order[5] = -2: backward of chunk 2, microbatch 1)"
std::string step_str(int index, int32_t entry, const StepRef& s) {
  return "step " + std::to_string(index) + " (order[" + std::to_string(index) + "] = " +
         (entry > 0 ? "+" : "") + std::to_string(entry) + ": " + describe(s) + ")";
}

// A trace time in microseconds: to the nanosecond, and 0 for a non-finite one (the
// Trace Event Format needs a number there).
double trace_us(double v) { return std::isfinite(v) ? std::round(v * 1000.0) / 1000.0 : 0.0; }

}  // namespace

std::string describe(const StepRef& s) {
  return std::string(s.forward ? "forward" : "backward") + " of chunk " + std::to_string(s.chunk) +
         ", microbatch " + std::to_string(s.microbatch + 1);
}

std::string schedule_plugin_name(const std::string& schedule) {
  std::string name = schedule;
  if (name.rfind("parallel/", 0) == 0) name = name.substr(9);
  if (name.rfind("pipeline.", 0) != 0) name = "pipeline." + name;
  return name;
}

// ---------------------------------------------------------------------------
// Orders from a plugin
// ---------------------------------------------------------------------------

std::string orders_too_large(long long pp, long long vpp, long long microbatches) {
  // In long double, which holds these products of 64-bit factors without wrapping
  // (their digits printed as whole numbers).
  const long double entries = 2.0L * pp * vpp * microbatches;
  std::ostringstream os;
  os << std::fixed << std::setprecision(0) << "pp " << pp << ", vpp " << vpp << ", microbatches " << microbatches
     << " give " << entries << " pipeline order entries (2 x pp x vpp x microbatches)";
  if (entries > kMaxOrderEntries)
    os << ", more than the " << kMaxOrderEntries << " a schedule is built and checked with: fewer microbatches "
       << "per step or pipeline chunks";
  else if (entries * pp > kMaxSimulationWork)
    os << " over " << pp << " stages, more than the " << kMaxSimulationWork
       << " entries x stages a schedule is checked with: fewer pipeline stages or microbatches";
  else
    return "";
  return os.str();
}

PipelineOrders compute_orders(const plugins::LoadedPlugin& plugin, const loom_options* options, int pp,
                              int vpp, int microbatches, int group_size) {
  PipelineOrders o;
  o.schedule = plugin.key();
  o.pp = pp;
  o.vpp = vpp;
  o.microbatches = microbatches;
  o.group_size = resolve_group_size(group_size, pp);
  if (pp < 1 || vpp < 1 || microbatches < 1 || group_size < 0)
    throw ScheduleError(ScheduleError::Kind::refused,
                        "schedule " + o.schedule + ": pp, vpp and microbatches must be at least 1 and the "
                        "group size at least 0, got " + sizes_str(o) + ", group size " +
                        std::to_string(group_size));
  if (const std::string why = orders_too_large(pp, vpp, microbatches); !why.empty())
    throw ScheduleError(ScheduleError::Kind::refused, "schedule " + o.schedule + ": " + why);
  const int64_t capacity64 = int64_t{2} * vpp * microbatches;

  const loom_schedule_api* api = plugin.schedule();  // throws PluginError when not a schedule
  if (!LOOM_HAS_SLOT(api, loom_schedule_api, order) || api->order == nullptr)
    throw ScheduleError(ScheduleError::Kind::invalid,
                        plugin.file + ": schedule " + o.schedule + " does not implement the order slot");

  std::unique_ptr<plugins::OptionValues> defaults;
  if (options == nullptr) {
    defaults = std::make_unique<plugins::OptionValues>(nullptr, plugin.options);
    options = defaults->raw();
  }
  const loom_host_api* host = plugins::host_api();
  const size_t capacity = static_cast<size_t>(capacity64);
  std::vector<int32_t> buf(capacity);
  for (int r = 0; r < pp; ++r) {
    loom_schedule_args args = loom::make<loom_schedule_args>();
    args.pp = pp;
    args.vpp = vpp;
    args.microbatches = microbatches;
    args.group_size = o.group_size;
    args.rank = r;
    size_t length = 0;
    int32_t warmup = 0;
    std::fill(buf.begin(), buf.end(), 0);
    loom_status st = api->order(options, &args, buf.data(), capacity, &length, &warmup);
    if (st != nullptr) {
      std::string msg = host->status_message(st);
      host->status_destroy(st);
      // Built-in plugins start their message with their own name; say it once.
      if (msg.rfind(o.schedule + ": ", 0) == 0) msg = msg.substr(o.schedule.size() + 2);
      throw ScheduleError(ScheduleError::Kind::refused,
                          o.schedule + " refuses " + sizes_str(o) + ", group size " +
                              std::to_string(o.group_size) + " (rank " + std::to_string(r) + "): " + msg,
                          r);
    }
    if (length > capacity)
      throw ScheduleError(ScheduleError::Kind::invalid,
                          "schedule " + o.schedule + " reported " + std::to_string(length) +
                              " entries for rank " + std::to_string(r) + ", more than the capacity of " +
                              std::to_string(capacity) + " it was given",
                          r);
    o.order.emplace_back(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(length));
    o.warmup.push_back(warmup);
  }
  validate(o);
  return o;
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

std::vector<std::vector<StepRef>> validate(const PipelineOrders& o) {
  const std::string who = "schedule " + o.schedule;
  if (static_cast<int>(o.order.size()) != o.pp || static_cast<int>(o.warmup.size()) != o.pp)
    throw ScheduleError(ScheduleError::Kind::invalid, who + ": expected orders for " + std::to_string(o.pp) +
                                                          " ranks, got " + std::to_string(o.order.size()));
  const size_t expected = static_cast<size_t>(2) * static_cast<size_t>(o.vpp) * static_cast<size_t>(o.microbatches);
  std::vector<std::vector<StepRef>> decoded(static_cast<size_t>(o.pp));
  for (int r = 0; r < o.pp; ++r) {
    const std::vector<int32_t>& order = o.order[static_cast<size_t>(r)];
    const std::string where = who + ", rank " + std::to_string(r);
    if (order.size() != expected)
      throw ScheduleError(ScheduleError::Kind::invalid,
                          where + ": the order has " + std::to_string(order.size()) + " entries but " +
                              sizes_str(o) + " need 2 * vpp * microbatches = " + std::to_string(expected),
                          r);
    const int32_t w = o.warmup[static_cast<size_t>(r)];
    if (w < 0 || int64_t{w} > int64_t{o.vpp} * o.microbatches)
      throw ScheduleError(ScheduleError::Kind::invalid,
                          where + ": warmup " + std::to_string(w) + " is outside 0..vpp * microbatches = 0.." +
                              std::to_string(int64_t{o.vpp} * o.microbatches),
                          r);
    std::vector<int> fwd(static_cast<size_t>(o.vpp) + 1, 0), bwd(static_cast<size_t>(o.vpp) + 1, 0);
    std::vector<StepRef>& steps = decoded[static_cast<size_t>(r)];
    steps.reserve(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      const int32_t e = order[i];
      const int index = static_cast<int>(i);
      if (e == 0 || e > o.vpp || e < -o.vpp)
        throw ScheduleError(ScheduleError::Kind::invalid,
                            where + ", step " + std::to_string(index) + ": entry " + std::to_string(e) +
                                " is not a local chunk; entries are +c (forward) or -c (backward) with c in 1.." +
                                std::to_string(o.vpp),
                            r, index);
      StepRef s;
      s.forward = e > 0;
      s.chunk = e > 0 ? e : -e;
      int& count = (s.forward ? fwd : bwd)[static_cast<size_t>(s.chunk)];
      s.microbatch = count;
      if (count >= o.microbatches)
        throw ScheduleError(ScheduleError::Kind::invalid,
                            where + ", step " + std::to_string(index) + ": a " + ordinal(count + 1) + " " +
                                (s.forward ? "forward" : "backward") + " of chunk " + std::to_string(s.chunk) +
                                ", but there are only " + std::to_string(o.microbatches) + " microbatches",
                            r, index);
      if (!s.forward && fwd[static_cast<size_t>(s.chunk)] <= count)
        throw ScheduleError(ScheduleError::Kind::invalid,
                            where + ", " + step_str(index, e, s) + ": the backward comes before its forward "
                                "on this rank; each -c must follow the matching +c",
                            r, index);
      ++count;
      steps.push_back(s);
    }
  }
  return decoded;
}

// ---------------------------------------------------------------------------
// Simulation
// ---------------------------------------------------------------------------

double Timeline::bubble_fraction() const {
  const double total = static_cast<double>(pp) * static_cast<double>(makespan);
  return total > 0 ? (total - static_cast<double>(busy)) / total : 0.0;
}

Timeline simulate(const PipelineOrders& o, SimCosts costs) {
  const std::vector<std::vector<StepRef>> decoded = validate(o);
  const int pp = o.pp, m = o.microbatches;
  const int g_count = pp * o.vpp;
  auto at_least_one = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int64_t c) { return c >= 1; });
  };
  if (costs.forward < 1 || costs.backward < 1 || !at_least_one(costs.forward_of) ||
      !at_least_one(costs.backward_of) || costs.transfer < 0)
    throw ScheduleError(ScheduleError::Kind::invalid, "simulation costs must be at least one slot");
  auto sized = [&](const std::vector<int64_t>& v) { return v.empty() || v.size() == static_cast<size_t>(g_count); };
  if (!sized(costs.forward_of) || !sized(costs.backward_of))
    throw ScheduleError(ScheduleError::Kind::invalid, "per-chunk simulation costs need one entry per global chunk");
  auto duration = [&](bool forward, int g) {
    const std::vector<int64_t>& of = forward ? costs.forward_of : costs.backward_of;
    return of.empty() ? (forward ? costs.forward : costs.backward) : of[static_cast<size_t>(g)];
  };

  // Where each (direction, global chunk, microbatch) runs: its step on its rank,
  // and when it finished (-1: not yet).
  auto slot = [&](bool forward, int g, int mb) {
    return (static_cast<size_t>(forward ? 0 : 1) * static_cast<size_t>(g_count) + static_cast<size_t>(g)) *
               static_cast<size_t>(m) + static_cast<size_t>(mb);
  };
  const size_t slots = static_cast<size_t>(2) * static_cast<size_t>(g_count) * static_cast<size_t>(m);
  std::vector<int64_t> done(slots, -1);
  std::vector<int> step_of(slots, -1);
  for (int r = 0; r < pp; ++r)
    for (size_t i = 0; i < decoded[static_cast<size_t>(r)].size(); ++i) {
      const StepRef& s = decoded[static_cast<size_t>(r)][i];
      step_of[slot(s.forward, global_chunk(pp, r, s.chunk), s.microbatch)] = static_cast<int>(i);
    }

  // The inputs a step receives: (forward?, global chunk, microbatch) of each producer.
  struct Need {
    bool forward;
    int g;
  };
  struct Needs {
    Need need[2] = {{true, 0}, {true, 0}};
    int count = 0;
    const Need* begin() const { return need; }
    const Need* end() const { return need + count; }
  };
  auto needs = [&](int r, const StepRef& s) {
    Needs n;
    const int g = global_chunk(pp, r, s.chunk);
    if (s.forward) {
      if (g > 0) n.need[n.count++] = {true, g - 1};
    } else {
      n.need[n.count++] = {true, g};  // its own forward (validated to come earlier)
      if (g + 1 < g_count) n.need[n.count++] = {false, g + 1};
    }
    return n;
  };

  Timeline t;
  t.pp = pp;
  t.vpp = o.vpp;
  t.microbatches = m;
  t.costs = costs;
  t.ranks.resize(static_cast<size_t>(pp));
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  std::vector<int64_t> clock(static_cast<size_t>(pp), 0);
  // When each rank's next step's receive is posted: early, as it begins the step
  // before (the clock before that step), else once it reaches the step.
  std::vector<int64_t> posted(static_cast<size_t>(pp), 0);
  size_t remaining = 0;
  for (const auto& d : decoded) remaining += d.size();

  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const std::vector<StepRef>& steps = decoded[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      while (i < steps.size()) {
        const StepRef& s = steps[i];
        int64_t ready = clock[static_cast<size_t>(r)];
        const int64_t post = costs.receives_posted_early ? posted[static_cast<size_t>(r)] : ready;
        bool available = true;
        for (const Need& n : needs(r, s)) {
          const int64_t at = done[slot(n.forward, n.g, s.microbatch)];
          if (at < 0) {
            available = false;
            break;
          }
          ready = std::max(ready, n.g % pp != r ? std::max(at, post) + costs.transfer : at);
        }
        if (!available) break;
        posted[static_cast<size_t>(r)] = clock[static_cast<size_t>(r)];  // the next step's, posted as this one begins
        TimedStep ts;
        static_cast<StepRef&>(ts) = s;
        ts.rank = r;
        ts.index = static_cast<int>(i);
        ts.entry = o.order[static_cast<size_t>(r)][i];
        ts.global_chunk = global_chunk(pp, r, s.chunk);
        ts.start = ready;
        ts.duration = duration(s.forward, ts.global_chunk);
        clock[static_cast<size_t>(r)] = ts.start + ts.duration;
        done[slot(s.forward, ts.global_chunk, s.microbatch)] = ts.start + ts.duration;
        t.busy += ts.duration;
        t.makespan = std::max(t.makespan, ts.start + ts.duration);
        t.ranks[static_cast<size_t>(r)].push_back(ts);
        ++i;
        --remaining;
        progress = true;
      }
    }
  }
  if (remaining == 0) return t;

  // Deadlock: every unfinished rank waits for an input nobody can produce yet.
  // Name the lowest stuck rank, what it waits for and who would send it, then
  // follow the waits until they close into a cycle.
  auto first_missing = [&](int r) {
    const StepRef& s = decoded[static_cast<size_t>(r)][next[static_cast<size_t>(r)]];
    for (const Need& n : needs(r, s))
      if (done[slot(n.forward, n.g, s.microbatch)] < 0) return n;
    return Need{true, -1};  // unreachable: a stuck step misses an input
  };
  auto here = [&](int r) {
    const size_t i = next[static_cast<size_t>(r)];
    return step_str(static_cast<int>(i), o.order[static_cast<size_t>(r)][i], decoded[static_cast<size_t>(r)][i]);
  };
  int stuck = 0;
  while (next[static_cast<size_t>(stuck)] >= decoded[static_cast<size_t>(stuck)].size()) ++stuck;
  const StepRef& s = decoded[static_cast<size_t>(stuck)][next[static_cast<size_t>(stuck)]];
  const Need need = first_missing(stuck);
  const int producer = need.g % pp;
  std::ostringstream msg;
  msg << "schedule " << o.schedule << " deadlocks (" << sizes_str(o) << ", group size " << o.group_size
      << "): rank " << stuck << " is stuck at " << here(stuck) << " waiting for the "
      << (need.forward ? "forward output (activations)" : "backward output (input gradient)") << " of global chunk "
      << need.g << ", microbatch " << s.microbatch + 1;
  if (producer == stuck) {
    msg << ", which this rank only produces later, at step " << step_of[slot(need.forward, need.g, s.microbatch)];
  } else {
    msg << ", from rank " << producer << ", which is itself stuck at " << here(producer);
    // The chain of waits from the stuck rank, until a rank repeats.
    std::vector<int> chain{stuck};
    int r = stuck;
    for (;;) {
      const int q = first_missing(r).g % pp;
      const bool seen = std::find(chain.begin(), chain.end(), q) != chain.end();
      chain.push_back(q);
      if (seen) break;
      r = q;
    }
    const auto start = std::find(chain.begin(), chain.end(), chain.back());
    msg << "; waits form the cycle rank " << *start;
    for (auto it = start + 1; it != chain.end(); ++it) msg << " -> rank " << *it;
  }
  msg << "; no rank can progress";
  throw ScheduleError(ScheduleError::Kind::deadlock, msg.str(), stuck,
                      static_cast<int>(next[static_cast<size_t>(stuck)]));
}

// ---------------------------------------------------------------------------
// Chrome trace
// ---------------------------------------------------------------------------

std::vector<TraceEvent> trace_events(const Timeline& t, double us_per_slot) {
  std::vector<TraceEvent> events;
  for (const auto& rank : t.ranks)
    for (const TimedStep& s : rank) {
      TraceEvent e;
      e.rank = s.rank;
      e.name = std::string(s.forward ? "F" : "B") + " mb" + std::to_string(s.microbatch + 1) + " c" +
               std::to_string(s.chunk);
      e.category = s.forward ? "forward" : "backward";
      e.start_us = static_cast<double>(s.start) * us_per_slot;
      e.dur_us = static_cast<double>(s.duration) * us_per_slot;
      e.args = {{"step", s.index}, {"global_chunk", s.global_chunk}, {"microbatch", s.microbatch + 1}};
      events.push_back(std::move(e));
    }
  return events;
}

void write_chrome_trace(std::ostream& os, const std::vector<TraceEvent>& events) {
  auto tid = [](const TraceEvent& e) { return e.lane == TraceLane::Comm ? kCommLaneTid + e.rank : e.rank; };
  std::vector<int> tids;
  for (const TraceEvent& e : events) tids.push_back(tid(e));
  std::sort(tids.begin(), tids.end());
  tids.erase(std::unique(tids.begin(), tids.end()), tids.end());

  // One event per line, so the file also reads and greps line by line; each line is
  // written as it is made (a long simulation has tens of millions).
  bool first = true;
  const auto line = [&](const nlohmann::ordered_json& j) {
    os << (first ? "[\n" : ",\n") << runtime::dump_json(j);
    first = false;
  };
  for (int t : tids)
    line({{"name", "thread_name"},
          {"ph", "M"},
          {"pid", 0},
          {"tid", t},
          {"args", {{"name", t >= kCommLaneTid ? "rank " + std::to_string(t - kCommLaneTid) + " comm"
                                               : "rank " + std::to_string(t)}}}});
  for (const TraceEvent& e : events) {
    nlohmann::ordered_json j = {{"name", e.name},
                                {"cat", e.category},
                                {"ph", "X"},
                                {"pid", 0},
                                {"tid", tid(e)},
                                {"ts", trace_us(e.start_us)},
                                {"dur", trace_us(e.dur_us)}};
    if (!e.args.empty()) {
      nlohmann::ordered_json& args = j["args"];
      for (const auto& [key, value] : e.args) args[key] = value;
    }
    line(j);
  }
  os << (first ? "[\n" : "") << "\n]\n";
}

void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events) {
  // Written whole beside its name, then renamed onto it (an earlier trace stays until
  // then); a device or pipe (/dev/stdout) directly.
  files::WholeFile out(path);
  const std::string& target = out.path();
  {
    std::ofstream f(target, out.mode());
    if (!f) throw std::runtime_error("cannot open trace file '" + target + "' for writing; check the directory exists");
    write_chrome_trace(f, events);
    f.flush();
    if (!f) throw std::runtime_error("writing trace file '" + target + "' failed (disk full?)");
  }
  if (!out.commit())
    throw std::runtime_error("cannot rename trace file '" + target + "' to '" + path + "': " + std::strerror(errno));
}

}  // namespace loom::pipeline
