// The kernels of kernels.inc for the avx2 instruction set (see kernels.hpp).
#define LOOM_CPU_KERNELS_FN kernels_avx2
#define LOOM_CPU_KERNELS_NAME "avx2"
#include "kernels.inc"
