// Communication accounting: every collective a rank's plugins call through a
// group the engine handed out is counted, per group kind ("tp", "dp", "pp",
// "embedding", ...) and per op, before it is forwarded to the comm plugin.
//
// The engine gives plugins loom_group structs whose api/comm point at a counting
// shim (a loom_comm_api whose functions count, then call the real comm plugin),
// so no plugin has to cooperate. RankRuntime::add_group installs it.
//
// What a counter holds, for a call of `count` elements of a dtype on a group of p:
//   elements   the logical tensor the collective produces or consumes:
//              all_reduce, broadcast, send, recv: count; all_gather: p * count (the
//              gathered output); reduce_scatter: p * count (the input); all_to_all:
//              p * count; all_to_all_v: the elements this rank sends; barrier: 0
//   bytes      elements * dtype size
//   bus_bytes  what a ring algorithm moves in and out of each rank (nccl-tests'
//              "bus bandwidth" factors): all_reduce 2(p-1)/p * bytes; all_gather,
//              reduce_scatter, all_to_all (p-1)/p * bytes; broadcast, send, recv
//              bytes. An all-reduce is a reduce-scatter plus an all-gather, so a
//              sequence-parallel layer (all-gather + reduce-scatter where tensor
//              parallelism has one all-reduce) has the same bus_bytes.
#pragma once

#include <loom/loom_abi.h>

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace loom::runtime {

struct CommCounter {
  uint64_t calls = 0;
  uint64_t elements = 0;
  uint64_t bytes = 0;
  double bus_bytes = 0;
  CommCounter& operator+=(const CommCounter& o) {
    calls += o.calls;
    elements += o.elements;
    bytes += o.bytes;
    bus_bytes += o.bus_bytes;
    return *this;
  }
};

// Group kind -> op ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
// "all_to_all_v", "broadcast", "barrier", "send", "recv") -> counter.
using CommStats = std::map<std::string, std::map<std::string, CommCounter>>;

// Told of every call once it returned (for `loom run --trace`): the group kind,
// the op, the logical bytes, when the call started, and whether it was started
// without waiting (ABI 1.15; then told at its wait, so the span runs from start to
// completion while the rank's thread went on).
using CommObserver = std::function<void(const std::string& kind, const char* op, uint64_t bytes,
                                        std::chrono::steady_clock::time_point start, bool started)>;

// One rank's counters; calls may come from any thread.
class CommStatsRecorder {
 public:
  void add(const std::string& kind, const char* op, const CommCounter& c);
  // Set before the rank's threads call collectives, cleared (nullptr) after.
  void set_observer(CommObserver observer) { observer_ = std::move(observer); }
  const CommObserver& observer() const { return observer_; }
  CommStats snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  CommStats stats_;
  CommObserver observer_;
};

// A rank's device memory handed to a comm plugin that takes host buffers only (no
// LOOM_COMM_DEVICE_BUFFERS; comm/local, comm/mpi) when the device keeps it apart from
// the host's (device/cuda): the shim copies each call's device buffers to host memory,
// runs the call there and copies what it wrote back, in the rank's stream order. Slow,
// and what lets every layout of several ranks run (and be checked) on one GPU.
struct DeviceStaging {
  // Where [p, p + bytes) lies: in host memory, inside one allocation of the rank's
  // device, or partly in one (a call with such a buffer is refused).
  enum class Where { Host, Device, Partly };
  std::function<Where(const void* p, size_t bytes)> where;
  // Copies bytes (LOOM_COPY_DEVICE_TO_HOST or HOST_TO_DEVICE) after the work the
  // rank's stream has so far, and returns when the copy has run.
  std::function<void(void* dst, const void* src, size_t bytes, int32_t kind)> copy;
  // Bytes staged each way, over every rank (tests read it).
  static uint64_t staged_bytes();
};

// A group like `real` whose collectives are counted into `recorder` under `kind`,
// with device buffers staged through host memory when `staging` is set.
// The result owns a small shim communicator: destroy it with
// result.api->group_destroy(result.comm), which also destroys the real one.
// Groups without a communicator (api or comm null) are returned unchanged.
loom_group counting_group(const loom_group& real, const std::string& kind, CommStatsRecorder* recorder,
                          const DeviceStaging* staging = nullptr);

// Sums (e.g. the ranks of a run, or the steps of an interval).
CommStats& operator+=(CommStats& a, const CommStats& b);
// One kind's counters summed over its ops.
CommCounter total(const CommStats& s, const std::string& kind);

// For --metrics: {"dp": {...}, "tp": {"all_reduce": {"calls": 8, "elements": 4096,
// "bytes": 16384, "bus_bytes": 16384.0}, ...}}; kinds and ops in name order, empty ones
// left out; bus_bytes is a double, the rest integers.
nlohmann::ordered_json comm_stats_to_json(const CommStats& s);
// For the run summary: one line, e.g.
// "comm per step: tp 24 all_reduce 1.50 MiB, 8 all_gather 512.0 KiB; dp 1 all_reduce 2.0 MiB"
// (per kind, per op: calls and bytes; "none" when nothing was called).
std::string comm_stats_summary(const CommStats& s, const std::string& label = "comm per step");

}  // namespace loom::runtime
