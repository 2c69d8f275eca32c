/* attn_f16_split_impl.h - the forward for float16 q, k and v on AMX tiles (set amx, which has
 * no float16 products on Sapphire Rapids). Each value x is split into two bfloat16, hi = x
 * rounded and lo = x - hi, exact: x's 11 significant bits are hi's 8 and lo's 3 or 4. Each
 * product x y of the forward's two matrix products is then hi_x hi_y + hi_x lo_y + lo_x hi_y
 * + lo_x lo_y, tiles_gemm's four terms (attn_amx_impl.h), each exact in float: the products
 * are float arithmetic's, as the widening sets'. (Without lo_x lo_y, under 2^-16 of x y, a
 * score's error grew with sum |q_d k_d|: where those cancel, 3.9x float16's tolerance on out.)
 * P, a float, is split the same way, to 16 significant bits (a float16 P has 11), after the
 * softmax and dropout, which are the float forward's. The backward widens to float, as before.
 *
 * Layouts: attn_bf16_impl.h's pairs of bfloat16 along the sum, each operand in two halves:
 *   q   BR x dp words        row r: hi words [0, d2), lo words [dp / 2, dp / 2 + d2)
 *   kt  2 d2 x KLD words     a key block: rows [0, d2) hi, [d2, 2 d2) lo
 *   vc  nk2 x 2 dvp words    pair row x: hi words [0, dvp), lo words [dvp, 2 dvp)
 *   s   P's hi words in the strip's rows, lo words SR rows further (BR >= 2 SR: free rows)
 * d2 = d / 2 and nk2 = nk / 2 rounded up; columns past d or dv and the pair past an odd nk are
 * zero.
 */
_Static_assert(2 * SR <= BR, "P's lo words take the rows of s past a strip's");

/* hi and lo of 16 floats, as 16 bfloat16 each; an infinite x has lo 0, not x - hi's NaN. */
static inline __attribute__((always_inline)) void f16_split16(__m512 x, __m256i *hi, __m256i *lo)
{
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 hx = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __mmask16 finite = (__mmask16)~_mm512_fpclass_ps_mask(hx, 0x18);   /* not +-inf */
    *hi = h;
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(finite, x, hx));
}

/* Words [0, n / 2) of hi and of lo = the pairs (2c, 2c + 1) of x's elements [0, n), n a
 * multiple of 32. hi may be x (P in place): elements are read before their words are written. */
static inline __attribute__((always_inline)) void f16_split_along(uint32_t *hi, uint32_t *lo,
                                                                  const float *x, int n)
{
    for (int c = 0; c < n; c += 32) {
        __m256i h0, l0, h1, l1;
        f16_split16(_mm512_loadu_ps(x + c), &h0, &l0);
        f16_split16(_mm512_loadu_ps(x + c + 16), &h1, &l1);
        _mm512_storeu_si512(hi + c / 2, _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
        _mm512_storeu_si512(lo + c / 2, _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1));
    }
}

/* One row of n float16 as floats, zero to the padded width (a multiple of 16). */
static inline __attribute__((always_inline)) void f16_row(float *x, const char *src, int n)
{
    for (int c = 0; c < FN(pad)(n); c += 16) {
        const int m = n - c >= 16 ? 16 : n - c > 0 ? n - c : 0;
        const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << m) - 1), src + 2 * c);
        _mm512_storeu_ps(x + c, _mm512_cvtph_ps(h));
    }
}

/* Query rows [0, rows) of a block (q above), rows [rows, pad_rows) zero. */
static void f16_split_load_q(uint32_t *q, int ld, const char *src, or_ssize stride, int rows,
                             int pad_rows, int d)
{
    float x[OR_MAX_HEAD_DIM];
    for (int r = 0; r < rows; r++, src += stride) {
        f16_row(x, src, d);
        f16_split_along(q + (or_ssize)r * ld, q + (or_ssize)r * ld + ld / 2, x, FN(pad)(d));
    }
    memset(q + (or_ssize)rows * ld, 0, sizeof(uint32_t) * (size_t)(pad_rows - rows) * (size_t)ld);
}

/* The keys of kv unit kvu (nk rows, paged or not) as kt blocks, block b at dst + b KLD 2 d2:
 * 16 keys split at a time, then their words moved 16 x 16 at a time through transpose_tile
 * (words as floats, bit for bit). */
