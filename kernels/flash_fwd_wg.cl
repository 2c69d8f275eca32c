/* flash_fwd_wg.cl - attention forward of the wg family (GPUs), as FlashAttention-2: a
 * work-group of (LANES, BQ / WTM) work-items per (BQ query rows, unit), the micro-tile layout
 * of wg.cl.
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *
 * Local tiles (OR_WG_FWD_TILES in params.h; LDQ, LDKV, LDP as in wg.cl):
 *   qs   BQ x LDQ    the block's queries, times scale; rows past Nq zero
 *   kvs  BK x LDKV   the key tile, then the value tile in the same memory (so that larger
 *                    blocks fit the 48 KiB that GPUs commonly offer)
 *   ps   BQ x LDP    the tile's probabilities, dropout applied
 *   red  BQ x LANES  partial row maxima and sums, when no subgroups reduce them
 * Per key tile: S = Q K^T in micro-tiles, the spec's transforms, the online softmax (running
 * max m and sum l per row, held alike by the LANES work-items of the row), P to ps, then
 * O += P V in micro-tiles. The output accumulator stays in registers.
 */
#if OR_FAMILY == OR_FAMILY_WG
__kernel void flash_fwd_wg(__global const storage_t *q, __global const storage_t *k,
                           __global const storage_t *v, __global storage_t *out,
                           __global real *lse, __global const long *meta,
                           __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_WG_FWD_TILES(WG_TILE, HEAD_D, HEAD_DV, BQ, BK)
    const int tx = get_local_id(0), ty = get_local_id(1), lid = ty * LANES + tx;
    wg_block b;
    if (!wg_query_block(meta, slopes, &p, &b))
        return;

    real o[WTM * WDV], m[WTM], l[WTM];
    for (int a = 0; a < WTM; a++) {
        m[a] = -INFINITY;
        l[a] = 0;
        for (int x = 0; x < WDV; x++)
            o[a * WDV + x] = 0;
    }
    wg_load(qs, LDQ, q, b.unit[OR_Q], meta[OR_Q], b.i0, b.rows, BQ, HEAD_D, p.scale, lid);

    for (long j0 = b.lo; j0 < b.hi; j0 += BK) {
        const int cols = (int)min((long)BK, b.hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        wg_load(kvs, LDKV, k, b.kvunit[OR_K], meta[OR_K], j0, cols, BK, HEAD_D, 1, lid);
        barrier(CLK_LOCAL_MEM_FENCE);
        real s[WTM][WN], mx[WTM], sum[WTM], alpha[WTM];
        wg_dot_tile(s, qs, LDQ, kvs, LDKV, HEAD_D, tx, ty);
        for (int a = 0; a < WTM; a++) {
            const long i = b.i0 + ty * WTM + a;
            mx[a] = -INFINITY;
            for (int c = 0; c < WN; c++) {
                const int col = tx + LANES * c;
                real dcap;
                s[a][c] = col < cols && i < b.nq
                              ? transform_score(s[a][c], i, j0 + col, b.off, b.slope, &p, &dcap)
                              : -INFINITY;
                mx[a] = fmax(mx[a], s[a][c]);
            }
        }
        wg_reduce_rows(mx, 1, red, tx, ty);
        for (int a = 0; a < WTM; a++) {
            const long i = b.i0 + ty * WTM + a;
            const real mnew = fmax(m[a], mx[a]);
            /* a row that sees no key yet keeps max -inf: its exp(-inf - 0) are 0 (and a NaN
             * score's NaN carries on) */
            const real base = mnew == -INFINITY ? 0 : mnew;
            sum[a] = 0;
            for (int c = 0; c < WN; c++) {
                const int col = tx + LANES * c;
                real e = exp(s[a][c] - base);
                sum[a] += e;
                if (p.dropout && e > 0)
                    e = or_dropout_keep(p.seed, (ulong)b.u, (uint)i, (uint)(j0 + col), p.threshold)
                            ? e * p.drop_scale : 0;
                ps[(ty * WTM + a) * LDP + col] = e;
            }
            /* nothing visible to this row yet: its (zero) state stays as it is */
            alpha[a] = mnew == -INFINITY ? 1 : exp(m[a] - mnew);
            m[a] = mnew;
        }
        wg_reduce_rows(sum, 0, red, tx, ty);
        for (int a = 0; a < WTM; a++) {
            l[a] = l[a] * alpha[a] + sum[a];
            for (int x = 0; x < WDV; x++)
                o[a * WDV + x] *= alpha[a];
        }
        barrier(CLK_LOCAL_MEM_FENCE);       /* every product with the key tile is done */
        wg_load(kvs, LDKV, v, b.kvunit[OR_V], meta[OR_V], j0, cols, cols, HEAD_DV, 1, lid);
        barrier(CLK_LOCAL_MEM_FENCE);
        wg_acc_tile(o, WDV, ps, kvs, LDKV, cols, HEAD_DV, tx, ty);
    }

    for (int a = 0; a < WTM; a++) {
        const long i = b.i0 + ty * WTM + a;
        if (i >= b.nq)
            break;
        const real inv = l[a] != 0 ? 1 / l[a] : 0;  /* 0: no key seen; NaN carries on */
        for (int x = 0; x < WDV && tx + LANES * x < HEAD_DV; x++)
            STORE(out, b.unit[OR_O] + i * meta[OR_O] + tx + LANES * x, o[a * WDV + x] * inv);
        if (tx == 0)
            lse[b.unit[OR_LSE] + i * meta[OR_LSE]] = l[a] != 0 ? m[a] + log(l[a]) : -INFINITY;
    }
}
#endif
