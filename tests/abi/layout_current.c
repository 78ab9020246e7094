/* Member offsets and sizes under the CURRENT header set (the SDK include path:
 * loom_abi.h and the service headers it includes). Compared by the ABI test with
 * layout_frozen.c (1.0) and layout_frozen_v1_1.c to layout_frozen_v1_23.c (1.1 to
 * 1.23): every released member must keep its offset and size. The members files
 * name each member as the released headers do; the current header's padding and
 * reserved members answer to those names as well (AbiLayout.SecondNamesAreTheSameBytes). */
#include <loom/loom_abi.h>

#include <stddef.h>

#define M(s, m) offsetof(s, m), sizeof(((s*)0)->m),
static const size_t k_layout[] = {
#include "layout_members.inc"
};
static const size_t k_layout_v1_1[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
};
static const size_t k_layout_v1_2[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
};
static const size_t k_layout_v1_3[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
};
static const size_t k_layout_v1_4[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
};
static const size_t k_layout_v1_5[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
#include "layout_members_v1_5.inc"
};
static const size_t k_layout_v1_6[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
#include "layout_members_v1_5.inc"
#include "layout_members_v1_6.inc"
};
static const size_t k_layout_v1_7[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
#include "layout_members_v1_5.inc"
#include "layout_members_v1_6.inc"
#include "layout_members_v1_7.inc"
};
static const size_t k_layout_v1_8[] = {
#include "layout_members.inc"
#include "layout_members_v1_1.inc"
#include "layout_members_v1_2.inc"
#include "layout_members_v1_3.inc"
#include "layout_members_v1_4.inc"
#include "layout_members_v1_5.inc"
#include "layout_members_v1_6.inc"
#include "layout_members_v1_7.inc"
#include "layout_members_v1_8.inc"
};
static const size_t k_layout_v1_9[] = {
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
};
static const size_t k_layout_v1_10[] = {
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
};
static const size_t k_layout_v1_11[] = {
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
};
static const size_t k_layout_v1_12[] = {
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
};
static const size_t k_layout_v1_13[] = {
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
};
static const size_t k_layout_v1_14[] = {
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
};
static const size_t k_layout_v1_15[] = {
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
};
static const size_t k_layout_v1_16[] = {
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
};
static const size_t k_layout_v1_17[] = {
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
};
static const size_t k_layout_v1_18[] = {
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
};
static const size_t k_layout_v1_19[] = {
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
};
static const size_t k_layout_v1_20[] = {
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
};
static const size_t k_layout_v1_21[] = {
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
};
static const size_t k_layout_v1_22[] = {
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
};
static const size_t k_layout_v1_23[] = {
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
const size_t* loom_abi_layout_current(size_t* count) {
  *count = sizeof(k_layout) / sizeof(k_layout[0]);
  return k_layout;
}
const size_t* loom_abi_layout_current_v1_1(size_t* count) {
  *count = sizeof(k_layout_v1_1) / sizeof(k_layout_v1_1[0]);
  return k_layout_v1_1;
}
const size_t* loom_abi_layout_current_v1_2(size_t* count) {
  *count = sizeof(k_layout_v1_2) / sizeof(k_layout_v1_2[0]);
  return k_layout_v1_2;
}
const size_t* loom_abi_layout_current_v1_3(size_t* count) {
  *count = sizeof(k_layout_v1_3) / sizeof(k_layout_v1_3[0]);
  return k_layout_v1_3;
}
const size_t* loom_abi_layout_current_v1_4(size_t* count) {
  *count = sizeof(k_layout_v1_4) / sizeof(k_layout_v1_4[0]);
  return k_layout_v1_4;
}
const size_t* loom_abi_layout_current_v1_5(size_t* count) {
  *count = sizeof(k_layout_v1_5) / sizeof(k_layout_v1_5[0]);
  return k_layout_v1_5;
}
const size_t* loom_abi_layout_current_v1_6(size_t* count) {
  *count = sizeof(k_layout_v1_6) / sizeof(k_layout_v1_6[0]);
  return k_layout_v1_6;
}
const size_t* loom_abi_layout_current_v1_7(size_t* count) {
  *count = sizeof(k_layout_v1_7) / sizeof(k_layout_v1_7[0]);
  return k_layout_v1_7;
}
const size_t* loom_abi_layout_current_v1_8(size_t* count) {
  *count = sizeof(k_layout_v1_8) / sizeof(k_layout_v1_8[0]);
  return k_layout_v1_8;
}
const size_t* loom_abi_layout_current_v1_9(size_t* count) {
  *count = sizeof(k_layout_v1_9) / sizeof(k_layout_v1_9[0]);
  return k_layout_v1_9;
}
const size_t* loom_abi_layout_current_v1_10(size_t* count) {
  *count = sizeof(k_layout_v1_10) / sizeof(k_layout_v1_10[0]);
  return k_layout_v1_10;
}
const size_t* loom_abi_layout_current_v1_11(size_t* count) {
  *count = sizeof(k_layout_v1_11) / sizeof(k_layout_v1_11[0]);
  return k_layout_v1_11;
}
const size_t* loom_abi_layout_current_v1_12(size_t* count) {
  *count = sizeof(k_layout_v1_12) / sizeof(k_layout_v1_12[0]);
  return k_layout_v1_12;
}
const size_t* loom_abi_layout_current_v1_13(size_t* count) {
  *count = sizeof(k_layout_v1_13) / sizeof(k_layout_v1_13[0]);
  return k_layout_v1_13;
}
const size_t* loom_abi_layout_current_v1_14(size_t* count) {
  *count = sizeof(k_layout_v1_14) / sizeof(k_layout_v1_14[0]);
  return k_layout_v1_14;
}
const size_t* loom_abi_layout_current_v1_15(size_t* count) {
  *count = sizeof(k_layout_v1_15) / sizeof(k_layout_v1_15[0]);
  return k_layout_v1_15;
}
const size_t* loom_abi_layout_current_v1_16(size_t* count) {
  *count = sizeof(k_layout_v1_16) / sizeof(k_layout_v1_16[0]);
  return k_layout_v1_16;
}
const size_t* loom_abi_layout_current_v1_17(size_t* count) {
  *count = sizeof(k_layout_v1_17) / sizeof(k_layout_v1_17[0]);
  return k_layout_v1_17;
}
const size_t* loom_abi_layout_current_v1_18(size_t* count) {
  *count = sizeof(k_layout_v1_18) / sizeof(k_layout_v1_18[0]);
  return k_layout_v1_18;
}
const size_t* loom_abi_layout_current_v1_19(size_t* count) {
  *count = sizeof(k_layout_v1_19) / sizeof(k_layout_v1_19[0]);
  return k_layout_v1_19;
}
const size_t* loom_abi_layout_current_v1_20(size_t* count) {
  *count = sizeof(k_layout_v1_20) / sizeof(k_layout_v1_20[0]);
  return k_layout_v1_20;
}
const size_t* loom_abi_layout_current_v1_21(size_t* count) {
  *count = sizeof(k_layout_v1_21) / sizeof(k_layout_v1_21[0]);
  return k_layout_v1_21;
}
const size_t* loom_abi_layout_current_v1_22(size_t* count) {
  *count = sizeof(k_layout_v1_22) / sizeof(k_layout_v1_22[0]);
  return k_layout_v1_22;
}
const size_t* loom_abi_layout_current_v1_23(size_t* count) {
  *count = sizeof(k_layout_v1_23) / sizeof(k_layout_v1_23[0]);
  return k_layout_v1_23;
}
