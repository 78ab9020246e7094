/* Member offsets and sizes under the FROZEN 1.1 header (include path
 * tests/abi/v1_1 comes first): the 1.0 members, then those 1.1 appended.
 * Compared with layout_current.c by the ABI test. */
#include <loom/loom_abi.h>

#include <stddef.h>
#include <string.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
};
#undef M
const size_t* loom_abi_layout_frozen_v1_1(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}

/* sizeof under 1.1 of the structs 1.2 appended to: a member appended later must start
 * at or past it (an old caller's struct_size covers the old tail padding). */
size_t loom_abi_sizeof_v1_1(const char* name) {
#define SIZE(s) \
  if (strcmp(name, #s) == 0) return sizeof(s);
  SIZE(loom_layernorm_bwd_args)
  SIZE(loom_embedding_args)
  SIZE(loom_device_api)
  SIZE(loom_layer_create_args)
  SIZE(loom_tp_linear_args)
  SIZE(loom_tp_embedding_args)
  SIZE(loom_tp_xent_args)
  SIZE(loom_tensor_parallel_api)
#undef SIZE
  return 0;
}
