// Pipeline schedules, engine side: ask a schedule plugin (parallel/pipeline.*) for
// every rank's order, check each order, and simulate all of them together before
// any rank starts, so that a schedule that would deadlock is refused up front.
//
// An order is one rank's list of signed local chunks: +c = forward of local chunk c
// (1-based), -c = its backward; the j-th +c is microbatch j of chunk c and the j-th
// -c the backward of microbatch j of chunk c. Local chunk c of rank r is global
// chunk (c - 1) * pp + r (0-based), so global chunk g lives on rank g mod pp.
//
// Numbering: data (StepRef::microbatch) counts microbatches from 0; everything shown
// to people (messages, the trace, `loom schedule`) counts them from 1, as chunks are.
#pragma once

#include <loom/loom_abi.h>

#include <cstdint>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace loom::plugins {
struct LoadedPlugin;
}

namespace loom::pipeline {

// One line naming the schedule, the rank and the step (position in its order).
class ScheduleError : public std::runtime_error {
 public:
  enum class Kind {
    refused,   // the plugin refused the combination (its message names the rule)
    invalid,   // the plugin returned an order that breaks the order rules
    deadlock,  // the orders together would deadlock
  };
  ScheduleError(Kind kind, const std::string& message, int rank = -1, int step = -1)
      : std::runtime_error(message), kind_(kind), rank_(rank), step_(step) {}
  Kind kind() const { return kind_; }
  int rank() const { return rank_; }  // -1 when not about one rank
  int step() const { return step_; }  // index into that rank's order; -1 when none