static void f16_split_pack_keys(uint32_t *dst, const or_problem *p, or_ssize kvu, or_ssize nk)
{
    const int d = p->d, d2 = (d + 1) / 2, half = FN(pad)(d) / 2;
    uint32_t *last = dst + nk / BC * KLD * 2 * d2;      /* its rows past nk are zero */
    for (int x = 0; nk % BC && x < 2 * d2; x++)
        memset(last + x * KLD + nk % BC, 0, sizeof(uint32_t) * (size_t)(BC - nk % BC));
    float row[OR_MAX_HEAD_DIM];
    uint32_t w[16][OR_MAX_HEAD_DIM];                      /* hi words, then lo from half */
    for (or_ssize r0 = 0; r0 < nk; r0 += 16) {
        for (int i = 0; i < 16; i++) {
            or_ssize run;
            if (r0 + i < nk)
                f16_row(row, or_kv_row(p, OR_K, kvu, r0 + i, &run), d);
            else
                memset(row, 0, sizeof(float) * (size_t)(2 * half));
            f16_split_along(w[i], w[i] + half, row, 2 * half);
        }
        uint32_t *out = dst + r0 / BC * KLD * 2 * d2 + r0 % BC;    /* word x at out[x KLD] */
        for (int x0 = 0; x0 < d2; x0 += 16)
            for (int lo = 0; lo < 2; lo++) {
                FN(vec) t[16];
                for (int i = 0; i < 16; i++)
                    memcpy(&t[i], w[i] + lo * half + x0, sizeof(t[i]));
                FN(transpose_tile)(t);
                for (int c = 0; c < 16 && x0 + c < d2; c++)
                    memcpy(out + (or_ssize)(lo * d2 + x0 + c) * KLD, &t[c], sizeof(t[c]));
            }
    }
}

/* The values of kv unit kvu as vc's pair rows (ld = 2 dvp words apart); the rows before
 * bf16_first_seen are zero. */
static void f16_split_pack_values(uint32_t *dst, int ld, const or_problem *p, or_ssize kvu,
                                  or_ssize nk)
{
    const int dvp = ld / 2;
    const or_view *v = &p->view[OR_V];
    const or_ssize first = bf16_first_seen(p, kvu, nk);
    float a[OR_MAX_HEAD_DIM], b[OR_MAX_HEAD_DIM];
    for (or_ssize x = 0; x < (nk + 1) / 2; x++) {
        if (2 * x + 1 < first) {
            memset(dst + x * ld, 0, sizeof(uint32_t) * (size_t)ld);
            continue;
        }
        or_ssize run;
        const char *src = or_kv_row(p, OR_V, kvu, 2 * x, &run);
        if (2 * x < first)
            memset(a, 0, sizeof(float) * (size_t)dvp);
        else
            f16_row(a, src, p->dv);
        if (2 * x + 1 < nk)
            f16_row(b, run > 1 ? src + v->row_stride : or_kv_row(p, OR_V, kvu, 2 * x + 1, &run),
                    p->dv);
        else
            memset(b, 0, sizeof(float) * (size_t)dvp);
        uint32_t *out = dst + x * ld;
        for (int c = 0; c < dvp; c += 16) {     /* word c: column c of rows 2x, 2x + 1 */
            __m256i ha, la, hb, lb;
            f16_split16(_mm512_loadu_ps(a + c), &ha, &la);
            f16_split16(_mm512_loadu_ps(b + c), &hb, &lb);
            _mm512_storeu_si512(out + c, _mm512_or_si512(_mm512_cvtepu16_epi32(ha),
                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16)));
            _mm512_storeu_si512(out + dvp + c, _mm512_or_si512(_mm512_cvtepu16_epi32(la),
                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(lb), 16)));
        }
    }
}

/* The forward pre-pass of a kv unit (transpose_keys_item's): kt blocks and vc. */
static void f16_split_pack_item(void *vjob, or_ssize kvu, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize nk = p->nk[kvu * p->prm.group];
    f16_split_pack_keys(or_unit_kt(job, kvu, worker), p, kvu, nk);
    f16_split_pack_values(or_unit_vc(job, kvu, worker), (int)job->ldvc, p, kvu, nk);
}

/* s (m x n floats, BC apart) = mul q K^T for a strip's q rows and a key block's kt. */
static inline __attribute__((always_inline)) void
f16_split_scores(float *s, const uint32_t *q, int dp, const uint32_t *kt, int d2, int m, int n,
                 float mul)
{
    tiles_gemm(s, BC, q, dp, dp / 2, kt, KLD, (or_ssize)d2 * KLD, 4, m, n, d2, mul, 0);
}

/* bf16_values_product's o += P V over keys [skip, kcols), P split (s above), vb the block's
 * vc rows. */
static inline __attribute__((always_inline)) void
f16_split_values_product(float *o, int dvp, float *s, int m, int n, int skip, int kcols,
                         const uint32_t *vb)
{
    uint32_t *ph = (uint32_t *)s, *pl = ph + (or_ssize)SR * BC;
    for (int r = 0; r < m; r++)
        f16_split_along(ph + (or_ssize)r * BC, pl + (or_ssize)r * BC, s + (or_ssize)r * BC, n);
    if (kcols > skip)
        tiles_gemm(o, dvp, ph + skip / 2, BC, (or_ssize)SR * BC,
                   vb + (or_ssize)(skip / 2) * 2 * dvp, 2 * dvp, dvp, 4, m, dvp,
                   (kcols + 1) / 2 - skip / 2, 1, 1);
}
