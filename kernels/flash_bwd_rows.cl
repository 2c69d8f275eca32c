/* flash_bwd_rows.cl - attention backward of the rows family (GPUs), without atomics: after
 * flash_bwd_prep (common.cl) has made D_i = rowsum(dO_i * O_i), two kernels:
 *
 *   flash_bwd_rows_dq    one work-item per query row i:      dQ_i = scale * sum_j dS_ij K_j
 *   flash_bwd_rows_dkdv  one work-item per key row j of a kv unit, over the query heads of
 *                   its GQA group:                      dV_j = sum_i P~_ij dO_i
 *                                                       dK_j = scale * sum_i dS_ij Q_i
 * with P_ij = exp(S_ij - lse_i) recomputed, P~ the dropped P scaled by 1/(1-p), and
 * dS_ij = P_ij (dP~_ij - D_i) dcap_ij. Every output element is summed by one work-item in a
 * fixed order, so results are deterministic. Shapes as in flash_fwd_rows.cl; dq/dk/dv have the
 * shapes of q/k/v.
 */
#if OR_FAMILY == OR_FAMILY_ROWS
__kernel void flash_bwd_rows_dq(__global const storage_t *q, __global const storage_t *k,
                           __global const storage_t *v, __global const storage_t *dout,
                           __global const real *lse, __global const real *di,
                           __global storage_t *dq, __global const long *meta,
                           __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    __local realv kt[BK][DP];
    __local realv vt[BK][DVP];
    const long u = get_group_id(1), i0 = (long)get_group_id(0) * BQ;
    const int lid = get_local_id(0);
    __global const long *unit = UNIT(meta, u);
    __global const long *kvunit = UNIT(meta, u / p.group * p.group);
    const long nq = unit[OR_UNIT_NQ], nk = unit[OR_UNIT_NK], off = nk - nq, i = i0 + lid;
    if (i0 >= nq)
        return;
    const int valid = i < nq;
    const real slope = p.has_alibi ? slopes[u] : 0;
    const real lse_i = valid ? lse[unit[OR_LSE] + i * meta[OR_LSE]] : -INFINITY;
    const real di_i = valid ? di[unit[OR_UNIT_ROW0] + i] : 0;

    realv qv[DP], dov[DVP], acc[DP];
    for (int x = 0; x < DP; x++) {
        qv[x] = valid ? load_vec(q, unit[OR_Q] + i * meta[OR_Q], x * VW, HEAD_D, p.scale) : 0;
        acc[x] = 0;
    }
    for (int x = 0; x < DVP; x++)
        dov[x] = valid ? load_vec(dout, unit[OR_DO] + i * meta[OR_DO], x * VW, HEAD_DV, 1) : 0;

    long lo, hi;
    or_key_range(p.left, p.right, nq, nk, i0, min(i0 + BQ, nq), &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += BK) {
        const int cols = (int)min((long)BK, hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        load_tiles(meta, kvunit, j0, cols, lid, kt, k, OR_K, 1, vt, v, OR_V);
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
                dp = or_dropout_keep(p.seed, (ulong)u, (uint)i, (uint)(j0 + c), p.threshold)
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
    store_row(dq, unit[OR_DQ] + i * meta[OR_DQ], acc, HEAD_D);
}

__kernel void flash_bwd_rows_dkdv(__global const storage_t *q, __global const storage_t *k,
                             __global const storage_t *v, __global const storage_t *dout,
                             __global const real *lse, __global const real *di,
                             __global storage_t *dk, __global storage_t *dv,
                             __global const long *meta, __global const real *slopes,
                             const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    __local realv qt[BK][DP];
    __local realv dot_t[BK][DVP];
    __local real lse_t[BK], di_t[BK];
    const long w = get_group_id(1), j0 = (long)get_group_id(0) * BQ;
    const int lid = get_local_id(0);
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[OR_UNIT_NK], j = j0 + lid;
    if (j0 >= nk)
        return;
    const int valid = j < nk;
    const long j1 = min(j0 + BQ, nk);

    realv kv[DP], vv[DVP], dka[DP], dva[DVP];
    for (int x = 0; x < DP; x++) {
        kv[x] = valid ? load_vec(k, kvunit[OR_K] + j * meta[OR_K], x * VW, HEAD_D, 1) : 0;
        dka[x] = 0;
    }
    for (int x = 0; x < DVP; x++) {
        vv[x] = valid ? load_vec(v, kvunit[OR_V] + j * meta[OR_V], x * VW, HEAD_DV, 1) : 0;
        dva[x] = 0;
    }
    for (int g = 0; g < p.group; g++) {
        const long u = w * p.group + g;
        __global const long *unit = UNIT(meta, u);
        const long nq = unit[OR_UNIT_NQ], off = nk - nq;
        const real slope = p.has_alibi ? slopes[u] : 0;
        long ilo, ihi;
        or_query_range(p.left, p.right, nq, nk, j0, j1, &ilo, &ihi);
        for (long i0 = ilo; i0 < ihi; i0 += BK) {
            const int rows = (int)min((long)BK, ihi - i0);
            barrier(CLK_LOCAL_MEM_FENCE);
            load_tiles(meta, unit, i0, rows, lid, qt, q, OR_Q, p.scale, dot_t, dout, OR_DO);
            for (int e = lid; e < rows; e += BQ) {
                lse_t[e] = lse[unit[OR_LSE] + (i0 + e) * meta[OR_LSE]];
                di_t[e] = di[unit[OR_UNIT_ROW0] + i0 + e];
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
                    kept = or_dropout_keep(p.seed, (ulong)u, (uint)(i0 + r), (uint)j, p.threshold)
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
    store_row(dk, kvunit[OR_DK] + j * meta[OR_DK], dka, HEAD_D);
    store_row(dv, kvunit[OR_DV] + j * meta[OR_DV], dva, HEAD_DV);
}
#endif
