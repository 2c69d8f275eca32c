/* flash_bwd_tiled.cl - attention backward of the tiled family (CPU devices): one work-item per
 * work-group owns a part of a kv unit's keys (the whole unit unless the call has few:
 * orchard.h or_bwd_parts), as the native path's backward does, and forms every product in
 * register tiles (tiles.cl). D_i comes from flash_bwd_prep (common.cl) first; the parts' dQ
 * are added by flash_bwd_tiled_dq after.
 *
 *   q, dout, dq (unit, Nq, ...)  k, v, dk, dv (kv unit, Nk, ...)  lse (unit, Nq)
 *   di    (rows)                 D_i = rowsum(dO_i * O_i), a unit's from its OR_UNIT_ROW0
 *   dqacc (parts, rows, DT)      each part's dQ summed over its key blocks (zeroed first),
 *                                total_rows (those of every unit) a part
 *
 * For each BK block of the part's keys (its dK, dV accumulated in local tiles) and each BQ block
 * of the query rows of the unit's GQA group that may see it (BQ x BK the backward's blocks:
 * cl_runtime.c fit_tiles_bwd, twice the family's keys where they fit):
 *   S = q K^T, P = exp(S - lse), dP = dO V^T, dS = P (dP~ - D) dcap,
 *   dV += P~^T dO, dK += dS^T q, dQ += dS K.
 * One work-item sums every element it writes, in a fixed order: deterministic, no atomics.
 *
 * Local tiles (row-major; TM, TN, DT, DVT as in tiles.cl; OR_TILED_BWD_TILES in params.h):
 *   kt  HEAD_D x BK, vt HEAD_DV x BK   the key block's keys and values transposed
 *   kb  BK x DT                            its keys
 *   dka BK x DT, dva BK x DVT          its dK, dV accumulators
 *   qs  BQ x DT (times scale), dos BQ x DVT, dqs BQ x DT   a query block
 *   s, dp, dcap  BQ x BK                scores -> P~, dP -> dS, d(softcap)
 */
#if OR_FAMILY == OR_FAMILY_TILED
__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void flash_bwd_tiled(__global const storage_t *q, __global const storage_t *k,
                     __global const storage_t *v, __global const storage_t *dout,
                     __global const real *lse, __global const real *di,
                     __global storage_t *dk, __global storage_t *dv, __global real *dqacc,
                     const long part_keys, const long total_rows, __global const long *meta,
                     __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_TILED_BWD_TILES(LOCAL_TILE, HEAD_D, HEAD_DV, DT, DVT, BQ, BK)
    /* parts 0, n-1, 1, n-2, ... in work-group order: a causal unit's first parts cost the
     * most (every later row sees their keys), and PoCL 3.1 on two threads ran them as if each
     * thread took half of the run in order (causal B1 H1 N4096 0.67x the time of part order) */
    const long at = get_group_id(0), parts = get_num_groups(0), w = get_group_id(1),
               part = at % 2 ? parts - 1 - at / 2 : at / 2;
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[OR_UNIT_NK], jhi = min(nk, (part + 1) * part_keys);

    for (int g = 0; g < p.group; g++) {         /* the part's dQ sums of the group's rows */
        __global const long *unit = UNIT(meta, w * p.group + g);
        __global real *dqu = dqacc + (part * total_rows + unit[OR_UNIT_ROW0]) * DT;
        for (long e = 0; e < unit[OR_UNIT_NQ] * DT; e += VW)
            CAT(vstore, VW)((realv)0, 0, dqu + e);
    }

    for (long j0 = part * part_keys; j0 < jhi; j0 += BK) {
        const int cols = (int)min((long)BK, jhi - j0), cols_tm = (cols + TM - 1) / TM * TM,
                  cols_tn = (cols + TN - 1) / TN * TN;
        load_block(kt, BK, 1, k, meta, kvunit, OR_K, j0, cols, BK, HEAD_D, 1);
        load_block(vt, BK, 1, v, meta, kvunit, OR_V, j0, cols, BK, HEAD_DV, 1);
        load_block(kb, DT, 0, k, meta, kvunit, OR_K, j0, cols, BK, HEAD_D, 1);
        for (int e = 0; e < BK * DT; e++)
            dka[e] = 0;
        for (int e = 0; e < BK * DVT; e++)
            dva[e] = 0;

        for (int g = 0; g < p.group; g++) {
            const long u = w * p.group + g;
            __global const long *unit = UNIT(meta, u);
            const long nq = unit[OR_UNIT_NQ], off = nk - nq;
            const real slope = p.has_alibi ? slopes[u] : 0;
            __global real *dqu = dqacc + (part * total_rows + unit[OR_UNIT_ROW0]) * DT;
            long ilo, ihi;
            or_query_range(p.left, p.right, nq, nk, j0, j0 + cols, &ilo, &ihi);
            for (long i0 = ilo; i0 < ihi; i0 += BQ) {
                const int rows = (int)min((long)BQ, ihi - i0);
                const int rows_tm = (rows + TM - 1) / TM * TM;
                load_block(qs, DT, 0, q, meta, unit, OR_Q, i0, rows, rows_tm, HEAD_D, p.scale);
                load_block(dos, DVT, 0, dout, meta, unit, OR_DO, i0, rows, rows_tm, HEAD_DV, 1);
                for (int r = 0; r < rows_tm; r++) {
                    lse_t[r] = r < rows ? lse[unit[OR_LSE] + (i0 + r) * meta[OR_LSE]] : -INFINITY;
                    di_t[r] = r < rows ? di[unit[OR_UNIT_ROW0] + i0 + r] : 0;
                    /* whole vectors (DT is): as element loops, 256-bit moves on PoCL, and
                     * the backward 1.005x the time (D 64, AVX-512 Xeon) */
                    for (int x = 0; x < DT; x += VW)
                        TILE_VEC(dqs + r * DT + x) =
                            r < rows ? CAT(vload, VW)(0, dqu + (i0 + r) * DT + x) : (realv)0;
                }
                tile_product(s, BK, qs, DT, 1, kt, BK, rows_tm, cols_tn, HEAD_D, 0);
                tile_product(dp, BK, dos, DVT, 1, vt, BK, rows_tm, cols_tn, HEAD_DV, 0);

                /* s becomes P~ (for dV), dp becomes dS (for dK, dQ); zero past the block */
                for (int r = 0; r < rows_tm; r++) {
                    __local real *srow = s + r * BK, *dprow = dp + r * BK;
                    if (lse_t[r] == -INFINITY) {    /* padding, or a row that sees no key */
                        for (int c = 0; c < BK; c++)
                            srow[c] = dprow[c] = 0;
                        continue;
                    }
                    const long i = i0 + r;
                    if (needs_transform(&p, i + off, j0, cols))
                        for (int c = 0; c < cols; c++) {
                            real dc;
                            srow[c] = transform_score(srow[c], i, j0 + c, off, slope, &p, &dc);
                            dcap[r * BK + c] = dc;
                        }
                    /* P over the block's keys in whole tiles, 0 past them (a unit's last
                     * block took all BK exps), two vectors at a time (cols_tn is a multiple
                     * of TN = 2 VW) so that their exps overlap: backward N 100 0.95x the
                     * time, N 256 0.98x, N 1024 0.99x (PoCL, AVX2 EPYC, 2 threads) */
                    for (int c = cols; c < BK; c++)
                        srow[c] = c < cols_tn ? -INFINITY : 0;
                    for (int c = 0; c < cols_tn; c += 2 * VW) {
                        TILE_VEC(srow + c) = or_expv(TILE_VEC(srow + c) - lse_t[r]);
                        TILE_VEC(srow + c + VW) = or_expv(TILE_VEC(srow + c + VW) - lse_t[r]);
                    }
                    /* where P is 0 (masked), dS is 0 whatever dP is: V may hold inf there */
                    if (p.dropout) {
                        for (int c = 0; c < cols; c++) {
                            const real kept = or_dropout_keep(p.seed, (ulong)u, (uint)i,
                                                           (uint)(j0 + c), p.threshold)
                                              ? p.drop_scale : 0;
                            dprow[c] = srow[c] == 0 ? 0 : srow[c] * (dprow[c] * kept - di_t[r]);
                            srow[c] *= kept;
                        }
                    } else {
                        for (int c = 0; c < cols_tn; c += VW) {
                            const realv pr = TILE_VEC(srow + c);
                            TILE_VEC(dprow + c) = select(pr * (TILE_VEC(dprow + c) - di_t[r]),
                                                         (realv)0, pr == 0);
                        }
                    }
                    for (int c = cols; c < BK; c++)   /* P is 0 there; dP is not set */
                        dprow[c] = 0;
                    if (p.softcap > 0)
                        for (int c = 0; c < cols; c++)
                            dprow[c] *= dcap[r * BK + c];
                }
                tile_product(dva, DVT, s, 1, BK, dos, DVT, cols_tm, DVT, rows_tm, 1);
                tile_product(dka, DT, dp, 1, BK, qs, DT, cols_tm, DT, rows_tm, 1);
                /* keys before the window of the tile's first row: no row sees them, and
                 * their K (maybe inf) must not meet dS = 0 */
                const long first = p.left >= 0 ? i0 + off - p.left - j0 : 0;
                const int skip = (int)clamp(first, 0L, (long)cols);
                tile_product(dqs, DT, dp + skip, BK, 1, kb + skip * DT, DT, rows_tm, DT,
                             cols_tm - skip, 1);
                for (int r = 0; r < rows; r++)
                    for (int x = 0; x < DT; x += VW)
                        CAT(vstore, VW)(TILE_VEC(dqs + r * DT + x), 0, dqu + (i0 + r) * DT + x);
            }
        }
        for (int c = 0; c < cols; c++) {
            for (int x = 0; x < HEAD_D; x++)
                STORE(dk, kvunit[OR_DK] + (j0 + c) * meta[OR_DK] + x, dka[c * DT + x]);
            for (int x = 0; x < HEAD_DV; x++)
                STORE(dv, kvunit[OR_DV] + (j0 + c) * meta[OR_DV] + x, dva[c * DVT + x]);
        }
    }
}

/* dQ of query row i of unit u (a work-item each): the parts' sums added in part order, times
 * the scale (s = scale * q.k, so dQ = scale * dS K). Its last three arguments are every
 * kernel's (attn_opencl.c set_params); it reads no slopes. */
__kernel void flash_bwd_tiled_dq(__global const real *dqacc, __global storage_t *dq,
                                 const long parts, const long total_rows,
                                 __global const long *meta,
                                 __global const real *slopes, const or_params params)
{
    const long i = get_global_id(0), u = get_global_id(1);
    __global const long *unit = UNIT(meta, u);
    if (i >= unit[OR_UNIT_NQ])
        return;
    __global const real *acc = dqacc + (unit[OR_UNIT_ROW0] + i) * DT;
    for (int x = 0; x < HEAD_D; x++) {
        real sum = acc[x];
        for (long t = 1; t < parts; t++)
            sum += acc[t * total_rows * DT + x];
        STORE(dq, unit[OR_DQ] + i * meta[OR_DQ] + x, sum * params.scale);
    }
}
#endif
