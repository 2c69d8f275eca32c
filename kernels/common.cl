/* common.cl - definitions shared by the kernels of every family (setup.py concatenates
 * params.h, this file, tiles.cl, wg.cl and the kernel files into one program source).
 *
 * Build-time constants (cl_runtime.c passes them as -D options):
 *   OR_STORAGE   the element type of q, k, v, out and gradients in memory (params.h's codes).
 *                float16 is read with vload_half / written with vstore_half_rte, so devices
 *                without cl_khr_fp16 work; bfloat16 is the top half of a float, read by a
 *                shift and written rounded to nearest even; both are computed in float.
 *   HEAD_D, HEAD_DV   head dims of q/k and v; private rows are sized by them.
 *   VW           lanes of the vector type (realv) the head-dim loops use: on CPUs, where
 *                one work-item is one SIMD thread, 16 (the tiled family, where the device
 *                prefers 16-wide floats: AVX-512) or 8; 4 on GPUs (cl_runtime.c).
 *   OR_FAMILY    the kernel family the program holds (params.h); only its kernels are built.
 *   BQ, BK       the backward's blocks. Rows: rows per work-group (one per work-item) and
 *                rows per local-memory tile. Tiled: query rows per single-work-item group and
 *                keys per block, multiples of the register tile (tiles.cl). Wg: rows of a
 *                work-group's block and of each tile it streams, whole micro-tiles (wg.cl).
 *   FQ, FK       the forward's blocks: the wg family's own (its tiles are about half the
 *                backward's at the same blocks), the tiled family's own (twice the rows
 *                where they fit, cl_runtime.c fit_tiles_fwd), BQ and BK in the rows family.
 *   SQ, SK       the split-KV decode's blocks (flash_decode.cl): the tiled family's own (its
 *                defaults or ORCHARD_CL_BLOCK_Q/K, never a tuned record's, where the backward
 *                takes twice the keys if they fit: cl_runtime.c fit_tiles_bwd), BQ and BK in
 *                the rows and wg families, whose split kernel streams keys with the rows
 *                forward's helpers (row_keys, load_tiles).
 *
 * Operands are addressed like the native path's views, through the meta table of params.h
 * (embedded ahead of this file, with the parameter struct, the mask rule and Philox). The last
 * dimension of every operand is contiguous.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
typedef CAT(REAL_T, VW) realv;         /* VW lanes: the head-dim loops run on these */
#if OR_STORAGE == OR_STORAGE_F16
typedef half storage_t;
#define LOAD(p, i) vload_half((i), (p))
#define LOADV(p, i) load_halves((p) + (i))
/* VW halves from p, lane by lane: vload_half asks for 2-byte alignment only, and so does the
 * standard's vload_halfN, but PoCL 3.1 loaded its 16 bytes with an aligned instruction and
 * faulted on float16 rows 4 bytes off (a backward over row strides of 17 elements) */
