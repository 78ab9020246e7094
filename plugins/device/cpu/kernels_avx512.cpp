// The kernels of kernels.inc for the avx512 instruction set (see kernels.hpp).
#define LOOM_CPU_KERNELS_FN kernels_avx512
#define LOOM_CPU_KERNELS_NAME "avx512"
#include "kernels.inc"
