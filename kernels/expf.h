/* expf.h - e^x in float, to about 1 ulp, written once for the native kernels (C, one float at a
 * time, in loops GCC vectorises: libm's expf is a call) and the OpenCL tiled family (VW floats
 * at a time: on PoCL its forward takes 0.95-0.98x the time it took with the built-in exp);
 * the float probabilities of the native sets with AVX-512 take or_exp16 (native_kernels.h).
 * Whoever includes it defines first:
 *   OR_EXPF           the function's name
 *   OR_EXPF_T         float, or a vector of floats
 *   OR_EXPF_U         the 32-bit unsigned type of the same shape
 *   OR_EXPF_BITS(x)   x's bits, as OR_EXPF_U;  OR_EXPF_FLOAT(u) the float with bits u
 *
 * Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Cephes' polynomial for e^r in Horner
 * form. Arguments are clamped below at -127 ln2, where 2^n's exponent bits become 0: so -inf (a
 * masked score) gives exactly 0. n is read from the bits of the sum that rounds it, and capped
 * as an unsigned integer (above 88.3 the result is inf, and a NaN's bits, whatever its sign,
 * cap too: the NaN carries on through the polynomial): one compare and blend instead of two, a
 * fifth fewer instructions per exp (native float forward at D 64 4 % faster, D 128 and the
 * backward 1-2 %, one core, A/B).
 * With OR_EXPF_COARSE defined as well, the polynomial is a degree-4 one (minimax on |r| <= ln2/2
 * with the terms 1 + r kept exact, fitted in float64), relative error 5.4e-6 instead of about
 * 1 ulp and three FMAs fewer: for probabilities about to be rounded to bfloat16 (2^-9).
 */
#ifdef OR_EXPF
OR_FN OR_EXPF_T OR_EXPF(OR_EXPF_T x)
{
    const OR_EXPF_T lo = (OR_EXPF_T)-88.0296919f, round = (OR_EXPF_T)12582912.0f;
    const OR_EXPF_T xc = x < lo ? lo : x;
    const OR_EXPF_T t = xc * 1.44269504f + round;       /* n in its low mantissa bits */
    const OR_EXPF_T n = t - round;                       /* round to nearest */
    OR_EXPF_T r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
#ifdef OR_EXPF_COARSE
    OR_EXPF_T y = (OR_EXPF_T)4.1277746659e-2f;
    y = y * r + 1.6753514403e-1f;
    y = y * r + 5.0005116073e-1f;
#else
    OR_EXPF_T y = (OR_EXPF_T)1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
#endif
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    const OR_EXPF_U cap = (OR_EXPF_U)255u;
    const OR_EXPF_U e = OR_EXPF_BITS(t) - (OR_EXPF_U)(0x4B400000u - 127u);  /* n + 127 */
    return y * OR_EXPF_FLOAT((e < cap ? e : cap) << 23);
}
#endif
