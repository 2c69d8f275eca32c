/* expf.h - e^x in float, to about 1 ulp, written once for the native kernels (C, one float at a
 * time, in loops GCC vectorises: libm's expf is a call) and the OpenCL tiled family (VW floats
 * at a time: on PoCL its forward takes 0.95-0.98x the time it took with the built-in exp);
 * its constants are those of the native sets' whole-register exps too (csrc/exp8.h, exp16.h).
 * Whoever includes it for the function defines first:
 *   OR_EXPF           the function's name
 *   OR_EXPF_T         float, or a vector of floats
 *   OR_EXPF_U         the 32-bit unsigned type of the same shape
 *   OR_EXPF_BITS(x)   x's bits, as OR_EXPF_U;  OR_EXPF_FLOAT(u) the float with bits u
 * (without OR_EXPF it gives the constants alone).
 *
 * Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 minimax polynomial for e^r
 * in Horner form (relative error 2e-9; at most 1.04 ulp from float64 over [-87, 88] with FMAs,
 * 1.31 without). It replaced Cephes' degree-7 one (0.89 / 1.14 ulp): an FMA less in a chain of
 * dependent ones, and the AVX2 exp's loop is bound by that chain's latency, not by its FMAs
 * (one core of an AMD EPYC, rows of 96 scores: 3.84 ns a vector against 4.28; float32 forward
 * at D 64 0.99x the time, 2 threads). Arguments are clamped below at -127 ln2, where 2^n's
 * exponent bits become 0: so -inf (a masked score) gives exactly 0. n is read from the bits of
 * the sum that rounds it, and capped as an unsigned integer (above 88.3 the result is inf, and a
 * NaN's bits, whatever its sign, cap too: the NaN carries on through the polynomial): one
 * compare and blend instead of two, a fifth fewer instructions per exp (native float forward at
 * D 64 4 % faster, D 128 and the backward 1-2 %, one core, A/B).
 * With OR_EXPF_COARSE defined as well, the polynomial is a degree-4 one (minimax on |r| <= ln2/2
 * with the terms 1 + r kept exact, fitted in float64), relative error 5.4e-6 instead of about
 * 1 ulp and two FMAs fewer: for probabilities about to be rounded to bfloat16 (2^-9).
 */
#ifndef OR_EXP_CONSTANTS
#define OR_EXP_CONSTANTS
#define OR_EXP_LOW -88.0296919f         /* -127 ln2: the clamp */
#define OR_EXP_ROUND 12582912.0f        /* 1.5 * 2^23: adding it rounds to an integer */
#define OR_EXP_LOG2E 1.44269504f
#define OR_EXP_LN2_HI 0.693359375f      /* ln2 = hi - lo, hi exact in 9 bits */
#define OR_EXP_LN2_LO 2.12194440e-4f
/* e^r = ((((c6 r + c5) r + c4) r + c3) r + c2) r^2 + r + 1 */
#define OR_EXP_C6 1.38436002e-3f
#define OR_EXP_C5 8.37420020e-3f
#define OR_EXP_C4 4.16680090e-2f
#define OR_EXP_C3 1.66664302e-1f
#define OR_EXP_C2 4.99999940e-1f
#endif

#ifdef OR_EXPF
OR_FN OR_EXPF_T OR_EXPF(OR_EXPF_T x)
{
    const OR_EXPF_T lo = (OR_EXPF_T)OR_EXP_LOW, round = (OR_EXPF_T)OR_EXP_ROUND;
    const OR_EXPF_T xc = x < lo ? lo : x;
    const OR_EXPF_T t = xc * OR_EXP_LOG2E + round;      /* n in its low mantissa bits */
    const OR_EXPF_T n = t - round;                       /* round to nearest */
    OR_EXPF_T r = xc - n * OR_EXP_LN2_HI;
    r = r + n * OR_EXP_LN2_LO;
#ifdef OR_EXPF_COARSE
    OR_EXPF_T y = (OR_EXPF_T)4.1277746659e-2f;
    y = y * r + 1.6753514403e-1f;
    y = y * r + 5.0005116073e-1f;
#else
    OR_EXPF_T y = (OR_EXPF_T)OR_EXP_C6;
    y = y * r + OR_EXP_C5;
    y = y * r + OR_EXP_C4;
    y = y * r + OR_EXP_C3;
    y = y * r + OR_EXP_C2;
#endif
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    const OR_EXPF_U cap = (OR_EXPF_U)255u;
    const OR_EXPF_U e = OR_EXPF_BITS(t) - (OR_EXPF_U)(0x4B400000u - 127u);  /* n + 127 */
    return y * OR_EXPF_FLOAT((e < cap ? e : cap) << 23);
}
#endif
