#include "engine/plugins/registry.hpp"

#include <boost/dll/shared_library.hpp>
#include <boost/filesystem.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace loom::plugins {
namespace {

namespace fs = boost::filesystem;

// Libraries stay loaded for the life of the process (plugins hand out pointers
// into their own static data), so the handles are kept here and never released.
std::vector<boost::dll::shared_library>& loaded_libraries() {
  static auto* libs = new std::vector<boost::dll::shared_library>();
  return *libs;
}

std::string version_str(uint32_t major, uint32_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

int32_t expected_api_type(const std::string& kind, int32_t api_type) {
  if (kind == "device") return LOOM_API_DEVICE;
  if (kind == "comm") return LOOM_API_COMM;
  if (kind == "layer") return LOOM_API_LAYER;
  if (kind == "exec") return LOOM_API_EXEC;
  if (kind == "parallel")
    return (api_type == LOOM_API_OPTIMIZER || api_type == LOOM_API_SCHEDULE || api_type == LOOM_API_TENSOR_PARALLEL ||
            api_type == LOOM_API_EXPERT_PARALLEL)
               ? api_type
               : LOOM_API_OPTIMIZER;
  return -1;
}

bool valid_name(const std::string& s) {
  if (s.empty()) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
  });
}

manifest::OptionDecl::Type option_type(int32_t t, bool& ok) {
  ok = true;
  switch (t) {
    case LOOM_OPTION_BOOL: return manifest::OptionDecl::Type::Bool;
    case LOOM_OPTION_INT: return manifest::OptionDecl::Type::Int;
    case LOOM_OPTION_FLOAT: return manifest::OptionDecl::Type::Float;
    case LOOM_OPTION_STRING: return manifest::OptionDecl::Type::String;
    default: ok = false; return manifest::OptionDecl::Type::Int;
  }
}

bool default_matches(manifest::OptionDecl::Type type, const std::string& literal) {
  try {
    toml::table t = toml::parse("v = " + literal);
    const toml::node* v = t.get("v");
    switch (type) {
      case manifest::OptionDecl::Type::Bool: return v->is_boolean();
      case manifest::OptionDecl::Type::Int: return v->is_integer();
      case manifest::OptionDecl::Type::Float: return v->is_floating_point() || v->is_integer();
      case manifest::OptionDecl::Type::String: return v->is_string();
    }
  } catch (const toml::parse_error&) {
  }
  return false;
}

// Converts a status from a plugin into text and frees it.
std::string take_message(loom_status s) {
  const loom_host_api* h = host_api();
  std::string m = h->status_message(s);
  h->status_destroy(s);
  return m;
}

}  // namespace

template <typename T>
static const T* typed_api(const LoadedPlugin& p, int32_t want, const char* what) {
  if (p.api_type != want)
    throw PluginError(p.file + ": plugin " + p.key() + " does not provide a " + what + " table");
  return static_cast<const T*>(p.api);
}
const loom_device_api* LoadedPlugin::device() const { return typed_api<loom_device_api>(*this, LOOM_API_DEVICE, "device"); }
const loom_comm_api* LoadedPlugin::comm() const { return typed_api<loom_comm_api>(*this, LOOM_API_COMM, "comm"); }
const loom_layer_api* LoadedPlugin::layer() const { return typed_api<loom_layer_api>(*this, LOOM_API_LAYER, "layer"); }
const loom_optimizer_api* LoadedPlugin::optimizer() const { return typed_api<loom_optimizer_api>(*this, LOOM_API_OPTIMIZER, "optimizer"); }
const loom_schedule_api* LoadedPlugin::schedule() const { return typed_api<loom_schedule_api>(*this, LOOM_API_SCHEDULE, "schedule"); }
const loom_exec_api* LoadedPlugin::exec() const { return typed_api<loom_exec_api>(*this, LOOM_API_EXEC, "exec"); }
const loom_tensor_parallel_api* LoadedPlugin::tensor_parallel() const {
  return typed_api<loom_tensor_parallel_api>(*this, LOOM_API_TENSOR_PARALLEL, "tensor-parallel");
}

namespace {
std::mutex& services_mu() {
  static std::mutex mu;
  return mu;
}
std::map<int32_t, const LoadedPlugin*>& default_services() {
  static std::map<int32_t, const LoadedPlugin*> m;
  return m;
}
}  // namespace

void set_default_service(int32_t api_type, const LoadedPlugin* plugin) {
  std::lock_guard<std::mutex> lock(services_mu());
  default_services()[api_type] = plugin;
}

