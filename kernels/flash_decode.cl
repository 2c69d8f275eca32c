/* flash_decode.cl - split-KV attention forward for decoding (Flash-Decoding), every family:
 * taken when every unit has at most OR_DECODE_MAX_QUERIES (16) query rows (csrc/orchard.h).
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *       (rows of k and v: row_at, common.cl; a paged call's through its page lists)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *   part     (unit, split, nq_max, OR_DECODE_ROW(HEAD_DV))  the split's output, unnormalised
 *   part_ml  (unit, split, nq_max, 2)   its running max m and sum l (-inf and 0: no key seen)
 *
 * With few query rows the forward kernels have little to run in parallel and read the keys
 * and values once per query head. Here the keys of each kv unit are cut into splits of `chunk`
 * keys: flash_decode_split runs a work-group per (block of rows, split, kv unit), where the
 * block holds the query rows of every query head of the GQA group (or_decode_blocks in
 * params.h), so they share one read of each key and value; it keeps an online softmax per row
 * with the steps of its family's forward (row_keys; the tiled forward's, row by row:
 * softmax_row), so scale, masks, softcap, ALiBi and dropout are those of the forward. flash_decode_combine then merges the splits of
 * each row exactly: with M = max_s m_s and L = sum_s l_s exp(m_s - M), out = sum_s part_s
 * exp(m_s - M) / L and lse = M + log L (out 0 and lse -inf where no split saw a key). The host
 * picks the splits from the shapes and the device's compute units alone (attn_opencl.c), so
 * a call's result does not depend on timing.
 *
 * The query heads of a GQA group belong to one batch entry (the unit order of problem.c), so
 * they share nq and nk; the split kernel reads them from the group's first unit.
 */

/* The rows of block b of a GQA group of `group` units of nq rows: query rows
 * [*i0, *i0 + *irows) of units [*ua, *ua + *nunits) (indices within the group). 0 when the
 * group needs no block b. */
inline int decode_block(long b, long nq, long group, long *ua, int *nunits, long *i0, int *irows)
{
    const long parts = (nq + SQ - 1) / SQ, per = nq > 0 && nq <= SQ ? SQ / nq : 1;
    if (b >= or_decode_blocks(nq, group, SQ))
        return 0;
    *ua = b / parts * per;
    *nunits = (int)min(per, group - *ua);
    *i0 = b % parts * SQ;
    *irows = (int)min((long)SQ, nq - *i0);
    return 1;
}

/* The keys rows [i0, i0 + irows) may see within split `split` of `chunk` keys. */
inline void split_keys(const or_params *p, long nq, long nk, long i0, int irows, long split,
                       long chunk, long *lo, long *hi)
{
    or_key_range(p->left, p->right, nq, nk, i0, i0 + irows, lo, hi);
    *lo = max(*lo, split * chunk);
    *hi = min(*hi, (split + 1) * chunk);
}

#if OR_FAMILY == OR_FAMILY_ROWS || OR_FAMILY == OR_FAMILY_WG
#if SQ != BQ || SK != BK
#error "the rows family's split kernel runs on the backward's blocks (row_keys, load_tiles)"
#endif
/* Rows family, and the wg family with its blocks: a work-item per query row of the block (BQ
 * work-items), K/V tiles of the split shared through local memory as in flash_fwd_rows
 * (row_keys). */
__kernel void flash_decode_split(__global const storage_t *q, __global const storage_t *k,
                                 __global const storage_t *v, __global real *part,
                                 __global real *part_ml, long nq_max, long chunk,
                                 __global const long *meta, __global const real *slopes,
                                 const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    __local realv kt[BK][DP];
    __local realv vt[BK][DVP];
    const long split = get_group_id(1), nsplit = get_num_groups(1);
    const long u0 = (long)get_group_id(2) * p.group;   /* the group's first unit */
    const int lid = get_local_id(0);
    __global const long *kvunit = UNIT(meta, u0);
    const long nq = kvunit[OR_UNIT_NQ], nk = kvunit[OR_UNIT_NK];
    long ua, i0;
    int nunits, irows;
    if (!decode_block(get_group_id(0), nq, p.group, &ua, &nunits, &i0, &irows))
        return;                 /* the whole work-group: no barrier is skipped by only some */
    const int valid = lid < nunits * irows;
    const long u = u0 + ua + (valid ? lid / irows : 0), i = i0 + (valid ? lid % irows : 0);
    __global const long *unit = UNIT(meta, u);
    const real slope = p.has_alibi ? slopes[u] : 0;

    realv acc[DVP];
    real m, l;
    long lo, hi;
    split_keys(&p, nq, nk, i0, irows, split, chunk, &lo, &hi);
    row_keys(q, k, v, meta, unit, kvunit, u, i, valid, lo, hi, nk - nq, slope, &p, kt, vt, acc,
             &m, &l);
    if (!valid)
        return;
    const long row = (u * nsplit + split) * nq_max + i;
    for (int x = 0; x < DVP; x++)
        CAT(vstore, VW)(acc[x], 0, part + row * OR_DECODE_ROW(HEAD_DV) + x * VW);
    part_ml[2 * row] = m;
    part_ml[2 * row + 1] = l;
}

