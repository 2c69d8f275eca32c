/* attn_native_impl.h - the native forward and backward kernels, written once over REAL.
 *
 * attn_native.c includes this file twice: REAL = float (float16 and float32 inputs) and
 * REAL = double (float64 inputs). FN(x) names the instance, EXP/LOG/TANH are REAL's libm.
 *
 * Tiles (row-major, REAL):
 *   q   BR x d     query rows of one block, pre-multiplied by scale
 *   kt  d  x BC    key block transposed, so S = q kt is a sum of contiguous axpys
 *   k   BC x d     key block (backward: dQ += dS k)
 *   v   BC x dv    value block (forward: O += P v)
 *   vt  dv x BC    value block transposed (backward: dP = dO vt)
 *   s   BR x BC    scores, then probabilities
 * The inner loops all run over a contiguous last dimension, which the compiler vectorises.
 */

static inline __attribute__((always_inline)) void
FN(load_rows)(REAL *dst, int ld, const char *src, or_ssize stride, or_ssize rows, int cols,
              or_dtype dt, REAL mul)
{
    for (or_ssize r = 0; r < rows; r++, src += stride) {
        REAL *out = dst + (or_ssize)r * ld;
        switch (dt) {
        case OR_F16: for (int c = 0; c < cols; c++) out[c] = (REAL)((const or_half *)src)[c] * mul; break;
        case OR_F32: for (int c = 0; c < cols; c++) out[c] = (REAL)((const float *)src)[c] * mul; break;
        case OR_F64: for (int c = 0; c < cols; c++) out[c] = (REAL)((const double *)src)[c] * mul; break;
        }
    }
}

/* dst[c * ld + r] = src row r, column c */
static inline __attribute__((always_inline)) void
FN(load_cols)(REAL *dst, int ld, const char *src, or_ssize stride, int rows, int cols, or_dtype dt)
{
    for (int r = 0; r < rows; r++, src += stride) {
        switch (dt) {
        case OR_F16: for (int c = 0; c < cols; c++) dst[(or_ssize)c * ld + r] = (REAL)((const or_half *)src)[c]; break;
        case OR_F32: for (int c = 0; c < cols; c++) dst[(or_ssize)c * ld + r] = (REAL)((const float *)src)[c]; break;
        case OR_F64: for (int c = 0; c < cols; c++) dst[(or_ssize)c * ld + r] = (REAL)((const double *)src)[c]; break;
        }
    }
}

static inline __attribute__((always_inline)) void
FN(store_rows)(char *dst, or_ssize stride, const REAL *src, int ld, or_ssize rows, int cols,
               or_dtype dt)
{
    for (or_ssize r = 0; r < rows; r++, dst += stride) {
        const REAL *in = src + (or_ssize)r * ld;
        switch (dt) {
        case OR_F16: for (int c = 0; c < cols; c++) ((or_half *)dst)[c] = (or_half)in[c]; break;
        case OR_F32: for (int c = 0; c < cols; c++) ((float *)dst)[c] = (float)in[c]; break;
        case OR_F64: for (int c = 0; c < cols; c++) ((double *)dst)[c] = (double)in[c]; break;
        }
    }
}

/* Address of row `row` of unit `unit` in operand `slot`. */
static inline char *FN(row_ptr)(const or_problem *p, int slot, or_ssize unit, or_ssize row)
{
    const or_view *w = &p->view[slot];
    return w->base + w->offs[unit] + row * w->row_stride;
}

/* Scores of rows i0.. and columns j0.. of a unit, in the spec's order: scale (already in q),
 * softcap, ALiBi, masks. dcap, when given, receives d(capped)/d(raw) = 1 - tanh^2. */
