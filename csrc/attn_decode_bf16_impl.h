/* attn_decode_bf16_impl.h - the decode step's two products on AVX512-BF16 dot products, for
 * bfloat16 q, k and v: attn_decode_impl.h includes it in the float instance of a set compiled
 * with AVX512-BF16 (isa_avx512bf16.c, OR_BF16_DOTS), as attn_native_impl.h does
 * attn_bf16_impl.h for the forward.
 *
 * A GQA step's query rows share each key and value they read, so it does 4 rows' products per
 * element read; widened to floats, each 32 bytes of a bfloat16 cache cost a shift, a mask and 8
 * FMAs, and one core read only ~12 GB/s of it (AMD EPYC, Zen 4) where a single-row step reads
 * ~22. VDPBF16PS takes the pairs as they lie and does two products per lane and instruction:
 *   q    R x dp words    query rows as given, unscaled, pairs along d (bf16_load_q); the scale
 *                        multiplies the scores, in float
 *   k    read in place, 32 elements (16 pairs along d) a vector, as q's
 *   pw   R x BC/2 words  P rounded to bfloat16, pairs of keys (bf16_pairs_along), as the forward
 *                        and torch's bfloat16 kernels round it; the softmax's sums are taken in
 *                        float before
 *   v    read in place: rows c and c + 1 interleaved (VPUNPCKLWD / VPUNPCKHWD) give pairs of
 *        keys for each column, within each 16-byte lane: so the output accumulators hold a
 *        block of 32 columns in unpacked order (decode_slot)
 * Columns past the last whole block of 32 (dv % 32) take the float path with P unrounded.
 */

/* s[r * BC + t] = scale x (q row r . key row t), r < nr (a constant), t < NKEYS: NKEYS / 2 keys at
 * a time for more than 2 rows, as decode_dots; a masked load for the last d % 32 elements. */
static inline __attribute__((always_inline)) void
decode_bf16_dots(float *s, const uint32_t *q, int ldq, const char *const *kr, int d, float scale,
                 const int nr)
{
    const int HALF = nr > 2 ? NKEYS / 2 : NKEYS;
#pragma GCC unroll 2
    for (int h = 0; h < NKEYS; h += HALF) {
        FN(vec) a[2 * NKEYS] = {0};     /* a[r * HALF + t], in registers, as decode_dots' */
        for (int i = 0; i < d; i += 2 * DVL) {
            const __mmask32 mask = d - i >= 2 * DVL ? ~0u : (1u << (d - i)) - 1;
            __m512bh x[DROWS];
            for (int r = 0; r < nr; r++)
                x[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + (or_ssize)r * ldq + i / 2);
            for (int t = 0; t < HALF; t++) {
                const __m512bh y = (__m512bh)_mm512_maskz_loadu_epi16(mask, kr[h + t] + 2 * i);
                for (int r = 0; r < nr; r++)
                    a[r * HALF + t] = (FN(vec))_mm512_dpbf16_ps((__m512)a[r * HALF + t], x[r], y);
            }
        }
        FN(decode_totals)(a, nr, HALF, s + h, scale);
    }
}

/* Output vectors [x, x + nx DVL) of rows [0, nr) of o (unpacked order) += P V over key columns
 * [0, kcols) (a multiple of NKEYS), a pair of keys at a time: P's words at pw (BC / 2 a row),
 * value rows at vr. As decode_pv_tile: accumulators in registers for the whole block, the next
 * block's n_next rows asked for meanwhile. nr and nx (even) are constants where inlined. */
static inline __attribute__((always_inline)) void
decode_bf16_pv_tile(float *o, int dvp, int x, const uint32_t *pw, const char *const *vr,
                    int kcols, const char *const *next, int n_next, int len, const int nr,
                    const int nx)
{
    FN(vec) acc[4][8];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nx; v++)
            memcpy(&acc[r][v], o + (or_ssize)r * dvp + x + v * DVL, sizeof(acc[r][v]));
    for (int c0 = 0; c0 < kcols; c0 += NKEYS) {
        if (c0 < n_next)
            FN(decode_prefetch)(next + c0, n_next - c0 < NKEYS ? n_next - c0 : NKEYS, len);
#pragma GCC unroll 4
        for (int c = c0; c < c0 + NKEYS; c += 2) {
#pragma GCC unroll 8
            for (int v = 0; v < nx; v += 2) {
                const __m512i a = _mm512_loadu_si512(vr[c] + 2 * (x + v * DVL));
                const __m512i b = _mm512_loadu_si512(vr[c + 1] + 2 * (x + v * DVL));
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 4
                for (int r = 0; r < nr; r++) {
                    const __m512bh p = (__m512bh)_mm512_set1_epi32(
                        (int)pw[(or_ssize)r * (BC / 2) + c / 2]);
                    acc[r][v] = (FN(vec))_mm512_dpbf16_ps((__m512)acc[r][v], p, lo);
                    acc[r][v + 1] = (FN(vec))_mm512_dpbf16_ps((__m512)acc[r][v + 1], p, hi);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nx; v++)
            memcpy(o + (or_ssize)r * dvp + x + v * DVL, &acc[r][v], sizeof(acc[r][v]));
}
