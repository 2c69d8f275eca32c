/* wg.cl - the work-group layout, tile loads, micro-tile products and row reductions of the wg
 * family (flash_fwd_wg.cl, flash_bwd_wg.cl), in the manner of FlashAttention-2.
 *
 * A work-group of (LANES, BQ / WTM) work-items computes a BQ x BK block of scores at a time.
 * Work-item (tx, ty) owns a register micro-tile of it: rows ty * WTM .. ty * WTM + WTM - 1
 * and columns tx + LANES * c (c < WN = BK / LANES), and the same rows of the output
 * accumulator at columns tx + LANES * x (x < WD or WDV). Its operands come from local tiles
 * the whole work-group loads (row-major, rows one real longer than they hold, see params.h):
 * lanes of one row read the same row element (a broadcast) and one element of different rows
 * (different banks), so every product is register-tiled: WTM + WN local reads per WTM x WN
 * multiply-adds.
 *
 * Softmax row reductions run over the LANES work-items that share a row: with subgroup
 * operations when the device has them (cl_khr_subgroups or cl_intel_subgroups) and its
 * subgroups are exactly those LANES work-items, else through local memory.
 * -DOR_WG_NO_SUBGROUPS (ORCHARD_CL_OPTIONS) forces the local-memory path.
 */
#if OR_FAMILY == OR_FAMILY_WG
#define LANES OR_WG_LANES
#define WTM OR_WG_TM
#define WG_THREADS OR_WG_THREADS(BQ)
#define WN (BK / LANES)                             /* score columns per work-item */
#define WD ((HEAD_D + LANES - 1) / LANES)           /* dq / dk columns per work-item */
#define WDV ((HEAD_DV + LANES - 1) / LANES)         /* out / dv columns per work-item */
#define LDQ (HEAD_D + 1)                            /* row lengths of the local tiles */
#define LDV (HEAD_DV + 1)
#define LDKV (OR_WG_MAX(HEAD_D, HEAD_DV) + 1)
#define LDP (BK + 1)
#define WG_TILE(name, reals) __local real name[reals];   /* params.h's tile lists */

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
 * [i0, i0 + rows) of unit u (block get_group_id(0) of unit get_group_id(2)), its meta words and
 * those of its kv unit, its ALiBi slope and the keys [lo, hi) its rows may see. */
typedef struct {
    long u, i0, nq, nk, off, lo, hi;
    int rows;
    real slope;
    __global const long *unit, *kvunit;
} wg_block;

/* Fills *b; 0 when the block starts past its unit's rows: the whole work-group then returns,
 * so no barrier is skipped by only some. */
inline int wg_query_block(__global const long *meta, __global const real *slopes,
                          const or_params *p, wg_block *b)
{
    b->u = get_group_id(2);
    b->i0 = (long)get_group_id(0) * BQ;
    b->unit = UNIT(meta, b->u);
    b->kvunit = UNIT(meta, b->u / p->group * p->group);
    b->nq = b->unit[OR_UNIT_NQ];
    b->nk = b->unit[OR_UNIT_NK];
    b->off = b->nk - b->nq;
    if (b->i0 >= b->nq)
        return 0;
    b->rows = (int)min((long)BQ, b->nq - b->i0);
    b->slope = p->has_alibi ? slopes[b->u] : 0;
    or_key_range(p->left, p->right, b->nq, b->nk, b->i0, b->i0 + b->rows, &b->lo, &b->hi);
    return 1;
}

/* Rows [r0, r0 + rows) of an operand (row stride `stride`, from element `base`), n elements
 * each, times mul, into a local tile of row length ld, VW elements per global read; rows
 * [rows, pad_rows) are zero. Every work-item of the group takes part. */
inline void wg_load(__local real *dst, int ld, __global const storage_t *src, long base,
                    long stride, long r0, int rows, int pad_rows, int n, real mul, int lid)
{
    const int nv = (n + VW - 1) / VW;
    for (int e = lid; e < pad_rows * nv; e += WG_THREADS) {
        const int r = e / nv, x0 = e % nv * VW;
        const realv t = r < rows ? load_vec(src, base + (r0 + r) * stride, x0, n, mul) : 0;
        if (x0 + VW <= n) {
            CAT(vstore, VW)(t, 0, dst + r * ld + x0);
        } else {
            real s[VW];
            CAT(vstore, VW)(t, 0, s);
            for (int l = 0; x0 + l < n; l++)
                dst[r * ld + x0 + l] = s[l];
        }
    }
}

/* acc[a][c] = row ty * WTM + a of tile a_t . row tx + LANES * c of tile b_t, over n
 * elements: a block of S = A B^T. */
inline void wg_dot_tile(real acc[WTM][WN], __local const real *a_t, int lda,
                        __local const real *b_t, int ldb, int n, int tx, int ty)
{
    for (int a = 0; a < WTM; a++)
        for (int c = 0; c < WN; c++)
            acc[a][c] = 0;
    for (int x = 0; x < n; x++) {
        real av[WTM], bv[WN];
        for (int a = 0; a < WTM; a++)
            av[a] = a_t[(ty * WTM + a) * lda + x];
        for (int c = 0; c < WN; c++)
            bv[c] = b_t[(tx + LANES * c) * ldb + x];
        for (int a = 0; a < WTM; a++)
            for (int c = 0; c < WN; c++)
                acc[a][c] = fma(av[a], bv[c], acc[a][c]);
    }
}

/* acc[a * w + x] += sum over k < kdim of p_t[row ty * WTM + a][k] * v_t[k][tx + LANES * x],
 * for the columns below n: a block of O += P V. */
inline void wg_acc_tile(real *acc, int w, __local const real *p_t, __local const real *v_t,
                        int ldv, int kdim, int n, int tx, int ty)
{
    for (int k = 0; k < kdim; k++) {
        real pv[WTM];
        for (int a = 0; a < WTM; a++)
            pv[a] = p_t[(ty * WTM + a) * LDP + k];
        for (int x = 0; x < w; x++) {
            if (tx + LANES * x >= n)
                break;
            const real vv = v_t[k * ldv + tx + LANES * x];
            for (int a = 0; a < WTM; a++)
                acc[a * w + x] = fma(pv[a], vv, acc[a * w + x]);
        }
    }
}

/* x[a] = the maximum (is_max) or sum of x[a] over the LANES work-items of row ty * WTM + a,
 * the same value in each, summed in a fixed order. Every work-item of the group calls it. */
inline void wg_reduce_rows(real x[WTM], int is_max, __local real *red, int tx, int ty)
{
#ifdef WG_SUBGROUPS
    /* the same for the whole group: a subgroup is one row of LANES work-items, or none is */
    if (get_max_sub_group_size() == LANES && get_num_sub_groups() == WG_THREADS / LANES) {
        for (int a = 0; a < WTM; a++)
            x[a] = is_max ? sub_group_reduce_max(x[a]) : sub_group_reduce_add(x[a]);
        return;
    }
#endif
    for (int a = 0; a < WTM; a++)
        red[(ty * WTM + a) * LANES + tx] = x[a];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int a = 0; a < WTM; a++) {
        __local const real *r = red + (ty * WTM + a) * LANES;
        real acc = r[0];
        for (int t = 1; t < LANES; t++)
            acc = is_max ? fmax(acc, r[t]) : acc + r[t];
        x[a] = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#endif
