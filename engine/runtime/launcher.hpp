// Starts the ranks of a run that live in this process — every rank as a thread
// for the embedded comm/local backend — each with its device instance and one
// communicator per rank-group kind, and runs a function on each.
#pragma once

#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/topology/rank_groups.hpp"

#include <functional>
#include <stdexcept>
#include <exception>
#include <map>
#include <string>
#include <vector>

namespace loom::runtime {

struct LaunchConfig {
  const plugins::LoadedPlugin* device_plugin = nullptr;
  const toml::table* device_options = nullptr;   // validated section, may be null
  const plugins::LoadedPlugin* comm_plugin = nullptr;
  const toml::table* comm_options = nullptr;
  topology::ParallelSizes sizes;                  // world, tp, cp, pp, ep, etp, order
  int64_t timeout_ms = 300000;
  int threads = 0;                                // per rank; 0 = cores / ranks
  // The services every rank's layers get from host->service(rank, api_type, NULL):
  // api_type -> table (the run plan's parallel.tensor and parallel.expert).
  std::map<int32_t, const void*> services;
  // Group kinds to create communicators for (collective set-up, so all up front).
  std::vector<std::string> group_kinds = {"world", "tp", "cp", "dp", "pp", "dp-cp", "tp-dp-cp",
                                          "embedding", "ep", "etp", "edp"};
};

// The error of a run: the root cause (the first rank that failed on its own, not
// the ranks that were stopped because of it).
class RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How this process was started. Under mpirun (OMPI_COMM_WORLD_SIZE/RANK), an MPI
// process manager (PMI_SIZE/PMI_RANK) or srun (SLURM_NTASKS/SLURM_PROCID) with more
// than one process, the run has one process per rank and this one hosts `rank`.
// What an exception says to a user: its text, or for std::bad_alloc, whose memory ran out.
std::string error_message(const std::exception& e);

struct ProcessLaunch {
  bool multi_process = false;
  int world_size = 1;      // processes started
  int rank = 0;            // this process's global rank
  int local_size = 1;      // processes on this node (0 when unknown)
  int local_rank = 0;      // this process's index on its node
  std::string launcher;    // "mpirun (OMPI_COMM_WORLD_SIZE=4)", for messages
};
ProcessLaunch detect_process_launch();
// The ranks of a world of `world` ranks this process runs: all of them as threads, or
// under mpirun/srun its own. Throws RunError when the launcher started another number
// of processes.
std::vector<int32_t> process_ranks(int world);

// CPUs this process may run on (its affinity mask), at least 1.
int usable_cores();

// Whether `device` keeps its memory apart from the host's (no LOOM_DEVICE_HOST_MEMORY)
// while `comm` takes host buffers only (no LOOM_COMM_DEVICE_BUFFERS): the engine then
// stages the buffers. A plugin built before 1.9, which declares neither, is taken at
// its word as before: host memory, and buffers passed as they are.
bool needs_staging(const plugins::LoadedPlugin* device, const plugins::LoadedPlugin* comm);

// Runs fn on every rank of this process (all ranks as threads, or only this
// process's rank when detect_process_launch() says one process per rank), returns
// when they are done. If a rank throws, the comm world is aborted so the others
// (threads or processes) stop promptly, and RunError is thrown.
void launch(const LaunchConfig& config, const std::function<void(RankRuntime&)>& fn);

}  // namespace loom::runtime
