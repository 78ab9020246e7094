#include "engine/runtime/launcher.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

namespace loom::runtime {

void launch(const LaunchConfig& config, const std::function<void(RankRuntime&)>& fn) {
  plugins::host_api();
  const topology::RankGroups groups = topology::RankGroups::build(config.sizes);
  const int world = groups.world();
  const loom_device_api* dev_api = config.device_plugin->device();
  const loom_comm_api* comm_api = config.comm_plugin->comm();
  plugins::OptionValues dev_opts(config.device_options, config.device_plugin->options);
  plugins::OptionValues comm_opts(config.comm_options, config.comm_plugin->options);

  std::vector<int32_t> local_ranks(world);
  for (int r = 0; r < world; ++r) local_ranks[r] = r;
  loom_comm_world_args wargs = loom::make<loom_comm_world_args>();
  wargs.world_size = world;
  wargs.num_local_ranks = world;
  wargs.local_ranks = local_ranks.data();
  wargs.timeout_ms = config.timeout_ms;
  loom_comm_world* comm_world = nullptr;
  loom::check(comm_api->world_create(comm_opts.raw(), &wargs, &comm_world));
  std::unique_ptr<loom_comm_world, void (*)(loom_comm_world*)> world_guard(comm_world, comm_api->world_destroy);

  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = config.threads > 0 ? config.threads : std::max(1, cores / world);

  std::mutex mu;
  std::vector<std::string> errors(world);
  std::atomic<int> first_failure{-1};
  auto abort_world = [&](int rank, const std::string& why) {
    int expected = -1;
    if (first_failure.compare_exchange_strong(expected, rank) && LOOM_HAS_SLOT(comm_api, loom_comm_api, world_abort) &&
        comm_api->world_abort)
      comm_api->world_abort(comm_world, ("rank " + std::to_string(rank) + " failed: " + why).c_str());
  };

  auto rank_main = [&](int rank) {
    try {
      loom_device_create_args dargs = loom::make<loom_device_create_args>();
      dargs.global_rank = rank;
      dargs.local_rank = rank;
      dargs.num_threads = threads;
      dargs.ranks_in_process = world;
      loom_device* dev = nullptr;
      loom::check(dev_api->create(dev_opts.raw(), &dargs, &dev));
      RankRuntime rt(rank, dev_api, dev);
      for (const std::string& kind : config.group_kinds) {
        std::vector<int32_t> members;
        if (kind == "world") {
          members = local_ranks;
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
      {
        std::lock_guard<std::mutex> lock(mu);
        errors[rank] = e.what();
      }
      abort_world(rank, e.what());
    }
  };

  if (world == 1) {
    rank_main(0);
  } else {
    std::vector<std::thread> threads_v;
    for (int r = 0; r < world; ++r) threads_v.emplace_back(rank_main, r);
    for (auto& t : threads_v) t.join();
  }
  int failed = first_failure.load();
  if (failed >= 0) throw RunError("rank " + std::to_string(failed) + ": " + errors[failed]);
}

}  // namespace loom::runtime
