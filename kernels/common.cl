/* common.cl - definitions shared by flash_fwd.cl and flash_bwd.cl (concatenated in that order
 * when the program is built).
 *
 * Build-time constants (cl_runtime.c passes them as -D options):
 *   OR_STORAGE   16, 32 or 64: the element type of q, k, v, out and gradients in memory.
 *                float16 is read with vload_half / written with vstore_half_rte, so devices
 *                without cl_khr_fp16 work; it is computed in float.
 *   HEAD_D, HEAD_DV   head dims of q/k and v; private rows are sized by them.
 *   VW           lanes of the vector type (realv) the head-dim loops use: 8 on CPUs, where
 *                one work-item is one SIMD thread, 4 on GPUs.
 *   BQ, BK       rows per work-group (one row per work-item) and rows per local-memory tile.
 *
 * Operands are addressed like the native path's views: `meta` holds OR_NSLOTS row strides (in
 * elements), then per unit OR_NSLOTS element offsets followed by nq and nk. The last dimension
 * of every operand is contiguous.
 */
#if OR_STORAGE == 64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define REAL_T double
#else
#define REAL_T float
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
typedef REAL_T real;
typedef CAT(REAL_T, VW) realv;         /* VW lanes: the head-dim loops run on these */
#if OR_STORAGE == 16
typedef half storage_t;
#define LOAD(p, i) vload_half((i), (p))
#define LOADV(p, i) CAT(vload_half, VW)(0, (p) + (i))
#define STORE(p, i, x) vstore_half_rte((x), (i), (p))
#else
typedef REAL_T storage_t;
#define LOAD(p, i) ((p)[i])
#define LOADV(p, i) CAT(vload, VW)(0, (p) + (i))
#define STORE(p, i, x) ((p)[i] = (x))
#endif
#define DP ((HEAD_D + VW - 1) / VW)     /* vectors per q or k row, zero-padded */
#define DVP ((HEAD_DV + VW - 1) / VW)   /* vectors per v row */

/* slots of the meta table: the order of orchard.h */
#define S_Q 0
#define S_K 1
#define S_V 2
#define S_O 3
#define S_LSE 4
#define S_DO 5
#define S_DQ 6
#define S_DK 7
#define S_DV 8
#define NSLOTS 9
#define UNIT_WORDS (NSLOTS + 2)
#define UNIT(meta, u) ((meta) + NSLOTS + (long)(u) * UNIT_WORDS)   /* offsets, then nq, nk */

/* Philox4x32-10, exactly as csrc/philox.h: keep-decision of score (bh, row, col). */
inline int dropout_keep(ulong seed, ulong bh, uint row, uint col, uint threshold)
{
    uint c0 = col / 4, c1 = row, c2 = (uint)bh, c3 = (uint)(bh >> 32);
    uint k0 = (uint)seed, k1 = (uint)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        ulong p0 = (ulong)0xD2511F53u * c0, p1 = (ulong)0xCD9E8D57u * c2;
        uint n0 = (uint)(p1 >> 32) ^ c1 ^ k0, n2 = (uint)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0;
        c1 = (uint)p1;
        c2 = n2;
        c3 = (uint)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    /* word col % 4, chosen bit by bit: Oclgrind 21.10 mis-simulates the lookup table that
       LLVM makes of a four-way switch or ternary chain here */
    const uint lo = (col & 1) ? c1 : c0, hi = (col & 1) ? c3 : c2;
    return ((col & 2) ? hi : lo) >= threshold;
}

typedef struct {
    real scale, softcap, drop_scale;
    long left, right;       /* visible j - (i + nk - nq) in [-left, right], -1 = unbounded */
    int has_alibi, dropout, group;
    uint threshold;
    ulong seed;
} params_t;

/* The score of (row i, key j) after softcap, ALiBi and masks (the spec's order); *dcap is
 * d(capped)/d(raw). Masked scores are -INFINITY: build options never assume finite math. */
inline real transform_score(real s, long i, long j, long off, real slope, const params_t *p,
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
    if ((p->left >= 0 && j < diag - p->left) || (p->right >= 0 && j > diag + p->right))
        s = -INFINITY;
    return s;
}

/* Keys [*lo, *hi) that query rows [i0, i1) may see (as key_range in attn_native.c). */
inline void key_range(const params_t *p, long nq, long nk, long i0, long i1, long *lo, long *hi)
{
    long off = nk - nq;
    *lo = 0;
    *hi = nk;
    if (p->left >= 0 && i0 + off - p->left > 0)
        *lo = i0 + off - p->left;
    if (p->right >= 0 && i1 + off + p->right < nk)
        *hi = i1 + off + p->right;
    if (*hi < *lo)
        *hi = *lo;
}

/* Query rows [*lo, *hi) that may see keys [j0, j1): the inverse of key_range. */
inline void query_range(const params_t *p, long nq, long nk, long j0, long j1, long *lo, long *hi)
{
    long off = nk - nq;
    *lo = 0;
    *hi = nq;
    if (p->right >= 0 && j0 - off - p->right > 0)
        *lo = j0 - off - p->right;
    if (p->left >= 0 && j1 - off + p->left < nq)
        *hi = j1 - off + p->left;
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
#if VW == 8
    CAT(REAL_T, 4) a = v.lo + v.hi;
#else
    CAT(REAL_T, 4) a = v;
#endif
    CAT(REAL_T, 2) b = a.lo + a.hi;
    return b.x + b.y;
}

inline real hmax(realv v)
{
#if VW == 8
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

/* Rows [r0, r0 + rows) of two operands into local tiles, loaded by the whole work-group of
 * BQ work-items: x (HEAD_D wide, times x_scale) into a, y (HEAD_DV wide) into b. */
inline void load_tiles(__local realv (*a)[DP], __global const storage_t *x, long x_base,
                       long x_rs, real x_scale, __local realv (*b)[DVP],
                       __global const storage_t *y, long y_base, long y_rs, long r0, int rows,
                       int lid)
{
    for (int e = lid; e < rows * DP; e += BQ)
        a[e / DP][e % DP] = load_vec(x, x_base + (r0 + e / DP) * x_rs, e % DP * VW, HEAD_D, x_scale);
    for (int e = lid; e < rows * DVP; e += BQ)
        b[e / DVP][e % DVP] = load_vec(y, y_base + (r0 + e / DVP) * y_rs, e % DVP * VW, HEAD_DV, 1);
}

#define PARAMS_ARGS                                                                          \
    real scale, real softcap, real drop_scale, long left, long right, int has_alibi,         \
        int dropout, int group, uint threshold, ulong seed
#define PARAMS_INIT                                                                          \
    {scale, softcap, drop_scale, left, right, has_alibi, dropout, group, threshold, seed}
