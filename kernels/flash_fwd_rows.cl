/* flash_fwd_rows.cl - attention forward of the rows family (GPUs): one work-group per (BQ query rows, unit), one work-item
 * per query row.
 *
 *   q   (unit, Nq, HEAD_D)   k (kv unit, Nk, HEAD_D)   v (kv unit, Nk, HEAD_DV)
 *       (rows of k and v: row_at, common.cl; a paged call's through its page lists)
 *   out (unit, Nq, HEAD_DV)  lse (unit, Nq), natural log, -inf for a row that sees no key
 *
 * Each work-item keeps its query row (pre-scaled) and output accumulator in private vectors;
 * the work-group streams BK-key tiles of K and V through local memory and keeps an online
 * softmax (running max m, running sum l) per row, as FlashAttention-2.
 */
/* the online-softmax steps also serve flash_decode_split of the wg family (flash_decode.cl) */
#if OR_FAMILY == OR_FAMILY_ROWS || OR_FAMILY == OR_FAMILY_WG
/* One K/V tile (cols keys from j0, in kt and vt) into the online softmax of query row i of
 * unit u (qv pre-scaled): running max *m, running sum *l, output accumulator acc. */
inline void row_tile(const realv *qv, realv *acc, real *m, real *l, __local realv (*kt)[DP],
                     __local realv (*vt)[DVP], int cols, long u, long i, long j0, long off,
                     real slope, const or_params *p)
{
    /* scores padded to whole vectors with -inf, so exp runs VW lanes at a time */
    real s[(BK + VW - 1) / VW * VW], mx = -INFINITY, dcap;
    for (int c = 0; c < cols; c++) {
        s[c] = transform_score(vdot(qv, kt[c], DP), i, j0 + c, off, slope, p, &dcap);
        mx = fmax(mx, s[c]);
    }
    const real mnew = fmax(*m, mx);
    if (mnew == -INFINITY) {    /* nothing visible to this row yet, or only NaN scores */
        for (int c = 0; c < cols; c++)
            *l = isnan(s[c]) ? s[c] : *l;   /* as NaN carries on */
        return;
    }
    for (int c = cols; c % VW != 0; c++)
        s[c] = -INFINITY;
    realv sum = 0;
    for (int c = 0; c < cols; c += VW) {
        const realv e = exp(CAT(vload, VW)(0, s + c) - mnew);
        sum += e;
        CAT(vstore, VW)(e, 0, s + c);
    }
    const real alpha = exp(*m - mnew);
    *l = *l * alpha + hsum(sum);
    for (int x = 0; x < DVP; x++)
        acc[x] *= alpha;
    for (int c = 0; c < cols; c++) {
        real e = s[c];
        if (p->dropout)
            e = or_dropout_keep(p->seed, (ulong)u, (uint)i, (uint)(j0 + c), p->threshold)
                    ? e * p->drop_scale : 0;
        for (int x = 0; x < DVP; x++)
            acc[x] += e * vt[c][x];
    }
    *m = mnew;
}

/* Query row i of unit u (when valid; every work-item of the group takes part in the loads)
 * over keys [lo, hi) of the kv unit, BK at a time through the local tiles kt and vt: its
 * output accumulator acc, unnormalised, running max *m and sum *l. */
inline void row_keys(__global const storage_t *q, __global const storage_t *k,
                     __global const storage_t *v, __global const long *meta,
                     __global const long *unit, __global const long *kvunit, long u, long i,
                     int valid, long lo, long hi, long off, real slope, const or_params *p,
                     __local realv (*kt)[DP], __local realv (*vt)[DVP], realv *acc, real *m,
                     real *l)
{
    realv qv[DP];
    for (int x = 0; x < DP; x++)
        qv[x] = valid ? load_vec(q, unit[OR_Q] + i * meta[OR_Q], x * VW, HEAD_D, p->scale) : 0;
    for (int x = 0; x < DVP; x++)
        acc[x] = 0;
    *m = -INFINITY;
    *l = 0;
    const int lid = get_local_id(0);
    for (long j0 = lo; j0 < hi; j0 += BK) {
        const int cols = (int)min((long)BK, hi - j0);
        barrier(CLK_LOCAL_MEM_FENCE);
        load_tiles(meta, kvunit, j0, cols, lid, kt, k, OR_K, 1, vt, v, OR_V);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (valid)
            row_tile(qv, acc, m, l, kt, vt, cols, u, i, j0, off, slope, p);
    }
}
#endif

#if OR_FAMILY == OR_FAMILY_ROWS

__kernel void flash_fwd_rows(__global const storage_t *q, __global const storage_t *k,
                        __global const storage_t *v, __global storage_t *out,
                        __global real *lse, __global const long *meta,
                        __global const real *slopes, const or_params params)
{
    const or_params p = params;     /* a private copy: its fields stay in registers */
    __local realv kt[BK][DP];
    __local realv vt[BK][DVP];
    const long u = get_group_id(1), i0 = (long)get_group_id(0) * BQ, i = i0 + get_local_id(0);
    __global const long *unit = UNIT(meta, u);
    const long nq = unit[OR_UNIT_NQ], nk = unit[OR_UNIT_NK], off = nk - nq;
    __global const long *kvunit = UNIT(meta, u / p.group * p.group);
    if (i0 >= nq)
        return;                 /* the whole work-group: no barrier is skipped by only some */
    const int valid = i < nq;
    const real slope = p.has_alibi ? slopes[u] : 0;

    realv acc[DVP];
    real m, l;
    long lo, hi;
    or_key_range(p.left, p.right, nq, nk, i0, min(i0 + BQ, nq), &lo, &hi);
    row_keys(q, k, v, meta, unit, kvunit, u, i, valid, lo, hi, off, slope, &p, kt, vt, acc, &m, &l);
    if (!valid)
        return;
    const real inv = l != 0 ? 1 / l : 0;    /* 0: no key seen; NaN carries on */
    for (int x = 0; x < DVP; x++)       /* a row that saw no key: 0, even where 0 * NaN */
        acc[x] = l != 0 ? acc[x] * inv : 0;
    store_row(out, unit[OR_O] + i * meta[OR_O], acc, HEAD_DV);
    lse[unit[OR_LSE] + i * meta[OR_LSE]] = l != 0 ? m + log(l) : -INFINITY;
}
#endif
