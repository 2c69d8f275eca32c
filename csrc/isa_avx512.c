/* isa_avx512.c - the native kernels for x86-64-v4 (AVX-512 F, BW, DQ, VL): 32 vector
 * registers of 64 bytes; 8 x 2 accumulators, blocks of 128 keys, strips of 16 rows (9 % faster
 * forward, 6 % backward than 96 keys, 12 x 2, 24 rows, A/B on a Sapphire Rapids Xeon). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4")
#define ISA avx512
#define VBYTES 64
#define MR 8
#define BC 128
#define SR 16
#include "native_kernels.h"
#endif
