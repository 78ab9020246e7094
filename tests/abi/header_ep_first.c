/* loom_ep.h included on its own, before anything else: it brings the whole ABI. */
#include <loom/loom_ep.h>

size_t loom_abi_sizes_ep_first(void) {
  return sizeof(loom_tensor_parallel_api) + 3 * sizeof(loom_expert_parallel_api) + 5 * sizeof(loom_host_api);
}