const void* find_service(int32_t api_type, const char* name) {
  const LoadedPlugin* chosen = nullptr;
  {
    std::lock_guard<std::mutex> lock(services_mu());
    auto it = default_services().find(api_type);
    if (it != default_services().end()) chosen = it->second;
  }
  if (name == nullptr || *name == '\0') {
    if (chosen) return chosen->api;
    // The built-in defaults (manifest keys parallel.tensor, parallel.expert).
    name = api_type == LOOM_API_EXPERT_PARALLEL ? "expert" : "tensor";
  }
  if (chosen && chosen->name == name && chosen->api_type == api_type) return chosen->api;
  const LoadedPlugin* p = registry().find("parallel", name);
  return p && p->api_type == api_type ? p->api : nullptr;
}

void Registry::load_file(const std::string& path) {
  const std::string file = fs::absolute(path).lexically_normal().string();
  boost::dll::shared_library lib;
  try {
    lib.load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    throw PluginError(file + ": cannot be loaded (" + e.what() +
                      "); check that it is a loom plugin built for this platform and that its "
                      "dependencies are installed");
  }

  const std::string entry = LOOM_PLUGIN_ENTRY_V1;
  if (!lib.has(entry)) {
    // Name the major it was built for when it exports another version's entry point.
    for (int major = 0; major < 100; ++major) {
      if (major == LOOM_ABI_MAJOR) continue;
      if (lib.has("loom_plugin_init_v" + std::to_string(major)))
        throw PluginError(file + ": built for loom plugin ABI " + std::to_string(major) +
                          ".x but this engine implements ABI " +
                          version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                          "; rebuild it against the loom SDK " + std::to_string(LOOM_ABI_MAJOR) + ".x");
    }
    throw PluginError(file + ": no entry symbol " + entry +
                      "; it is not a loom plugin (build it with loom_add_plugin and LOOM_PLUGIN_LIBRARY)");
  }

  auto& init = lib.get<loom_status(const loom_host_api*, const loom_plugin_library**)>(entry);
  const loom_plugin_library* desc = nullptr;
  loom_status st = init(host_api(), &desc);
  if (st != nullptr) throw PluginError(file + ": plugin initialisation failed: " + take_message(st));
  if (desc == nullptr || desc->struct_size < offsetof(loom_plugin_library, num_plugins) + sizeof(size_t))
    throw PluginError(file + ": " + entry + " returned no valid library descriptor; rebuild it against this SDK");
  if (desc->abi_major != LOOM_ABI_MAJOR)
    throw PluginError(file + ": built for loom plugin ABI " + version_str(desc->abi_major, desc->abi_minor) +
                      " but this engine implements ABI " + version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                      "; rebuild it against the loom SDK " + std::to_string(LOOM_ABI_MAJOR) + ".x");
  if (desc->abi_minor > LOOM_ABI_MINOR)
    throw PluginError(file + ": built for loom plugin ABI " + version_str(desc->abi_major, desc->abi_minor) +
                      ", newer than this engine's ABI " + version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                      "; upgrade loom or rebuild the plugin against SDK " +
                      version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR));
  if (desc->num_plugins > 0 && desc->plugins == nullptr)
    throw PluginError(file + ": library descriptor lists plugins but the array is NULL");

  std::vector<std::unique_ptr<LoadedPlugin>> found;
  for (size_t i = 0; i < desc->num_plugins; ++i) {
    const loom_plugin_info* info = desc->plugins[i];
    if (info == nullptr || info->struct_size < offsetof(loom_plugin_info, num_options) + sizeof(size_t))
      throw PluginError(file + ": plugin descriptor #" + std::to_string(i) + " is NULL or too small");
    auto p = std::make_unique<LoadedPlugin>();
    p->kind = info->kind ? info->kind : "";
    p->name = info->name ? info->name : "";
    p->version = info->version ? info->version : "";
    p->description = info->description ? info->description : "";
    p->file = file;
    p->api_type = info->api_type;
    p->api = info->api;
    p->abi_major = desc->abi_major;
    p->abi_minor = desc->abi_minor;
    if (!valid_name(p->kind) || !valid_name(p->name))
      throw PluginError(file + ": plugin descriptor #" + std::to_string(i) + " has an invalid kind/name '" +
                        p->kind + "/" + p->name + "' (use lowercase letters, digits, '_', '.', '-')");
    if (expected_api_type(p->kind, p->api_type) != p->api_type)
      throw PluginError(file + ": plugin " + p->key() + " declares api_type " + std::to_string(p->api_type) +
                        ", which is not a table of kind '" + p->kind +
                        "' (kinds: device, comm, layer, parallel, exec)");
    // A table kind exists from the minor that introduced it; an older library cannot mean it.
    const uint32_t introduced = p->api_type == LOOM_API_EXPERT_PARALLEL   ? 4
                                : p->api_type == LOOM_API_TENSOR_PARALLEL ? 1
                                                                          : 0;
    if (p->abi_minor < introduced)
      throw PluginError(file + ": plugin " + p->key() + " declares api_type " + std::to_string(p->api_type) +
                        ", which ABI 1." + std::to_string(introduced) + " introduced, but it was built for ABI " +
                        version_str(p->abi_major, p->abi_minor));
    if (p->api == nullptr || *static_cast<const uint32_t*>(p->api) < sizeof(uint32_t) * 2)
      throw PluginError(file + ": plugin " + p->key() + " has no API table");
    if (info->num_options > 0 && info->options == nullptr)
      throw PluginError(file + ": plugin " + p->key() + " lists options but the array is NULL");
    for (size_t j = 0; j < info->num_options; ++j) {
      const loom_option_decl& d = info->options[j];
      bool ok = false;
      manifest::OptionDecl od{option_type(d.type, ok), d.name ? d.name : "", std::nullopt, d.doc ? d.doc : ""};
      if (!ok || od.name.empty())
        throw PluginError(file + ": plugin " + p->key() + " option #" + std::to_string(j) +
                          " has no name or an unknown type");
      if (d.default_value) {
        od.default_value = d.default_value;
        if (!default_matches(od.type, d.default_value))
          throw PluginError(file + ": plugin " + p->key() + " option '" + od.name + "' has default '" +
                            d.default_value + "' that does not match its declared type");
      }
      p->options.push_back(std::move(od));
    }
    for (const auto& q : found)
      if (q->key() == p->key())
        throw PluginError(file + ": describes plugin " + p->key() + " twice");
    found.push_back(std::move(p));
  }
  for (const auto& p : found)
    if (const LoadedPlugin* prev = find(p->kind, p->name))
      throw PluginError("plugin " + p->key() + " in " + file + " duplicates the one already loaded from " +
                        prev->file + "; remove one of them from the search path or rename it");

  for (auto& p : found) plugins_.push_back(std::move(p));
  loaded_libraries().push_back(std::move(lib));
}

