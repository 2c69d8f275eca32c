/* flash_fwd_tiled.cl - attention forward of the tiled family (CPU devices): one work-item per
 * work-group computes BQ query rows of one unit with register tiles, as the native path
 * does (csrc/attn_native_impl.h).
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *
 * Why a second kernel: on a CPU the row-per-work-item kernel does one dot product per score
 * and sums it across the lanes (0.37x the native path on PoCL); this one forms scores and
 * outputs in register tiles (tiles.cl), about 0.9x the native path.
 *
 * Local tiles (row-major; TM, TN and DVT as in tiles.cl; OR_TILED_FWD_TILES in params.h):
 *   qs  BQ x HEAD_D     queries of the block, times scale
 *   kt  HEAD_D x BK     key block transposed; columns past the block are zero
 *   vs  BK x DVT        value block; DVT = HEAD_DV rounded up to TN, zero-padded
 *   s   BQ x BK     scores, then probabilities
 *   o   BQ x DVT        output accumulator
 *
 * A key block that the right edge of the mask cuts (a causal diagonal) goes in strips of
 * STRIP rows, each over the key columns (whole TN-wide tiles) some row of it can see.
 */
#define STRIP (4 * TM)
#if OR_FAMILY == OR_FAMILY_TILED
/* Row r of a block, query row i of unit u, after its scores of keys [j0, j0 + cols) were
 * formed in srow (nc columns, whole tiles): the spec's transforms, then the online softmax
 * (running max *m, sum *l; the output row orow rescaled) turns them into the probabilities,
 * dropout applied, that the next tile product adds to orow. Also the step of
 * flash_decode_split (flash_decode.cl). */
inline void softmax_row(__local real *srow, __local real *orow, __local real *m, __local real *l,
                        long u, long i, long off, real slope, long j0, int cols, int nc,
                        const or_params *p)
{
    const long diag = i + off;
    /* the spec's transforms, where this row needs them; padding columns are masked */
    if (needs_transform(p, diag, j0, cols)) {
        for (int c = 0; c < min(cols, nc); c++) {
            real dcap;
            srow[c] = transform_score(srow[c], i, j0 + c, off, slope, p, &dcap);
        }
    }
    for (int c = cols; c < nc; c++)
        srow[c] = -INFINITY;
    realv mv = -INFINITY;
    for (int c = 0; c < nc; c += VW)
        mv = fmax(mv, CAT(vload, VW)(0, srow + c));
    const real mnew = fmax(*m, hmax(mv));
    if (mnew == -INFINITY) {            /* nothing visible to this row yet */
        for (int c = 0; c < nc; c++)
            srow[c] = 0;
        return;
    }
    realv sum = 0;
    for (int c = 0; c < nc; c += VW) {
        const realv e = exp(CAT(vload, VW)(0, srow + c) - mnew);
        sum += e;
        CAT(vstore, VW)(e, 0, srow + c);
    }
    const real alpha = exp(*m - mnew);
    *m = mnew;
    *l = *l * alpha + hsum(sum);
    if (alpha != 1)
        for (int x = 0; x < DVT; x++)
            orow[x] *= alpha;
    if (p->dropout)
        for (int c = 0; c < min(cols, nc); c++)
            srow[c] = or_dropout_keep(p->seed, (ulong)u, (uint)i, (uint)(j0 + c), p->threshold)
                          ? srow[c] * p->drop_scale : 0;
}

__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void flash_fwd_tiled(__global const storage_t *q, __global const storage_t *k,
               __global const storage_t *v, __global storage_t *out, __global real *lse,
               __global const long *meta, __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_TILED_FWD_TILES(LOCAL_TILE, HEAD_D, HEAD_DV, DT, DVT, BQ, BK)
    const long u = get_group_id(1), i0 = (long)get_group_id(0) * BQ;
    __global const long *unit = UNIT(meta, u);
    const long nq = unit[OR_UNIT_NQ], nk = unit[OR_UNIT_NK], off = nk - nq;
    __global const long *kvunit = UNIT(meta, u / p.group * p.group);
    if (i0 >= nq)
        return;
    const int rows = (int)min((long)BQ, nq - i0), rows_tm = (rows + TM - 1) / TM * TM;
    const real slope = p.has_alibi ? slopes[u] : 0;

    load_block(qs, HEAD_D, q, unit[OR_Q], meta[OR_Q], i0, rows, rows_tm, HEAD_D, p.scale);
    for (int r = 0; r < rows_tm; r++) {
        for (int x = 0; x < DVT; x++)
            o[r * DVT + x] = 0;
        m[r] = -INFINITY;
        l[r] = 0;
    }

    long lo, hi;
    or_key_range(p.left, p.right, nq, nk, i0, i0 + rows, &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += BK) {
        const int cols = (int)min((long)BK, hi - j0), cols_tn = (cols + TN - 1) / TN * TN;
        load_block_t(kt, BK, k, kvunit[OR_K], meta[OR_K], j0, cols, cols_tn, HEAD_D);
        load_block(vs, DVT, v, kvunit[OR_V], meta[OR_V], j0, cols, cols_tn, HEAD_DV, 1);
        const long reach = i0 + off + p.right - j0;     /* row r sees columns <= r + reach */
        const int cut = p.right >= 0 && reach + 1 < cols, sr = cut ? STRIP : rows_tm;
        for (int r0 = 0; r0 < rows_tm; r0 += sr) {
            const int mr = min(sr, rows_tm - r0);
            const long end = r0 + mr + reach;           /* past the strip's last column */
            const int nc = !cut ? cols_tn
                                : end <= 0 ? 0 : (int)min((long)cols_tn, (end + TN - 1) / TN * TN);
            if (nc == 0)
                continue;   /* no row of the strip sees this block: nothing to add */
            tile_product(s + r0 * BK, BK, qs + r0 * HEAD_D, HEAD_D, 1, kt, BK, mr, nc,
                         HEAD_D, 0);

            for (int r = r0; r < min(rows, r0 + mr); r++)
                softmax_row(s + r * BK, o + r * DVT, m + r, l + r, u, i0 + r, off, slope, j0,
                            cols, nc, &p);
            /* padding rows of s are the products of zero queries: finite, and never stored */
            tile_product(o + r0 * DVT, DVT, s + r0 * BK, BK, 1, vs, DVT, mr, DVT, nc, 1);
        }
    }

    for (int r = 0; r < rows; r++) {
        const long i = i0 + r;
        const real inv = l[r] > 0 ? 1 / l[r] : 0;
        for (int x = 0; x < HEAD_DV; x++)
            STORE(out, unit[OR_O] + i * meta[OR_O] + x, o[r * DVT + x] * inv);
        lse[unit[OR_LSE] + i * meta[OR_LSE]] = l[r] > 0 ? m[r] + log(l[r]) : -INFINITY;
    }
}
#endif
