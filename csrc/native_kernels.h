/* native_kernels.h - one instance of every native kernel, for the instruction set of the file
 * that includes it (isa_*.c), which first defines:
 *   ISA     the set's name (the table is or_kernels_ISA)
 *   VBYTES  bytes of a vector register the kernels' vector types fill (32: AVX2, 64: AVX-512)
 *   MR      rows of the matrix-product micro-kernel: its MR x 2 accumulators, two vectors of B
 *           and a broadcast must fit the register file (16 or 32 vectors)
 *   BC      keys per block: the key and value blocks and a strip's tiles stay in L1
 *   SR      forward rows per strip
 * and, where the target has AVX512-BF16, OR_BF16_DOTS (attn_bf16_impl.h), and the compiler target for the functions below. The kernels themselves are written once,
 * over REAL, in attn_native_impl.h (forward, backward) and attn_decode_impl.h (decoding).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* tiles are padded to whole micro-kernels: rows to MR, columns to two vectors */
_Static_assert(BR % MR == 0 && BC % MR == 0 && SR % MR == 0 && BC % (2 * VBYTES / 4) == 0,
               "block sizes must be multiples of the micro-kernel's");

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* exp for the float kernels, inlined so that the row loops vectorise (libm's expf is a call).
 * Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Cephes' polynomial for e^r in Horner
 * form: about 1 ulp. Arguments are clamped below at -127 ln2, where 2^n's exponent bits become
 * 0: so -inf (a masked score) gives exactly 0. n is read from the bits of the sum that rounds
 * it, and capped in integers (above 88.3 the result is inf): one compare and blend instead of
 * two: a fifth fewer instructions per exp, the float forward at D 64 4 % faster, D 128 and the
 * backward 1-2 % (one core, A/B). */
static inline __attribute__((always_inline)) float or_expf(float x)
{
    const float xc = x < -88.0296919f ? -88.0296919f : x;
    const float t = xc * 1.44269504f + 12582912.0f;     /* n in its low mantissa bits */
    const float n = t - 12582912.0f;                     /* round to nearest */
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    int32_t e;
    memcpy(&e, &t, sizeof(e));
    e -= 0x4B400000 - 127;                               /* n + 127, the exponent of 2^n */
    /* unsigned: a NaN's bits can make e negative, and shifting that is undefined */
    const uint32_t bits = (uint32_t)(e < 255 ? e : 255) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof(two_n));
    return y * two_n;
}

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

const or_kernels CAT(or_kernels_, ISA) = {
    .name = OR_STR(ISA),
    .width = 2 * VBYTES,
    .block_keys = BC,
#ifdef OR_BF16_DOTS
    .transpose_keys_item = {transpose_keys_item_f, transpose_keys_item_d, bf16_pack_item},
    .fwd_item = {fwd_item_f, fwd_item_d, bf16_fwd_item},
    .bwd_item = {bwd_item_f, bwd_item_d, bf16_bwd_item},
    .bwd_scratch = {bwd_scratch_f, bwd_scratch_d, bf16_bwd_scratch},
#else
    .transpose_keys_item = {transpose_keys_item_f, transpose_keys_item_d},
    .fwd_item = {fwd_item_f, fwd_item_d},
    .bwd_item = {bwd_item_f, bwd_item_d},
    .bwd_scratch = {bwd_scratch_f, bwd_scratch_d},
#endif
    .decode_item = {decode_item_f, decode_item_d},
};
