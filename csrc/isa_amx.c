/* isa_amx.c - the AVX512-BF16 set (isa_avx512bf16.c) with the bfloat16 products whose left
 * operand is row-major on AMX-BF16 tiles (attn_amx_impl.h). Offered where the CPU has AMX and
 * Linux grants the process its tile state (native_isa.c). Strips of 32 rows, so that each
 * tile of keys or values loaded serves two row tiles (attn_amx_impl.h); blocks of 128 keys
 * (Sapphire Rapids, against 64 and 256: 64 1.11-1.16x the forward's time, 256 0.91-0.95x the
 * forward's but 1.04-1.09x the backward's). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16")
#define ISA amx
#define VBYTES 64
#define MR 8
#define BC 128
#define SR 32
#define OR_BF16_DOTS 1
#define OR_AMX_TILES 1
#include "native_kernels.h"
#endif
