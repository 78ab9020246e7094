// Plugin discovery and loading: each file is checked first (a regular ELF file of
// this machine whose segments and section headers lie inside it: a truncated copy
// would crash the dynamic loader), Boost.DLL opens it (RTLD_NOW|RTLD_LOCAL), the
// ABI is negotiated through loom_plugin_init_v<major> (which must be a function),
// and each plugin it describes is registered as kind/name once its table has every
// required slot. Libraries are never unloaded.
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
// A kind/name already registered from another file (the message names both files).
class DuplicatePluginError : public PluginError {
 public:
  using PluginError::PluginError;
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
  // Loads one library and registers its plugins (a file it loaded before: nothing
  // more). Throws PluginError
  // (DuplicatePluginError when a kind/name it describes is already registered).
  void load_file(const std::string& path);
  // Loads every loom_*.so in each directory; returns one error line per library
  // that failed (the others stay registered) and per directory that does not exist
  // (the default next to the loom binary excepted). Each line is also kept in
  // load_errors(), duplicates in duplicate_errors() too.
  std::vector<std::string> load_dirs(const std::vector<std::string>& dirs);
  // Every error line load_dirs returned so far, in order.
  const std::vector<std::string>& load_errors() const { return load_errors_; }
  // Those of them that name a kind/name found in two files: which one a run would
  // use depends on the search order, so `loom run` refuses them.
  const std::vector<std::string>& duplicate_errors() const { return duplicate_errors_; }
  // Null when absent.
  const LoadedPlugin* find(const std::string& kind, const std::string& name) const;
  // Throws PluginError "no plugin kind/name is loaded (available kind plugins: ...)".
  const LoadedPlugin& get(const std::string& kind, const std::string& name) const;
  const std::vector<std::unique_ptr<LoadedPlugin>>& all() const { return plugins_; }

  // Whether load_dirs loads a file of this name (loom_*.so).
  static bool searched_file_name(const std::string& filename);

  // Search order: extra (manifest plugins.search_paths), $LOOM_PLUGIN_PATH (':'-separated),
  // then the directory next to the loom binary (build tree or install tree).
  static std::vector<std::string> search_paths(const std::vector<std::string>& extra = {});

 private:
  std::vector<std::unique_ptr<LoadedPlugin>> plugins_;
  std::vector<std::string> load_errors_, duplicate_errors_;
};

// The process-wide registry the CLI uses.
Registry& registry();

// Services (ABI 1.1): the table of api_type when a rank has none of its own
// (RankRuntime::set_service: the run plan's), or a named one: name NULL = the
// schema's default (parallel/tensor, parallel/expert of the process registry);
// otherwise the parallel plugin of that name. Null when none.
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
