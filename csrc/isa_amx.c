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
/* bfloat16 decode steps of 9-16 query rows a unit go to the forward on tiles: B1 H32 Hkv8 at
 * 1,024 keys D 128 0.67x torch SDPA on the decode path, 1.06-1.11x there (16 rows; B4 H12 D 64
 * 0.70 against 1.29-1.42x, 12 rows over 4,096 keys 0.79-0.95 against 0.97-1.16x, 9 rows over
 * 1,024 0.94 against 0.92x); at 8 rows or fewer the decode path stays ahead (1.0-2.3x torch,
 * the forward 0.5-0.9x). The avx512bf16 set's forward was no faster there (0.4-0.6x). */
#define DECODE_BF16_ROWS 8
#include "native_kernels.h"
#endif
