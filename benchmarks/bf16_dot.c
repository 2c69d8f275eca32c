/* bf16_dot.c - is AVX512-BF16's dot product (VDPBF16PS) worth using for bfloat16 scores?
 *
 *     gcc -O3 benchmarks/bf16_dot.c -o /tmp/bf16_dot && /tmp/bf16_dot
 *
 * Times, on one core, the register tile of the native forward's score product (12 x 32
 * outputs, S = Q K^T for 24 query rows x 96 keys x D 64, inputs in L1) two ways: float FMAs on
 * widened operands (what the kernels do), and VDPBF16PS on pairs of bfloat16 (two products
 * per float lane and instruction: half the instructions). Prints GFLOP/s of each and their
 * ratio. The kernel set that uses them (avx512bf16, csrc/attn_bf16_impl.h) is the default
 * only where this ratio is above 1: 2.0 on an AMD EPYC (Zen 4: 221 vs 110 GFLOP/s), 0.51 on
 * the Sapphire Rapids-class Xeon of README (95 vs 185), hence AMD's CPUs (csrc/native_isa.c).
 */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { MR = 12, ROWS = 24, KEYS = 96, D = 64, REPS = 200000 };

/* s (ROWS x KEYS) = q (ROWS x k, k elements per row) . kt (k rows of KEYS), float FMAs */
__attribute__((noinline)) static void scores_f32(float *s, const float *q, const float *kt)
{
    for (int i0 = 0; i0 < ROWS; i0 += MR)
        for (int j0 = 0; j0 < KEYS; j0 += 32) {
            __m512 acc[MR][2];
            for (int i = 0; i < MR; i++)
                acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int x = 0; x < D; x++) {
                const __m512 b0 = _mm512_loadu_ps(kt + x * KEYS + j0);
                const __m512 b1 = _mm512_loadu_ps(kt + x * KEYS + j0 + 16);
                for (int i = 0; i < MR; i++) {
                    const __m512 a = _mm512_set1_ps(q[(i0 + i) * D + x]);
                    acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
                }
            }
            for (int i = 0; i < MR; i++) {
                _mm512_storeu_ps(s + (i0 + i) * KEYS + j0, acc[i][0]);
                _mm512_storeu_ps(s + (i0 + i) * KEYS + j0 + 16, acc[i][1]);
            }
        }
}

/* the same with pairs of bfloat16 (D / 2 pairs per row, kt as D / 2 rows of KEYS pairs) */
__attribute__((noinline)) static void scores_bf16(float *s, const uint32_t *q, const uint32_t *kt)
{
    for (int i0 = 0; i0 < ROWS; i0 += MR)
        for (int j0 = 0; j0 < KEYS; j0 += 32) {
            __m512 acc[MR][2];
            for (int i = 0; i < MR; i++)
                acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int x = 0; x < D / 2; x++) {
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kt + x * KEYS + j0);
                const __m512bh b1 = (__m512bh)_mm512_loadu_si512(kt + x * KEYS + j0 + 16);
                for (int i = 0; i < MR; i++) {
                    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[(i0 + i) * D / 2 + x]);
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
                }
            }
            for (int i = 0; i < MR; i++) {
                _mm512_storeu_ps(s + (i0 + i) * KEYS + j0, acc[i][0]);
                _mm512_storeu_ps(s + (i0 + i) * KEYS + j0 + 16, acc[i][1]);
            }
        }
}

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) {
        puts("this CPU has no AVX512-BF16");
        return 0;
    }
    float *qf = aligned_alloc(64, sizeof(float) * ROWS * D), *ktf = aligned_alloc(64, sizeof(float) * D * KEYS);
    uint32_t *qb = aligned_alloc(64, sizeof(uint32_t) * ROWS * D / 2), *ktb = aligned_alloc(64, sizeof(uint32_t) * D / 2 * KEYS);
    float *s = aligned_alloc(64, sizeof(float) * ROWS * KEYS);
    for (int i = 0; i < ROWS * D; i++)
        qf[i] = 0.01f * (float)(i % 13);
    for (int i = 0; i < D * KEYS; i++)
        ktf[i] = 0.01f * (float)(i % 11);
    for (int i = 0; i < ROWS * D / 2; i++)
        qb[i] = 0x3C003F80u;                    /* the pair (1.0, 0.0078125) */
    for (int i = 0; i < D / 2 * KEYS; i++)
        ktb[i] = 0x3F803C00u;
    const double flops = 2.0 * ROWS * KEYS * D * REPS;
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < 5; round++) {   /* alternating, best of five */
        double t = seconds();
        for (int r = 0; r < REPS; r++)
            scores_f32(s, qf, ktf);
        t = seconds() - t;
        best[0] = t < best[0] ? t : best[0];
        t = seconds();
        for (int r = 0; r < REPS; r++)
            scores_bf16(s, qb, ktb);
        t = seconds() - t;
        best[1] = t < best[1] ? t : best[1];
    }
    printf("float FMA: %.0f GFLOP/s, bfloat16 VDPBF16PS: %.0f GFLOP/s, ratio %.2f (checksum %g)\n",
           flops / best[0] / 1e9, flops / best[1] / 1e9, best[0] / best[1], (double)s[7]);
    return 0;
}
#else
#include <stdio.h>
int main(void) { puts("x86-64 with GCC only"); return 0; }
#endif
