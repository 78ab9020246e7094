// Where the GPU tests load their plugins from, found at run time the way bin/loom finds
// its plugins, so that a build moved to another folder (or a pack made by
// scripts/gpu-pack.sh: bin/loom_gpu_tests next to lib/loom/plugins) still finds them:
//   1. $LOOM_PLUGIN_PATH (':'-separated),
//   2. next to the running binary: <dir of /proc/self/exe>/../lib/loom/plugins (and the
//      install layout's libdir),
// both from the engine's own search (plugins::Registry::search_paths); the first of
// those directories that holds the library wins;
//   3. else the build tree's plugin folder of compile time (LOOM_TEST_PLUGIN_DIR).
#pragma once

#include <filesystem>
#include <string>

#include "engine/plugins/registry.hpp"

namespace loom_test {

// The directory holding `library` (a plugin file name such as "loom_device_cuda.so").
inline std::string plugin_dir(const std::string& library = "loom_device_cuda.so") {
  for (const std::string& dir : loom::plugins::Registry::search_paths()) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(std::filesystem::path(dir) / library, ec)) return dir;
  }
  return LOOM_TEST_PLUGIN_DIR;
}

// The path of one plugin library: plugin_file("loom_comm_nccl.so").
inline std::string plugin_file(const std::string& library) { return plugin_dir(library) + "/" + library; }

}  // namespace loom_test