 private:
  Kind kind_;
  int rank_, step_;
};

// Every rank's order for one (pp, vpp, microbatches, group size).
struct PipelineOrders {
  int pp = 1, vpp = 1, microbatches = 1, group_size = 1;  // group_size resolved (never 0)
  std::vector<std::vector<int32_t>> order;  // [rank] -> signed order, 2 * vpp * microbatches long
  std::vector<int32_t> warmup;              // [rank] -> warmup forwards the plugin reported
  std::string schedule;                     // "parallel/pipeline.1f1b": names it in messages
};

// One entry of an order, decoded.
struct StepRef {
  bool forward = true;
  int chunk = 1;       // local chunk, 1-based
  int microbatch = 0;  // 0-based
};

inline int global_chunk(int pp, int rank, int chunk) { return (chunk - 1) * pp + rank; }

// "forward of chunk 1, microbatch 3" (microbatch shown 1-based).
std::string describe(const StepRef& s);

// pipeline.microbatch_group_size: 0 means pp.
inline int resolve_group_size(int group_size, int pp) { return group_size == 0 ? pp : group_size; }

// The plugin name for a schedule as a user writes it: "1f1b", "pipeline.1f1b" and
// "parallel/pipeline.1f1b" all give "pipeline.1f1b" (kind "parallel").
std::string schedule_plugin_name(const std::string& schedule);

// The orders of pp ranks with vpp chunks and `microbatches` each (2 * pp * vpp * M
// entries) are built and simulated in host memory: at most kMaxOrderEntries entries,
// and kMaxSimulationWork entries x stages (the simulation's passes grow with pp too;
// pp 20000 with one microbatch: about 2 s). Far beyond any real run's (Megatron-LM's
// largest use thousands of microbatches). "" when within, else what is too large.
constexpr long long kMaxOrderEntries = 20'000'000;
constexpr long long kMaxSimulationWork = 1'000'000'000;
std::string orders_too_large(long long pp, long long vpp, long long microbatches);

// Calls the plugin's order slot for every rank (capacity 2 * vpp * microbatches),
// then validate()s the result. `options` are the plugin's resolved options; null
// means its declared defaults. group_size 0 means pp. Throws ScheduleError, or
// plugins::PluginError when the plugin has no schedule table.
PipelineOrders compute_orders(const plugins::LoadedPlugin& plugin, const loom_options* options, int pp,
                              int vpp, int microbatches, int group_size);

// Checks each rank's order: length 2 * vpp * microbatches, entries in ±1..±vpp, each
// +c and -c exactly `microbatches` times, each backward after the forward of the same
// (chunk, microbatch) on that rank, warmup within 0..vpp * microbatches. Returns the
// decoded steps [rank][step]. Throws ScheduleError (Kind::invalid) naming rank and step.
std::vector<std::vector<StepRef>> validate(const PipelineOrders& orders);

// Time each step takes in the simulation, in slots. The default is one slot for a
// forward and one for a backward (what `loom schedule` draws); {1, 2} models the
// usual backward = 2 x forward.
struct SimCosts {
  int64_t forward = 1;
  int64_t backward = 1;
  // When not empty (pp * vpp entries): the time of each global chunk's forward and
  // backward, in place of `forward` and `backward` (`loom plan --perf`, in ns).
  std::vector<int64_t> forward_of, backward_of;
  // Added to an input that comes from another rank (a p2p transfer); 0 = none.
  // A transfer starts once the input is sent and its receive is posted: when the
  // rank reaches the step, or with receives posted early (pipeline.overlap_p2p_comm)
  // when the rank begins the step before it.
  int64_t transfer = 0;
  bool receives_posted_early = false;
};

struct TimedStep : StepRef {
  int rank = 0;
  int index = 0;        // position in the rank's order
  int32_t entry = 0;    // the signed order entry
  int global_chunk = 0;
  int64_t start = 0;    // slots
  int64_t duration = 0;
};

struct Timeline {
  int pp = 1, vpp = 1, microbatches = 1;
  SimCosts costs;
  std::vector<std::vector<TimedStep>> ranks;  // [rank] in order
  int64_t makespan = 0;                       // slots until the last step ends
  int64_t busy = 0;                           // slots spent in steps, summed over ranks
  // Idle share of pp * makespan rank-slots.
  double bubble_fraction() const;
};

// Runs every rank's order against the others with the sends and receives they imply:
// the forward of global chunk g, microbatch m receives the forward output of g - 1
// (from rank (g - 1) mod pp; a local hand-off when that is the same rank); the
// backward of g receives the backward output of g + 1 (the last global chunk starts
// from its own forward), and needs its own forward of g. Sends never block (buffered,
// as comm/local's), receives do. Each rank runs its next step as soon as its inputs
// exist, starting when its previous step and its inputs are done (an input from
// another rank: costs.transfer after both it was sent and its receive was posted).
// If no rank can advance while some are unfinished, throws ScheduleError
// (Kind::deadlock) naming the first stuck rank, its step, what it waits for, the
// rank that would produce it and the cycle of waits. Validates first.
Timeline simulate(const PipelineOrders& orders, SimCosts costs = {});

// Chrome trace ("Trace Event Format", viewable in Perfetto / chrome://tracing).
// Where an event is drawn: the rank's own track, or beside it the collectives it
// started without waiting (ABI 1.15), which run while the rank computes.
enum class TraceLane { Rank, Comm };
constexpr int kCommLaneTid = 1000000;

struct TraceEvent {
  int rank = 0;              // becomes tid (pid is 0); the comm lane's tid is kCommLaneTid + rank
  std::string name;          // "F mb3 c1"
  std::string category;      // "forward", "backward", ...
  double start_us = 0;
  double dur_us = 0;
  std::vector<std::pair<std::string, long long>> args;  // optional, shown on selection
  TraceLane lane = TraceLane::Rank;
};

// The timeline as events, one slot = us_per_slot microseconds.
std::vector<TraceEvent> trace_events(const Timeline& timeline, double us_per_slot = 1000.0);

// Writes a JSON array of complete ("X") events, plus one thread_name metadata ("M")
// event per rank so that rows read "rank N"; one event per line, times rounded to the
// nanosecond (non-finite ones as 0).
void write_chrome_trace(std::ostream& os, const std::vector<TraceEvent>& events);
// The same into a file; throws std::runtime_error naming the file when it cannot be written.
void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events);

}  // namespace loom::pipeline
