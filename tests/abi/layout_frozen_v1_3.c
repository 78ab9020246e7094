/* Member offsets and sizes under the FROZEN 1.3 header (include path
 * tests/abi/v1_3 comes first): the 1.0 members, then those 1.1, 1.2 and 1.3 appended.
 * Compared with layout_current.c by the ABI test. */
#include <loom/loom_abi.h>

#include <stddef.h>
#include <string.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
};
#undef M
const size_t* loom_abi_layout_frozen_v1_3(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}

/* sizeof of the 1.3 structs that 1.4 appended to (0 for others): a 1.4 member
 * must start at or past it, except a pad_1_3 that fills the 1.3 tail padding. */
size_t loom_abi_sizeof_v1_3(const char* name) {
#define SIZE(s) \
  if (strcmp(name, #s) == 0) return sizeof(s);
  SIZE(loom_layer_fwd_args)
  SIZE(loom_layer_bwd_args)
  SIZE(loom_param_decl)
  SIZE(loom_optimizer_create_args)
  SIZE(loom_optimizer_api)
#undef SIZE
  return 0;
}
