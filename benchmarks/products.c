/* products.c - the float32 forward's and backward's matrix products alone, in the native
 * kernels' own tiling: how fast can a kernel be if its softmax, transposes, loads and stores
 * took no time? benchmarks/products.py builds it with the machine's cc -march=native and times
 * it against the kernels themselves and the FMA peak (fma_peak.c).
 *
 * One head of 1,024 queries and 1,024 keys of head dim d (64 or 128), as the native kernels run
 * it (csrc/attn_native_impl.h), all products on MR x 2 accumulators, the k loop unrolled KU
 * times (gemm):
 *   forward (fwd_block): for each strip of SR query rows and each block of BC keys,
 *     S = q K^T from the block's transposed keys (d x KLD), then o += S V from its value rows
 *     (BC x LDV), both by column panels;
 *   backward (bwd_key_block): for each block of BR query rows and each block of BC keys,
 *     S = q K^T and dP = dO V^T by rows of tiles, then dQ += dS K, dV += P^T dO, dK += dS^T q
 *     by column panels, the backward's row tiles LDB(d) apart (bwd_ld).
 * Between the products S and dP are only scaled, to keep the results finite: what the softmax
 * does there is left out. The sizes are those of the set the machine runs (csrc/isa_amx.c,
 * isa_avx2.c).
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
#define BR 192                                  /* csrc/native.h */
#define VL (VBYTES / 4)
#define STR_(x) #x
#define STR(x) STR_(x)
#define W (2 * VL)
#define NK 1024
#define BLOCKS ((NK + BC - 1) / BC)           /* key blocks, the last one partial */
#define KLD (BC + 16)                           /* native.h OR_BLOCK_LD */
#define LDV(d) ((d) % 128 == 0 ? (d) + 16 : (d)) /* native.h or_rows_ld */
#define LDB(d) LDV(d)                           /* attn_native_impl.h bwd_ld */

typedef float vec __attribute__((vector_size(VBYTES)));
typedef float uvec __attribute__((vector_size(VBYTES), aligned(4)));

/* C (m x n, ldc) = or += A (m x k) B (k x n, ldb), A's element (i, x) at a[i * ars + x * acs],
 * by rows of tiles or by column panels of W */
static inline __attribute__((always_inline)) void
gemm(float *c, int ldc, const float *a, int ars, int acs, const float *b, int ldb, int m, int n,
     int k, int accumulate, int by_columns)
{
    const int outer = by_columns ? n : m, outer_step = by_columns ? W : MR;
    const int inner = by_columns ? m : n, inner_step = by_columns ? MR : W;
    for (int u = 0; u < outer; u += outer_step)
        for (int v = 0; v < inner; v += inner_step) {
            const int i0 = by_columns ? v : u, j0 = by_columns ? u : v;
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
                    const float av = a[(i0 + i) * ars + x * acs];
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

static void scale(float *x, int n)
{
    for (int e = 0; e < n; e++)
        x[e] *= 1.0f / 1024;
}

/* The operands, small values, made at the first call and kept (the kernels' are in cache
 * too), each sized for d 128: keys transposed in blocks, keys, values and their transposed
 * blocks, the dK and dV accumulators, query rows (q, dO, dQ, o) and tiles of scores (s, dP). */
static float *kt, *k, *v, *vt, *dk, *dv, *q, *dout, *dq, *o, *s, *dp;

static float *filled(long n, int mod)
{
    float *x = aligned_alloc(64, sizeof(float) * (size_t)n);
    for (long e = 0; x && e < n; e++)
        x[e] = (float)(e % mod) / 8;
    return x;
}

static int operands(void)
{
    if (kt)
        return 0;
    kt = filled(BLOCKS * 128L * KLD, 7);
    vt = filled(BLOCKS * 128L * KLD, 5);
    k = filled((NK + MR) * (long)LDB(128), 3);
    v = filled(NK * (long)LDV(128), 5);
    dk = filled((NK + MR) * (long)LDB(128), 2);
    dv = filled((NK + MR) * (long)LDB(128), 2);
    q = filled(BR * (long)LDB(128), 3);
    dout = filled(BR * (long)LDB(128), 7);
    dq = filled(BR * (long)LDB(128), 2);
    o = filled(SR * 128L, 2);
    s = filled((long)BR * BC, 2);
    dp = filled((long)BR * BC, 2);
    return kt && vt && k && v && dk && dv && q && dout && dq && o && s && dp ? 0 : -1;
}

/* d at run time, as the kernels see it */
static __attribute__((noinline)) void forward(int d)
{
    for (int r0 = 0; r0 < NK; r0 += SR) {
        memset(o, 0, sizeof(float) * SR * d);
        for (int j0 = 0; j0 < NK; j0 += BC) {
            const int cols = NK - j0 < BC ? NK - j0 : BC;   /* the last block's: a multiple of W */
            gemm(s, BC, q + r0 % (4 * SR) * d, d, 1, kt + j0 / BC * d * KLD, KLD, SR, cols, d, 0,
                 1);
            scale(s, SR * BC);
            gemm(o, d, s, BC, 1, v + j0 * LDV(d), LDV(d), SR, d, cols, 1, 1);
        }
    }
}

static __attribute__((noinline)) void backward(int d)
{
    const int ld = LDB(d);
    for (int i0 = 0; i0 < NK; i0 += BR) {
        const int rows = NK - i0 < BR ? NK - i0 : BR, rows_mr = (rows + MR - 1) / MR * MR;
        for (int j0 = 0; j0 < NK; j0 += BC) {
            const int cols = NK - j0 < BC ? NK - j0 : BC, cols_mr = (cols + MR - 1) / MR * MR;
            gemm(s, BC, q, ld, 1, kt + j0 / BC * d * KLD, KLD, rows_mr, cols, d, 0, 0);
            gemm(dp, BC, dout, ld, 1, vt + j0 / BC * d * KLD, KLD, rows_mr, cols, d, 0, 0);
            scale(s, rows_mr * BC);
            scale(dp, rows_mr * BC);
            gemm(dq, ld, dp, BC, 1, k + j0 * ld, ld, rows_mr, d, cols, 1, 1);
            gemm(dv + j0 * ld, ld, s, 1, BC, dout, ld, cols_mr, d, rows, 1, 1);
            gemm(dk + j0 * ld, ld, dp, 1, BC, q, ld, cols_mr, d, rows, 1, 1);
        }
    }
}

/* Seconds one head's products take, forward (backward 0) or backward (1), at d 64 or 128
 * (anything else, or no memory: -1). */
double products(int d, int backward_pass)
{
    if ((d != 64 && d != 128) || operands() != 0)
        return -1;
    const double t = now();
    if (backward_pass)
        backward(d);
    else
        forward(d);
    return now() - t;
}