static inline __attribute__((always_inline)) void
FN(scores)(const or_problem *p, const REAL *q, const REAL *kt, int rows, int cols,
           or_ssize i0, or_ssize j0, or_ssize off, REAL slope, REAL *s, REAL *dcap)
{
    const int d = p->d;
    for (int r = 0; r < rows; r++) {
        REAL *srow = s + (or_ssize)r * BC;
        for (int c = 0; c < cols; c++)
            srow[c] = 0;
        for (int x = 0; x < d; x++) {
            const REAL a = q[(or_ssize)r * d + x];
            const REAL *krow = kt + (or_ssize)x * BC;
            for (int c = 0; c < cols; c++)
                srow[c] += a * krow[c];
        }
        if (p->softcap > 0) {
            const REAL cap = (REAL)p->softcap, inv = 1 / cap;
            for (int c = 0; c < cols; c++) {
                REAL t = TANH(srow[c] * inv);
                srow[c] = cap * t;
                if (dcap)
                    dcap[(or_ssize)r * BC + c] = 1 - t * t;
            }
        }
        const or_ssize diag = i0 + r + off;     /* the key column aligned with this row */
        if (p->slopes) {
            for (int c = 0; c < cols; c++) {
                or_ssize dist = diag - (j0 + c);
                srow[c] -= slope * (REAL)(dist < 0 ? -dist : dist);
            }
        }
        or_ssize first = p->left >= 0 ? diag - p->left - j0 : 0;           /* visible c range */
        or_ssize last = p->right >= 0 ? diag + p->right - j0 : cols - 1;
        for (int c = 0; c < cols; c++)
            if (c < first || c > last)
                srow[c] = -INFINITY;
    }
}

static inline __attribute__((always_inline)) void
FN(fwd_block)(const or_problem *p, const or_job *job, or_ssize u, or_ssize i0, int worker)
{
    const int d = p->d, dv = p->dv;
    const or_ssize nq = p->nq[u], nk = p->nk[u], off = nk - nq, kvu = u / p->group;
    const int rows = (int)(nq - i0 < BR ? nq - i0 : BR);
    const REAL slope = p->slopes ? (REAL)p->slopes[u] : 0;
    const REAL drop_scale = (REAL)p->drop_scale;

    REAL *q = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    REAL *kt = q + BR * d, *v = kt + d * BC, *s = v + BC * dv, *o = s + BR * BC;
    REAL *m = o + BR * dv, *l = m + BR;
    unsigned char *keep = (unsigned char *)(l + BR);

    const or_view *w = p->view;
    FN(load_rows)(q, d, FN(row_ptr)(p, OR_Q, u, i0), w[OR_Q].row_stride, rows, d, w[OR_Q].dtype,
                  (REAL)p->scale);
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
    }
    memset(o, 0, sizeof(REAL) * rows * dv);

    or_ssize lo, hi;
    key_range(p, nq, nk, i0, i0 + rows, &lo, &hi);
    for (or_ssize j0 = lo; j0 < hi; j0 += BC) {
        const int cols = (int)(hi - j0 < BC ? hi - j0 : BC);
        FN(load_cols)(kt, BC, FN(row_ptr)(p, OR_K, kvu, j0), w[OR_K].row_stride, cols, d, w[OR_K].dtype);
        FN(load_rows)(v, dv, FN(row_ptr)(p, OR_V, kvu, j0), w[OR_V].row_stride, cols, dv, w[OR_V].dtype, 1);
        FN(scores)(p, q, kt, rows, cols, i0, j0, off, slope, s, NULL);
        for (int r = 0; r < rows; r++) {
            REAL *srow = s + (or_ssize)r * BC;
            REAL mx = -INFINITY;
            for (int c = 0; c < cols; c++)
                mx = srow[c] > mx ? srow[c] : mx;
            const REAL mnew = mx > m[r] ? mx : m[r];
            if (mnew == -INFINITY)
                continue;                       /* nothing visible to this row yet */
            const REAL alpha = EXP(m[r] - mnew);
            m[r] = mnew;
            REAL sum = 0;
            for (int c = 0; c < cols; c++) {
                REAL e = EXP(srow[c] - mnew);
                srow[c] = e;
                sum += e;
            }
            l[r] = l[r] * alpha + sum;
            REAL *orow = o + (or_ssize)r * dv;
            if (alpha != 1)
                for (int x = 0; x < dv; x++)
                    orow[x] *= alpha;
            if (p->dropout) {
                or_dropout_row(p->seed, (uint64_t)u, (uint32_t)(i0 + r), (uint32_t)j0, cols,
                               p->drop_threshold, keep);
                for (int c = 0; c < cols; c++)
                    srow[c] = keep[c] ? srow[c] * drop_scale : 0;
            }
            for (int c = 0; c < cols; c++) {
                const REAL e = srow[c];
                if (e == 0)
                    continue;
                const REAL *vrow = v + (or_ssize)c * dv;
                for (int x = 0; x < dv; x++)
                    orow[x] += e * vrow[x];
            }
        }
    }

    for (int r = 0; r < rows; r++) {
        const REAL inv = l[r] > 0 ? 1 / l[r] : 0;
        REAL *orow = o + (or_ssize)r * dv;
        for (int x = 0; x < dv; x++)
            orow[x] *= inv;
        m[r] = l[r] > 0 ? m[r] + LOG(l[r]) : -INFINITY;     /* m now holds lse */
    }
    FN(store_rows)(FN(row_ptr)(p, OR_O, u, i0), w[OR_O].row_stride, o, dv, rows, dv, w[OR_O].dtype);
    FN(store_rows)(FN(row_ptr)(p, OR_LSE, u, i0), w[OR_LSE].row_stride, m, 1, rows, 1, w[OR_LSE].dtype);
}

