/* attn_bf16_impl.h - the forward's two matrix products on AVX512-BF16 dot products, for
 * bfloat16 q, k and v.
 *
 * VDPBF16PS adds to each float lane the two products of a pair of bfloat16: twice the products
 * of a float FMA per instruction, and where it issues as fast as an FMA (AMD Zen 4:
 * benchmarks/bf16_dot.c, 2.0x the float FMA's GFLOP/s) twice the matrix products' speed.
 * attn_native_impl.h includes this file in the float instance of a set compiled with
 * AVX512-BF16 (isa_avx512bf16.c, OR_BF16_DOTS); everything but the products (scores' transform,
 * online softmax, dropout, normalisation) is the float forward's, on the same float tiles.
 *
 * The products read their operands as pairs along the summed dimension, a 32-bit word each:
 *   q    BR x dp words    query rows as given, unscaled (the scale multiplies S, in float)
 *   kt   d2 x KLD words   a key block: word (x, j) holds columns 2x, 2x + 1 of key j
 *   s    BR x BC floats   scores, probabilities, then P rounded to bfloat16 in place: row r's
 *                         words (pairs of keys) from s + r BC
 *   vc   nk2 x dvp words  a unit's values: word (x, c) holds column c of keys 2x, 2x + 1
 *   o    BR x dvp floats  the output accumulator, as the float forward's
 * d2 = d / 2 and nk2 = nk / 2 rounded up; an odd d or nk is padded with a zero. Rounding P to
 * bfloat16 is what FlashAttention-2 and torch's bfloat16 kernels do; the softmax's sums are
 * taken in float before it.
 */
#include <immintrin.h>

/* Elements 2x and 2x + 1 of a row of n bfloat16, as one word (a zero past the row's end). */
static inline uint32_t bf16_pair(const char *row, int x, int n)
{
    const uint16_t *e = (const uint16_t *)row;
    return (uint32_t)e[2 * x] | (2 * x + 1 < n ? (uint32_t)e[2 * x + 1] << 16 : 0);
}

/* C (m x n floats, ldc) = mul * A B, or C += A B where accumulate; A (m x k2 words, word (i, x)
 * at a[i * ars + x * acs]) and B (k2 rows of n words, ldb apart) are pairs of bfloat16 along the
 * sum. m is a multiple of MR and n of W, as gemm's (attn_native_impl.h), whose register tile
 * this is. */
static inline __attribute__((always_inline)) void
bf16_gemm(float *c, int ldc, const uint32_t *a, int ars, int acs, const uint32_t *b, or_ssize ldb,
          int m, int n, int k2, float mul, int accumulate)
{
    for (int i0 = 0; i0 < m; i0 += MR) {
        for (int j0 = 0; j0 < n; j0 += W) {
            __m512 acc[MR][2];
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) {
                    const float *ci = c + (or_ssize)(i0 + i) * ldc + j0 + W / 2 * h;
                    acc[i][h] = accumulate ? _mm512_loadu_ps(ci) : _mm512_setzero_ps();
                }
            if (accumulate)     /* as gemm, for the backward's dK and dV; by rows, as here */
                FN(ask_next_tile)(c, ldc, i0, j0, m, n, 0);
            for (int x = 0; x < k2; x++) {
                const uint32_t *brow = b + (or_ssize)x * ldb + j0;
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(brow);
                const __m512bh b1 = (__m512bh)_mm512_loadu_si512(brow + W / 2);
                for (int i = 0; i < MR; i++) {
                    const __m512bh av = (__m512bh)_mm512_set1_epi32(
                        (int)a[(or_ssize)(i0 + i) * ars + (or_ssize)x * acs]);
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
                }
            }
            const __m512 scale = _mm512_set1_ps(accumulate ? 1.0f : mul);
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++)
                    _mm512_storeu_ps(c + (or_ssize)(i0 + i) * ldc + j0 + W / 2 * h,
                                     _mm512_mul_ps(acc[i][h], scale));
        }
    }
}

#ifdef OR_AMX_TILES
#include "attn_amx_impl.h"
#else
/* Without AMX tiles, products of a row-major A are dot products as the others. */
static inline __attribute__((always_inline)) void
bf16_rows_gemm(float *c, int ldc, const uint32_t *a, int lda, const uint32_t *b, or_ssize ldb,
               int m, int n, int k2, float mul, int accumulate)
{
    bf16_gemm(c, ldc, a, lda, 1, b, ldb, m, n, k2, mul, accumulate);
}

static inline void bf16_tiles_begin(void) {}
static inline void bf16_tiles_end(void) {}
#endif