inline realv load_halves(__global const half *p)
{
    real t[VW];
    for (int l = 0; l < VW; l++)
        t[l] = vload_half(l, p);
    return CAT(vload, VW)(0, t);
}
#define STORE(p, i, x) vstore_half_rte((x), (i), (p))
#elif OR_STORAGE == OR_STORAGE_BF16
typedef ushort storage_t;
#define LOAD(p, i) as_float((uint)(p)[i] << 16)
#define LOADV(p, i) CAT(as_float, VW)(CAT(convert_uint, VW)(CAT(vload, VW)(0, (p) + (i))) << 16)
#define STORE(p, i, x) ((p)[i] = bfloat16_rne(x))
inline ushort bfloat16_rne(float x)     /* NaN stays NaN */
{
    const uint u = as_uint(x);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (ushort)((u >> 16) | 0x40)
                                           : (ushort)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
#else
typedef REAL_T storage_t;
#define LOAD(p, i) ((p)[i])
#define LOADV(p, i) CAT(vload, VW)(0, (p) + (i))
#define STORE(p, i, x) ((p)[i] = (x))
#endif
#define DP ((HEAD_D + VW - 1) / VW)     /* vectors per q or k row, zero-padded */
#define DVP ((HEAD_DV + VW - 1) / VW)   /* vectors per v row */

/* e^x of a whole vector: in float, expf.h (which setup.py embeds after this file), the native
 * path's exp; the tiled family (CPUs) calls it, where the built-in exp cost 3-5 % of a call */
#if OR_STORAGE == OR_STORAGE_F64
#define or_expv exp
#else
#define OR_EXPF or_expv
#define OR_EXPF_T realv
#define OR_EXPF_U CAT(uint, VW)
#define OR_EXPF_BITS CAT(as_uint, VW)
#define OR_EXPF_FLOAT CAT(as_float, VW)
#endif

#define UNIT(meta, u) ((meta) + OR_META_HEAD + (long)(u) * OR_UNIT_WORDS)  /* a unit's meta words */

/* Where the rows of operand slot s of a unit lie, read by each tile load once, into registers
 * (read from the meta table at every row, PoCL's tiled forward ran 1.6 % slower): row r at
 * element base + r * stride, or, for the keys and values of a paged call (pages >= 0), through
 * the unit's page list in the meta table (params.h): row (first + r) % per_page of page
 * meta[pages + (first + r) / per_page], pages page_stride elements apart. Filled through a
 * pointer and passed by one: a struct passed by value gets LLVM's noalias scopes, which
 * Oclgrind cannot run. The forward's K and V loads read pages; the backward reads none. */
typedef struct {
    __global const long *meta;
    long base, stride, pages, first, per_page, page_stride;
} or_rows;

inline void rows_of(or_rows *at, __global const long *meta, __global const long *unit, int s)
{
    at->meta = meta;
    at->base = unit[s];
    at->stride = meta[s];
    at->pages = (s == OR_K || s == OR_V) ? unit[OR_UNIT_PAGES] : -1;
    if (at->pages >= 0) {
        at->first = unit[OR_UNIT_FIRST];
        at->per_page = meta[OR_META_PAGE_ROWS];
        at->page_stride = meta[s == OR_K ? OR_META_PAGE_K : OR_META_PAGE_V];
    }
}

/* The element offset of row r (rows_of). */
inline long row_at(const or_rows *at, long r)
{
    if (at->pages < 0)
        return at->base + r * at->stride;
    const long t = at->first + r;
    return at->base + at->meta[at->pages + t / at->per_page] * at->page_stride
           + t % at->per_page * at->stride;
}

/* The score of (row i, key j) after softcap, ALiBi and masks (the spec's order); *dcap is
 * d(capped)/d(raw), 0 where masked (a key no row sees may hold NaN, and so its dcap).
 * Masked scores are -INFINITY: build options never assume finite math. */
inline real transform_score(real s, long i, long j, long off, real slope, const or_params *p,
                            real *dcap)
{
    *dcap = 1;
    if (p->softcap > 0) {
        real t = tanh(s / p->softcap);
        s = p->softcap * t;
        *dcap = 1 - t * t;
    }
    long diag = i + off;
    if (p->has_alibi)
        s -= slope * (real)(diag > j ? diag - j : j - diag);
    if (!or_visible(p->left, p->right, diag, j)) {
        s = -INFINITY;
        *dcap = 0;
    }
    return s;
}

/* Elements [x0, x0 + VW) of a row (those >= n are 0), times scale, as one vector. */
inline realv load_vec(__global const storage_t *p, long row, int x0, int n, real scale)
{
    if (x0 + VW <= n)
        return CAT(convert_, CAT(REAL_T, VW))(LOADV(p, row + x0)) * scale;
    real t[VW];
    for (int l = 0; l < VW; l++)
        t[l] = x0 + l < n ? (real)LOAD(p, row + x0 + l) * scale : 0;
    return CAT(vload, VW)(0, t);
}

/* The first n elements of a vector row to memory. */
inline void store_row(__global storage_t *p, long row, const realv *v, int n)
{
    for (int xv = 0; xv * VW < n; xv++) {
        real t[VW];
        CAT(vstore, VW)(v[xv], 0, t);
        for (int l = 0; l < VW && xv * VW + l < n; l++)
            STORE(p, row + xv * VW + l, t[l]);
    }
}

inline real hsum(realv v)
{
#if VW == 16
    CAT(REAL_T, 8) h = v.lo + v.hi;
    CAT(REAL_T, 4) a = h.lo + h.hi;
#elif VW == 8
    CAT(REAL_T, 4) a = v.lo + v.hi;
#else
    CAT(REAL_T, 4) a = v;
#endif
    CAT(REAL_T, 2) b = a.lo + a.hi;
    return b.x + b.y;
}

inline real hmax(realv v)
{
#if VW == 16
    CAT(REAL_T, 8) h = fmax(v.lo, v.hi);
    CAT(REAL_T, 4) a = fmax(h.lo, h.hi);
#elif VW == 8
    CAT(REAL_T, 4) a = fmax(v.lo, v.hi);
#else
    CAT(REAL_T, 4) a = v;
#endif
    CAT(REAL_T, 2) b = fmax(a.lo, a.hi);
    return fmax(b.x, b.y);
}

inline real vdot(const realv *a, __local const realv *b, int n)
{
    realv acc = a[0] * b[0];
    for (int x = 1; x < n; x++)
        acc += a[x] * b[x];
    return hsum(acc);
}

/* Rows [r0, r0 + rows) of two operands of a unit (slots xs and ys, rows_of) into local tiles,
 * loaded by the whole work-group of BQ work-items: x (HEAD_D wide, times x_scale) into a,
 * y (HEAD_DV wide) into b. */
inline void load_tiles(__global const long *meta, __global const long *unit, long r0, int rows,
                       int lid, __local realv (*a)[DP], __global const storage_t *x, int xs,
                       real x_scale, __local realv (*b)[DVP], __global const storage_t *y, int ys)
{
    or_rows xr, yr;
    rows_of(&xr, meta, unit, xs);
    rows_of(&yr, meta, unit, ys);
    for (int e = lid; e < rows * DP; e += BQ)
        a[e / DP][e % DP] = load_vec(x, row_at(&xr, r0 + e / DP), e % DP * VW, HEAD_D, x_scale);
    for (int e = lid; e < rows * DVP; e += BQ)
        b[e / DVP][e % DVP] = load_vec(y, row_at(&yr, r0 + e / DVP), e % DVP * VW, HEAD_DV, 1);
}

/* The backward's first kernel, in every family: D_i = rowsum(dO_i * O_i), one work-item per
 * query row, into di (the unit's rows from its OR_UNIT_ROW0). */
__kernel void flash_bwd_prep(__global const storage_t *dout, __global const storage_t *out,
                             __global const long *meta, __global real *di)
{
    const long u = get_global_id(1), i = get_global_id(0);
    __global const long *unit = UNIT(meta, u);
    if (i >= unit[OR_UNIT_NQ])
        return;
    real acc = 0;
    for (int x = 0; x < HEAD_DV; x++)
        acc += (real)LOAD(dout, unit[OR_DO] + i * meta[OR_DO] + x)
               * (real)LOAD(out, unit[OR_O] + i * meta[OR_O] + x);
    di[unit[OR_UNIT_ROW0] + i] = acc;
}
