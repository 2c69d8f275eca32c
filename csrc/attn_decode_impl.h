/* attn_decode_impl.h - the native split-KV decode forward (Flash-Decoding), written once over
 * REAL; attn_native.c includes it after attn_native_impl.h (whose tiles and score transform it
 * shares) for float and for double, and runs it when or_is_decode (orchard.h).
 *
 * A decode step has few query rows per head, so the query-block parallelism of the forward
 * leaves cores idle and its whole-cache key transposition costs more than the attention. Here a
 * work item is (kv unit, split): the R = group x nq query rows of one GQA group against one
 * contiguous range of keys, read once, in order, a block of BC keys at a time:
 *   q    R x dp        the group's query rows, pre-multiplied by scale (row g * nq + i is
 *                      query row i of the group's head g)
 *   k    BC x dp       the key block, converted, or read in place when already REAL rows
 *   v    BC x dvp      the value block, likewise
 *   s    R x BC        scores, then probabilities (the forward's s tile)
 * and leaves, per row, its partial (unnormalised output o, running max m, sum l) in part.
 * The combine item of a kv unit then merges its splits exactly, in split order:
 *   M = max m_s,  L = sum l_s e^(m_s - M),  out = sum o_s e^(m_s - M) / L,  lse = M + log L.
 * Split boundaries depend only on the shapes (decode_plan), so results do not depend on the
 * number of threads.
 */

#define DVL (32 / (int)sizeof(REAL))    /* lanes of FN(vec) */

/* Layout of one item's partial results in job->part, in REALs: o (R x dvp), then m, then l. */
static inline REAL *FN(decode_part)(const or_job *job, or_ssize item)
{
    return (REAL *)job->part + item * job->part_stride;
}

static inline __attribute__((always_inline)) REAL FN(hsum)(FN(vec) a)
{
    REAL t = 0;
    for (int l = 0; l < DVL; l++)
        t += a[l];
    return t;
}

/* s[r * BC + c] = q row r . key row c, for r < rows, c < cols; both padded with zeros to a
 * multiple of DVL (dlen). Four keys at a time: four independent sums hide the FMA latency
 * that one dot product's chain exposes (about 2x the decode step, measured). */
static inline __attribute__((always_inline)) void
FN(decode_scores)(REAL *s, const REAL *q, int rows, int dp, const REAL *k, or_ssize ldk,
                  int cols, int dlen)
{
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
        const REAL *k0 = k + (or_ssize)c * ldk, *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
        for (int r = 0; r < rows; r++) {
            const REAL *qrow = q + (or_ssize)r * dp;
            FN(vec) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x, y;
            for (int i = 0; i < dlen; i += DVL) {
                memcpy(&x, qrow + i, sizeof(x));
                memcpy(&y, k0 + i, sizeof(y));
                a0 += x * y;
                memcpy(&y, k1 + i, sizeof(y));
                a1 += x * y;
                memcpy(&y, k2 + i, sizeof(y));
                a2 += x * y;
                memcpy(&y, k3 + i, sizeof(y));
                a3 += x * y;
            }
            REAL *srow = s + (or_ssize)r * BC + c;
            srow[0] = FN(hsum)(a0);
            srow[1] = FN(hsum)(a1);
            srow[2] = FN(hsum)(a2);
            srow[3] = FN(hsum)(a3);
        }
    }
    for (; c < cols; c++) {
        const REAL *krow = k + (or_ssize)c * ldk;
        for (int r = 0; r < rows; r++) {
            const REAL *qrow = q + (or_ssize)r * dp;
            FN(vec) a = {0}, x, y;
            for (int i = 0; i < dlen; i += DVL) {
                memcpy(&x, qrow + i, sizeof(x));
                memcpy(&y, krow + i, sizeof(y));
                a += x * y;
            }
            s[(or_ssize)r * BC + c] = FN(hsum)(a);
        }
    }
}

/* o (rows x dvp) += P (s, rows x BC) V (cols value rows of ldv), four value rows at a time so
 * that an output row is loaded and stored once per four keys; each value row is read once. */
