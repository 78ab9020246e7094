// Plugin discovery and loading: Boost.DLL opens each library (RTLD_NOW|RTLD_LOCAL),
// the ABI is negotiated through loom_plugin_init_v<major>, and each plugin it
// describes is registered as kind/name. Libraries are never unloaded.
#pragma once

#include <loom/loom_abi.h>

#include "engine/manifest/manifest.hpp"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::plugins {

// One line: the file, what is wrong, what to do.
class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LoadedPlugin {
  std::string kind, name, version, description;
  std::string file;           // the shared object it came from
  int32_t api_type = 0;       // LOOM_API_*
  const void* api = nullptr;  // the kind's table; check struct_size before using a slot
  uint32_t abi_major = 0, abi_minor = 0;
  std::vector<manifest::OptionDecl> options;
  std::string key() const { return kind + "/" + name; }
  // The table, typed; throws PluginError if api_type does not match.
  const loom_device_api* device() const;
  const loom_comm_api* comm() const;
  const loom_layer_api* layer() const;
  const loom_optimizer_api* optimizer() const;
  const loom_schedule_api* schedule() const;
  const loom_exec_api* exec() const;
  const loom_tensor_parallel_api* tensor_parallel() const;  // ABI 1.1
};

class Registry {
 public:
  // Loads one library and registers its plugins. Throws PluginError.
  void load_file(const std::string& path);
  // Loads every loom_*.so in each directory (missing directories are skipped);
  // returns one error line per library that failed; the others stay registered.
  std::vector<std::string> load_dirs(const std::vector<std::string>& dirs);
  // Null when absent.
  const LoadedPlugin* find(const std::string& kind, const std::string& name) const;
  // Throws PluginError "no plugin kind/name is loaded (available kind plugins: ...)".
  const LoadedPlugin& get(const std::string& kind, const std::string& name) const;
  const std::vector<std::unique_ptr<LoadedPlugin>>& all() const { return plugins_; }

  // Search order: extra (manifest plugins.search_paths), $LOOM_PLUGIN_PATH (':'-separated),
  // then the directory next to the loom binary (build tree or install tree).
  static std::vector<std::string> search_paths(const std::vector<std::string>& extra = {});

 private:
  std::vector<std::unique_ptr<LoadedPlugin>> plugins_;
};

// The process-wide registry the CLI uses.
Registry& registry();

// Services (ABI 1.1): what host->service(rank, api_type, NULL) returns when the
// rank has no service of its own for api_type (RankRuntime::set_service). make_plan
// sets the plugin the manifest names (parallel.tensor).
void set_default_service(int32_t api_type, const LoadedPlugin* plugin);
// The table of api_type: name NULL = the default (else parallel/tensor of the
// process registry); otherwise the parallel plugin of that name. Null when none.
const void* find_service(int32_t api_type, const char* name);

// The host table given to every plugin (also installed as loom::host_slot() for the engine).
const loom_host_api* host_api();

// A plugin instance's resolved options, handed to plugins as loom_options*.
class OptionValues {
 public:
  // Values from `section` (may be null), defaults from decls for what is missing.
  // Assumes the section was validated (Manifest::apply_plugin_options).
  OptionValues(const toml::table* section, const std::vector<manifest::OptionDecl>& decls);
  ~OptionValues();
  OptionValues(const OptionValues&) = delete;
  OptionValues& operator=(const OptionValues&) = delete;
  const loom_options* raw() const;

 private:
  struct loom_options_s* impl_;
};

}  // namespace loom::plugins
