/* isa_avx512.c - the native kernels for x86-64-v4 (AVX-512 F, BW, DQ, VL): 32 vector
 * registers of 64 bytes; 12 x 2 accumulators. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4")
#define ISA avx512
#define VBYTES 64
#define MR 12
#include "native_kernels.h"
#endif