static inline __attribute__((always_inline)) void
FN(decode_pv)(REAL *o, int dvp, int dv, const REAL *s, int rows, const REAL *v, or_ssize ldv,
              int cols)
{
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
        const REAL *v0 = v + (or_ssize)c * ldv, *v1 = v0 + ldv, *v2 = v1 + ldv, *v3 = v2 + ldv;
        for (int r = 0; r < rows; r++) {
            const REAL *p = s + (or_ssize)r * BC + c;
            REAL *orow = o + (or_ssize)r * dvp;
            for (int x = 0; x < dv; x++)
                orow[x] += p[0] * v0[x] + p[1] * v1[x] + p[2] * v2[x] + p[3] * v3[x];
        }
    }
    for (; c < cols; c++) {
        const REAL *vrow = v + (or_ssize)c * ldv;
        for (int r = 0; r < rows; r++) {
            const REAL pc = s[(or_ssize)r * BC + c];
            REAL *orow = o + (or_ssize)r * dvp;
            for (int x = 0; x < dv; x++)
                orow[x] += pc * vrow[x];
        }
    }
}

/* Asks for the next block's key and value rows while this one is computed: one core alone
 * reads the cache at well below the machine's bandwidth otherwise. */
static inline __attribute__((always_inline)) void
FN(decode_prefetch)(const char *k, const char *v, or_ssize kstride, or_ssize vstride, int rows,
                    int kbytes, int vbytes)
{
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b < kbytes; b += 64)
            __builtin_prefetch(k + r * kstride + b, 0, 3);
        for (int b = 0; b < vbytes; b += 64)
            __builtin_prefetch(v + r * vstride + b, 0, 3);
    }
}

/* One split of one kv unit. */
__attribute__((target_clones(OR_CLONES)))
static void FN(decode_item)(void *vjob, or_ssize item, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_view *w = p->view;
    const or_ssize kvu = item / job->splits, split = item % job->splits;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0], nk = p->nk[u0];
    const int d = p->d, dv = p->dv, dp = FN(pad)(d), dvp = FN(pad)(dv);
    const int rows = (int)(group * nq);
    const REAL drop_scale = (REAL)p->prm.drop_scale;

    REAL *o = FN(decode_part)(job, item), *m = o + (or_ssize)rows * dvp, *l = m + rows;
    REAL *q = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    REAL *s = q + (or_ssize)rows * dp, *kb = s + (or_ssize)rows * BC, *vb = kb + BC * dp;
    unsigned char *keep = (unsigned char *)(vb + BC * dvp);

    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
    }
    memset(o, 0, sizeof(REAL) * (size_t)rows * dvp);
    or_ssize lo, hi;    /* the keys some row sees, cut to this split */
    or_key_range(p->prm.left, p->prm.right, nq, nk, 0, nq, &lo, &hi);
    lo = lo > split * job->split_keys ? lo : split * job->split_keys;
    hi = hi < (split + 1) * job->split_keys ? hi : (split + 1) * job->split_keys;
    if (lo >= hi)
        return;

    for (or_ssize g = 0; g < group; g++)
        FN(load_rows)(q + g * nq * dp, dp, FN(row_ptr)(p, OR_Q, u0 + g, 0), w[OR_Q].row_stride,
                      nq, d, nq, w[OR_Q].dtype, (REAL)p->prm.scale);
    /* REAL rows of whole vectors are read in place; others are converted a block at a time */
    const or_dtype real_dtype = sizeof(REAL) == sizeof(double) ? OR_F64 : OR_F32;
    const int k_in_place = w[OR_K].dtype == real_dtype && d % DVL == 0
                           && w[OR_K].row_stride % (or_ssize)sizeof(REAL) == 0;
    const int v_in_place = w[OR_V].dtype == real_dtype
                           && w[OR_V].row_stride % (or_ssize)sizeof(REAL) == 0;
    for (or_ssize j0 = lo; j0 < hi; j0 += BC) {
        const int cols = (int)(hi - j0 < BC ? hi - j0 : BC), ncols = FN(pad)(cols);
        const char *ksrc = FN(row_ptr)(p, OR_K, kvu, j0), *vsrc = FN(row_ptr)(p, OR_V, kvu, j0);
        const REAL *kr = kb, *vr = vb;
        or_ssize ldk = dp, ldv = dvp;
        if (j0 + BC < hi)
            FN(decode_prefetch)(ksrc + BC * w[OR_K].row_stride, vsrc + BC * w[OR_V].row_stride,
                                w[OR_K].row_stride, w[OR_V].row_stride,
                                (int)(hi - j0 - BC < BC ? hi - j0 - BC : BC),
                                d * w[OR_K].itemsize, dv * w[OR_V].itemsize);
        if (k_in_place) {
            kr = (const REAL *)ksrc;
            ldk = w[OR_K].row_stride / (or_ssize)sizeof(REAL);
        } else {
            FN(load_rows)(kb, dp, ksrc, w[OR_K].row_stride, cols, d, cols, w[OR_K].dtype, 1);
        }
        if (v_in_place) {
            vr = (const REAL *)vsrc;
            ldv = w[OR_V].row_stride / (or_ssize)sizeof(REAL);
        } else {
            FN(load_rows)(vb, dvp, vsrc, w[OR_V].row_stride, cols, dv, cols, w[OR_V].dtype, 1);
        }
        FN(decode_scores)(s, q, rows, dp, kr, ldk, cols, k_in_place ? d : dp);
        for (or_ssize g = 0; g < group; g++)
            FN(transform_scores)(p, (int)nq, cols, 0, j0, nq, nk,
                                 p->slopes ? (REAL)p->slopes[u0 + g] : 0, s + g * nq * BC, NULL);
        for (int r = 0; r < rows; r++) {
            REAL *srow = s + (or_ssize)r * BC, *orow = o + (or_ssize)r * dvp;
            const REAL mx = FN(row_max)(srow, ncols), mnew = mx > m[r] ? mx : m[r];
            if (mnew == -INFINITY) {            /* nothing visible to this row yet */
                memset(srow, 0, sizeof(REAL) * BC);
                continue;
            }
            const REAL alpha = EXP(m[r] - mnew);
            m[r] = mnew;
            l[r] = l[r] * alpha + FN(exp_row)(srow, mnew, ncols);
            if (alpha != 1)
                for (int x = 0; x < dv; x++)
                    orow[x] *= alpha;
            if (p->prm.dropout) {
                const or_ssize u = u0 + r / nq, i = r % nq;
                or_dropout_row(p->prm.seed, (uint64_t)u, (uint32_t)i, (uint32_t)j0, cols,
                               p->prm.threshold, keep);
                for (int c = 0; c < cols; c++)
                    srow[c] = keep[c] ? srow[c] * drop_scale : 0;
            }
        }
        FN(decode_pv)(o, dvp, dv, s, rows, vr, ldv, cols);
    }
}

