/* flash_fwd_wg.cl - attention forward of the wg family (GPUs), as FlashAttention-2: a
 * work-group of (LANES, FQ / WTM) work-items per (FQ query rows, unit), the micro-tile layout
 * of wg.cl. Its blocks FQ x FK are its own (the backward's tiles are about twice as large at
 * the same blocks: cl_runtime.c's fit_wg_fwd).
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *       (rows of k and v: row_at, common.cl; a paged call's through its page lists)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *
 * Local tiles (OR_WG_FWD_TILES in params.h; rows OR_WG_LD long):
 *   qs   FQ x LDQ    the block's queries, times scale; rows past Nq zero
 *   kvs  FK x LDKV   the key tile, then the value tile in the same memory (so that larger
 *                    blocks fit the 48 KiB that GPUs commonly offer); rows past the keys zero
 *   ps   FQ x FLDP   the tile's probabilities, dropout applied; before them, the row maxima's
 *                    reduction without subgroups, and after the last tile the row sums'
 * Per key tile: S = Q K^T in micro-tiles, the spec's transforms, the online softmax (running
 * max m per row, held alike by the LANES work-items of the row), P to ps, then O += P V in
 * micro-tiles. Each work-item keeps its own part of the row sums, rescaled with the row's max
 * and reduced once at the end. The output accumulator stays in registers.
 */
#if OR_FAMILY == OR_FAMILY_WG
#define FWN (FK / LANES)                            /* score columns per work-item */
#define FLDP OR_WG_LD(FK)                      /* row length of ps */

__kernel void flash_fwd_wg(__global const storage_t *q, __global const storage_t *k,
                           __global const storage_t *v, __global storage_t *out,
                           __global real *lse, __global const long *meta,
                           __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_WG_FWD_TILES(WG_TILE, HEAD_D, HEAD_DV, FQ, FK)
    const int tx = get_local_id(0), ty = get_local_id(1), lid = ty * LANES + tx,
              threads = OR_WG_THREADS(FQ);
    wg_block b;
    if (!wg_query_block(meta, slopes, &p, FQ, &b))
        return;

    real4 o[WTM * WDV4];
    real m[WTM], l[WTM];
    for (int a = 0; a < WTM; a++) {
        m[a] = -INFINITY;
        l[a] = 0;
        for (int g = 0; g < WDV4; g++)
            o[a * WDV4 + g] = 0;
    }
    wg_load(qs, LDQ, q, meta, b.unit, OR_Q, b.i0, b.rows, FQ, HEAD_D, p.scale, lid,
            threads);

    for (long j0 = b.lo; j0 < b.hi; j0 += FK) {
        const int cols = (int)min((long)FK, b.hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        wg_load(kvs, LDKV, k, meta, b.kvunit, OR_K, j0, cols, FK, HEAD_D, 1, lid,
                threads);
        barrier(CLK_LOCAL_MEM_FENCE);
        real s[WTM * FWN], mx[WTM];
        wg_dot_tile(s, FWN, qs, LDQ, kvs, LDKV, HEAD_D, tx, ty);
        for (int a = 0; a < WTM; a++) {
            const long i = b.i0 + ty * WTM + a;
            mx[a] = -INFINITY;
            for (int c = 0; c < FWN; c++) {
                const int col = tx + LANES * c;
                real dcap;
                s[a * FWN + c] = col < cols && i < b.nq
                                     ? transform_score(s[a * FWN + c], i, j0 + col, b.off,
                                                       b.slope, &p, &dcap)
                                     : -INFINITY;
                mx[a] = fmax(mx[a], s[a * FWN + c]);
            }
        }
        wg_reduce_rows(mx, 1, ps, tx, ty);
        for (int a = 0; a < WTM; a++) {
            const long i = b.i0 + ty * WTM + a;
            const real mnew = fmax(m[a], mx[a]);
            /* a row that sees no key yet keeps max -inf: its exp(-inf - 0) are 0 (and a NaN
             * score's NaN carries on) */
            const real base = mnew == -INFINITY ? 0 : mnew;
            /* nothing visible to this row yet: its (zero) state stays as it is */
            const real alpha = mnew == -INFINITY ? 1 : exp(m[a] - mnew);
            real sum = 0;
            for (int c = 0; c < FWN; c++) {
                const int col = tx + LANES * c;
                real e = exp(s[a * FWN + c] - base);
                sum += e;
                if (p.dropout && e > 0)
                    e = or_dropout_keep(p.seed, (ulong)b.u, (uint)i, (uint)(j0 + col), p.threshold)
                            ? e * p.drop_scale : 0;
                ps[(ty * WTM + a) * FLDP + col] = e;
            }
            m[a] = mnew;
            l[a] = l[a] * alpha + sum;
            for (int g = 0; g < WDV4; g++)
                o[a * WDV4 + g] *= alpha;
        }
        barrier(CLK_LOCAL_MEM_FENCE);       /* every product with the key tile is done */
        wg_load(kvs, LDKV, v, meta, b.kvunit, OR_V, j0, cols, FK, HEAD_DV, 1, lid,
                threads);
        barrier(CLK_LOCAL_MEM_FENCE);
        wg_acc_tile(o, WDV4, ps, FLDP, kvs, LDKV, cols, HEAD_DV, tx, ty);
    }

    barrier(CLK_LOCAL_MEM_FENCE);           /* ps is free for the sums' reduction */
    wg_reduce_rows(l, 0, ps, tx, ty);
    for (int a = 0; a < WTM; a++) {
        const long i = b.i0 + ty * WTM + a;
        if (i >= b.nq)
            break;
        const real inv = l[a] != 0 ? 1 / l[a] : 0;  /* 0: no key seen; NaN carries on */
        for (int g = 0; g < WDV4 && wg_col(tx, g) < HEAD_DV; g++)
            wg_store4(out, b.unit[OR_O] + i * meta[OR_O], wg_col(tx, g), HEAD_DV,
                      l[a] != 0 ? o[a * WDV4 + g] * inv : (real4)0);
        if (tx == 0)
            lse[b.unit[OR_LSE] + i * meta[OR_LSE]] = l[a] != 0 ? m[a] + log(l[a]) : -INFINITY;
    }
}
#endif
