/* Member offsets and sizes under the FROZEN 1.23 headers (include path
 * tests/abi/v1_23 comes first): the 1.0 members, then those 1.1 to 1.23 appended.
 * Compared with layout_current.c by the ABI test. */
#include <loom/loom_abi.h>

#include <stddef.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
#include "layout_members_v1_5.inc"
#include "layout_members_v1_6.inc"
#include "layout_members_v1_7.inc"
#include "layout_members_v1_8.inc"
#include "layout_members_v1_9.inc"
#include "layout_members_v1_10.inc"
#include "layout_members_v1_11.inc"
#include "layout_members_v1_12.inc"
#include "layout_members_v1_13.inc"
#include "layout_members_v1_14.inc"
#include "layout_members_v1_15.inc"
#include "layout_members_v1_16.inc"
#include "layout_members_v1_17.inc"
#include "layout_members_v1_18.inc"
#include "layout_members_v1_19.inc"
#include "layout_members_v1_20.inc"
#include "layout_members_v1_21.inc"
#include "layout_members_v1_22.inc"
#include "layout_members_v1_23.inc"
};
#undef M
const size_t* loom_abi_layout_frozen_v1_23(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}
