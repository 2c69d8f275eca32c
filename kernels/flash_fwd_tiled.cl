/* flash_fwd_tiled.cl - attention forward of the tiled family (CPU devices): one work-item per
 * work-group computes FQ query rows of one unit with register tiles, as the native path
 * does (csrc/attn_native_impl.h). FQ x FK are the forward's blocks (cl_runtime.c
 * fit_tiles_fwd: twice the family's rows where they fit).
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *       (rows of k and v: row_at, common.cl; a paged call's through its page lists)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *
 * Why a second kernel: on a CPU the row-per-work-item kernel does one dot product per score
 * and sums it across the lanes (0.37x the native path on PoCL); this one forms scores and
 * outputs in register tiles (tiles.cl).
 *
 * Scores are formed transposed, S^T = K Q^T, a key per row and a query per column: the
 * queries are transposed once per work-group rather than every key block once per query
 * block (a tenth of the forward's time), and the online softmax runs down the columns, VW
 * query rows per vector, with no sums or maxima across lanes and one vector exp for VW rows'
 * rescale factors.
 *
 * Local tiles (row-major; TN, STEP and DVT as in tiles.cl; OR_TILED_FWD_TILES in params.h):
 *   qt  HEAD_D x FQ     queries of the block transposed, times scale; zero past the block
 *   kb  FK x HEAD_D     key block; rows past the block are zero
 *   vs  FK x DVT        value block; DVT = HEAD_DV rounded up to TN, zero-padded
 *   st  FK x FQ     scores transposed, then probabilities
 *   o   FQ x DVT        output accumulator
 *   m, l  FQ            running max and sum of each query row
 *
 * A key block that the right edge of the mask cuts (a causal diagonal) goes in strips of
 * STEP query rows, each over the key rows (whole TM-row tiles) some row of it can see.
 */
#if OR_FAMILY == OR_FAMILY_TILED
/* Query rows [i, i + VW) of unit u (columns of st, stride FQ between keys; their output rows
 * o, running max m and sum l), after their scores of keys [j0, j0 + cols) were formed in key
 * rows [0, nc) of st (whole tiles): the spec's transforms, then the online softmax turns them
 * into the probabilities, dropout applied, that the next tile product adds to o. */
inline void softmax_cols(__local real *st, __local real *o, __local real *m, __local real *l,
                         long u, long i, long off, real slope, long j0, int cols, int nc,
                         const or_params *p)
{
    /* a mask edge inside the block is nearest the first row (right) or last row (left) */
    if (needs_transform(p, i + off, j0, cols) || needs_transform(p, i + VW - 1 + off, j0, cols)) {
        for (int c = 0; c < min(cols, nc); c++)
            for (int x = 0; x < VW; x++) {
                real dcap;
                st[c * FQ + x] = transform_score(st[c * FQ + x], i + x, j0 + c, off, slope, p,
                                                 &dcap);
            }
    }
    for (int c = cols; c < nc; c++)     /* padding keys are masked */
        TILE_VEC(st + c * FQ) = -INFINITY;
    /* the maxima in two chains, by compares (a NaN score is passed over, as by fmax): fmax
     * became four dependent operations a key, 4 % of the forward at D 64 (PoCL, AVX-512) */
    const realv mold = TILE_VEC(m);
    realv mnew = mold, m2 = mold;
    for (int c = 0; c < nc; c += 2) {   /* nc is a whole number of TM-row tiles: even */
        const realv x = TILE_VEC(st + c * FQ), y = TILE_VEC(st + (c + 1) * FQ);
        mnew = select(mnew, x, x > mnew);
        m2 = select(m2, y, y > m2);
    }
    mnew = select(mnew, m2, m2 > mnew);
    /* a row that sees no key yet keeps max -inf: its probabilities exp(-inf - 0) are 0 */
    const realv base = select(mnew, (realv)0, mnew == (realv)(-INFINITY));
    realv sum = 0;
    for (int c = 0; c < nc; c++) {
        const realv e = or_expv(TILE_VEC(st + c * FQ) - base);
        sum += e;
        TILE_VEC(st + c * FQ) = e;
    }
    const realv alpha = or_expv(mold - base);
    TILE_VEC(m) = mnew;
    TILE_VEC(l) = TILE_VEC(l) * alpha + sum;
    real a[VW];
    CAT(vstore, VW)(alpha, 0, a);
    for (int x = 0; x < VW; x++)
        if (a[x] != 1)
            for (int y = 0; y < DVT; y += VW)
                TILE_VEC(o + x * DVT + y) *= a[x];
    if (p->dropout)
        for (int c = 0; c < min(cols, nc); c++)
            for (int x = 0; x < VW; x++)
                st[c * FQ + x] = or_dropout_keep(p->seed, (ulong)u, (uint)(i + x), (uint)(j0 + c),
                                                 p->threshold)
                                     ? st[c * FQ + x] * p->drop_scale : 0;
}

