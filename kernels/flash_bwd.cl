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

#if !OR_TILED     /* CPU devices build flash_bwd_tiled.cl's kernel instead */
__kernel void flash_bwd_dq(__global const storage_t *q, __global const storage_t *k,
                           __global const storage_t *v, __global const storage_t *dout,
                           __global const real *lse, __global const real *di, long di_stride,
                           __global storage_t *dq, __global const long *meta,
                           __global const real *slopes, PARAMS_ARGS)
{
    const params_t p = PARAMS_INIT;
    __local realv kt[BK][DP];
    __local realv vt[BK][DVP];
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

    realv qv[DP], dov[DVP], acc[DP];
    for (int x = 0; x < DP; x++) {
        qv[x] = valid ? load_vec(q, unit[S_Q] + i * meta[S_Q], x * VW, HEAD_D, p.scale) : 0;
        acc[x] = 0;
    }
    for (int x = 0; x < DVP; x++)
        dov[x] = valid ? load_vec(dout, unit[S_DO] + i * meta[S_DO], x * VW, HEAD_DV, 1) : 0;

    long lo, hi;
    key_range(&p, nq, nk, i0, min(i0 + BQ, nq), &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += BK) {
        const int cols = (int)min((long)BK, hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        load_tiles(kt, k, kvunit[S_K], meta[S_K], 1, vt, v, kvunit[S_V], meta[S_V], j0, cols, lid);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lse_i == -INFINITY)
            continue;           /* padding, or a row that sees no key: zero gradient */
        for (int c = 0; c < cols; c++) {
            real dcap;
            const real s = transform_score(vdot(qv, kt[c], DP), i, j0 + c, off, slope, &p, &dcap);
            const real pr = exp(s - lse_i);
            if (pr == 0)
                continue;       /* masked: this key's K and V may be anything, even inf */
            real dp = vdot(dov, vt[c], DVP);
            if (p.dropout)
                dp = dropout_keep(p.seed, (ulong)u, (uint)i, (uint)(j0 + c), p.threshold)
                         ? dp * p.drop_scale : 0;
            const real ds = pr * (dp - di_i) * dcap;
            for (int x = 0; x < DP; x++)
                acc[x] += ds * kt[c][x];
        }
    }
    if (!valid)
        return;
    for (int x = 0; x < DP; x++)
        acc[x] *= p.scale;
    store_row(dq, unit[S_DQ] + i * meta[S_DQ], acc, HEAD_D);
}

__kernel void flash_bwd_dkdv(__global const storage_t *q, __global const storage_t *k,
                             __global const storage_t *v, __global const storage_t *dout,
                             __global const real *lse, __global const real *di, long di_stride,
                             __global storage_t *dk, __global storage_t *dv,
                             __global const long *meta, __global const real *slopes,
                             PARAMS_ARGS)
{
    const params_t p = PARAMS_INIT;
    __local realv qt[BK][DP];
    __local realv dot_t[BK][DVP];
    __local real lse_t[BK], di_t[BK];
    const long w = get_group_id(1), j0 = (long)get_group_id(0) * BQ;
    const int lid = get_local_id(0);
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[NSLOTS + 1], j = j0 + lid;
    if (j0 >= nk)
        return;
    const int valid = j < nk;
    const long j1 = min(j0 + BQ, nk);

    realv kv[DP], vv[DVP], dka[DP], dva[DVP];
    for (int x = 0; x < DP; x++) {
        kv[x] = valid ? load_vec(k, kvunit[S_K] + j * meta[S_K], x * VW, HEAD_D, 1) : 0;
        dka[x] = 0;
    }
    for (int x = 0; x < DVP; x++) {
        vv[x] = valid ? load_vec(v, kvunit[S_V] + j * meta[S_V], x * VW, HEAD_DV, 1) : 0;
        dva[x] = 0;
    }
    for (int g = 0; g < p.group; g++) {
        const long u = w * p.group + g;
        __global const long *unit = UNIT(meta, u);
        const long nq = unit[NSLOTS], off = nk - nq;
        const real slope = p.has_alibi ? slopes[u] : 0;
        long ilo, ihi;
        query_range(&p, nq, nk, j0, j1, &ilo, &ihi);
        for (long i0 = ilo; i0 < ihi; i0 += BK) {
            const int rows = (int)min((long)BK, ihi - i0);
            barrier(CLK_LOCAL_MEM_FENCE);
            load_tiles(qt, q, unit[S_Q], meta[S_Q], p.scale, dot_t, dout, unit[S_DO], meta[S_DO],
                       i0, rows, lid);
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
                real dcap;
                const real s = transform_score(vdot(kv, qt[r], DP), i0 + r, j, off, slope, &p, &dcap);
                const real pr = exp(s - lse_t[r]);
                if (pr == 0)
                    continue;   /* masked: this key's K and V may be anything, even inf */
                real kept = 1;
                if (p.dropout)
                    kept = dropout_keep(p.seed, (ulong)u, (uint)(i0 + r), (uint)j, p.threshold)
                               ? p.drop_scale : 0;
                const real dp = vdot(vv, dot_t[r], DVP);
                for (int x = 0; x < DVP; x++)
                    dva[x] += pr * kept * dot_t[r][x];
                const real ds = pr * (dp * kept - di_t[r]) * dcap;
                for (int x = 0; x < DP; x++)
                    dka[x] += ds * qt[r][x];
            }
        }
    }
    if (!valid)
        return;
    store_row(dk, kvunit[S_DK] + j * meta[S_DK], dka, HEAD_D);
    store_row(dv, kvunit[S_DV] + j * meta[S_DV], dva, HEAD_DV);
}
#endif
