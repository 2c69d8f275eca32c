/* isa_amx.c - the AVX512-BF16 set (isa_avx512bf16.c) with the bfloat16 products whose left
 * operand is row-major on AMX-BF16 tiles (attn_amx_impl.h). Offered where the CPU has AMX and
 * Linux grants the process its tile state (native_isa.c). Strips of 32 rows: the forward's
 * tiles load each block of keys and values once per 32 rows, not 16 (Sapphire Rapids, D 128:
 * 0.85-0.88x the time; backward within 4 %, both ways). */
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
