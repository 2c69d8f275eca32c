/* flash_bwd_wg.cl - attention backward of the wg family (GPUs), in the FlashAttention-2
 * split and without atomics: after flash_bwd_prep (common.cl) has made D_i = rowsum(dO_i O_i),
 *
 *   flash_bwd_wg_dkdv  a work-group per (BQ key rows, kv unit), over the query heads of its
 *                      GQA group and their query rows BK at a time:
 *                          dV_j = sum_i P~_ij dO_i      dK_j = scale * sum_i dS_ij Q_i
 *   flash_bwd_wg_dq    a work-group per (BQ query rows, unit), over its keys BK at a time:
 *                          dQ_i = scale * sum_j dS_ij K_j
 * with P_ij = exp(S_ij - lse_i) recomputed, P~ the dropped P scaled by 1/(1-p) and
 * dS_ij = P_ij (dP~_ij - D_i) dcap_ij, dP = dO V^T. Both use the micro-tile layout of wg.cl
 * with the block's BQ rows as micro-tile rows and the tile's BK rows as its columns; each
 * output element is summed by one work-item in a fixed order, so results are deterministic.
 * Shapes as in flash_fwd_wg.cl; dq/dk/dv have the shapes of q/k/v.
 *
 * Local tiles (OR_WG_BWD_TILES in params.h; rows OR_WG_LD long), in dQ / in dK, dV:
 *   rs   BQ x LDQ    queries times scale / keys     (the block's rows)
 *   rvs  BQ x LDV    dO / values
 *   cs   BK x LDQ    keys / queries times scale     (the tile's rows, zero past its end)
 *   cvs  BK x LDV    values / dO
 *   ps   BQ x BLDP   - / P~ transposed
 *   ds   BQ x BLDP   dS / dS transposed
 *   lse_t, di_t     - / lse and D of the tile's query rows (-inf and 0 past its end)
 */
#if OR_FAMILY == OR_FAMILY_WG
#define BWN (BK / LANES)                            /* score columns per work-item */
#define BLDP OR_WG_LD(BK)                           /* row length of ps and ds */
#define BWG_THREADS OR_WG_THREADS(BQ)

/* A tile of both backward kernels: rows [r0, r0 + n) of a unit's x (slot xs, HEAD_D wide,
 * times x_scale) and y (slot ys, HEAD_DV wide) into cs and cvs (zero past n), then this
 * work-item's micro-tiles of S = rs cs^T and dP = rvs cvs^T (or their transposes, in dK/dV). */
inline void wg_bwd_tile(__global const long *meta, __global const long *unit,
                        __global const storage_t *x, int xs, real x_scale,
                        __global const storage_t *y, int ys, long r0, int n,
                        __local const real *rs, __local const real *rvs, __local real *cs,
                        __local real *cvs, real *s, real *dp, int tx, int ty)
{
    const int lid = ty * LANES + tx;
    barrier(CLK_LOCAL_MEM_FENCE);       /* every product with the last tile is done */
    wg_load(cs, LDQ, x, meta, unit, xs, r0, n, BK, HEAD_D, x_scale, lid, BWG_THREADS);
    wg_load(cvs, LDV, y, meta, unit, ys, r0, n, BK, HEAD_DV, 1, lid, BWG_THREADS);
    barrier(CLK_LOCAL_MEM_FENCE);
    wg_dot_tile(s, BWN, rs, LDQ, cs, LDQ, HEAD_D, tx, ty);
    wg_dot_tile(dp, BWN, rvs, LDV, cvs, LDV, HEAD_DV, tx, ty);
}

