// The kernels of kernels.inc for the base instruction set (see kernels.hpp).
#define LOOM_CPU_KERNELS_FN kernels_base
#define LOOM_CPU_KERNELS_NAME "base"
#include "kernels.inc"
