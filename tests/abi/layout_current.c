/* Member offsets and sizes under the CURRENT header (the SDK include path).
 * Compared with layout_frozen.c by the ABI test: every released member must keep
 * its offset and size. */
#include <loom/loom_abi.h>

#include <stddef.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
};
#undef M
const size_t* loom_abi_layout_current(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}
