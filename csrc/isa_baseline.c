/* isa_baseline.c - the native kernels in portable C, for any architecture: vector types of 16
 * bytes, which every SIMD unit has (x86-64's SSE2, ARM's NEON) and compilers map directly; 16
 * registers hold the 6 x 2 accumulators. (32-byte types on SSE2 went through memory: 30x
 * slower, measured.) */
#define ISA baseline
#define VBYTES 16
#define MR 6
#define BC 96
#define SR 24
#include "native_kernels.h"
