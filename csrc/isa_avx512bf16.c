/* isa_avx512bf16.c - the AVX-512 set (isa_avx512.c's blocks) plus AVX512-BF16, whose dot
 * products run the bfloat16 forward's matrix products (attn_bf16_impl.h). The default set only
 * where those run at a float FMA's rate (native_isa.c). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#define ISA avx512bf16
#define VBYTES 64
#define MR 8
#define BC 128
#define SR 16
#define OR_BF16_DOTS 1
#include "native_kernels.h"
#endif
