/* amx_tiles.c - how fast do AMX-BF16 tiles run here, alone and in the bfloat16 forward's pattern?
 *
 *     gcc -O2 benchmarks/amx_tiles.c -o /tmp/amx_tiles && /tmp/amx_tiles
 *     (two at once, one per core: taskset -c 0 /tmp/amx_tiles & taskset -c 1 /tmp/amx_tiles)
 *
 * On one core, GFLOP/s of TDPBF16PS (16 x 32 by 32 x 16 bfloat16 products, 8,192
 * multiply-adds; best of 20 rounds, the ways taken in turn, since this VM's speed drifts 2x):
 *   tiles     four independent accumulator tiles, operands already in tile registers: the peak
 *   chain     one accumulator, each product waiting on the last: the latency
 *   forward   the native bfloat16 forward's two products on a strip of 32 query rows (D 64,
 *             csrc/attn_amx_impl.h amx_block): S = q K^T into floats, then o += P V, for each
 *             block of 128 keys of a unit of 1,024, its K and V tiles loaded from the unit's
 *             packed blocks (152 KB and 128 KB: L2, as in the kernel)
 *   softmax   forward with a stand-in for the softmax between the products (row maxima, exps
 *             in AVX-512, P written back as bfloat16): GFLOP/s of the products still
 *   pipelined softmax with the next key block's S issued before this block's softmax, into a
 *             second buffer, so that the tiles could run beside the AVX-512 work
 *   exps      the stand-in alone, timed as if it were the products (for the sum of the parts)
 * The forward's own tile time (perf) set against `forward` says whether its products wait on
 * the tiles or on the rest (csrc/isa_amx.c); softmax against forward and exps whether the two
 * units' work adds up or costs more together; pipelined whether it can overlap.
 */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../csrc/exp16.h"     /* or_exp16, the native float kernels' exp */

enum { NK = 1024, BC = 128, KLD = 144, D2 = 32, DVP = 64, SR = 32, QLD = 64 };

static uint32_t q[SR * QLD], kt[NK / BC * D2 * KLD], vc[NK / 2 * DVP];
static float s[2][SR * BC], o[SR * DVP], sums[SR];

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* C (32 x 32 floats, ldc) = or += A (32 x k2 words, lda) B (k2 x 32 words, ldb) */
static void block(float *c, int ldc, const uint32_t *a, int lda, const uint32_t *b, int ldb,
                  int k2, int accumulate)
{
    float *c1 = c + 16 * ldc;
    if (accumulate) {
        _tile_loadd(0, c, 4 * ldc);
        _tile_loadd(1, c + 16, 4 * ldc);
        _tile_loadd(2, c1, 4 * ldc);
        _tile_loadd(3, c1 + 16, 4 * ldc);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int x = 0; x < k2; x += 16) {
        _tile_loadd(4, a + x, 4 * lda);
        _tile_loadd(5, b + x * ldb, 4 * ldb);
        _tile_loadd(6, b + x * ldb + 16, 4 * ldb);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, a + 16 * lda + x, 4 * lda);
        _tile_dpbf16ps(2, 7, 5);
        _tile_dpbf16ps(3, 7, 6);
    }
    _tile_stored(0, c, 4 * ldc);
    _tile_stored(1, c + 16, 4 * ldc);
    _tile_stored(2, c1, 4 * ldc);
    _tile_stored(3, c1 + 16, 4 * ldc);
}

/* The softmax's stand-in on a strip's scores: each row's maximum, exp(s - max) and its sum,
 * the exps written back over the row as bfloat16 pairs (as csrc/attn_native_impl.h
 * exp_row_lanes does for P; the pairs' order does not matter to the timing). */