__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void flash_fwd_tiled(__global const storage_t *q, __global const storage_t *k,
               __global const storage_t *v, __global storage_t *out, __global real *lse,
               __global const long *meta, __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_TILED_FWD_TILES(LOCAL_TILE, HEAD_D, HEAD_DV, DT, DVT, FQ, FK)
    const long u = get_group_id(1), i0 = (long)get_group_id(0) * FQ;
    __global const long *unit = UNIT(meta, u);
    const long nq = unit[OR_UNIT_NQ], nk = unit[OR_UNIT_NK], off = nk - nq;
    __global const long *kvunit = UNIT(meta, u / p.group * p.group);
    if (i0 >= nq)
        return;
    const int rows = (int)min((long)FQ, nq - i0), rows_st = (rows + STEP - 1) / STEP * STEP;
    const real slope = p.has_alibi ? slopes[u] : 0;

    load_block(qt, FQ, 1, q, meta, unit, OR_Q, i0, rows, rows_st, HEAD_D, p.scale);
    for (int r = 0; r < rows_st; r++) {
        for (int x = 0; x < DVT; x++)
            o[r * DVT + x] = 0;
        m[r] = -INFINITY;
        l[r] = 0;
    }

    long lo, hi;
    or_key_range(p.left, p.right, nq, nk, i0, i0 + rows, &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += FK) {
        const int cols = (int)min((long)FK, hi - j0), cols_tm = (cols + TM - 1) / TM * TM;
        load_block(kb, HEAD_D, 0, k, meta, kvunit, OR_K, j0, cols, cols_tm, HEAD_D, 1);
        load_block(vs, DVT, 0, v, meta, kvunit, OR_V, j0, cols, cols_tm, HEAD_DV, 1);
        const long reach = i0 + off + p.right - j0;     /* row r sees keys <= r + reach */
        const int cut = p.right >= 0 && reach + 1 < cols, sr = cut ? STEP : rows_st;
        for (int r0 = 0; r0 < rows_st; r0 += sr) {
            const int mr = min(sr, rows_st - r0);
            const long end = r0 + mr + reach;           /* past the strip's last key */
            const int nc = !cut ? cols_tm
                                : end <= 0 ? 0 : (int)min((long)cols_tm, (end + TM - 1) / TM * TM);
            if (nc == 0)
                continue;   /* no row of the strip sees this block: nothing to add */
            tile_product(st + r0, FQ, kb, HEAD_D, 1, qt + r0, FQ, nc, mr, HEAD_D, 0);
            for (int c = r0; c < min(rows, r0 + mr); c += VW)
                softmax_cols(st + c, o + c * DVT, m + c, l + c, u, i0 + c, off, slope, j0, cols,
                             nc, &p);
            /* columns of padding rows hold the scores of zero queries: finite, never stored */
            tile_product(o + r0 * DVT, DVT, st + r0, 1, FQ, vs, DVT, mr, DVT, nc, 1);
        }
    }

    for (int r = 0; r < rows; r++) {
        const long i = i0 + r;
        const real inv = l[r] != 0 ? 1 / l[r] : 0;  /* 0: no key seen; NaN carries on */
        for (int x = 0; l[r] == 0 && x < HEAD_DV; x++)  /* then 0, even where 0 * NaN */
            o[r * DVT + x] = 0;
        for (int x = 0; x < HEAD_DV; x++)
            STORE(out, unit[OR_O] + i * meta[OR_O] + x, o[r * DVT + x] * inv);
        lse[unit[OR_LSE] + i * meta[OR_LSE]] = l[r] != 0 ? m[r] + log(l[r]) : -INFINITY;
    }
}
#endif