/* One work item: a block of BR query rows of one unit. */
__attribute__((target_clones(OR_CLONES)))
static void FN(fwd_item)(void *vjob, or_ssize item, int worker)
{
    const or_job *job = vjob;
    or_ssize u = item / job->blocks, i0 = (item % job->blocks) * BR;
    if (i0 < job->p->nq[u])
        FN(fwd_block)(job->p, job, u, i0, worker);
}

/* One work item: a kv unit; it owns dK and dV of that unit and the dQ of its query heads,
 * so no two workers ever write the same element and no atomics are needed. */
__attribute__((target_clones(OR_CLONES)))
static void FN(bwd_item)(void *vjob, or_ssize kvu, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const int d = p->d, dv = p->dv;
    const or_ssize nk = p->nk[kvu * p->group];
    const REAL drop_scale = (REAL)p->drop_scale;

    REAL *dk = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    REAL *dvacc = dk + job->nk_max * d;
    REAL *q = dvacc + job->nk_max * dv, *dout = q + BR * d, *o = dout + BR * dv, *dq = o + BR * dv;
    REAL *k = dq + BR * d, *kt = k + BC * d, *vt = kt + d * BC;
    REAL *s = vt + dv * BC, *dp = s + BR * BC, *dcap = dp + BR * BC, *lse = dcap + BR * BC;
    REAL *di = lse + BR;
    unsigned char *keep = (unsigned char *)(di + BR);
    const or_view *w = p->view;

    memset(dk, 0, sizeof(REAL) * nk * d);
    memset(dvacc, 0, sizeof(REAL) * nk * dv);
    for (or_ssize g = 0; g < p->group; g++) {
        const or_ssize u = kvu * p->group + g, nq = p->nq[u], off = nk - nq;
        const REAL slope = p->slopes ? (REAL)p->slopes[u] : 0;
        for (or_ssize i0 = 0; i0 < nq; i0 += BR) {
            const int rows = (int)(nq - i0 < BR ? nq - i0 : BR);
            FN(load_rows)(q, d, FN(row_ptr)(p, OR_Q, u, i0), w[OR_Q].row_stride, rows, d,
                          w[OR_Q].dtype, (REAL)p->scale);
            FN(load_rows)(dout, dv, FN(row_ptr)(p, OR_DO, u, i0), w[OR_DO].row_stride, rows, dv,
                          w[OR_DO].dtype, 1);
            FN(load_rows)(o, dv, FN(row_ptr)(p, OR_O, u, i0), w[OR_O].row_stride, rows, dv,
                          w[OR_O].dtype, 1);
            FN(load_rows)(lse, 1, FN(row_ptr)(p, OR_LSE, u, i0), w[OR_LSE].row_stride, rows, 1,
                          w[OR_LSE].dtype, 1);
            for (int r = 0; r < rows; r++) {        /* D_i = rowsum(dO * O) */
                REAL acc = 0;
                for (int x = 0; x < dv; x++)
                    acc += dout[(or_ssize)r * dv + x] * o[(or_ssize)r * dv + x];
                di[r] = acc;
            }
            memset(dq, 0, sizeof(REAL) * rows * d);

            or_ssize lo, hi;
            key_range(p, nq, nk, i0, i0 + rows, &lo, &hi);
            for (or_ssize j0 = lo; j0 < hi; j0 += BC) {
                const int cols = (int)(hi - j0 < BC ? hi - j0 : BC);
                const char *kp = FN(row_ptr)(p, OR_K, kvu, j0);
                FN(load_rows)(k, d, kp, w[OR_K].row_stride, cols, d, w[OR_K].dtype, 1);
                FN(load_cols)(kt, BC, kp, w[OR_K].row_stride, cols, d, w[OR_K].dtype);
                FN(load_cols)(vt, BC, FN(row_ptr)(p, OR_V, kvu, j0), w[OR_V].row_stride, cols, dv,
                              w[OR_V].dtype);
                FN(scores)(p, q, kt, rows, cols, i0, j0, off, slope, s, dcap);

                for (int r = 0; r < rows; r++) {
                    REAL *prow = s + (or_ssize)r * BC, *dprow = dp + (or_ssize)r * BC;
                    const REAL lr = lse[r];
                    for (int c = 0; c < cols; c++)      /* P, recomputed from lse */
                        prow[c] = lr == -INFINITY ? 0 : EXP(prow[c] - lr);
                    for (int c = 0; c < cols; c++)
                        dprow[c] = 0;
                    for (int x = 0; x < dv; x++) {      /* dP = dO V^T */
                        const REAL a = dout[(or_ssize)r * dv + x];
                        const REAL *vrow = vt + (or_ssize)x * BC;
                        for (int c = 0; c < cols; c++)
                            dprow[c] += a * vrow[c];
                    }
                    /* Afterwards prow holds the dropped P (for dV), dprow holds dS. */
                    if (p->dropout) {
                        or_dropout_row(p->seed, (uint64_t)u, (uint32_t)(i0 + r), (uint32_t)j0,
                                       cols, p->drop_threshold, keep);
                        for (int c = 0; c < cols; c++) {
                            const REAL pk = keep[c] ? prow[c] * drop_scale : 0;
                            const REAL dpk = keep[c] ? dprow[c] * drop_scale : 0;
                            dprow[c] = prow[c] * (dpk - di[r]);
                            prow[c] = pk;
                        }
                    } else {
                        for (int c = 0; c < cols; c++)
                            dprow[c] = prow[c] * (dprow[c] - di[r]);
                    }
                    if (p->softcap > 0)
                        for (int c = 0; c < cols; c++)
                            dprow[c] *= dcap[(or_ssize)r * BC + c];
                }

                for (int c = 0; c < cols; c++) {        /* dV += P^T dO,  dK += dS^T q */
                    REAL *dvrow = dvacc + (j0 + c) * dv, *dkrow = dk + (j0 + c) * d;
                    for (int r = 0; r < rows; r++) {
                        const REAL pr = s[(or_ssize)r * BC + c], ds = dp[(or_ssize)r * BC + c];
                        if (pr != 0)
                            for (int x = 0; x < dv; x++)
                                dvrow[x] += pr * dout[(or_ssize)r * dv + x];
                        if (ds != 0)
                            for (int x = 0; x < d; x++)
                                dkrow[x] += ds * q[(or_ssize)r * d + x];
                    }
                }
                for (int r = 0; r < rows; r++) {        /* dQ += dS k */
                    REAL *dqrow = dq + (or_ssize)r * d;
                    for (int c = 0; c < cols; c++) {
                        const REAL ds = dp[(or_ssize)r * BC + c];
                        if (ds != 0)
                            for (int x = 0; x < d; x++)
                                dqrow[x] += ds * k[(or_ssize)c * d + x];
                    }
                }
            }
            const REAL scale = (REAL)p->scale;          /* s = scale * q.k */
            for (or_ssize x = 0; x < (or_ssize)rows * d; x++)
                dq[x] *= scale;
            FN(store_rows)(FN(row_ptr)(p, OR_DQ, u, i0), w[OR_DQ].row_stride, dq, d, rows, d,
                           w[OR_DQ].dtype);
        }
    }
    FN(store_rows)(FN(row_ptr)(p, OR_DK, kvu, 0), w[OR_DK].row_stride, dk, d, nk, d, w[OR_DK].dtype);
    FN(store_rows)(FN(row_ptr)(p, OR_DV, kvu, 0), w[OR_DV].row_stride, dvacc, dv, nk, dv,
                   w[OR_DV].dtype);
}
