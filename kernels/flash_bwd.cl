/* flash_bwd.cl - attention backward without atomics, in three kernels:
 *
 *   flash_bwd_prep  D_i = rowsum(dO_i * O_i)            di  (unit, di_stride)
 *   flash_bwd_dq    one work-item per query row i:      dQ_i = scale * sum_j dS_ij K_j
 *   flash_bwd_dkdv  one work-item per key row j of a kv unit, over the query heads of its
 *                   GQA group:                          dV_j = sum_i P~_ij dO_i
 *                                                       dK_j = scale * sum_i dS_ij Q_i
 * with P_ij = exp(S_ij - lse_i) recomputed, P~ the dropped P scaled by 1/(1-p), and
 * dS_ij = P_ij (dP~_ij - D_i) dcap_ij. Every output element is summed by one work-item in a
 * fixed order, so results are deterministic. Shapes as in flash_fwd.cl; dq/dk/dv have the
 * shapes of q/k/v.
 */
__kernel void flash_bwd_prep(__global const storage_t *dout, __global const storage_t *out,
                             __global const long *meta, __global real *di, long di_stride)
{
    const long u = get_global_id(1), i = get_global_id(0);
    __global const long *unit = UNIT(meta, u);
    if (i >= unit[NSLOTS])
        return;
    real acc = 0;
    for (int x = 0; x < HEAD_DV; x++)
        acc += (real)LOAD(dout, unit[S_DO] + i * meta[S_DO] + x)
               * (real)LOAD(out, unit[S_O] + i * meta[S_O] + x);
    di[u * di_stride + i] = acc;
}

__kernel void flash_bwd_dq(__global const storage_t *q, __global const storage_t *k,
                           __global const storage_t *v, __global const storage_t *dout,
                           __global const real *lse, __global const real *di, long di_stride,
                           __global storage_t *dq, __global const long *meta,
                           __global const real *slopes, PARAMS_ARGS)
{
    const params_t p = PARAMS_INIT;
    __local real kt[BK][HEAD_D];
    __local real vt[BK][HEAD_DV];
    const long u = get_group_id(1), i0 = (long)get_group_id(0) * BQ;
    const int lid = get_local_id(0);
    __global const long *unit = UNIT(meta, u);
    __global const long *kvunit = UNIT(meta, u / p.group * p.group);
    const long nq = unit[NSLOTS], nk = unit[NSLOTS + 1], off = nk - nq, i = i0 + lid;
    if (i0 >= nq)
        return;
    const int valid = i < nq;
    const real slope = p.has_alibi ? slopes[u] : 0;
    const real lse_i = valid ? lse[unit[S_LSE] + i * meta[S_LSE]] : -INFINITY;
    const real di_i = valid ? di[u * di_stride + i] : 0;

    real qr[HEAD_D], dor[HEAD_DV], acc[HEAD_D];
    for (int x = 0; x < HEAD_D; x++) {
        qr[x] = valid ? (real)LOAD(q, unit[S_Q] + i * meta[S_Q] + x) * p.scale : 0;
        acc[x] = 0;
    }
    for (int x = 0; x < HEAD_DV; x++)
        dor[x] = valid ? (real)LOAD(dout, unit[S_DO] + i * meta[S_DO] + x) : 0;

    long lo, hi;
    key_range(&p, nq, nk, i0, min(i0 + BQ, nq), &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += BK) {
        const int cols = (int)min((long)BK, hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < cols * HEAD_D; e += BQ)
            kt[e / HEAD_D][e % HEAD_D] = LOAD(k, kvunit[S_K] + (j0 + e / HEAD_D) * meta[S_K] + e % HEAD_D);
        for (int e = lid; e < cols * HEAD_DV; e += BQ)
            vt[e / HEAD_DV][e % HEAD_DV] = LOAD(v, kvunit[S_V] + (j0 + e / HEAD_DV) * meta[S_V] + e % HEAD_DV);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lse_i == -INFINITY)
            continue;           /* padding, or a row that sees no key: zero gradient */
        for (int c = 0; c < cols; c++) {
            real s = 0, dp = 0, dcap;
            for (int x = 0; x < HEAD_D; x++)
                s += qr[x] * kt[c][x];
            s = transform_score(s, i, j0 + c, off, slope, &p, &dcap);
            const real pr = exp(s - lse_i);
            for (int x = 0; x < HEAD_DV; x++)
                dp += dor[x] * vt[c][x];
            if (p.dropout)
                dp = dropout_keep(p.seed, (ulong)u, (uint)i, (uint)(j0 + c), p.threshold) ? dp * p.drop_scale : 0;
            const real ds = pr * (dp - di_i) * dcap;
            for (int x = 0; x < HEAD_D; x++)
                acc[x] += ds * kt[c][x];
        }
    }
    if (valid)
        for (int x = 0; x < HEAD_D; x++)
            STORE(dq, unit[S_DQ] + i * meta[S_DQ] + x, acc[x] * p.scale);
}

