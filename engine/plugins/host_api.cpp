// The host table handed to every plugin: logging into glog, status objects,
// option lookup, and the per-rank services behind loom_rank.
#include <loom/cpp/core.hpp>

#include "engine/plugins/registry.hpp"
#include "engine/plugins/rank_context.hpp"

#include <glog/logging.h>

#include <string>

struct loom_status_s {
  int32_t code;
  std::string message;
};

struct loom_options_s {
  toml::table values;
};

namespace loom::plugins {
namespace {

void host_log(int32_t severity, const char* file, int32_t line, const char* message) {
  google::LogSeverity s = severity >= LOOM_LOG_ERROR     ? google::GLOG_ERROR
                          : severity == LOOM_LOG_WARNING ? google::GLOG_WARNING
                                                         : google::GLOG_INFO;
  google::LogMessage(file ? file : "plugin", line, s).stream() << (message ? message : "");
}

loom_status status_create(int32_t code, const char* message) {
  try {
    return new loom_status_s{code == LOOM_CODE_OK ? LOOM_CODE_INTERNAL : code,
                             message ? message : "(no message)"};
  } catch (...) {
    return nullptr;  // out of memory while reporting an error: nothing better to do
  }
}
int32_t status_code(loom_status s) { return s ? s->code : LOOM_CODE_OK; }
const char* status_message(loom_status s) { return s ? s->message.c_str() : ""; }
void status_destroy(loom_status s) { delete s; }

const toml::node* option_node(const loom_options* o, const char* name) {
  if (o == nullptr || name == nullptr) return nullptr;
  return o->values.get(name);
}
int32_t option_int(const loom_options* o, const char* name, int64_t* out) {
  const toml::node* n = option_node(o, name);
  if (n == nullptr || !n->is_integer()) return 0;
  *out = n->as_integer()->get();
  return 1;
}
int32_t option_float(const loom_options* o, const char* name, double* out) {
  const toml::node* n = option_node(o, name);
  if (n == nullptr) return 0;
  if (n->is_floating_point()) *out = n->as_floating_point()->get();
  else if (n->is_integer()) *out = static_cast<double>(n->as_integer()->get());
  else return 0;
  return 1;
}
int32_t option_bool(const loom_options* o, const char* name, int32_t* out) {
  const toml::node* n = option_node(o, name);
  if (n == nullptr || !n->is_boolean()) return 0;
  *out = n->as_boolean()->get() ? 1 : 0;
  return 1;
}
const char* option_string(const loom_options* o, const char* name) {
  const toml::node* n = option_node(o, name);
  if (n == nullptr || !n->is_string()) return nullptr;
  return n->as_string()->get().c_str();
}

loom_status no_rank() { return status_create(LOOM_CODE_INVALID_ARGUMENT, "loom_rank handle is NULL"); }

loom_status rank_alloc(loom_rank* r, size_t bytes, void** out) { return r ? r->alloc(bytes, out) : no_rank(); }
void rank_free(loom_rank* r, void* p) {
  if (r) r->free(p);
}
loom_status rank_device(loom_rank* r, const loom_device_api** api, loom_device** dev, loom_stream** stream) {
  return r ? r->device(api, dev, stream) : no_rank();
}
loom_status rank_group(loom_rank* r, const char* kind, loom_group* out) {
  if (!r) return no_rank();
  if (!kind || !out) return status_create(LOOM_CODE_INVALID_ARGUMENT, "group(): kind and out are required");
  return r->group(kind, out);
}
loom_status rank_exec(loom_rank* r, const loom_exec_api** api, loom_exec** exec) {
  return r ? r->exec(api, exec) : no_rank();
}
int32_t rank_global(loom_rank* r) { return r ? r->global_rank() : -1; }
const void* rank_service(loom_rank* r, int32_t api_type, const char* name) {
  try {
    const void* s = r ? r->service(api_type, name) : nullptr;
    return s ? s : find_service(api_type, name);
  } catch (...) {
    return nullptr;  // nothing throws across the ABI
  }
}

loom_host_api make_host_api() {
  loom_host_api h = loom::make<loom_host_api>();
  h.abi_major = LOOM_ABI_MAJOR;
  h.abi_minor = LOOM_ABI_MINOR;
  h.engine_version = LOOM_VERSION;
  h.log = host_log;
  h.status_create = status_create;
  h.status_code = status_code;
  h.status_message = status_message;
  h.status_destroy = status_destroy;
  h.option_int = option_int;
  h.option_float = option_float;
  h.option_bool = option_bool;
  h.option_string = option_string;
  h.alloc = rank_alloc;
  h.free = rank_free;
  h.device = rank_device;
  h.group = rank_group;
  h.exec = rank_exec;
  h.global_rank = rank_global;
  h.service = rank_service;
  return h;
}

}  // namespace

const loom_host_api* host_api() {
  static const loom_host_api api = [] {
    loom_host_api a = make_host_api();
    return a;
  }();
  // The engine uses the same C++ layer as plugins, through the same table.
  if (loom::host_slot() == nullptr) loom::host_slot() = &api;
  return &api;
}

OptionValues::OptionValues(const toml::table* section, const std::vector<manifest::OptionDecl>& decls)
    : impl_(new loom_options_s{}) {
  host_api();
  if (section) impl_->values = *section;
  for (const manifest::OptionDecl& d : decls) {
    if (impl_->values.contains(d.name) || !d.default_value) continue;
    try {
      toml::table parsed = toml::parse("v = " + *d.default_value);
      if (const toml::node* v = parsed.get("v")) impl_->values.insert(d.name, *v);
    } catch (const toml::parse_error&) {
      // A malformed default is reported when the plugin is loaded; skip it here.
    }
  }
}
OptionValues::~OptionValues() { delete impl_; }
const loom_options* OptionValues::raw() const { return impl_; }

}  // namespace loom::plugins