/* Query rows [0, rows) of a block as words (q above), rows [rows, pad_rows) zero. A row's
 * words are its bytes (x86 is little-endian: element 2x is a word's low half), so it is
 * copied whole; a word a pair at a time was 4 % of a bfloat16 forward at D 64 (AMX). */
static inline void bf16_load_q(uint32_t *q, int ld, const char *src, or_ssize stride, int rows,
                               int pad_rows, int d)
{
    const int d2 = (d + 1) / 2;
    for (int r = 0; r < rows; r++, src += stride) {
        char *row = (char *)(q + (or_ssize)r * ld);
        memcpy(row, src, sizeof(uint16_t) * (size_t)d);
        memset(row + sizeof(uint16_t) * (size_t)d, 0, sizeof(uint16_t) * (size_t)(2 * d2 - d));
    }
    memset(q + (or_ssize)rows * ld, 0, sizeof(uint32_t) * (size_t)(pad_rows - rows) * (size_t)ld);
}

/* W / 2 words at dst = the W floats at src as pairs, rounded to bfloat16 (to nearest even).
 * dst may be src: all W are read before any word is written. */
static inline __attribute__((always_inline)) void bf16_store_pairs(uint32_t *dst,
                                                                   const float *src)
{
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + W / 2), _mm512_loadu_ps(src));
    _mm512_storeu_si512(dst, (__m512i)h);
}

/* Words (r, x) of dst = elements 2x, 2x + 1 of src's row r, rounded to bfloat16, for rows
 * [0, m) and columns [0, n) (a multiple of W). dst may be src (P in place): a row's columns c..
 * are read before its words c / 2.. are written. */
static inline void bf16_pairs_along(uint32_t *dst, int ldd, const float *src, int lds, int m,
                                    int n)
{
    for (int r = 0; r < m; r++)
        for (int c = 0; c < n; c += W)
            bf16_store_pairs(dst + (or_ssize)r * ldd + c / 2, src + (or_ssize)r * lds + c);
}

/* Words (x, c) of dst = elements (2x, c), (2x + 1, c) of src, rounded to bfloat16, for pairs of
 * rows [x0, x1) and columns [0, n) (a multiple of W). */
static inline void bf16_pairs_of_rows(uint32_t *dst, int ldd, const float *src, int lds, int x0,
                                      int x1, int n)
{
    for (int x = x0; x < x1; x++)
        for (int c = 0; c < n; c += W / 2) {
            const float *in = src + (or_ssize)2 * x * lds + c;
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in));
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + lds));
            _mm512_storeu_si512(dst + (or_ssize)x * ldd + c,
                                _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
        }
}

/* o (m x dvp) += P V over keys [skip, kcols) of a block: s's rows (n columns computed, P) to
 * bfloat16 unless the softmax wrote them so (packed), then the product from the pair that holds
 * key skip (P is 0 before it; its partner row of vb is a real key's, or the zero that pads the
 * unit). vb: the block's vc rows. */
static inline __attribute__((always_inline)) void
bf16_values_product(float *o, int dvp, float *s, int m, int n, int skip, int kcols,
                    const uint32_t *vb, int packed)
{
    if (!packed)
        bf16_pairs_along((uint32_t *)s, BC, s, BC, m, n);
    if (kcols > skip)
        bf16_rows_gemm(o, dvp, (const uint32_t *)s + skip / 2, BC, vb + (or_ssize)(skip / 2) * dvp,
                       dvp, m, dvp, (kcols + 1) / 2 - skip / 2, 1, 1);
}

/* K or V (slot) of kv unit kvu, rows [from, from + nk) of n columns, as blocks of BC keys of
 * pairs along the columns (kt above): block b at dst + b KLD n2, n2 = n / 2 rounded up, zero
 * past them.
 * Unpaged rows go 16 x 16 words at a time through transpose_tile (the float forward's: words
 * move as floats, bit for bit); the rest, and paged rows, a word at a time. */