__kernel void flash_bwd_wg_dq(__global const storage_t *q, __global const storage_t *k,
                              __global const storage_t *v, __global const storage_t *dout,
                              __global const real *lse, __global const real *di,
                              __global storage_t *dq, __global const long *meta,
                              __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_WG_BWD_TILES(WG_TILE, HEAD_D, HEAD_DV, BQ, BK)
    const int tx = get_local_id(0), ty = get_local_id(1), lid = ty * LANES + tx;
    wg_block b;
    if (!wg_query_block(meta, slopes, &p, BQ, &b))
        return;

    real4 acc[WTM * WD4];
    real lse_a[WTM], di_a[WTM];
    for (int a = 0; a < WTM; a++) {
        const long i = b.i0 + ty * WTM + a;
        lse_a[a] = i < b.nq ? lse[b.unit[OR_LSE] + i * meta[OR_LSE]] : -INFINITY;
        di_a[a] = i < b.nq ? di[b.unit[OR_UNIT_ROW0] + i] : 0;
        for (int g = 0; g < WD4; g++)
            acc[a * WD4 + g] = 0;
    }
    wg_load(rs, LDQ, q, meta, b.unit, OR_Q, b.i0, b.rows, BQ, HEAD_D, p.scale, lid,
            BWG_THREADS);
    wg_load(rvs, LDV, dout, meta, b.unit, OR_DO, b.i0, b.rows, BQ, HEAD_DV, 1, lid,
            BWG_THREADS);

    for (long j0 = b.lo; j0 < b.hi; j0 += BK) {
        const int cols = (int)min((long)BK, b.hi - j0);
        real s[WTM * BWN], dp[WTM * BWN];
        wg_bwd_tile(meta, b.kvunit, k, OR_K, 1, v, OR_V, j0, cols, rs, rvs, cs, cvs, s, dp, tx,
                    ty);
        for (int a = 0; a < WTM; a++) {
            const long i = b.i0 + ty * WTM + a;
            for (int c = 0; c < BWN; c++) {
                const int col = tx + LANES * c;
                real d = 0;     /* padding, a row that sees no key, a masked score: 0 */
                if (col < cols && lse_a[a] != -INFINITY) {
                    real dcap;
                    const real sc = transform_score(s[a * BWN + c], i, j0 + col, b.off, b.slope,
                                                    &p, &dcap);
                    const real pr = exp(sc - lse_a[a]);
                    real dpk = dp[a * BWN + c];
                    if (p.dropout && pr > 0)
                        dpk = or_dropout_keep(p.seed, (ulong)b.u, (uint)i, (uint)(j0 + col),
                                              p.threshold) ? dpk * p.drop_scale : 0;
                    d = pr > 0 ? pr * (dpk - di_a[a]) * dcap : 0;
                }
                ds[(ty * WTM + a) * BLDP + col] = d;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        wg_acc_tile(acc, WD4, ds, BLDP, cs, LDQ, cols, HEAD_D, tx, ty);
    }

    for (int a = 0; a < WTM; a++) {
        const long i = b.i0 + ty * WTM + a;
        if (i >= b.nq)
            break;
        /* a row that sees no key: 0, even where its dS of 0 met a NaN key (0 * NaN) */
        for (int g = 0; g < WD4 && wg_col(tx, g) < HEAD_D; g++)
            wg_store4(dq, b.unit[OR_DQ] + i * meta[OR_DQ], wg_col(tx, g), HEAD_D,
                      lse_a[a] != -INFINITY ? acc[a * WD4 + g] * p.scale : (real4)0);
    }
}

__kernel void flash_bwd_wg_dkdv(__global const storage_t *q, __global const storage_t *k,
                                __global const storage_t *v, __global const storage_t *dout,
                                __global const real *lse, __global const real *di,
                                __global storage_t *dk, __global storage_t *dv,
                                __global const long *meta, __global const real *slopes,
                                const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_WG_BWD_TILES(WG_TILE, HEAD_D, HEAD_DV, BQ, BK)
    const int tx = get_local_id(0), ty = get_local_id(1), lid = ty * LANES + tx;
    const long w = get_group_id(2), j0 = (long)get_group_id(0) * BQ;
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[OR_UNIT_NK];
    if (j0 >= nk)
        return;
    const int keys = (int)min((long)BQ, nk - j0);

    real4 dka[WTM * WD4], dva[WTM * WDV4];
    for (int a = 0; a < WTM; a++) {
        for (int g = 0; g < WD4; g++)
            dka[a * WD4 + g] = 0;
        for (int g = 0; g < WDV4; g++)
            dva[a * WDV4 + g] = 0;
    }
    wg_load(rs, LDQ, k, meta, kvunit, OR_K, j0, keys, BQ, HEAD_D, 1, lid, BWG_THREADS);
    wg_load(rvs, LDV, v, meta, kvunit, OR_V, j0, keys, BQ, HEAD_DV, 1, lid, BWG_THREADS);

    for (int g = 0; g < p.group; g++) {
        const long u = w * p.group + g;
        __global const long *unit = UNIT(meta, u);
        const long nq = unit[OR_UNIT_NQ], off = nk - nq;
        const real slope = p.has_alibi ? slopes[u] : 0;
        long ilo, ihi;
        or_query_range(p.left, p.right, nq, nk, j0, j0 + keys, &ilo, &ihi);
        for (long i0 = ilo; i0 < ihi; i0 += BK) {
            const int rows = (int)min((long)BK, ihi - i0);
            /* the last tile's lse_t and di_t were read before the barrier ending its products */
            for (int e = lid; e < BK; e += BWG_THREADS) {
                lse_t[e] = e < rows ? lse[unit[OR_LSE] + (i0 + e) * meta[OR_LSE]] : -INFINITY;
                di_t[e] = e < rows ? di[unit[OR_UNIT_ROW0] + i0 + e] : 0;
            }
            real s[WTM * BWN], dp[WTM * BWN];
            wg_bwd_tile(meta, unit, q, OR_Q, p.scale, dout, OR_DO, i0, rows, rs, rvs, cs, cvs, s,
                        dp, tx, ty);
            for (int a = 0; a < WTM; a++) {
                const long j = j0 + ty * WTM + a;
                for (int c = 0; c < BWN; c++) {
                    const int col = tx + LANES * c;
                    real pt = 0, d = 0;     /* padding, a masked score: 0 */
                    if (j < nk && lse_t[col] != -INFINITY) {
                        real dcap;
                        const real sc = transform_score(s[a * BWN + c], i0 + col, j, off, slope,
                                                        &p, &dcap);
                        const real pr = exp(sc - lse_t[col]);
                        real kept = 1;
                        if (p.dropout && pr > 0)
                            kept = or_dropout_keep(p.seed, (ulong)u, (uint)(i0 + col), (uint)j,
                                                   p.threshold) ? p.drop_scale : 0;
                        pt = pr * kept;
                        d = pr > 0 ? pr * (dp[a * BWN + c] * kept - di_t[col]) * dcap : 0;
                    }
                    ps[(ty * WTM + a) * BLDP + col] = pt;
                    ds[(ty * WTM + a) * BLDP + col] = d;
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            wg_acc_tile(dva, WDV4, ps, BLDP, cvs, LDV, rows, HEAD_DV, tx, ty);
            wg_acc_tile(dka, WD4, ds, BLDP, cs, LDQ, rows, HEAD_D, tx, ty);
        }
    }

    for (int a = 0; a < WTM; a++) {
        const long j = j0 + ty * WTM + a;
        if (j >= nk)
            break;
        for (int g = 0; g < WD4 && wg_col(tx, g) < HEAD_D; g++)
            wg_store4(dk, kvunit[OR_DK] + j * meta[OR_DK], wg_col(tx, g), HEAD_D, dka[a * WD4 + g]);
        for (int g = 0; g < WDV4 && wg_col(tx, g) < HEAD_DV; g++)
            wg_store4(dv, kvunit[OR_DV] + j * meta[OR_DV], wg_col(tx, g), HEAD_DV,
                      dva[a * WDV4 + g]);
    }
}
#endif
