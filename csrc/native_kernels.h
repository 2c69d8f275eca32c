/* native_kernels.h - one instance of every native kernel, for the instruction set of the file
 * that includes it (isa_*.c), which first defines:
 *   ISA     the set's name (the table is or_kernels_ISA)
 *   VBYTES  bytes of a vector register the kernels' vector types fill (32: AVX2, 64: AVX-512)
 *   MR      rows of the matrix-product micro-kernel: its MR x 2 accumulators, two vectors of B
 *           and a broadcast must fit the register file (16 or 32 vectors)
 *   BC      keys per block: the key and value blocks and a strip's tiles stay in L1
 *   SR      forward rows per strip
 *   KU      (optional, default 1) the micro-kernel's k loop unrolled KU times
 * and, where the target has AVX512-BF16, OR_BF16_DOTS (attn_bf16_impl.h), where it has AMX
 * OR_AMX_TILES too (attn_amx_impl.h, attn_f16_split_impl.h), optionally DECODE_BF16_ROWS
 * (or_kernels' decode_bf16_rows; default OR_DECODE_MAX_QUERIES), and the compiler target for
 * the functions below. The kernels themselves are written once,
 * over REAL, in attn_native_impl.h (forward, backward) and attn_decode_impl.h (decoding).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#ifdef __F16C__
#include <immintrin.h>      /* store_rows' float16 conversions (attn_native_impl.h) */
#endif

#ifndef KU
#define KU 1
#endif
#ifndef DECODE_BF16_ROWS
#define DECODE_BF16_ROWS OR_DECODE_MAX_QUERIES
#endif

/* tiles are padded to whole micro-kernels: rows to MR, columns to two vectors */
_Static_assert(BR % MR == 0 && BC % MR == 0 && SR % MR == 0 && BC % (2 * VBYTES / 4) == 0,
               "block sizes must be multiples of the micro-kernel's");

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* exp for the float kernels (kernels/expf.h, shared with the OpenCL tiled family), inlined so
 * that the row loops vectorise */
static inline __attribute__((always_inline)) uint32_t or_float_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline __attribute__((always_inline)) float or_bits_float(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

#define OR_EXPF or_expf
#define OR_EXPF_T float
#define OR_EXPF_U uint32_t
#define OR_EXPF_BITS or_float_bits
#define OR_EXPF_FLOAT or_bits_float
#include "expf.h"
#ifdef OR_BF16_DOTS     /* the bfloat16 forward's probabilities (attn_native_impl.h softmax_rows) */
#undef OR_EXPF
#define OR_EXPF or_expf_coarse
#define OR_EXPF_COARSE
#include "expf.h"
#undef OR_EXPF_COARSE
#endif
#undef OR_EXPF     /* exp8.h and exp16.h below read expf.h's constants alone */

/* OR_EXPV(v): e^x of a vector of VBYTES floats (a GCC vector), the float rows' exps
 * (attn_native_impl.h exp_row_lanes), where the set has one */
#if VBYTES == 64 && defined(__AVX512F__)
#include "exp16.h"
#define OR_EXPV(v) ((__typeof__(v))or_exp16((__m512)(v)))
#elif VBYTES == 32 && defined(__AVX2__) && defined(__FMA__)
#include "exp8.h"
#define OR_EXPV(v) ((__typeof__(v))or_exp8((__m256)(v)))
#endif

#define REAL float
#define REAL_SIZE 4     /* sizeof(REAL), for the preprocessor */
#define SFX _f
#define EXP or_expf
#define LOG logf
#define TANH tanhf
#include "attn_native_impl.h"
#include "attn_decode_impl.h"
#undef REAL
#undef REAL_SIZE
#undef SFX
#undef EXP
#undef LOG
#undef TANH

#define REAL double
#define REAL_SIZE 8
#define SFX _d
#define EXP exp
#define LOG log
#define TANH tanh
#include "attn_native_impl.h"
#include "attn_decode_impl.h"

/* The float16 forward on tiles (OR_IN_F16_TILES) is only in sets with AMX. */
#ifdef OR_AMX_TILES
#define F16_TILES(item) , item
#else
#define F16_TILES(item)
#endif

const or_kernels CAT(or_kernels_, ISA) = {
    .name = OR_STR(ISA),
    .width = 2 * VBYTES,
    .block_keys = BC,
    .decode_bf16_rows = DECODE_BF16_ROWS,
#ifdef OR_BF16_DOTS
    .transpose_keys_item = {transpose_keys_item_f, transpose_keys_item_d, bf16_pack_item
                            F16_TILES(f16_split_pack_item)},
    .fwd_item = {fwd_item_f, fwd_item_d, bf16_fwd_item F16_TILES(f16_split_fwd_item)},
    .bwd_item = {bwd_item_f, bwd_item_d, bf16_bwd_item},
    .bwd_scratch = {bwd_scratch_f, bwd_scratch_d, bf16_bwd_scratch},
#else
    .transpose_keys_item = {transpose_keys_item_f, transpose_keys_item_d},
    .fwd_item = {fwd_item_f, fwd_item_d},
    .bwd_item = {bwd_item_f, bwd_item_d},
    .bwd_scratch = {bwd_scratch_f, bwd_scratch_d},
#endif
    .bwd_sum_item = {bwd_sum_item_f, bwd_sum_item_d},
    .decode_item = {decode_item_f, decode_item_d},
};
