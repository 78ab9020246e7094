/* Member offsets and struct sizes under the FROZEN 1.0 header (include path
 * tests/abi/v1_0 comes first). Compared with layout_current.c by the ABI test. */
#include <loom/loom_abi.h>

#include <stddef.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
};
#undef M
const size_t* loom_abi_layout_frozen_v1_0(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}