#elif OR_FAMILY == OR_FAMILY_TILED
/* Row r of a block, query row i of unit u, after its scores of keys [j0, j0 + cols) were
 * formed in srow (nc columns, whole tiles): the spec's transforms, then the online softmax
 * (running max *m, sum *l; the output row orow rescaled) turns them into the probabilities,
 * dropout applied, that the next tile product adds to orow. A block of a few rows has its
 * scores row by row; flash_fwd_tiled's blocks of many have them column by column
 * (softmax_cols). */
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
    if (mnew == -INFINITY) {    /* nothing visible to this row yet, or only NaN scores */
        for (int c = 0; c < nc; c++) {
            *l = isnan(srow[c]) ? srow[c] : *l;     /* as NaN carries on */
            srow[c] = 0;
        }
        return;
    }
    realv sum = 0;
    for (int c = 0; c < nc; c += VW) {
        const realv e = or_expv(CAT(vload, VW)(0, srow + c) - mnew);
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

/* Tiled family: a single work-item per group forms the block's scores and outputs in
 * register tiles, as flash_fwd_tiled does, but a row of scores per query row, since a block
 * holds a few rows (local tiles: OR_TILED_DECODE_TILES). */
__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void flash_decode_split(__global const storage_t *q, __global const storage_t *k,
                        __global const storage_t *v, __global real *part,
                        __global real *part_ml, long nq_max, long chunk,
                        __global const long *meta, __global const real *slopes,
                        const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    OR_TILED_DECODE_TILES(LOCAL_TILE, HEAD_D, HEAD_DV, DT, DVT, SQ, SK)
    const long split = get_group_id(1), nsplit = get_num_groups(1);
    const long u0 = (long)get_group_id(2) * p.group;   /* the group's first unit */
    __global const long *kvunit = UNIT(meta, u0);
    const long nq = kvunit[OR_UNIT_NQ], nk = kvunit[OR_UNIT_NK], off = nk - nq;
    long ua, i0;
    int nunits, irows;
    if (!decode_block(get_group_id(0), nq, p.group, &ua, &nunits, &i0, &irows))
        return;
    /* row r of the block: query row i0 + r % irows of unit u0 + ua + r / irows */
    const int rows = nunits * irows, rows_tm = (rows + TM - 1) / TM * TM;
    for (int r = 0; r < rows_tm; r++) {
        __global const long *unit = UNIT(meta, u0 + ua + (r < rows ? r / irows : 0));
        load_block(qs + r * HEAD_D, HEAD_D, 0, q, meta, unit, OR_Q, i0 + r % irows,
                   r < rows, 1, HEAD_D, p.scale);
        for (int x = 0; x < DVT; x++)
            o[r * DVT + x] = 0;
        m[r] = -INFINITY;
        l[r] = 0;
    }

    long lo, hi;
    split_keys(&p, nq, nk, i0, irows, split, chunk, &lo, &hi);
    for (long j0 = lo; j0 < hi; j0 += SK) {
        const int cols = (int)min((long)SK, hi - j0), cols_tn = (cols + TN - 1) / TN * TN;
        load_block(kt, SK, 1, k, meta, kvunit, OR_K, j0, cols, cols_tn, HEAD_D, 1);
        load_block(vs, DVT, 0, v, meta, kvunit, OR_V, j0, cols, cols_tn, HEAD_DV, 1);
        tile_product(s, SK, qs, HEAD_D, 1, kt, SK, rows_tm, cols_tn, HEAD_D, 0);
        for (int r = 0; r < rows; r++) {
            const long u = u0 + ua + r / irows;
            softmax_row(s + r * SK, o + r * DVT, m + r, l + r, u, i0 + r % irows, off,
                        p.has_alibi ? slopes[u] : 0, j0, cols, cols_tn, &p);
        }
        /* padding rows of s are the products of zero queries: finite, and never stored */
        tile_product(o, DVT, s, SK, 1, vs, DVT, rows_tm, DVT, cols_tn, 1);
    }

    for (int r = 0; r < rows; r++) {
        const long row = ((u0 + ua + r / irows) * nsplit + split) * nq_max + i0 + r % irows;
        for (int x = 0; x < HEAD_DV; x++)
            part[row * OR_DECODE_ROW(HEAD_DV) + x] = o[r * DVT + x];
        part_ml[2 * row] = m[r];
        part_ml[2 * row + 1] = l[r];
    }
}
#endif

/* Every family: a work-item per (query row i, unit u) merges the nsplit partial rows. */
__kernel void flash_decode_combine(__global const real *part, __global const real *part_ml,
                                   __global storage_t *out, __global real *lse, long nq_max,
                                   long nsplit, __global const long *meta)
{
    const long u = get_global_id(1), i = get_global_id(0);
    __global const long *unit = UNIT(meta, u);
    if (i >= unit[OR_UNIT_NQ])
        return;
    const long first = u * nsplit * nq_max + i;     /* split s is row first + s * nq_max */
    real mx = -INFINITY, sum = 0, acc[HEAD_DV];
    for (long s = 0; s < nsplit; s++)
        mx = fmax(mx, part_ml[2 * (first + s * nq_max)]);
    for (int x = 0; x < HEAD_DV; x++)
        acc[x] = 0;
    for (long s = 0; s < nsplit; s++) {
        const long row = first + s * nq_max;
        if (part_ml[2 * row + 1] == 0)  /* no key in this split (else l > 0, or NaN) */
            continue;
        const real w = exp(part_ml[2 * row] - mx);
        sum += w * part_ml[2 * row + 1];
        for (int x = 0; x < HEAD_DV; x++)
            acc[x] += w * part[row * OR_DECODE_ROW(HEAD_DV) + x];
    }
    for (int x = 0; x < HEAD_DV; x++)
        STORE(out, unit[OR_O] + i * meta[OR_O] + x, sum != 0 ? acc[x] / sum : 0);
    lse[unit[OR_LSE] + i * meta[OR_LSE]] = sum != 0 ? mx + log(sum) : -INFINITY;
}
