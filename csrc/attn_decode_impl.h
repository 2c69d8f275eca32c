/* attn_decode_impl.h - the native split-KV decode forward (Flash-Decoding), written once over
 * REAL; native_kernels.h includes it after attn_native_impl.h (whose tiles and score transform it
 * shares) for float and for double, and attn_native.c runs it when or_is_decode (orchard.h).
 *
 * A decode step has few query rows per head, so the query-block parallelism of the forward
 * leaves cores idle and its whole-cache key transposition costs more than the attention. Here a
 * work item is (kv unit, split): the R = group x nq query rows of one GQA group against one
 * contiguous range of keys, read once, in order, a block of BC keys at a time:
 *   q    R x dp        the group's query rows, pre-multiplied by scale (row g * nq + i is
 *                      query row i of the group's head g)
 *   k, v               read in place through their strides, in their own dtype, widened to
 *                      REAL in registers (no tile: a float16/bfloat16 step would otherwise
 *                      write and reread a float copy of the cache)
 *   s    R x BC        scores, then probabilities (the forward's s tile)
 * and leaves, per row, its partial (unnormalised output o, running max m, sum l) in part.
 * The combine item of a kv unit then merges its splits exactly, in split order:
 *   M = max m_s,  L = sum l_s e^(m_s - M),  out = sum o_s e^(m_s - M) / L,  lse = M + log L.
 * Split boundaries depend only on the shapes (decode_plan), so results do not depend on the
 * number of threads.
 */

#define DVL (VBYTES / (int)sizeof(REAL))    /* lanes of FN(vec) */

/* Layout of one item's partial results in job->part, in REALs: o (R x dvp), then m, then l. */
static inline REAL *FN(decode_part)(const or_job *job, or_ssize item)
{
    return (REAL *)job->part + item * job->part_stride;
}

/* The sum of a vector's lanes. */
static inline __attribute__((always_inline)) REAL FN(hsum)(const FN(vec) *a)
{
    REAL lane[DVL];
    memcpy(lane, a, sizeof(lane));
    return FN(lanes_sum)(lane, DVL);
}

/* n rows of a key or value block (len elements of dtype dt, stride bytes apart) as REAL rows
 * of *ld: in place when they already are REAL, else widened into buf (n x len, in L1): once
 * per key for all the rows of the group, not once per row. dt is a constant wherever this is
 * inlined (decode_item's dispatch), so the switch folds away. */
static inline __attribute__((always_inline)) const REAL *
FN(decode_rows)(REAL *buf, const char *src, or_ssize stride, int n, int len, or_dtype dt,
                or_ssize *ld)
{
    if (dt == (sizeof(REAL) == sizeof(double) ? OR_F64 : OR_F32)) {
        *ld = stride / (or_ssize)sizeof(REAL);
        return (const REAL *)src;
    }
    /* the same rows of the next block, asked for here, a few at a time between the widening
     * work, rather than all at the block's start: 1.15-1.33x faster in bfloat16 (A/B) */
    for (int t = 0; t < n; t++)
        for (int b = 0; b < len * or_dtypes[dt].itemsize; b += 64)
            __builtin_prefetch(src + (BC + t) * stride + b, 0, 3);
    for (int t = 0; t < n; t++, src += stride) {
        REAL *restrict out = buf + t * len;
        switch (dt) {
#define OR_LOAD(id, tag, ...) \
        case id: for (int i = 0; i < len; i++) out[i] = (REAL)or_load_##tag(src, i); break;
        OR_DTYPES(OR_LOAD)
#undef OR_LOAD
        }
    }
    *ld = len;
    return buf;
}

/* q row . key row over d elements: whole vectors into acc, then the tail. */
static inline __attribute__((always_inline)) REAL
FN(dot)(const REAL *qrow, const REAL *krow, int d)
{
    const int dvec = d - d % DVL;
    FN(vec) a = {0}, x, y;
    for (int i = 0; i < dvec; i += DVL) {
        memcpy(&x, qrow + i, sizeof(x));
        memcpy(&y, krow + i, sizeof(y));
        a += x * y;
    }
    REAL t = FN(hsum)(&a);
    for (int i = dvec; i < d; i++)
        t += qrow[i] * krow[i];
    return t;
}

/* s[r * BC + c] = q row r . key row c, for r < rows, c < cols (keys of dtype dt, ks bytes
 * apart). Four keys at a time: four independent sums hide the FMA latency that one dot
 * product's chain exposes (about 2x the decode step, measured). */
