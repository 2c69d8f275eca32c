/* forward_products.c - the float32 forward's two matrix products alone, in the native kernels'
 * own tiling: how fast can the forward be if its softmax, transposes and stores took no time?
 * benchmarks/forward_products.py builds it with the machine's cc -march=native and times it
 * against the forward itself and the FMA peak (fma_peak.c).
 *
 * One head of 1,024 queries and 1,024 keys of head dim d (64 or 128), as the native forward runs
 * it (csrc/attn_native_impl.h fwd_block): for each strip of SR query rows and each block of BC
 * keys, S = q K^T from the block's transposed keys (d x KLD), then o += S V from its value rows
 * (BC x LDV), both by column panels of two vectors with MR x 2 accumulators, the k loop unrolled
 * KU times (gemm, by_columns).
 * Between the two products S is only scaled, to keep o finite: what the softmax does there is
 * left out. The sizes are those of the set the machine runs (csrc/isa_amx.c, isa_avx2.c).
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#define VBYTES 64
#define MR 8
#define BC 128
#define SR 32
#define KU 1
#else
#define VBYTES 32
#define MR 6
#define BC 96
#define SR 24
#define KU 2
#endif
#define VL (VBYTES / 4)
#define STR_(x) #x
#define STR(x) STR_(x)
#define W (2 * VL)
#define NK 1024
#define BLOCKS ((NK + BC - 1) / BC)           /* key blocks, the last one partial */
#define KLD (BC + 16)                           /* native.h OR_BLOCK_LD */
#define LDV(d) ((d) % 128 == 0 ? (d) + 16 : (d)) /* native.h or_rows_ld */

typedef float vec __attribute__((vector_size(VBYTES)));
typedef float uvec __attribute__((vector_size(VBYTES), aligned(4)));

/* C (m x n, ldc) = or += A (m x k, row-major, lda) B (k x n, ldb), by column panels of W */
static inline __attribute__((always_inline)) void
gemm(float *c, int ldc, const float *a, int lda, const float *b, int ldb, int m, int n, int k,
     int accumulate)
{
    for (int j0 = 0; j0 < n; j0 += W)
        for (int i0 = 0; i0 < m; i0 += MR) {
            vec acc[MR][2];
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++)
                    acc[i][h] = accumulate ? *(const uvec *)(c + (i0 + i) * ldc + j0 + h * VL)
                                           : (vec){0};
            _Pragma(STR(GCC unroll KU))
            for (int x = 0; x < k; x++) {
                const vec b0 = *(const uvec *)(b + x * ldb + j0),
                          b1 = *(const uvec *)(b + x * ldb + j0 + VL);
                for (int i = 0; i < MR; i++) {
                    const float av = a[(i0 + i) * lda + x];
                    acc[i][0] += av * b0;
                    acc[i][1] += av * b1;
                }
            }
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++)
                    *(uvec *)(c + (i0 + i) * ldc + j0 + h * VL) = acc[i][h];
        }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* d at run time, as the kernels see it */
static __attribute__((noinline)) void head(int d, const float *q, const float *kt, const float *v,
                                           float *s, float *o)
{
    for (int r0 = 0; r0 < NK; r0 += SR) {
        memset(o, 0, sizeof(float) * SR * d);
        for (int j0 = 0; j0 < NK; j0 += BC) {
            const int cols = NK - j0 < BC ? NK - j0 : BC;   /* the last block's: a multiple of W */
            gemm(s, BC, q + r0 % (4 * SR) * d, d, kt + j0 / BC * d * KLD, KLD, SR, cols, d, 0);
            for (int e = 0; e < SR * BC; e++)
                s[e] *= 1.0f / 1024;
            gemm(o, d, s, BC, v + j0 * LDV(d), LDV(d), SR, d, cols, 1);
        }
    }
}

/* Seconds one head's products take (d 64 or 128; anything else: -1). Its operands, small
 * values, are made at the first call and kept: the forward's are in cache too. */
double forward_products(int d)
{
    static float *kt, *v, *q, *s, *o;
    if (d != 64 && d != 128)
        return -1;
    if (kt == NULL) {
        kt = aligned_alloc(64, sizeof(float) * BLOCKS * 128 * KLD);
        v = aligned_alloc(64, sizeof(float) * NK * LDV(128));
        q = aligned_alloc(64, sizeof(float) * 4 * SR * 128);
        s = aligned_alloc(64, sizeof(float) * SR * BC);
        o = aligned_alloc(64, sizeof(float) * SR * 128);
        if (!kt || !v || !q || !s || !o)
            return -1;
        for (long e = 0; e < BLOCKS * 128L * KLD; e++)
            kt[e] = (float)(e % 7) / 8;
        for (long e = 0; e < NK * (long)LDV(128); e++)
            v[e] = (float)(e % 5) / 8;
        for (long e = 0; e < 4L * SR * 128; e++)
            q[e] = (float)(e % 3) / 8;
    }
    const double t = now();
    head(d, q, kt, v, s, o);
    return now() - t;
}
