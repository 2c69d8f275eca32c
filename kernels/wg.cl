/* wg.cl - the work-group layout, tile loads, micro-tile products and row reductions of the wg
 * family (flash_fwd_wg.cl, flash_bwd_wg.cl), in the manner of FlashAttention-2.
 *
 * A work-group of (LANES, bq / WTM) work-items computes a bq x bk block of scores at a time
 * (the forward's blocks FQ x FK, the backward's BQ x BK). Work-item (tx, ty) owns a register
 * micro-tile of it: rows ty * WTM .. ty * WTM + WTM - 1 and columns tx + LANES * c
 * (c < bk / LANES), and the same rows of the output accumulator in vectors of 4 columns,
 * columns 4 * (tx + LANES * g) .. + 3 (wg_col). Its operands come from local tiles the whole
 * work-group loads, row-major, rows of whole vectors of 4 (zero past the data) and one vector
 * more (params.h's OR_WG_LD), and every read of them is a vector of 4 along the products'
 * inner dimension: lanes of one row read the same vector (a broadcast), lanes of different
 * columns vectors of different rows, whose starts the extra vector spreads over the banks.
 * So a product costs WTM + bk / LANES vector reads per 4 * WTM * bk / LANES multiply-adds
 * (measured on an H200: scalar reads, one per multiply-add pair, held the forward at 13-17 %
 * of the FMA peak).
 *
 * Softmax row reductions run over the LANES work-items that share a row: with subgroup
 * operations when the device has them (cl_khr_subgroups or cl_intel_subgroups) and its
 * subgroups are exactly those LANES work-items, else through local memory.
 * -DOR_WG_NO_SUBGROUPS (ORCHARD_CL_OPTIONS) forces the local-memory path.
 */
#if OR_FAMILY == OR_FAMILY_WG
#define LANES OR_WG_LANES
#define WTM OR_WG_TM
#define WD4 ((HEAD_D + 4 * LANES - 1) / (4 * LANES))    /* dq / dk vectors per work-item row */
#define WDV4 ((HEAD_DV + 4 * LANES - 1) / (4 * LANES))  /* out / dv vectors per work-item row */
#define LDQ OR_WG_LD(HEAD_D)                            /* row lengths of the local tiles */
#define LDV OR_WG_LD(HEAD_DV)
#define LDKV OR_WG_LD(OR_WG_MAX(HEAD_D, HEAD_DV))
typedef CAT(REAL_T, 4) real4;
/* a vector of a local tile: rows and reads start at whole vectors, so it is aligned */
#define LOCAL4(p) (*(__local const real4 *)(p))
#define WG_TILE(name, reals) __local real name[reals] __attribute__((aligned(4 * sizeof(real))));

/* The first output column of a work-item's vector g (of WD4 or WDV4). */
inline int wg_col(int tx, int g)
{
    return 4 * (tx + LANES * g);
}

/* The host defines OR_WG_SUBGROUPS when the device lists cl_khr_subgroups or
 * cl_intel_subgroups: a compiler may declare the built-ins for a device that lacks them
 * (Oclgrind's does). The compiler must declare them too: cl_khr_subgroups is an OpenCL 2.0
 * extension, so compilers define it for 2.0 programs only; in the 1.2 programs built here,
 * cl_intel_subgroups brings the same built-ins. */
#if defined(OR_WG_SUBGROUPS) && !defined(OR_WG_NO_SUBGROUPS)                                  \
    && (defined(cl_khr_subgroups) || defined(__opencl_c_subgroups) || defined(cl_intel_subgroups))
#ifdef cl_khr_subgroups
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
#define WG_SUBGROUPS 1
#endif

/* The block of query rows of this work-group, where the forward and dQ kernels start: rows
 * [i0, i0 + rows) of unit u (block get_group_id(0), of bq rows, of unit get_group_id(2)), its
 * meta words and those of its kv unit, its ALiBi slope and the keys [lo, hi) its rows may see. */
typedef struct {
    long u, i0, nq, nk, off, lo, hi;
    int rows;
    real slope;
    __global const long *unit, *kvunit;
} wg_block;

/* Fills *b; 0 when the block starts past its unit's rows: the whole work-group then returns,
 * so no barrier is skipped by only some. */
inline int wg_query_block(__global const long *meta, __global const real *slopes,
                          const or_params *p, int bq, wg_block *b)
{
    b->u = get_group_id(2);
    b->i0 = (long)get_group_id(0) * bq;
    b->unit = UNIT(meta, b->u);
    b->kvunit = UNIT(meta, b->u / p->group * p->group);
    b->nq = b->unit[OR_UNIT_NQ];
    b->nk = b->unit[OR_UNIT_NK];
    b->off = b->nk - b->nq;
    if (b->i0 >= b->nq)
        return 0;
    b->rows = (int)min((long)bq, b->nq - b->i0);
    b->slope = p->has_alibi ? slopes[b->u] : 0;
    or_key_range(p->left, p->right, b->nq, b->nk, b->i0, b->i0 + b->rows, &b->lo, &b->hi);
    return 1;
}

