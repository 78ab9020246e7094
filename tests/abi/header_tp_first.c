/* loom_tp.h included on its own, before anything else: it brings the whole ABI. */
#include <loom/loom_tp.h>

size_t loom_abi_sizes_tp_first(void) {
  return sizeof(loom_tensor_parallel_api) + 3 * sizeof(loom_expert_parallel_api) + 5 * sizeof(loom_host_api);
}