std::vector<std::string> Registry::load_dirs(const std::vector<std::string>& dirs) {
  std::vector<std::string> errors;
  std::set<std::string> seen_dirs;
  for (const std::string& d : dirs) {
    boost::system::error_code ec;
    fs::path dir = fs::canonical(d, ec);
    if (ec || !fs::is_directory(dir) || !seen_dirs.insert(dir.string()).second) continue;
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("loom_", 0) == 0 && entry.path().extension() == ".so") files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());  // deterministic order → deterministic duplicate messages
    for (const std::string& f : files) {
      try {
        load_file(f);
      } catch (const PluginError& e) {
        errors.push_back(e.what());
      }
    }
  }
  return errors;
}

const LoadedPlugin* Registry::find(const std::string& kind, const std::string& name) const {
  for (const auto& p : plugins_)
    if (p->kind == kind && p->name == name) return p.get();
  return nullptr;
}

const LoadedPlugin& Registry::get(const std::string& kind, const std::string& name) const {
  if (const LoadedPlugin* p = find(kind, name)) return *p;
  std::string available;
  for (const auto& p : plugins_)
    if (p->kind == kind) available += (available.empty() ? "" : ", ") + p->name;
  throw PluginError("no plugin " + kind + "/" + name + " is loaded (available " + kind + " plugins: " +
                    (available.empty() ? "none" : available) +
                    "); check plugins.search_paths or LOOM_PLUGIN_PATH");
}

std::vector<std::string> Registry::search_paths(const std::vector<std::string>& extra) {
  std::vector<std::string> paths = extra;
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ':'))
      if (!item.empty()) paths.push_back(item);
  }
  boost::system::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path bin = exe.parent_path();
    paths.push_back((bin / LOOM_PLUGIN_REL_DIR).lexically_normal().string());
    paths.push_back((bin / "../lib/loom/plugins").lexically_normal().string());
  }
  return paths;
}

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace loom::plugins