__kernel void flash_bwd_dkdv(__global const storage_t *q, __global const storage_t *k,
                             __global const storage_t *v, __global const storage_t *dout,
                             __global const real *lse, __global const real *di, long di_stride,
                             __global storage_t *dk, __global storage_t *dv,
                             __global const long *meta, __global const real *slopes,
                             PARAMS_ARGS)
{
    const params_t p = PARAMS_INIT;
    __local real qt[BK][HEAD_D];
    __local real dot_t[BK][HEAD_DV];
    __local real lse_t[BK], di_t[BK];
    const long w = get_group_id(1), j0 = (long)get_group_id(0) * BQ;
    const int lid = get_local_id(0);
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[NSLOTS + 1], j = j0 + lid;
    if (j0 >= nk)
        return;
    const int valid = j < nk;
    const long j1 = min(j0 + BQ, nk);

    real kr[HEAD_D], vr[HEAD_DV], dka[HEAD_D], dva[HEAD_DV];
    for (int x = 0; x < HEAD_D; x++) {
        kr[x] = valid ? (real)LOAD(k, kvunit[S_K] + j * meta[S_K] + x) : 0;
        dka[x] = 0;
    }
    for (int x = 0; x < HEAD_DV; x++) {
        vr[x] = valid ? (real)LOAD(v, kvunit[S_V] + j * meta[S_V] + x) : 0;
        dva[x] = 0;
    }
    for (int g = 0; g < p.group; g++) {
        const long u = w * p.group + g;
        __global const long *unit = UNIT(meta, u);
        const long nq = unit[NSLOTS], off = nk - nq;
        const real slope = p.has_alibi ? slopes[u] : 0;
        /* query rows that may see keys [j0, j1): the inverse of key_range */
        long ilo = 0, ihi = nq;
        if (p.right >= 0 && j0 - off - p.right > 0)
            ilo = j0 - off - p.right;
        if (p.left >= 0 && j1 - off + p.left < nq)
            ihi = j1 - off + p.left;
        for (long i0 = ilo; i0 < ihi; i0 += BK) {
            const int rows = (int)min((long)BK, ihi - i0);
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int e = lid; e < rows * HEAD_D; e += BQ)
                qt[e / HEAD_D][e % HEAD_D] =
                    (real)LOAD(q, unit[S_Q] + (i0 + e / HEAD_D) * meta[S_Q] + e % HEAD_D) * p.scale;
            for (int e = lid; e < rows * HEAD_DV; e += BQ)
                dot_t[e / HEAD_DV][e % HEAD_DV] =
                    LOAD(dout, unit[S_DO] + (i0 + e / HEAD_DV) * meta[S_DO] + e % HEAD_DV);
            for (int e = lid; e < rows; e += BQ) {
                lse_t[e] = lse[unit[S_LSE] + (i0 + e) * meta[S_LSE]];
                di_t[e] = di[u * di_stride + i0 + e];
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            if (!valid)
                continue;
            for (int r = 0; r < rows; r++) {
                if (lse_t[r] == -INFINITY)
                    continue;
                real s = 0, dp = 0, dcap;
                for (int x = 0; x < HEAD_D; x++)
                    s += qt[r][x] * kr[x];
                s = transform_score(s, i0 + r, j, off, slope, &p, &dcap);
                const real pr = exp(s - lse_t[r]);
                real kept = 1;
                if (p.dropout)
                    kept = dropout_keep(p.seed, (ulong)u, (uint)(i0 + r), (uint)j, p.threshold) ? p.drop_scale : 0;
                for (int x = 0; x < HEAD_DV; x++) {
                    dva[x] += pr * kept * dot_t[r][x];
                    dp += dot_t[r][x] * vr[x];
                }
                const real ds = pr * (dp * kept - di_t[r]) * dcap;
                for (int x = 0; x < HEAD_D; x++)
                    dka[x] += ds * qt[r][x];
            }
        }
    }
    if (!valid)
        return;
    for (int x = 0; x < HEAD_D; x++)
        STORE(dk, kvunit[S_DK] + j * meta[S_DK] + x, dka[x]);
    for (int x = 0; x < HEAD_DV; x++)
        STORE(dv, kvunit[S_DV] + j * meta[S_DV] + x, dva[x]);
}