static void softmax(float *sc)
{
    for (int r = 0; r < SR; r++) {
        float *row = sc + r * BC;
        __m512 mx = _mm512_loadu_ps(row);
        for (int c = 16; c < BC; c += 16)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + c));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < BC; c += 32) {
            const __m512 a = or_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + c), m));
            const __m512 b = or_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + c + 16), m));
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            _mm512_storeu_si512(row + c / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        sums[r] += _mm512_reduce_add_ps(sum);
    }
}

/* S of key block j into sc (32 x 128 floats) */
static void scores(float *sc, int j)
{
    for (int c0 = 0; c0 < BC; c0 += 32)
        block(sc + c0, BC, q, QLD, kt + j * D2 * KLD + c0, KLD, D2, 0);
}

/* o += P V of key block j, P in sc */
static void values(const float *sc, int j)
{
    for (int c0 = 0; c0 < DVP; c0 += 32)
        block(o + c0, DVP, (const uint32_t *)sc, BC, vc + j * BC / 2 * DVP + c0, DVP, BC / 2, 1);
}

enum { TILES, CHAIN, FORWARD, SOFTMAX, PIPELINED, EXPS, WAYS };

static double run(int how)
{
    const long reps = how == TILES || how == CHAIN ? 100000 : 200;
    double flops = 0, t = now();
    for (long r = 0; r < reps; r++) {
        if (how == TILES) {
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 7, 5);
            _tile_dpbf16ps(3, 7, 6);
            flops += 4 * 2.0 * 16 * 16 * 32;
            continue;
        }
        if (how == CHAIN) {
            _tile_dpbf16ps(0, 4, 5);
            flops += 2.0 * 16 * 16 * 32;
            continue;
        }
        if (how == PIPELINED)
            scores(s[0], 0);
        for (int j = 0; j < NK / BC; j++) {
            float *sc = s[how == PIPELINED ? j & 1 : 0];
            if (how == PIPELINED) {     /* the next block's S, before this block's softmax */
                if (j + 1 < NK / BC)
                    scores(s[(j + 1) & 1], j + 1);
            } else if (how != EXPS) {
                scores(sc, j);
            }
            if (how != FORWARD)
                softmax(sc);
            if (how != EXPS)
                values(sc, j);
        }
        flops += NK / BC * 2 * 2.0 * SR * BC * 64;
    }
    return flops / (now() - t) / 1e9;
}

int main(void)
{
    /* Linux grants a process the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE 18) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        fprintf(stderr, "amx_tiles: this kernel or CPU grants no AMX tile state\n");
        return 1;
    }
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    for (size_t i = 0; i < sizeof(kt) / 4; i++)    /* pairs of bfloat16 1/64: no overflow */
        kt[i] = 0x3c803c80u;
    for (size_t i = 0; i < sizeof(vc) / 4; i++)
        vc[i] = 0x3c803c80u;
    for (size_t i = 0; i < sizeof(q) / 4; i++)
        q[i] = 0x3c803c80u;
    _tile_loadd(4, q, 4 * QLD);
    _tile_loadd(5, kt, 4 * KLD);
    _tile_loadd(6, kt + 16, 4 * KLD);
    _tile_loadd(7, q + 16 * QLD, 4 * QLD);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const char *names[WAYS] = {"tiles", "chain", "forward", "softmax", "pipelined", "exps"};
    double best[WAYS] = {0};
    for (int round = 0; round < 20; round++)
        for (int how = 0; how < WAYS; how++) {
            const double g = run(how);
            best[how] = g > best[how] ? g : best[how];
        }
    for (int how = 0; how < WAYS; how++)
        printf("%-9s %5.0f GFLOP/s\n", names[how], best[how]);
    printf("softmax against its parts: %.2fx their summed time\n",
           (1 / best[SOFTMAX]) / (1 / best[FORWARD] + 1 / best[EXPS]));
    _tile_release();
    printf("(checksum %g %g)\n", (double)o[0], (double)sums[0]);
    return 0;
}
#else
#include <stdio.h>
int main(void)
{
    puts("amx_tiles: x86-64 with GCC only");
    return 0;
}
#endif