static void bf16_pack_blocks(uint32_t *dst, const or_problem *p, int slot, or_ssize kvu,
                             or_ssize from, or_ssize nk, int n)
{
    const int n2 = (n + 1) / 2;
    const or_ssize stride = p->view[slot].row_stride;
    uint32_t *last = dst + nk / BC * KLD * n2;          /* its rows past nk are zero */
    for (int x = 0; nk % BC && x < n2; x++)
        memset(last + x * KLD + nk % BC, 0, sizeof(uint32_t) * (size_t)(BC - nk % BC));
    or_ssize tiled = 0;
    const int whole = n / 2 / 16 * 16;                  /* words of whole tiles */
    if (p->pages.rows == 0 && whole > 0) {
        const char *src = or_kv_row(p, slot, kvu, from, &tiled);
        tiled = nk / 16 * 16;
        for (or_ssize r0 = 0; r0 < tiled; r0 += 16) {
            uint32_t *out = dst + r0 / BC * KLD * n2 + r0 % BC;
            for (int x0 = 0; x0 < whole; x0 += 16) {
                FN(vec) t[16];
                for (int i = 0; i < 16; i++)
                    memcpy(&t[i], src + (r0 + i) * stride + 4 * x0, sizeof(t[i]));
                FN(transpose_tile)(t);
                for (int c = 0; c < 16; c++)
                    memcpy(out + (or_ssize)(x0 + c) * KLD, &t[c], sizeof(t[c]));
            }
            for (or_ssize r = r0; r < r0 + 16; r++)     /* words past the whole tiles */
                for (int x = whole; x < n2; x++)
                    out[(or_ssize)x * KLD + r - r0] = bf16_pair(src + r * stride, x, n);
        }
    }
    or_ssize run;
    for (or_ssize j = tiled; j < nk; j += run) {
        const char *src = or_kv_row(p, slot, kvu, from + j, &run);
        run = run < nk - j ? run : nk - j;
        for (or_ssize r = j; r < j + run; r++, src += stride) {
            uint32_t *out = dst + r / BC * KLD * n2 + r % BC;    /* word x at out[x * KLD] */
            for (int x = 0; x < n2; x++)
                out[x * KLD] = bf16_pair(src, x, n);
        }
    }
}

/* The first key of kv unit kvu that some query row sees. The products along keys read keys in
 * pairs from an even one, so the key before it may share its pair: it is packed as 0, not read
 * (a key no row sees may hold NaN, which its P of 0 would not cancel). */
static or_ssize bf16_first_seen(const or_problem *p, or_ssize kvu, or_ssize nk)
{
    const or_ssize nq = p->nq[kvu * p->prm.group];
    or_ssize lo, hi;
    or_key_range(p->prm.left, p->prm.right, nq, nk, 0, nq, &lo, &hi);
    return lo;
}

/* The same rows as pairs of rows (vc above): word (x, c) of dst (rows ld words apart) holds
 * column c of rows from + 2x, from + 2x + 1; columns [n, ld), the pair past an odd nk and the
 * rows before bf16_first_seen are zero (from: even). */
static void bf16_pack_row_pairs(uint32_t *dst, int ld, const or_problem *p, int slot,
                                or_ssize kvu, or_ssize from, or_ssize nk, int n)
{
    const or_ssize stride = p->view[slot].row_stride,
                   first = bf16_first_seen(p, kvu, p->nk[kvu * p->prm.group]) - from;
    const __m256i zero = _mm256_setzero_si256();
    for (or_ssize x = 0; x < (nk + 1) / 2; x++) {
        or_ssize run;
        const char *a = 2 * x >= first ? or_kv_row(p, slot, kvu, from + 2 * x, &run) : NULL;
        const char *b = NULL;
        if (2 * x + 1 < nk && 2 * x + 1 >= first)
            b = a && run > 1 ? a + stride : or_kv_row(p, slot, kvu, from + 2 * x + 1, &run);
        uint32_t *out = dst + x * ld;
        for (int c = 0; c < ld; c += 16) {      /* 16 columns of each row: 16 words */
            const int m = n - c >= 16 ? 16 : n - c > 0 ? n - c : 0;
            const __mmask16 k = (__mmask16)((1u << m) - 1);
            const __m256i lo = a ? _mm256_mask_loadu_epi16(zero, k, a + 2 * c) : zero;
            const __m256i hi = b ? _mm256_mask_loadu_epi16(zero, k, b + 2 * c) : zero;
            _mm512_storeu_si512(out + c, _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
        }
    }
}

/* The forward pre-pass of a kv unit (transpose_keys_item's): its keys as kt blocks, its values
 * as vc, paged or not. */
static void bf16_pack_item(void *vjob, or_ssize kvu, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize nk = p->nk[kvu * p->prm.group];
    bf16_pack_blocks(or_unit_kt(job, kvu, worker), p, OR_K, kvu, 0, nk, p->d);
    bf16_pack_row_pairs(or_unit_vc(job, kvu, worker), (p->dv + W - 1) / W * W, p, OR_V,
                        kvu, 0, nk, p->dv);
}

#ifdef OR_AMX_TILES
#include "attn_f16_split_impl.h"
#endif
