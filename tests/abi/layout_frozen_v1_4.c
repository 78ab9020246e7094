/* Member offsets and sizes under the FROZEN 1.4 header (include path
 * tests/abi/v1_4 comes first): the 1.0 members, then those 1.1, 1.2, 1.3 and 1.4
 * appended. Compared with layout_current.c by the ABI test. */
#include <loom/loom_abi.h>

#include <stddef.h>
#include <string.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
};
#undef M
const size_t* loom_abi_layout_frozen_v1_4(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}

/* sizeof of the 1.4 structs that 1.5 appended to (0 for others): a 1.5 member
 * must start at or past it. */
size_t loom_abi_sizeof_v1_4(const char* name) {
#define SIZE(s) \
  if (strcmp(name, #s) == 0) return sizeof(s);
  SIZE(loom_optimizer_create_args)
#undef SIZE
  return 0;
}
