// Starts the ranks of a run that live in this process — every rank as a thread
// for the embedded comm/local backend — each with its device instance and one
// communicator per rank-group kind, and runs a function on each.
#pragma once

#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/topology/rank_groups.hpp"

#include <functional>
#include <stdexcept>
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
  // Group kinds to create communicators for (collective set-up, so all up front).
  std::vector<std::string> group_kinds = {"world", "tp", "cp", "dp", "pp", "dp-cp", "tp-dp-cp",
                                          "embedding", "ep", "edp"};
};

// The error of a run: the root cause (the first rank that failed on its own, not
// the ranks that were stopped because of it).
class RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs fn on every rank, returns when all are done. If a rank throws, the comm
// world is aborted so the others stop promptly, and RunError is thrown.
void launch(const LaunchConfig& config, const std::function<void(RankRuntime&)>& fn);

}  // namespace loom::runtime
