// exec/eager: every layer step runs directly, as it is issued.
#include <loom/cpp/plugin.hpp>

namespace {

loom_status create(const loom_options*, loom_rank*, loom_exec** out) {
  *out = nullptr;  // stateless
  return nullptr;
}
void destroy(loom_exec*) {}
loom_status run(loom_exec*, loom_rank*, const loom_exec_step* step) {
  if (step == nullptr || step->fn == nullptr)
    return loom::make_status(LOOM_CODE_INVALID_ARGUMENT, "exec/eager: step without a function");
  return step->fn(step->ctx);
}

const loom_exec_api* table() {
  static const loom_exec_api api = [] {
    loom_exec_api a = loom::make<loom_exec_api>();
    a.create = create;
    a.destroy = destroy;
    a.run = run;
    return a;
  }();
  return &api;
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::raw_plugin("exec", "eager", "1.0.0", "runs each layer step directly",
                                     LOOM_API_EXEC, table()))
