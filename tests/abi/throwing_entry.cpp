// A library whose entry point throws a C++ exception through the C ABI (a plugin bug):
// the loader must refuse the library, naming it, not let the command abort.
#include <loom/loom_abi.h>

#include <stdexcept>

extern "C" __attribute__((visibility("default"))) loom_status loom_plugin_init_v1(const loom_host_api*,
                                                                                 const loom_plugin_library**) {
  throw std::runtime_error("thrown from the entry point");
}
