/* exp8.h - e^x of 8 floats in AVX2 + FMA, for the native kernels' float rows (native_kernels.h,
 * set avx2). The includer compiles for x86-64-v3.
 *
 * kernels/expf.h's operations one for one (its constants, its order, so the same results),
 * written on whole registers: GCC's vectorisation of expf.h's scalar loop (exp_row_lanes'
 * fallback) kept the row's lane sums and its results in stack arrays, stored and reloaded
 * every 16 elements, and the sums' chain through memory was its bound. The clamp is one
 * VMAXPS with the argument second, so that a NaN carries on, as expf.h's compare does. */
#ifndef ORCHARD_EXP8_H
#define ORCHARD_EXP8_H
#include <immintrin.h>
#include "../kernels/expf.h"    /* its constants (the includer has no OR_EXPF defined) */

static inline __attribute__((always_inline)) __m256 or_exp8(__m256 x)
{
    const __m256 round = _mm256_set1_ps(OR_EXP_ROUND);
    x = _mm256_max_ps(_mm256_set1_ps(OR_EXP_LOW), x);
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(OR_EXP_LOG2E), round);
    const __m256 n = _mm256_sub_ps(t, round);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(OR_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(OR_EXP_LN2_LO), r);
    __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(OR_EXP_C6), r, _mm256_set1_ps(OR_EXP_C5));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(OR_EXP_C4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(OR_EXP_C3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(OR_EXP_C2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    /* 2^n: n + 127 from t's bits, capped at 255 as an unsigned integer (inf, and any NaN) */
    __m256i e = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000 - 127));
    e = _mm256_min_epu32(e, _mm256_set1_epi32(255));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif
