/* flash_bwd_tiled.cl - attention backward for CPU devices: one work-item per work-group owns
 * a kv unit, as the native path's backward does, and forms every product in register tiles
 * (tiles.cl). Built instead of flash_bwd.cl's dq and dkdv kernels when OR_TILED is 1; D_i
 * comes from flash_bwd_prep first.
 *
 *   q, dout, dq (unit, Nq, ...)  k, v, dk, dv (kv unit, Nk, ...)  lse (unit, Nq)
 *   di    (unit, di_stride)      D_i = rowsum(dO_i * O_i)
 *   dqacc (unit, di_stride, DT)  dQ summed over key blocks (zeroed by the host), scaled on store
 *
 * For each TILE_K block of keys (its dK, dV accumulated in local tiles) and each TILE_Q block
 * of the query rows of the unit's GQA group that may see it:
 *   S = q K^T, P = exp(S - lse), dP = dO V^T, dS = P (dP~ - D) dcap,
 *   dV += P~^T dO, dK += dS^T q, dQ += dS K.
 * One work-item sums every element it writes, in a fixed order: deterministic, no atomics.
 *
 * Local tiles (row-major; TM, TN, DT, DVT as in tiles.cl):
 *   kt  HEAD_D x TILE_K, vt HEAD_DV x TILE_K   the key block's keys and values transposed
 *   kb  TILE_K x DT                            its keys
 *   dka TILE_K x DT, dva TILE_K x DVT          its dK, dV accumulators
 *   qs  TILE_Q x DT (times scale), dos TILE_Q x DVT, dqs TILE_Q x DT   a query block
 *   s, dp, dcap  TILE_Q x TILE_K                scores -> P~, dP -> dS, d(softcap)
 */
#if OR_TILED
__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void flash_bwd_tiled(__global const storage_t *q, __global const storage_t *k,
                     __global const storage_t *v, __global const storage_t *dout,
                     __global const real *lse, __global const real *di, long di_stride,
                     __global storage_t *dq, __global storage_t *dk, __global storage_t *dv,
                     __global real *dqacc, __global const long *meta,
                     __global const real *slopes, PARAMS_ARGS)
{
    const params_t p = PARAMS_INIT;
    __local real kt[HEAD_D * TILE_K], vt[HEAD_DV * TILE_K], kb[TILE_K * DT];
    __local real dka[TILE_K * DT], dva[TILE_K * DVT];
    __local real qs[TILE_Q * DT], dos[TILE_Q * DVT], dqs[TILE_Q * DT];
    __local real s[TILE_Q * TILE_K], dp[TILE_Q * TILE_K], dcap[TILE_Q * TILE_K];
    __local real lse_t[TILE_Q], di_t[TILE_Q];
    const long w = get_group_id(1);
    __global const long *kvunit = UNIT(meta, w * p.group);
    const long nk = kvunit[NSLOTS + 1];

    for (long j0 = 0; j0 < nk; j0 += TILE_K) {
        const int cols = (int)min((long)TILE_K, nk - j0), cols_tm = (cols + TM - 1) / TM * TM,
                  cols_tn = (cols + TN - 1) / TN * TN;
        load_block_t(kt, TILE_K, k, kvunit[S_K], meta[S_K], j0, cols, TILE_K, HEAD_D);
        load_block_t(vt, TILE_K, v, kvunit[S_V], meta[S_V], j0, cols, TILE_K, HEAD_DV);
        load_block(kb, DT, k, kvunit[S_K], meta[S_K], j0, cols, TILE_K, HEAD_D, 1);
        for (int e = 0; e < TILE_K * DT; e++)
            dka[e] = 0;
        for (int e = 0; e < TILE_K * DVT; e++)
            dva[e] = 0;

        for (int g = 0; g < p.group; g++) {
            const long u = w * p.group + g;
            __global const long *unit = UNIT(meta, u);
            const long nq = unit[NSLOTS], off = nk - nq;
            const real slope = p.has_alibi ? slopes[u] : 0;
            __global real *dqu = dqacc + u * di_stride * DT;
            long ilo, ihi;
            query_range(&p, nq, nk, j0, j0 + cols, &ilo, &ihi);
            for (long i0 = ilo; i0 < ihi; i0 += TILE_Q) {
                const int rows = (int)min((long)TILE_Q, ihi - i0);
                const int rows_tm = (rows + TM - 1) / TM * TM;
                load_block(qs, DT, q, unit[S_Q], meta[S_Q], i0, rows, rows_tm, HEAD_D, p.scale);
                load_block(dos, DVT, dout, unit[S_DO], meta[S_DO], i0, rows, rows_tm, HEAD_DV, 1);
                for (int r = 0; r < rows_tm; r++) {
                    lse_t[r] = r < rows ? lse[unit[S_LSE] + (i0 + r) * meta[S_LSE]] : -INFINITY;
                    di_t[r] = r < rows ? di[u * di_stride + i0 + r] : 0;
                    for (int x = 0; x < DT; x++)
                        dqs[r * DT + x] = r < rows ? dqu[(i0 + r) * DT + x] : 0;
                }
                tile_product(s, TILE_K, qs, DT, 1, kt, TILE_K, rows_tm, cols_tn, HEAD_D, 0);
                tile_product(dp, TILE_K, dos, DVT, 1, vt, TILE_K, rows_tm, cols_tn, HEAD_DV, 0);

                /* s becomes P~ (for dV), dp becomes dS (for dK, dQ); zero past the block */
                for (int r = 0; r < rows_tm; r++) {
                    __local real *srow = s + r * TILE_K, *dprow = dp + r * TILE_K;
                    if (lse_t[r] == -INFINITY) {    /* padding, or a row that sees no key */
                        for (int c = 0; c < TILE_K; c++)
                            srow[c] = dprow[c] = 0;
                        continue;
                    }
                    const long i = i0 + r;
                    if (needs_transform(&p, i + off, j0, cols))
                        for (int c = 0; c < cols; c++) {
                            real dc;
                            srow[c] = transform_score(srow[c], i, j0 + c, off, slope, &p, &dc);
                            dcap[r * TILE_K + c] = dc;
                        }
                    for (int c = cols; c < TILE_K; c++)
                        srow[c] = -INFINITY;
                    for (int c = 0; c < TILE_K; c += VW)
                        CAT(vstore, VW)(exp(CAT(vload, VW)(0, srow + c) - lse_t[r]), 0, srow + c);
                    /* where P is 0 (masked), dS is 0 whatever dP is: V may hold inf there */
                    if (p.dropout) {
                        for (int c = 0; c < cols; c++) {
                            const real kept = dropout_keep(p.seed, (ulong)u, (uint)i,
                                                           (uint)(j0 + c), p.threshold)
                                              ? p.drop_scale : 0;
                            dprow[c] = srow[c] == 0 ? 0 : srow[c] * (dprow[c] * kept - di_t[r]);
                            srow[c] *= kept;
                        }
                    } else {
                        for (int c = 0; c < cols_tn; c += VW) {
                            const realv pr = CAT(vload, VW)(0, srow + c),
                                        dpv = CAT(vload, VW)(0, dprow + c);
                            CAT(vstore, VW)(select(pr * (dpv - di_t[r]), (realv)0, pr == 0), 0,
                                            dprow + c);
                        }
                    }
                    for (int c = cols; c < TILE_K; c++)   /* P is 0 there; dP is not set */
                        dprow[c] = 0;
                    if (p.softcap > 0)
                        for (int c = 0; c < cols; c++)
                            dprow[c] *= dcap[r * TILE_K + c];
                }
                tile_product(dva, DVT, s, 1, TILE_K, dos, DVT, cols_tm, DVT, rows_tm, 1);
                tile_product(dka, DT, dp, 1, TILE_K, qs, DT, cols_tm, DT, rows_tm, 1);
                /* keys before the window of the tile's first row: no row sees them, and
                 * their K (maybe inf) must not meet dS = 0 */
                const long first = p.left >= 0 ? i0 + off - p.left - j0 : 0;
                const int skip = (int)clamp(first, 0L, (long)cols);
                tile_product(dqs, DT, dp + skip, TILE_K, 1, kb + skip * DT, DT, rows_tm, DT,
                             cols_tm - skip, 1);
                for (int r = 0; r < rows; r++)
                    for (int x = 0; x < DT; x++)
                        dqu[(i0 + r) * DT + x] = dqs[r * DT + x];
            }
        }
        for (int c = 0; c < cols; c++) {
            for (int x = 0; x < HEAD_D; x++)
                STORE(dk, kvunit[S_DK] + (j0 + c) * meta[S_DK] + x, dka[c * DT + x]);
            for (int x = 0; x < HEAD_DV; x++)
                STORE(dv, kvunit[S_DV] + (j0 + c) * meta[S_DV] + x, dva[c * DVT + x]);
        }
    }

    for (int g = 0; g < p.group; g++) {         /* s = scale * q.k, so dQ = scale * dS K */
        const long u = w * p.group + g;
        __global const long *unit = UNIT(meta, u);
        __global const real *dqu = dqacc + u * di_stride * DT;
        for (long i = 0; i < unit[NSLOTS]; i++)
            for (int x = 0; x < HEAD_D; x++)
                STORE(dq, unit[S_DQ] + i * meta[S_DQ] + x, dqu[i * DT + x] * p.scale);
    }
}
#endif