/* Merges the splits of one kv unit and stores its rows of out and lse. */
__attribute__((target_clones(OR_CLONES)))
static void FN(decode_combine_item)(void *vjob, or_ssize kvu, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0];
    const int dv = p->dv, dvp = FN(pad)(dv), rows = (int)(group * nq);
    REAL *out = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    for (int r = 0; r < rows; r++) {
        REAL mmax = -INFINITY, lsum = 0;
        for (or_ssize s = 0; s < job->splits; s++) {
            const REAL ms = FN(decode_part)(job, kvu * job->splits + s)[(or_ssize)rows * dvp + r];
            mmax = ms > mmax ? ms : mmax;
        }
        memset(out, 0, sizeof(REAL) * (size_t)dvp);
        for (or_ssize s = 0; mmax > -INFINITY && s < job->splits; s++) {
            const REAL *part = FN(decode_part)(job, kvu * job->splits + s);
            const REAL ms = part[(or_ssize)rows * dvp + r], ls = part[(or_ssize)rows * dvp + rows + r];
            if (ls == 0)
                continue;
            const REAL f = EXP(ms - mmax);
            lsum += ls * f;
            for (int x = 0; x < dv; x++)
                out[x] += part[(or_ssize)r * dvp + x] * f;
        }
        const REAL inv = lsum > 0 ? 1 / lsum : 0, lse = lsum > 0 ? mmax + LOG(lsum) : -INFINITY;
        for (int x = 0; x < dv; x++)
            out[x] *= inv;
        const or_ssize u = u0 + r / nq, i = r % nq;
        FN(store_rows)(FN(row_ptr)(p, OR_O, u, i), p->view[OR_O].row_stride, out, dvp, 1, dv,
                       p->view[OR_O].dtype);
        FN(store_rows)(FN(row_ptr)(p, OR_LSE, u, i), p->view[OR_LSE].row_stride, &lse, 1, 1, 1,
                       p->view[OR_LSE].dtype);
    }
}

#undef DVL
