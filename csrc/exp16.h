/* exp16.h - e^x of 16 floats in AVX-512, for the native kernels (native_kernels.h, in sets
 * with AVX-512) and benchmarks/amx_tiles.c, which times it beside AMX tiles.
 * The includer compiles for AVX-512 F. */
#ifndef ORCHARD_EXP16_H
#define ORCHARD_EXP16_H
#include <immintrin.h>

/* e^x for 16 floats: the float kernels' probabilities in sets with AVX-512 (attn_native_impl.h
 * exp_row_lanes). expf.h's reduction x = n ln2 + r, then a degree-6 minimax polynomial for e^r
 * on |r| <= ln2 / 2 (relative error 2e-9, about 1 ulp once rounded) and 2^n by VSCALEFPS: 13
 * vector operations where expf.h takes 17, its 2^n four integer steps and a multiply, in a
 * forward whose FMA ports are its bound (at D 64 the exps are a fifth of their operations).
 * Below -87, where e^x leaves float's normal range, and at -inf (a masked score) the result is
 * exactly 0, as expf.h's; above 88.8 inf; a NaN carries on (the compare is true for it, and
 * VMINPS returns its second operand when one is NaN). */
static inline __attribute__((always_inline)) __m512 or_exp16(__m512 x)
{
    const __m512 round = _mm512_set1_ps(12582912.0f);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.8f), x);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), round), round);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.38436002e-3f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.37420020e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.16680090e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.66664302e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.99999940e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, y, n);
}
#endif
