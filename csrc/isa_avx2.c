/* isa_avx2.c - the native kernels for x86-64-v3 (AVX2, FMA, F16C): 16 vector registers of 32
 * bytes; 6 x 2 accumulators (12 hide the FMA latency; measured about 10 % faster than 4 x 2),
 * blocks of 96 keys. The k loop unrolled twice: the forward's two products alone, one core of
 * an AMD EPYC (Zen 2), 88-90 % of the FMA peak against 84-86 %; float32 forward B4 H8 N1024
 * D64 0.98x the time, backward 0.99x (2 threads). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v3")
#define ISA avx2
#define VBYTES 32
#define MR 6
#define BC 96
#define SR 24
#define KU 2
#include "native_kernels.h"
#endif