static inline __attribute__((always_inline)) void
FN(decode_scores)(REAL *s, const REAL *q, int rows, int dp, const char *k, or_ssize ks,
                  int cols, int d, or_dtype dt, REAL *buf)
{
    const int dvec = d - d % DVL;
    or_ssize ld;
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
        const REAL *k0 = FN(decode_rows)(buf, k + c * ks, ks, 4, d, dt, &ld);
        const REAL *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
        for (int r = 0; r < rows; r++) {
            const REAL *qrow = q + (or_ssize)r * dp;
            FN(vec) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x, y;
            for (int i = 0; i < dvec; i += DVL) {
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
            REAL t[4] = {FN(hsum)(&a0), FN(hsum)(&a1), FN(hsum)(&a2), FN(hsum)(&a3)};
            for (int i = dvec; i < d; i++) {
                t[0] += qrow[i] * k0[i];
                t[1] += qrow[i] * k1[i];
                t[2] += qrow[i] * k2[i];
                t[3] += qrow[i] * k3[i];
            }
            memcpy(s + (or_ssize)r * BC + c, t, sizeof(t));
        }
    }
    for (; c < cols; c++) {
        const REAL *krow = FN(decode_rows)(buf, k + c * ks, ks, 1, d, dt, &ld);
        for (int r = 0; r < rows; r++)
            s[(or_ssize)r * BC + c] = FN(dot)(q + (or_ssize)r * dp, krow, d);
    }
}

/* o (rows x dvp) += P (s, rows x BC) V (cols value rows of dtype dt, vs bytes apart), four
 * value rows at a time so that an output row is loaded and stored once per four keys; each
 * value row is read (and widened) once. */
static inline __attribute__((always_inline)) void
FN(decode_pv)(REAL *o, int dvp, int dv, const REAL *s, int rows, const char *v, or_ssize vs,
              int cols, or_dtype dt, REAL *buf)
{
    or_ssize ld;
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
        const REAL *v0 = FN(decode_rows)(buf, v + c * vs, vs, 4, dv, dt, &ld);
        const REAL *v1 = v0 + ld, *v2 = v1 + ld, *v3 = v2 + ld;
        for (int r = 0; r < rows; r++) {
            const REAL *p = s + (or_ssize)r * BC + c;
            REAL *orow = o + (or_ssize)r * dvp;
            for (int x = 0; x < dv; x++)
                orow[x] += p[0] * v0[x] + p[1] * v1[x] + p[2] * v2[x] + p[3] * v3[x];
        }
    }
    for (; c < cols; c++) {
        const REAL *vrow = FN(decode_rows)(buf, v + c * vs, vs, 1, dv, dt, &ld);
        for (int r = 0; r < rows; r++) {
            const REAL pc = s[(or_ssize)r * BC + c];
            REAL *orow = o + (or_ssize)r * dvp;
            for (int x = 0; x < dv; x++)
                orow[x] += pc * vrow[x];
        }
    }
}

/* Asks for the next block's key and value rows while this one is computed, for rows read in
 * place (decode_rows asks for widened ones itself): one core alone reads the cache at well
 * below the machine's bandwidth otherwise (without it, 1.05-1.3x slower in float32,
 * measured). */
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

/* One split of one kv unit, whose keys and values are of dtype dt. */
static inline __attribute__((always_inline)) void
FN(decode_split)(const or_job *job, or_ssize item, int worker, or_dtype dt)
{
    const or_problem *p = job->p;
    const or_view *w = p->view;
    const or_ssize kvu = item / job->splits, split = item % job->splits;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0], nk = p->nk[u0];
    const int d = p->d, dv = p->dv, dp = FN(pad)(d), dvp = FN(pad)(dv);
    const int rows = (int)(group * nq);
    const REAL drop_scale = (REAL)p->prm.drop_scale;

    REAL *o = FN(decode_part)(job, item), *m = o + (or_ssize)rows * dvp, *l = m + rows;
    REAL *q = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    REAL *s = q + (or_ssize)rows * dp, *buf = s + (or_ssize)rows * BC;     /* buf: 4 x max(d, dv) */
    unsigned char *keep = (unsigned char *)(buf + 4 * (d > dv ? d : dv));

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
    const or_ssize ks = w[OR_K].row_stride, vs = w[OR_V].row_stride;
    for (or_ssize j0 = lo; j0 < hi; j0 += BC) {
        const int cols = (int)(hi - j0 < BC ? hi - j0 : BC), ncols = FN(pad)(cols);
        const char *kr = FN(row_ptr)(p, OR_K, kvu, j0), *vr = FN(row_ptr)(p, OR_V, kvu, j0);
        if (j0 + BC < hi && dt == (sizeof(REAL) == sizeof(double) ? OR_F64 : OR_F32))
            FN(decode_prefetch)(kr + BC * ks, vr + BC * vs, ks, vs,
                                (int)(hi - j0 - BC < BC ? hi - j0 - BC : BC),
                                d * w[OR_K].itemsize, dv * w[OR_V].itemsize);
        FN(decode_scores)(s, q, rows, dp, kr, ks, cols, d, dt, buf);
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
        FN(decode_pv)(o, dvp, dv, s, rows, vr, vs, cols, dt, buf);
    }
}

/* A work item: one split, in an instance for its key and value dtype. */
static void FN(decode_item)(void *vjob, or_ssize item, int worker)
{
    const or_job *job = vjob;
    switch (job->p->view[OR_K].dtype) {
#define OR_SPLIT(id, ...) case id: FN(decode_split)(job, item, worker, id); break;
    OR_DTYPES(OR_SPLIT)
#undef OR_SPLIT
    }
}

/* Merges the splits of one kv unit and stores its rows of out and lse. */
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
            const REAL *ml = part + (or_ssize)rows * dvp;   /* m, then l */
            const REAL ms = ml[r], ls = ml[rows + r];
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