/* Rows [r0, r0 + rows) of operand slot s of a unit (rows_of), n elements each, times mul, into
 * a local tile of row length ld (OR_WG_LD(n): whole vectors of VW fit), VW elements per global
 * read and local write, zero past n; rows [rows, pad_rows) are zero. Every one of the group's
 * `threads` work-items takes part. */
inline void wg_load(__local real *dst, int ld, __global const storage_t *src,
                    __global const long *meta, __global const long *unit, int s, long r0,
                    int rows, int pad_rows, int n, real mul, int lid, int threads)
{
    const int nv = (n + VW - 1) / VW;
    or_rows at;
    rows_of(&at, meta, unit, s);
    for (int e = lid; e < pad_rows * nv; e += threads) {
        const int r = e / nv, x0 = e % nv * VW;
        const realv t = r < rows ? load_vec(src, row_at(&at, r0 + r), x0, n, mul) : 0;
        CAT(vstore, VW)(t, 0, dst + r * ld + x0);
    }
}

/* acc[a * wn + c] = row ty * WTM + a of tile a_t . row tx + LANES * c of tile b_t, over n
 * elements (the tiles zero from n to a whole vector): a block of S = A B^T. */
inline void wg_dot_tile(real *acc, int wn, __local const real *a_t, int lda,
                        __local const real *b_t, int ldb, int n, int tx, int ty)
{
    for (int e = 0; e < WTM * wn; e++)
        acc[e] = 0;
    for (int x = 0; x < n; x += 4) {
        real4 av[WTM];
        for (int a = 0; a < WTM; a++)
            av[a] = LOCAL4(a_t + (ty * WTM + a) * lda + x);
        for (int c = 0; c < wn; c++) {
            const real4 bv = LOCAL4(b_t + (tx + LANES * c) * ldb + x);
            for (int a = 0; a < WTM; a++) {
                real t = acc[a * wn + c];
                t = fma(av[a].x, bv.x, t);
                t = fma(av[a].y, bv.y, t);
                t = fma(av[a].z, bv.z, t);
                acc[a * wn + c] = fma(av[a].w, bv.w, t);
            }
        }
    }
}

/* acc[a * w4 + g] += sum over k < kdim of p_t[row ty * WTM + a][k] * v_t[k][wg_col(tx, g) ..
 * + 3], for the vectors that start below n: a block of O += P V. p_t (row length ldp) is zero,
 * and v_t's rows finite, from kdim to a whole vector. */
inline void wg_acc_tile(real4 *acc, int w4, __local const real *p_t, int ldp,
                        __local const real *v_t, int ldv, int kdim, int n, int tx, int ty)
{
    for (int k = 0; k < kdim; k += 4) {
        real4 pv[WTM];
        for (int a = 0; a < WTM; a++)
            pv[a] = LOCAL4(p_t + (ty * WTM + a) * ldp + k);
        for (int g = 0; g < w4 && wg_col(tx, g) < n; g++) {
            __local const real *vk = v_t + k * ldv + wg_col(tx, g);
            const real4 v0 = LOCAL4(vk), v1 = LOCAL4(vk + ldv), v2 = LOCAL4(vk + 2 * ldv),
                        v3 = LOCAL4(vk + 3 * ldv);
            for (int a = 0; a < WTM; a++)
                acc[a * w4 + g] = fma(pv[a].w, v3, fma(pv[a].z, v2,
                                      fma(pv[a].y, v1, fma(pv[a].x, v0, acc[a * w4 + g]))));
        }
    }
}

/* Vector acc (the columns from col) of a row to memory, those below n. */
inline void wg_store4(__global storage_t *dst, long row, int col, int n, real4 acc)
{
    const real t[4] = {acc.x, acc.y, acc.z, acc.w};
    for (int e = 0; e < 4 && col + e < n; e++)
        STORE(dst, row + col + e, t[e]);
}

/* x[a] = the maximum (is_max) or sum of x[a] over the LANES work-items of row ty * WTM + a,
 * the same value in each, summed in a fixed order. Every work-item of the group calls it. */
inline void wg_reduce_rows(real x[WTM], int is_max, __local real *red, int tx, int ty)
{
#ifdef WG_SUBGROUPS
    /* the same for the whole group: a subgroup is one row of LANES work-items, or none is */
    if (get_max_sub_group_size() == LANES && get_num_sub_groups() == get_local_size(1)) {
        for (int a = 0; a < WTM; a++)
            x[a] = is_max ? sub_group_reduce_max(x[a]) : sub_group_reduce_add(x[a]);
        return;
    }
#endif
    for (int a = 0; a < WTM; a++)
        red[(ty * WTM + a) * LANES + tx] = x[a];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int a = 0; a < WTM; a++) {    /* vectors of 4 partials (LANES is a multiple of 4) */
        __local const real *r = red + (ty * WTM + a) * LANES;
        real4 acc = LOCAL4(r);
        for (int t = 4; t < LANES; t += 4)
            acc = is_max ? fmax(acc, LOCAL4(r + t)) : acc + LOCAL4(r + t);
        x[a] = is_max ? fmax(fmax(acc.x, acc.y), fmax(acc.z, acc.w))
                      : (acc.x + acc.y) + (acc.z + acc.w);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#endif
