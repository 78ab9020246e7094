#include "engine/runtime/launcher.hpp"

#include <glog/logging.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

namespace loom::runtime {

std::string error_message(const std::exception& e) {
  // A bare "std::bad_alloc" says nothing of whose memory ran out.
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr)
    return std::string("out of host memory (") + e.what() +
           "): the process's memory limit (ulimit -v, a container's) is too small for this run, or lower the batch "
           "or the ranks per process";
  return e.what();
}

namespace {

// A non-negative integer environment variable, or -1.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  int n = -1;
  const char* end = v + std::char_traits<char>::length(v);
  auto res = std::from_chars(v, end, n);
  return res.ec == std::errc() && res.ptr == end && n >= 0 ? n : -1;
}

}  // namespace

bool needs_staging(const plugins::LoadedPlugin* device, const plugins::LoadedPlugin* comm) {
  if (device == nullptr || comm == nullptr || device->abi_minor < 9 || comm->abi_minor < 9) return false;
  const loom_device_api* d = device->device();
  const loom_comm_api* c = comm->comm();
  const bool host_memory = d == nullptr || (d->features & LOOM_DEVICE_HOST_MEMORY) != 0;
  const bool device_buffers = c != nullptr && (c->features & LOOM_COMM_DEVICE_BUFFERS) != 0;
  return !host_memory && !device_buffers;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

ProcessLaunch detect_process_launch() {
  struct Source {
    const char *size, *rank, *local_size, *local_rank, *name;
  };
  // The same order as the manifest's world-size check (launcher_world_size).
  static const Source sources[] = {
      {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "mpirun"},
      {"PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "the MPI process manager"},
      {"SLURM_NTASKS", "SLURM_PROCID", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID", "srun"},
  };
  ProcessLaunch p;
  for (const Source& s : sources) {
    const int size = env_int(s.size);
    if (size <= 0) continue;
    const int rank = env_int(s.rank);
    if (rank < 0 || rank >= size) continue;
    p.world_size = size;
    p.rank = rank;
    p.multi_process = size > 1;
    p.local_size = env_int(s.local_size) > 0 ? env_int(s.local_size) : 0;
    p.local_rank = std::max(0, env_int(s.local_rank));
    p.launcher = std::string(s.name) + " (" + s.size + "=" + std::to_string(size) + ", " + s.rank + "=" +
                 std::to_string(rank) + ")";
    break;
  }
  return p;
}

// Every rank is a thread of this process, or (under mpirun/srun) this process hosts
// its own rank only and the comm plugin connects the processes.
std::vector<int32_t> process_ranks(int world) {
  const ProcessLaunch proc = detect_process_launch();
  if (!proc.multi_process) {
    std::vector<int32_t> all(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
    return all;
  }
  if (proc.world_size != world)
    throw RunError("the run has " + std::to_string(world) + " ranks but " + proc.launcher + " started " +
                   std::to_string(proc.world_size) + " processes; start one process per rank (mpirun -np " +
                   std::to_string(world) + ")");
  return {proc.rank};
}

void launch(const LaunchConfig& config, const std::function<void(RankRuntime&)>& fn) {
  plugins::host_api();
  const topology::RankGroups groups = topology::RankGroups::build(config.sizes);
  const int world = groups.world();
  const loom_device_api* dev_api = config.device_plugin->device();
  const loom_comm_api* comm_api = config.comm_plugin->comm();
  plugins::OptionValues dev_opts(config.device_options, config.device_plugin->options);
  plugins::OptionValues comm_opts(config.comm_options, config.comm_plugin->options);

  const ProcessLaunch proc = detect_process_launch();
  std::vector<int32_t> local_ranks = process_ranks(world);
  std::vector<int32_t> all_ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all_ranks[static_cast<size_t>(r)] = r;
  loom_comm_world_args wargs = loom::make<loom_comm_world_args>();
  wargs.world_size = world;
  wargs.num_local_ranks = static_cast<int32_t>(local_ranks.size());
  wargs.local_ranks = local_ranks.data();
  wargs.timeout_ms = config.timeout_ms;
  loom_comm_world* comm_world = nullptr;
  loom::check(comm_api->world_create(comm_opts.raw(), &wargs, &comm_world));
  std::unique_ptr<loom_comm_world, void (*)(loom_comm_world*)> world_guard(comm_world, comm_api->world_destroy);

  // Host threads per rank: the cores this process may use, shared by the ranks of
  // this process; under mpirun/srun without binding, by the processes of this node.
  const int cores = usable_cores();
  const int nodes_share =
      proc.multi_process && cores >= static_cast<int>(std::thread::hardware_concurrency()) && proc.local_size > 0
          ? proc.local_size
          : 1;
  const int threads = config.threads > 0
                          ? config.threads
                          : std::max(1, cores / (static_cast<int>(local_ranks.size()) * nodes_share));

  std::mutex mu;
  std::vector<std::string> errors(world);
  std::atomic<int> first_failure{-1};
  auto abort_world = [&](int rank, const std::string& why) {
    int expected = -1;
    if (first_failure.compare_exchange_strong(expected, rank) && LOOM_HAS_SLOT(comm_api, loom_comm_api, world_abort) &&
        comm_api->world_abort)
      comm_api->world_abort(comm_world, ("rank " + std::to_string(rank) + " failed: " + why).c_str());
  };

  // Device memory to a comm plugin that takes host buffers only goes through host
  // copies (DeviceStaging, comm_stats.hpp).
  const bool stage_device_buffers = world > 1 && needs_staging(config.device_plugin, config.comm_plugin);
  auto rank_main = [&](int rank) {
    try {
      loom_device_create_args dargs = loom::make<loom_device_create_args>();
      dargs.global_rank = rank;
      dargs.local_rank = proc.multi_process ? proc.local_rank : rank;
      dargs.num_threads = threads;
      dargs.ranks_in_process = static_cast<int32_t>(local_ranks.size());
      loom_device* dev = nullptr;
      loom::check(dev_api->create(dev_opts.raw(), &dargs, &dev));
      RankRuntime rt(rank, dev_api, dev);
      for (const auto& [api_type, table] : config.services) rt.set_service(api_type, table);
      if (stage_device_buffers) rt.stage_device_buffers();
      rt.set_abort_world([&abort_world, rank](const std::string& why) { abort_world(rank, why); });
      for (const std::string& kind : config.group_kinds) {
        std::vector<int32_t> members;
        if (kind == "world") {
          members = all_ranks;
        } else {
          const std::vector<int>& g = groups.group_of(kind, rank);
          members.assign(g.begin(), g.end());
        }
        if (members.empty()) continue;  // e.g. a middle pipeline stage has no embedding group
        loom_group_desc desc = loom::make<loom_group_desc>();
        desc.kind = kind.c_str();
        desc.ranks = members.data();
        desc.size = static_cast<int32_t>(members.size());
        desc.my_rank = rank;
        loom_comm* comm = nullptr;
        loom::check(comm_api->group_create(comm_world, &desc, &comm));
        loom_group g = loom::make<loom_group>();
        g.api = comm_api;
        g.comm = comm;
        g.size = desc.size;
        g.rank = static_cast<int32_t>(std::find(members.begin(), members.end(), rank) - members.begin());
        rt.add_group(kind, g);
      }
      fn(rt);
    } catch (const std::exception& e) {
      const std::string why = error_message(e);
      {
        std::lock_guard<std::mutex> lock(mu);
        errors[rank] = why;
      }
      abort_world(rank, why);
    }
  };

  if (local_ranks.size() == 1) {
    rank_main(local_ranks[0]);
  } else {
    // A thread that cannot be started (a thread or memory limit) stops the ranks already
    // running, which may be waiting for it in a collective, before its error is thrown:
    // an exception with joinable threads alive would end the process in std::terminate.
    std::vector<std::thread> threads_v;
    std::string start_error;
    for (int r = 0; r < world && start_error.empty(); ++r) {
      try {
        threads_v.emplace_back(rank_main, r);
      } catch (const std::exception& e) {
        start_error = "cannot start the thread of rank " + std::to_string(r) + " of " + std::to_string(world) + " (" +
                      e.what() + "); the process's thread or memory limit (ulimit -u, ulimit -v) is too small for "
                      "this many ranks as threads of one process";
        abort_world(r, start_error);
      }
    }
    for (auto& t : threads_v) t.join();
    if (!start_error.empty()) throw RunError(start_error);
  }
  int failed = first_failure.load();
  if (failed >= 0) throw RunError("rank " + std::to_string(failed) + ": " + errors[failed]);
}

}  // namespace loom::runtime
