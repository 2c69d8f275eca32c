/* exp16.h - e^x of 16 floats in AVX-512, for the native kernels (native_kernels.h, in sets
 * with AVX-512) and benchmarks/amx_tiles.c, which times it beside AMX tiles.
 * The includer compiles for AVX-512 F. */
#ifndef ORCHARD_EXP16_H
#define ORCHARD_EXP16_H
#include <immintrin.h>
#include "../kernels/expf.h"    /* its constants (the includer has no OR_EXPF defined) */

/* e^x for 16 floats: the float kernels' probabilities in sets with AVX-512 (attn_native_impl.h
 * exp_row_lanes). expf.h's reduction x = n ln2 + r and polynomial for e^r, and 2^n by
 * VSCALEFPS: 13 vector operations where expf.h takes 16, its 2^n four integer steps and a
 * multiply, in a forward whose FMA ports are its bound (at D 64 the exps are a fifth of their
 * operations).
 * Below -87, where e^x leaves float's normal range, and at -inf (a masked score) the result is
 * exactly 0, as expf.h's; above 88.8 inf; a NaN carries on (the compare is true for it, and
 * VMINPS returns its second operand when one is NaN). */
static inline __attribute__((always_inline)) __m512 or_exp16(__m512 x)
{
    const __m512 round = _mm512_set1_ps(OR_EXP_ROUND);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.8f), x);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(OR_EXP_LOG2E), round), round);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(OR_EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(OR_EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(OR_EXP_C6);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(OR_EXP_C5));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(OR_EXP_C4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(OR_EXP_C3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(OR_EXP_C2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, y, n);
}
#endif
