/* attn_native_impl.h - the native forward and backward kernels, written once over REAL.
 *
 * native_kernels.h includes this file twice, once per instruction set (isa_*.c): REAL = float (float16 and float32 inputs) and
 * REAL = double (float64 inputs). FN(x) names the instance, EXP/LOG/TANH are REAL's functions.
 * In sets with AVX512-BF16 the float instance's forward has a variant for bfloat16 q, k and v
 * (fwd_block's dots) whose tiles attn_bf16_impl.h describes.
 *
 * Tiles (row-major REAL; rows padded to a multiple of MR, columns of a matrix product's
 * right-hand side and result padded to a multiple of W with zeros, so that the micro-kernel
 * never needs a tail):
 *   q    BR x dp     query rows of the block, pre-multiplied by scale     (dp  = d  rounded up to W)
 *   kt   d  x KLD    key block transposed (stored so for every block: load_cols_blocked;
 *                    KLD = BC and a cache line, native.h)
 *   k    BC x dp     key block                                           (backward)
 *   v    BC x dvp    value block, rows ldvc apart (converted: or_rows_ld) or the operand's
 *                    row stride (read in place)                          (dvp = dv rounded up to W)
 *   vt   dv x BC     value block transposed                              (backward)
 *   s    BR x BC     scores, then probabilities; padded columns are -inf, then 0
 *   o    BR x dvp    output accumulator
 */

#define W (2 * VBYTES / (int)sizeof(REAL))    /* two vectors of REALs: the micro-kernel's width */
#define KLD OR_BLOCK_LD(BC, sizeof(REAL))       /* leading dimension of a transposed block */

#include "lane_folds.h"

static inline int FN(pad)(int n) { return (n + W - 1) / W * W; }

typedef REAL FN(vec) __attribute__((vector_size(VBYTES)));
/* The same at any REAL's address: a tile's rows are read and written through it, since GCC
 * lowers a memcpy of a register array's element to 16-byte moves through the stack (the
 * accumulators' loads and stores, 5-8 % of a forward at D 64, AMD EPYC, AVX2 set) */
typedef REAL FN(uvec) __attribute__((vector_size(VBYTES), aligned(sizeof(REAL))));
#define VL (VBYTES / (int)sizeof(REAL))     /* lanes per vector; W = 2 VL */

/* x[c] = column c of the VL x VL tile whose rows are x[0..VL): log2(VL) rounds, each pairing
 * rows 2i and 2i + 1 into their even lanes (new row i) and odd lanes (row i + VL / 2). */
static inline __attribute__((always_inline)) void FN(transpose_tile)(FN(vec) *x)
{
    for (int round = VL; round > 1; round /= 2) {
        FN(vec) t[VL];
        for (int i = 0; i < VL / 2; i++) {
            t[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], FOLD_E1);
            t[i + VL / 2] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], FOLD_O1);
        }
        memcpy(x, t, sizeof(t));
    }
}

/* Rows of a strided operand into a tile of leading dimension ld: converts to REAL, multiplies
 * by mul, zero-fills columns [cols, ld) and rows [rows, pad_rows). */
static inline __attribute__((always_inline)) void
FN(load_rows)(REAL *restrict dst, int ld, const char *restrict src, or_ssize stride, or_ssize rows,
              int cols, or_ssize pad_rows, or_dtype dt, REAL mul)
{
    for (or_ssize r = 0; r < rows; r++, src += stride) {
        REAL *restrict out = dst + r * ld;     /* restrict: so that conversions vectorise */
        switch (dt) {
#define OR_LOAD(id, tag, ...) \
        case id: for (int c = 0; c < cols; c++) out[c] = (REAL)or_load_##tag(src, c) * mul; break;
        OR_DTYPES(OR_LOAD)
#undef OR_LOAD
        }
        for (int c = cols; c < ld; c++)
            out[c] = 0;
    }
    if (pad_rows > rows)
        memset(dst + rows * ld, 0, sizeof(REAL) * (size_t)(pad_rows - rows) * (size_t)ld);
}

/* The same rows (at most BC) transposed: dst[c * ld + r] = row r, column c; columns
 * [rows, BC) zeroed ([BC, ld) is never read: native.h OR_BLOCK_LD). Strided stores are slow,
 * so each key is transposed once per call (forward) or per work item (backward), never per
 * block pair, and a VL x VL tile at a time in registers (transpose_tile): an element per store
 * was 7 % of a forward and of a backward at D 32, N 256. */
static inline __attribute__((always_inline)) void
FN(load_cols)(REAL *dst, or_ssize ld, const char *src, or_ssize stride, or_ssize rows,
                          int cols, or_dtype dt)
{
    for (int c = 0; rows < BC && c < cols; c++)
        memset(dst + c * ld + rows, 0, sizeof(REAL) * (size_t)(BC - rows));
    const or_ssize rows_vl = rows / VL * VL;
    const int cols_vl = cols / VL * VL;
    switch (dt) {
#define OR_LOAD(id, tag, ...) \
    case id: \
        for (or_ssize r0 = 0; r0 < rows_vl; r0 += VL) \
            for (int c0 = 0; c0 < cols_vl; c0 += VL) { \
                FN(vec) x[VL]; \
                for (int i = 0; i < VL; i++) { \
                    const char *row = src + (r0 + i) * stride; \
                    REAL in[VL]; \
                    for (int t = 0; t < VL; t++) \
                        in[t] = (REAL)or_load_##tag(row, c0 + t); \
                    memcpy(&x[i], in, sizeof(x[i])); \
                } \
                FN(transpose_tile)(x); \
                for (int c = 0; c < VL; c++) \
                    memcpy(dst + (c0 + c) * ld + r0, &x[c], sizeof(x[c])); \
            } \
        break;
    OR_DTYPES(OR_LOAD)
#undef OR_LOAD
    }
    /* the edges, an element each: columns past the last whole tile, then rows past it */
    for (or_ssize r = cols_vl < cols ? 0 : rows_vl; r < rows; r++) {
        const int c_from = r < rows_vl ? cols_vl : 0;
        const char *row = src + r * stride;
        switch (dt) {
#define OR_LOAD(id, tag, ...) \
        case id: for (int c = c_from; c < cols; c++) dst[c * ld + r] = (REAL)or_load_##tag(row, c); \
                 break;
        OR_DTYPES(OR_LOAD)
#undef OR_LOAD
        }
    }
}

/* Rows [0, rows) as blocks of BC rows, each transposed (cols x KLD, zero-padded past the last
 * row), block b at dst + b * KLD * cols. A matrix product then reads a block's cols rows from
 * KLD * cols contiguous REALs instead of one page each (about 4 % of the forward, measured). */
static inline __attribute__((always_inline)) void
FN(load_cols_blocked)(REAL *dst, const char *src, or_ssize stride, or_ssize rows,
                                  int cols, or_dtype dt)
{
    for (or_ssize j0 = 0; j0 < rows; j0 += BC)
        FN(load_cols)(dst + j0 / BC * KLD * cols, KLD, src + j0 * stride, stride,
                      rows - j0 < BC ? rows - j0 : BC, cols, dt);
}

/* Rows of a tile (leading dimension ld) into a strided operand, converted to its dtype. float
 * to float16 goes 8 at a time through F16C's VCVTPS2PH where the set has it: GCC leaves the
 * element loop (and a vector conversion) one element per instruction, 10 % of a float16
 * forward at N 256, D 64 (amx). */
static inline __attribute__((always_inline)) void
FN(store_rows)(char *dst, or_ssize stride, const REAL *src, int ld, or_ssize rows, int cols,
               or_dtype dt)
{
    for (or_ssize r = 0; r < rows; r++, dst += stride) {
        const REAL *in = src + r * ld;
        int c0 = 0;
#if REAL_SIZE == 4 && defined(__F16C__)
        for (; dt == OR_F16 && c0 + 8 <= cols; c0 += 8)     /* to nearest even, as the cast */
            _mm_storeu_si128((__m128i *)(dst + sizeof(or_half) * (size_t)c0),
                             _mm256_cvtps_ph(_mm256_loadu_ps(in + c0), _MM_FROUND_TO_NEAREST_INT));
#endif
        switch (dt) {
#define OR_STORE(id, tag, ...) \
        case id: for (int c = c0; c < cols; c++) or_store_##tag(dst, c, in[c]); break;
        OR_DTYPES(OR_STORE)
#undef OR_STORE
        }
    }
}

/* Address of row `row` of unit `unit` in operand `slot`. */
static inline char *FN(row_ptr)(const or_problem *p, int slot, or_ssize unit, or_ssize row)
{
    const or_view *w = &p->view[slot];
    return w->base + w->offs[unit] + row * w->row_stride;
}

/* Asks for the MR x W tile of C (m x n, ldc) that a matrix product going row by row of tiles,
 * or by_columns, takes after tile (i0, j0), if any. */
static inline __attribute__((always_inline)) void
FN(ask_next_tile)(const REAL *c, int ldc, int i0, int j0, int m, int n, const int by_columns)
{
    int in = j0 + W < n ? i0 : i0 + MR, jn = j0 + W < n ? j0 + W : 0;
    if (by_columns) {
        in = i0 + MR < m ? i0 + MR : 0;
        jn = i0 + MR < m ? j0 : j0 + W;
    }
    for (int i = 0; in < m && jn < n && i < MR; i++) {
        __builtin_prefetch(c + (or_ssize)(in + i) * ldc + jn, 1, 3);
        __builtin_prefetch(c + (or_ssize)(in + i) * ldc + jn + W / 2, 1, 3);
    }
}

/* Sets compiled with AVX512-BF16 (isa_avx512bf16.c) give their float instance a second forward,
 * for bfloat16 q, k and v, whose matrix products run on bfloat16 dot products. */
#if defined(OR_BF16_DOTS) && REAL_SIZE == 4
#define DOTS 1
#include "attn_bf16_impl.h"
#define EXP_COARSE or_expf_coarse     /* kernels/expf.h: P rounded to bfloat16 next */
#else
#define DOTS 0
#define EXP_COARSE EXP
#endif
/* The AMX set's backward keeps dK and dV transposed, so that all five products have a
 * row-major left operand (attn_amx_impl.h). */
#if DOTS && defined(OR_AMX_TILES)
#define TILES 1
#else
#define TILES 0
#endif

/* C (m x n, ldc) = A (m x k) B (k x n, ldb) where accumulate is 0, C += A B where it is 1, and
 * where it is 2 (a C not in L1) C += A B asking for each next tile of C meanwhile. A's element
 * (i, x) is a[i * ars + x * acs], so A may be read transposed (P^T, dS^T) at no cost. m is a
 * multiple of MR and n of W.
 * An MR x W block of C stays in registers (GCC vector extensions: MR x 2 vectors of VBYTES)
 * while k streams through. The order of the sums depends only on the shapes, never on threads.
 * The requests are for the backward's dQ, dK and dV: dK and dV (whole-unit accumulators,
 * megabytes at N 4,096) missed in L2 at every tile's first load, 9 % of its time (with the
 * requests, AMD EPYC: backward at D 128 0.93x the time, D 64 0.98x). The forward's output
 * strip stays in L1: the requests were 1 % of its samples there.
 * Tiles go row by row of tiles, or by_columns: then a column panel of B (k x W) is read from L1
 * by every row of tiles after the first. The forward's B, a key block transposed or a block of
 * values, outgrows L1 at d 128 (48 KB or more): by columns, the forward took 0.97-0.99x the
 * time there, causal 0.95-0.97x (AMD EPYC, avx2, three runs). The backward's dQ += dS K, dK
 * += dS^T q and dV += P^T dO go by columns too, their B's rows a cache line apart more than
 * 512-byte multiples (bwd_ld; B1 H8 N2048 D128 backward 0.991-0.992x the time, two runs of 16
 * and 24 pairs, D 64 1.00x), S and dP by rows (by columns: 1.00x). */

static inline __attribute__((always_inline)) void
FN(gemm)(REAL *c, int ldc, const REAL *a, int ars, int acs, const REAL *b, or_ssize ldb, int m,
         int n, int k, int accumulate, const int by_columns)
{
    const int outer = by_columns ? n : m, outer_step = by_columns ? W : MR;
    const int inner = by_columns ? m : n, inner_step = by_columns ? MR : W;
    for (int u = 0; u < outer; u += outer_step)
    for (int v = 0; v < inner; v += inner_step) {
        const int i0 = by_columns ? v : u, j0 = by_columns ? u : v;
        FN(vec) acc[MR][2];
        for (int i = 0; i < MR; i++)
            for (int h = 0; h < 2; h++)
                acc[i][h] = accumulate ? *(const FN(uvec) *)(c + (or_ssize)(i0 + i) * ldc + j0 + h * VL)
                                       : (FN(vec)){0};
        if (accumulate == 2)
            FN(ask_next_tile)(c, ldc, i0, j0, m, n, by_columns);
        _Pragma(OR_STR(GCC unroll KU))
        for (int x = 0; x < k; x++) {
            const REAL *brow = b + (or_ssize)x * ldb + j0;
            FN(vec) b0, b1;
            memcpy(&b0, brow, sizeof(b0));
            memcpy(&b1, brow + VL, sizeof(b1));
            for (int i = 0; i < MR; i++) {
                const REAL av = a[(or_ssize)(i0 + i) * ars + (or_ssize)x * acs];
                acc[i][0] += av * b0;
                acc[i][1] += av * b1;
            }
        }
        for (int i = 0; i < MR; i++)
            for (int h = 0; h < 2; h++)
                *(FN(uvec) *)(c + (or_ssize)(i0 + i) * ldc + j0 + h * VL) = acc[i][h];
    }
}

/* *m = lane-wise *v > *m ? *v : *m, which is what MAXPS computes (a NaN in *v keeps *m). */
static inline __attribute__((always_inline)) void FN(vmax)(FN(vec) *m, const FN(vec) *v)
{
    const __typeof__(*v > *m) gt = *v > *m;
    *m = (FN(vec))(((__typeof__(gt))*v & gt) | ((__typeof__(gt))*m & ~gt));
}

/* Lane t of the result: the largest of the row's elements t, t + VL, t + 2 VL, ... (n, a
 * multiple of W), two vectors at a time. */
static inline __attribute__((always_inline)) FN(vec) FN(row_max_lanes)(const REAL *x, int n)
{
    FN(vec) m0, m1, v0, v1;
    memcpy(&m0, x, sizeof(m0));
    memcpy(&m1, x + VL, sizeof(m1));
    for (int c0 = W; c0 < n; c0 += W) {
        memcpy(&v0, x + c0, sizeof(v0));
        memcpy(&v1, x + c0 + VL, sizeof(v1));
        FN(vmax)(&m0, &v0);
        FN(vmax)(&m1, &v1);
    }
    FN(vmax)(&m0, &m1);
    return m0;
}

/* x[c] = exp(mul x[c] - shift) over the first n elements of a row (n a multiple of W), in W
 * independent lanes so that the loop vectorises; lane t of the result is the sum of lanes t
 * and t + VL. mul x - shift is one FMA: with mul 1 exactly x - shift. to_bf16 (the bfloat16
 * forward's P, where no dropout follows): the exp is EXP_COARSE and the row's results are
 * written as pairs of bfloat16 in place, words c / 2 from x (attn_bf16_impl.h), not as REALs:
 * a pass less over the scores (the separate conversion was 5 % of that forward). The sums are
 * the REALs'. Float rows in sets with AVX2 or AVX-512 go through the set's OR_EXPV instead
 * (native_kernels.h). */
static inline __attribute__((always_inline)) FN(vec)
FN(exp_row_lanes)(REAL *x, REAL mul, REAL shift, int n, const int to_bf16)
{
#if REAL_SIZE == 4 && defined(OR_EXPV)
    if (!to_bf16) {     /* whole vectors through the set's exp (native_kernels.h OR_EXPV) */
        FN(vec) lo = {0}, hi = {0}, e0, e1;
        for (int c0 = 0; c0 < n; c0 += W) {
            memcpy(&e0, x + c0, sizeof(e0));
            memcpy(&e1, x + c0 + VL, sizeof(e1));
            e0 = OR_EXPV(e0 * mul - shift);
            e1 = OR_EXPV(e1 * mul - shift);
            lo += e0;
            hi += e1;
            memcpy(x + c0, &e0, sizeof(e0));
            memcpy(x + c0 + VL, &e1, sizeof(e1));
        }
        return lo + hi;
    }
#endif
    REAL lane[W] = {0};
    for (int c0 = 0; c0 < n; c0 += W) {
        REAL e[W];
        for (int t = 0; t < W; t++) {
            const REAL y = x[c0 + t] * mul - shift;
            e[t] = to_bf16 ? EXP_COARSE(y) : EXP(y);
            lane[t] += e[t];
        }
#if DOTS
        if (to_bf16) {
            bf16_store_pairs((uint32_t *)x + c0 / 2, e);
            continue;
        }
#endif
        memcpy(x + c0, e, sizeof(e));
    }
    /* two whole vectors: a scalar loop over the lanes became a load across the two halves'
     * stores, which stalled on store forwarding (3 % of a float forward, AMX set) */
    FN(vec) lo, hi;
    memcpy(&lo, lane, sizeof(lo));
    memcpy(&hi, lane + VL, sizeof(hi));
    return lo + hi;
}

/* One fold of x and y over blocks of b lanes (lane_folds.h): their sums, or maxima where max. */
#define FOLD_BLOCKS(b) \
    static inline __attribute__((always_inline)) FN(vec) FN(fold##b)(FN(vec) x, FN(vec) y, \
                                                                      const int max) \
    { \
        FN(vec) e = __builtin_shufflevector(x, y, FOLD_E##b); \
        const FN(vec) o = __builtin_shufflevector(x, y, FOLD_O##b); \
        if (max) \
            FN(vmax)(&e, &o); \
        else \
            e += o; \
        return e; \
    }
#if FOLD_LANES == 16
FOLD_BLOCKS(8)
#endif
#if FOLD_LANES >= 8
FOLD_BLOCKS(4)
#endif
#if FOLD_LANES >= 4
FOLD_BLOCKS(2)
#endif
FOLD_BLOCKS(1)
#undef FOLD_BLOCKS

/* Folds the m vectors of x (a power of two) level by level, blocks of VL / 2 lanes first, then
 * VL / 4, ..., 1: pairs of vectors while there are two or more, then the last one with itself.
 * Returns the number of vectors left, each holding VL / (m left) totals (sums, or maxima where
 * max) in order: lane r of x[0] is the total of the lanes of x[r] when m = VL. Each total is a
 * tree whose first level combines lanes t and t + VL / 2, the next t and t + VL / 4, ... */
static inline __attribute__((always_inline)) int FN(fold_vectors)(FN(vec) *x, int m, const int max)
{
#define FOLD_LEVEL(b) \
    if (m == 1) { \
        x[0] = FN(fold##b)(x[0], x[0], max); \
    } else { \
        for (int i = 0; i < m / 2; i++) \
            x[i] = FN(fold##b)(x[2 * i], x[2 * i + 1], max); \
        m /= 2; \
    }
#if FOLD_LANES == 16
    FOLD_LEVEL(8)
#endif
#if FOLD_LANES >= 8
    FOLD_LEVEL(4)
#endif
#if FOLD_LANES >= 4
    FOLD_LEVEL(2)
#endif
    FOLD_LEVEL(1)
#undef FOLD_LEVEL
    return m;
}

/* The total of the lanes of v, in fold_vectors' order. */
static inline __attribute__((always_inline)) REAL FN(lanes_total)(FN(vec) v, const int max)
{
    FN(fold_vectors)(&v, 1, max);
    return v[0];
}

/* The largest of the first n elements of a row (n a multiple of W). */
static inline __attribute__((always_inline)) REAL FN(row_max)(const REAL *x, int n)
{
    return FN(lanes_total)(FN(row_max_lanes)(x, n), 1);
}

/* exp_row_lanes, and the sum of the row's results. */
static inline __attribute__((always_inline)) REAL FN(exp_row)(REAL *x, REAL shift, int n)
{
    return FN(lanes_total)(FN(exp_row_lanes)(x, 1, shift, n, 0), 0);
}

/* The online softmax step of rows [0, live) of s (rows BC apart, n columns computed, a multiple
 * of W) against their running maxima m and sums l and their output rows o (dvp apart): new
 * maxima, s to exp(s - max), l and o rescaled by exp(old max - new max). The scores are s
 * times mul (> 0: the maxima of s are theirs, times mul). VL rows at a time, so
 * that their maxima and sums are folded together (fold_vectors) and their factors are one vector
 * of exps: reduced one row at a time, with a scalar exp each, they took a sixth of the float
 * forward. A row that has seen only masked scores keeps the maximum -inf and weights 0.
 * to_bf16: exp_row_lanes'. */
static inline __attribute__((always_inline)) void
FN(softmax_rows)(REAL *s, int live, int n, REAL *m, REAL *l, REAL *o, int dvp, REAL mul,
                 const int to_bf16)
{
    for (int g = 0; g < live; g += VL) {
        const int rows = live - g < VL ? live - g : VL;
        FN(vec) x[VL];
        REAL mx[VL], mold[VL], shift[VL], alpha[VL], sum[VL];
        for (int r = 0; r < VL; r++) {
            x[r] = r < rows ? FN(row_max_lanes)(s + (or_ssize)(g + r) * BC, n)
                            : (FN(vec)){0} - INFINITY;
            mold[r] = r < rows ? m[g + r] : -INFINITY;
        }
        FN(fold_vectors)(x, VL, 1);
        memcpy(mx, &x[0], sizeof(mx));
        for (int t = 0; t < VL; t++) {
            mx[t] *= mul;
            mx[t] = mx[t] > mold[t] ? mx[t] : mold[t];      /* the new maximum */
            shift[t] = mx[t] == -INFINITY ? 0 : mx[t];      /* -inf - -inf would be NaN */
            alpha[t] = EXP(mold[t] - shift[t]);
        }
        for (int r = 0; r < VL; r++)
            x[r] = r < rows ? FN(exp_row_lanes)(s + (or_ssize)(g + r) * BC, mul, shift[r], n,
                                                to_bf16)
                            : (FN(vec)){0};
        FN(fold_vectors)(x, VL, 0);
        memcpy(sum, &x[0], sizeof(sum));
        for (int r = 0; r < rows; r++) {
            m[g + r] = mx[r];
            l[g + r] = l[g + r] * alpha[r] + sum[r];
            REAL *orow = o + (or_ssize)(g + r) * dvp;
            if (alpha[r] != 1)
                for (int c = 0; c < dvp; c++)
                    orow[c] *= alpha[r];
        }
    }
}
#undef VL

/* Transforms the raw products q.k (s, BR x BC) of rows i0.. and keys j0.. of a unit of nq
 * queries and nk keys, in the spec's order: softcap, ALiBi, masks (columns >= cols are
 * padding and masked too).
 * dcap, when given, receives d(capped)/d(raw) = 1 - tanh^2. */
static inline __attribute__((always_inline)) void
FN(transform_scores)(const or_problem *p, int rows, int cols, or_ssize i0, or_ssize j0,
                     or_ssize nq, or_ssize nk, REAL slope, REAL *s, REAL *dcap)
{
    const or_ssize off = nk - nq;
    for (int r = 0; r < rows; r++) {
        REAL *srow = s + (or_ssize)r * BC;
        if (p->prm.softcap > 0) {
            const REAL cap = (REAL)p->prm.softcap, inv = 1 / cap;
            for (int c = 0; c < cols; c++) {
                REAL t = TANH(srow[c] * inv);
                srow[c] = cap * t;
                if (dcap)
                    dcap[(or_ssize)r * BC + c] = 1 - t * t;
            }
        }
        const or_ssize diag = i0 + r + off;     /* the key column aligned with this row */
        if (p->slopes) {
            for (int c = 0; c < cols; c++) {
                or_ssize dist = diag - (j0 + c);
                srow[c] -= slope * (REAL)(dist < 0 ? -dist : dist);
            }
        }
        or_ssize lo, hi;                        /* the keys this row sees */
        or_key_range(p->prm.left, p->prm.right, nq, nk, i0 + r, i0 + r + 1, &lo, &hi);
        for (or_ssize c = 0; c < lo - j0 && c < BC; c++)
            srow[c] = -INFINITY;
        const or_ssize end = hi - j0 < cols ? hi - j0 : cols;
        for (or_ssize c = end < 0 ? 0 : end; c < BC; c++)
            srow[c] = -INFINITY;
    }
}

/* Forward of BR query rows starting at i0 of unit u; its matrix products on bfloat16 dot
 * products where dots (attn_bf16_impl.h: q, kt, vc and P are pairs of bfloat16 then), dots 2
 * on float16 split into two bfloat16 (attn_f16_split_impl.h). */
static inline __attribute__((always_inline)) void
FN(fwd_block)(const or_problem *p, const or_job *job, or_ssize u, or_ssize i0, int worker,
              const int dots)
{
    const int d = p->d, dv = p->dv, dp = FN(pad)(d), dvp = FN(pad)(dv);
    const or_ssize nq = p->nq[u], nk = p->nk[u], off = nk - nq, kvu = u / p->prm.group;
    const int rows = (int)(nq - i0 < BR ? nq - i0 : BR), rows_mr = (rows + MR - 1) / MR * MR;
    const REAL slope = p->slopes ? (REAL)p->slopes[u] : 0;
    const REAL drop_scale = (REAL)p->prm.drop_scale;
    /* With dots the products are unscaled; where the scores' transform only masks (softcap
     * and ALiBi need them scaled) the softmax's exp takes the scale, not a pass over them */
    const REAL folded = dots && p->prm.softcap == 0 && p->slopes == NULL && p->prm.scale > 0
                        ? (REAL)p->prm.scale : 1;
    /* bfloat16 P straight from the softmax (exp_row_lanes), where dropout does not scale it
     * first; the live rows' only: a strip's padded rows (past the block's queries, q zero)
     * keep their scores, zeros, whose bits are bfloat16 zeros too */
    const int p_bf16 = dots == 1 && !p->prm.dropout;

    REAL *q = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    REAL *s = q + BR * dp, *o = s + BR * BC, *m = o + BR * dvp, *l = m + BR;
    const REAL *kt = or_unit_kt(job, kvu, worker);       /* blocked, d x KLD each */
    const REAL *vc = job->v_in_place ? NULL : or_unit_vc(job, kvu, worker);
    unsigned char *keep = (unsigned char *)(l + BR);

    const or_view *w = p->view;
#if TILES
    if (dots == 2)
        f16_split_load_q((uint32_t *)q, dp, FN(row_ptr)(p, OR_Q, u, i0), w[OR_Q].row_stride,
                         rows, rows_mr, d);
    else
#endif
#if DOTS
    if (dots)
        bf16_load_q((uint32_t *)q, dp, FN(row_ptr)(p, OR_Q, u, i0), w[OR_Q].row_stride, rows,
                    rows_mr, d);
    else
#endif
    FN(load_rows)(q, dp, FN(row_ptr)(p, OR_Q, u, i0), w[OR_Q].row_stride, rows, d, rows_mr,
                  w[OR_Q].dtype, (REAL)p->prm.scale);
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
    }
    memset(o, 0, sizeof(REAL) * (size_t)rows_mr * dvp);

    or_ssize lo, hi;
    or_key_range(p->prm.left, p->prm.right, nq, nk, i0, i0 + rows, &lo, &hi);
    for (or_ssize j0 = lo - lo % BC; j0 < hi; j0 += BC) {
        const int cols = (int)(hi - j0 < BC ? hi - j0 : BC), skip = (int)(j0 < lo ? lo - j0 : 0);
        /* values in place, or converted (transpose_keys_item); rows before lo (the block
         * starts on a multiple of BC) are never read */
        const REAL *vb = vc ? vc + (dots ? j0 / 2 : j0) * job->ldvc     /* dots: pairs of rows */
                            : (const REAL *)FN(row_ptr)(p, OR_V, kvu, j0);
        const or_ssize ldv = vc ? job->ldvc : w[OR_V].row_stride / (or_ssize)sizeof(REAL);
        /* SR rows at a time, each over the key columns some row of the strip may see: on the
         * diagonal of a causal mask that is about half the block */
        for (int r0 = 0; r0 < rows_mr; r0 += SR) {
            const int sr = rows_mr - r0 < SR ? rows_mr - r0 : SR, live = rows - r0 < sr ? rows - r0 : sr;
            /* columns computed: whole W-wide tiles over the block's keys. A unit's last block
             * had all BC computed and masked: N 100 forward and backward took 0.80x the time
             * without that, N 256 0.93-0.95x, N 1024 0.95x (AMD EPYC, avx2, 2 threads) */
            int ncols = FN(pad)(cols);
            if (p->prm.right >= 0) {
                const or_ssize end = i0 + r0 + live + off + p->prm.right - j0;   /* past the last */
                if (end <= 0)
                    continue;   /* no row of the strip sees this block */
                ncols = end < cols ? FN(pad)((int)end) : ncols;
            }
            const int kcols = ncols < cols ? ncols : cols;      /* keys read and transformed */
#if TILES
            if (dots == 2)
                f16_split_scores(s, (const uint32_t *)q + (or_ssize)r0 * dp, dp,
                                 (const uint32_t *)kt + j0 / BC * KLD * 2 * ((d + 1) / 2),
                                 (d + 1) / 2, sr, ncols, (REAL)p->prm.scale / folded);
            else
#endif
#if DOTS
            if (dots)
                bf16_rows_gemm(s, BC, (const uint32_t *)q + (or_ssize)r0 * dp, dp,
                               (const uint32_t *)kt + j0 / BC * KLD * ((d + 1) / 2), KLD, sr,
                               ncols, (d + 1) / 2, (REAL)p->prm.scale / folded, 0);
            else
#endif
            FN(gemm)(s, BC, q + (or_ssize)r0 * dp, dp, 1, kt + j0 / BC * KLD * d, KLD, sr, ncols,
                     d, 0, 1);
            FN(transform_scores)(p, live, kcols, i0 + r0, j0, nq, nk, slope, s, NULL);
            if (p_bf16)     /* a constant in each call: two loops, not both exps and a blend */
                FN(softmax_rows)(s, live, ncols, m + r0, l + r0, o + (or_ssize)r0 * dvp, dvp,
                                 folded, 1);
            else
                FN(softmax_rows)(s, live, ncols, m + r0, l + r0, o + (or_ssize)r0 * dvp, dvp,
                                 folded, 0);
            for (int r = 0; p->prm.dropout && r < live; r++) {
                REAL *srow = s + (or_ssize)r * BC;
                or_dropout_row(p->prm.seed, (uint64_t)u, (uint32_t)(i0 + r0 + r), (uint32_t)j0,
                               kcols, p->prm.threshold, keep);
                for (int c = 0; c < kcols; c++)
                    srow[c] = keep[c] ? srow[c] * drop_scale : 0;
            }
#if TILES
            if (dots == 2)
                f16_split_values_product(o + (or_ssize)r0 * dvp, dvp, s, sr, ncols, skip, kcols,
                                         (const uint32_t *)vb);
            else
#endif
#if DOTS
            if (dots)
                bf16_values_product(o + (or_ssize)r0 * dvp, dvp, s, sr, ncols, skip, kcols,
                                    (const uint32_t *)vb, p_bf16);
            else
#endif
            if (kcols > skip)       /* P is 0 before lo: those value rows are not read */
                FN(gemm)(o + (or_ssize)r0 * dvp, dvp, s + skip, BC, 1, vb + (or_ssize)skip * ldv,
                         ldv, sr, dvp, kcols - skip, 1, 1);
        }
    }

    for (int r = 0; r < rows; r++) {
        /* l is 0 only for a row that saw no key: its out is 0, even where its masked 0s met a
         * NaN value that another row of the block sees (0 * NaN); a NaN in l carries on */
        const REAL inv = 1 / l[r];
        REAL *orow = o + (or_ssize)r * dvp;
        if (l[r] == 0)
            memset(orow, 0, sizeof(REAL) * (size_t)dv);
        else
            for (int x = 0; x < dv; x++)
                orow[x] *= inv;
        m[r] = l[r] != 0 ? m[r] + LOG(l[r]) : -INFINITY;    /* m now holds lse */
    }
    FN(store_rows)(FN(row_ptr)(p, OR_O, u, i0), w[OR_O].row_stride, o, dvp, rows, dv, w[OR_O].dtype);
    FN(store_rows)(FN(row_ptr)(p, OR_LSE, u, i0), w[OR_LSE].row_stride, m, 1, rows, 1,
                   w[OR_LSE].dtype);
}

/* transpose_keys_item of paged keys and values (orchard.h): the same tiles, filled a run of
 * rows (to the end of its page) at a time. */
static inline __attribute__((always_inline)) void
FN(paged_keys_item)(const or_job *job, or_ssize kvu, or_ssize nk, int worker)
{
    const or_problem *p = job->p;
    const int d = p->d;
    const or_view *k = &p->view[OR_K], *v = &p->view[OR_V];
    REAL *kt = or_unit_kt(job, kvu, worker), *vc = or_unit_vc(job, kvu, worker);
    memset(kt, 0, sizeof(REAL) * (size_t)((nk + BC - 1) / BC * KLD) * (size_t)d);
    or_ssize run;
    for (or_ssize j = 0; j < nk; j += run) {
        const char *src = or_kv_row(p, OR_K, kvu, j, &run);
        run = run < nk - j ? run : nk - j;
        for (or_ssize r = j; r < j + run; r++, src += k->row_stride) {
            REAL *dst = kt + r / BC * KLD * d + r % BC;    /* column c at dst[c * KLD] */
            switch (k->dtype) {
#define OR_LOAD(id, tag, ...) \
            case id: for (int c = 0; c < d; c++) dst[c * KLD] = (REAL)or_load_##tag(src, c); break;
            OR_DTYPES(OR_LOAD)
#undef OR_LOAD
            }
        }
    }
    for (or_ssize j = 0; j < nk; j += run) {   /* paged values are never read in place */
        const char *src = or_kv_row(p, OR_V, kvu, j, &run);
        run = run < nk - j ? run : nk - j;
        FN(load_rows)(vc + j * job->ldvc, (int)job->ldvc, src,
                      v->row_stride, run, p->dv, run, v->dtype, 1);
    }
}

/* A kv unit's keys transposed, in blocks (load_cols_blocked), and its values converted when
 * they are not read in place (or_unit_kt, or_unit_vc): the forward's pre-pass item, or the
 * start of its item of a whole unit (attn_native.c fwd_unit_item). Cloned (and the loads
 * inlined) as the kernels are, so that float16 converts with the CPU's F16C instructions
 * rather than a library call per element (that call was 20 % of a float16 forward). */
static void FN(transpose_keys_item)(void *vjob, or_ssize kvu, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize nk = p->nk[kvu * p->prm.group];
    if (p->pages.rows) {
        FN(paged_keys_item)(job, kvu, nk, worker);
        return;
    }
    FN(load_cols_blocked)(or_unit_kt(job, kvu, worker), FN(row_ptr)(p, OR_K, kvu, 0),
                          p->view[OR_K].row_stride, nk, p->d, p->view[OR_K].dtype);
    if (!job->v_in_place)
        FN(load_rows)(or_unit_vc(job, kvu, worker), (int)job->ldvc,
                      FN(row_ptr)(p, OR_V, kvu, 0), p->view[OR_V].row_stride, nk, p->dv, nk,
                      p->view[OR_V].dtype, 1);
}

/* One work item: a block of BR query rows of one unit (items in job->order, or in index order
 * where a unit's item runs them); with dots, between the tiles' configuration and their
 * release (no-ops without AMX). */
static inline __attribute__((always_inline)) void
FN(fwd_item_as)(void *vjob, or_ssize item, int worker, const int dots)
{
    const or_job *job = vjob;
    item = job->order ? job->order[item] : item;
    const or_ssize u = item / job->blocks, i0 = (item % job->blocks) * BR;
    if (i0 >= job->p->nq[u])
        return;
#if DOTS
    if (dots)
        bf16_tiles_begin();
#endif
    FN(fwd_block)(job->p, job, u, i0, worker, dots);
#if DOTS
    if (dots)
        bf16_tiles_end();
#endif
}

static void FN(fwd_item)(void *vjob, or_ssize item, int worker)
{
    FN(fwd_item_as)(vjob, item, worker, 0);
}

#if DOTS
static void bf16_fwd_item(void *vjob, or_ssize item, int worker)
{
    FN(fwd_item_as)(vjob, item, worker, 1);
}
#endif
#if TILES
static void f16_split_fwd_item(void *vjob, or_ssize item, int worker)
{
    FN(fwd_item_as)(vjob, item, worker, 2);
}
#endif

/* Keys per chunk of the backward (a multiple of BC): an item's keys (a unit's, or a part's) go
 * in chunks, each through all of the unit's query blocks, so that what a query block reads of
 * the chunk (dK and dV accumulators, keys and values packed: about 3 dp + 2 dvp REALs a key)
 * is still in cache from the block before, not streamed in again for each (native.h
 * OR_BWD_CHUNK_BYTES). One chunk where the item's keys fit, and on dot products (dots): their
 * products run 3-4x faster, and packing each query block's q and dO for every chunk cost more
 * than the cache saved (AMX, N 4096 D 256: 1.16x the time). */
static or_ssize FN(bwd_chunk)(const or_job *job, const int dots)
{
    const or_problem *p = job->p;
    if (dots)
        return job->part_keys > BC ? job->part_keys : BC;
    const size_t per_key = sizeof(REAL) * (size_t)(3 * FN(pad)(p->d) + 2 * FN(pad)(p->dv));
    const or_ssize keys = (or_ssize)(OR_BWD_CHUNK_BYTES / per_key) / BC * BC;
    return keys < BC ? BC : keys;
}

/* Leading dimension of the backward's tiles of rows of d REALs (native.h or_bwd_ld) */
static inline int FN(bwd_ld)(int d, const int dots)
{
    return or_bwd_ld(d, 2 * VBYTES, sizeof(REAL), dots);
}

/* The dQ accumulators of a chunked backward of one part: the unit's query rows (each query
 * head's rows padded by MR), kept between chunks; none with one chunk, or with parts, whose
 * dQ is kept in part_dq. */
static size_t FN(bwd_dq_rows)(const or_job *job, const int dots)
{
    return job->parts == 1 && job->part_keys > FN(bwd_chunk)(job, dots)
               ? (size_t)job->p->prm.group * (size_t)(job->nq_max + MR) : 0;
}

/* Backward scratch, in REALs: bwd_tiles' tiles (below) up to di, in its order; the dot
 * products' tiles and a row's dropout mask come after. */
static size_t FN(bwd_scratch_of)(const or_job *job, const int dots)
{
    const or_problem *p = job->p;
    const size_t ldq = (size_t)FN(bwd_ld)(p->d, dots), ldo = (size_t)FN(bwd_ld)(p->dv, dots);
    const size_t n = (size_t)job->part_keys;
    return FN(bwd_dq_rows)(job, dots) * ldq         /* dQ between chunks */
           + (n + MR) * (ldq + ldo)                 /* dk, dv accumulators */
           + n * ldq                                /* k */
           + (size_t)or_blocks_size(job->part_keys, BC, sizeof(REAL), p->d + p->dv)  /* kt, vt */
           + BR * ldq * 2 + BR * ldo * 2            /* q, dq, dout, o */
           + 3 * (size_t)BR * BC + 2 * BR;          /* s, dp, dcap, lse, di */
}

static size_t FN(bwd_scratch)(const or_job *job)
{
    return FN(bwd_scratch_of)(job, 0);
}

#if DOTS
/* bf16_bwd_item's: bwd_item's, then its tiles of pairs of bfloat16 (qw, dow, qr, dor, prr, dsr)
 * and with AMX tiles the transposed dK and dV (dkt, dvt) */
static size_t bf16_bwd_scratch(const or_job *job)
{
    const size_t dp = (size_t)FN(pad)(job->p->d), dvp = (size_t)FN(pad)(job->p->dv);
    return FN(bwd_scratch_of)(job, 1) + BR * (dp + dvp) / 2 * 3 + (size_t)BR * BC
           + TILES * (dp + dvp) * (size_t)(job->part_keys / BC + 1) * BC;   /* dkt, dvt */
}
#endif

/* The backward's tiles in a worker's scratch (bwd_scratch_of's sizes, in that order), for an
 * item's nk keys from key kb on (a unit's, kb 0, or a part's), indexed from kb in them. With
 * dots the five matrix products run on bfloat16 dot products, their operands pairs of bfloat16
 * (the forward's layouts, attn_bf16_impl.h; P and dS rounded to bfloat16):
 *   qw, dow   q and dO rows, pairs along d / dv      (S = q K^T, dP = dO V^T)
 *   qr, dor   q and dO, pairs of rows                 (dK += dS^T q, dV += P^T dO)
 *   prr, dsr  P and dS, pairs of rows, BC words wide  (the A operands of those two)
 *   kt, vt    blocks of pairs along d / dv; k: pairs of rows (dQ += dS K, dS pairs along keys
 *             in place)
 * With AMX tiles dK and dV accumulate transposed, dK^T += q^T dS and dV^T += dO^T P, their
 * left operands q^T and dO^T in qr and dor as rows of BR / 2 words (pairs of query rows):
 *   dkt, dvt  dp x ldt and dvp x ldt floats, ldt = nk rounded up past a multiple of BC,
 *             transposed into dk and dvacc at the end of the item */
typedef struct {
    int ldq, ldo;                   /* leading dimensions (bwd_ld) of rows of d and of dv */
    or_ssize kb;                    /* the part's first key: row 0 of k, dk, dvacc, ... */
    REAL *dqall;                    /* dQ between chunks (bwd_dq_rows rows), or none */
    REAL *dk, *dvacc;               /* the part's dK and dV accumulators */
    REAL *k, *kt, *vt;              /* its keys, keys and values transposed in blocks */
    REAL *q, *dq, *dout, *o;        /* a query block's rows */
    REAL *s, *dpm, *dcap, *lse, *di;
    unsigned char *keep;            /* a row's dropout mask */
    uint32_t *qw, *dow, *qr, *dor, *prr, *dsr;     /* with dots (above) */
    float *dkt, *dvt;                               /* with AMX tiles, ldt floats a row */
    int ldt;
} FN(bwd_tiles);

/* A block of query rows of the backward: rows [i0, i0 + rows) of unit u. */
typedef struct {
    or_ssize u, i0, nq, nk;
    int rows, rows_mr;
    REAL slope;
    REAL *dq;       /* its dQ: the dq tile, its rows of the accumulators kept between chunks,
                     * or of its part's in part_dq */
} FN(bwd_rows);

/* Worker `worker`'s tiles for the part of nk keys from key kb on (with dots, its bfloat16 ones
 * too). */
static inline __attribute__((always_inline)) FN(bwd_tiles)
FN(bwd_tiles_of)(const or_job *job, int worker, or_ssize kb, or_ssize nk, const int dots)
{
    const or_problem *p = job->p;
    const int d = p->d, dv = p->dv;
    const or_ssize most = job->part_keys;
    FN(bwd_tiles) t = {.ldq = FN(bwd_ld)(d, dots), .ldo = FN(bwd_ld)(dv, dots), .kb = kb};
    t.dqall = (REAL *)(job->scratch + (size_t)worker * job->per_worker);
    t.dk = t.dqall + FN(bwd_dq_rows)(job, dots) * (size_t)t.ldq;
    t.dvacc = t.dk + (most + MR) * t.ldq;
    t.k = t.dvacc + (most + MR) * t.ldo;
    t.kt = t.k + most * t.ldq;
    t.vt = t.kt + or_blocks_size(most, BC, sizeof(REAL), d);
    t.q = t.vt + or_blocks_size(most, BC, sizeof(REAL), dv);
    t.dq = t.q + BR * t.ldq;
    t.dout = t.dq + BR * t.ldq;
    t.o = t.dout + BR * t.ldo;
    t.s = t.o + BR * t.ldo;
    t.dpm = t.s + BR * BC;
    t.dcap = t.dpm + BR * BC;
    t.lse = t.dcap + BR * BC;
    t.di = t.lse + BR;
    t.keep = (unsigned char *)(t.di + BR);
#if DOTS
    if (dots) {
        const int dp = FN(pad)(d), dvp = FN(pad)(dv);
        t.qw = (uint32_t *)(t.di + BR);
        t.dow = t.qw + BR * dp;
        t.qr = t.dow + BR * dvp;
        t.dor = t.qr + BR / 2 * dp;
        t.prr = t.dor + BR / 2 * dvp;
        t.dsr = t.prr + BR / 2 * BC;
        t.dkt = (float *)(t.dsr + BR / 2 * BC);
        t.dvt = t.dkt + TILES * (most / BC + 1) * BC * dp;
        t.ldt = (int)(nk / BC + 1) * BC;
        t.keep = (unsigned char *)(t.dvt + TILES * (most / BC + 1) * BC * dvp);
    }
#endif
    return t;
}

/* A query block's rows into the tiles (q scaled but where dots: with those its products are
 * unscaled), its D_i = rowsum(dO * O). */
static inline __attribute__((always_inline)) void
FN(bwd_load_rows)(const or_problem *p, const FN(bwd_tiles) *t, const FN(bwd_rows) *b,
                  const int dots)
{
    const int d = p->d, dv = p->dv;
    const or_view *w = p->view;
    FN(load_rows)(t->q, t->ldq, FN(row_ptr)(p, OR_Q, b->u, b->i0), w[OR_Q].row_stride, b->rows,
                  d, b->rows_mr, w[OR_Q].dtype, dots ? 1 : (REAL)p->prm.scale);
    FN(load_rows)(t->dout, t->ldo, FN(row_ptr)(p, OR_DO, b->u, b->i0), w[OR_DO].row_stride,
                  b->rows, dv, b->rows_mr, w[OR_DO].dtype, 1);
#if DOTS
    if (dots) {     /* exact: the values are bfloat16 */
        const int dp = FN(pad)(d), dvp = FN(pad)(dv);
        bf16_pairs_along(t->qw, dp, t->q, t->ldq, b->rows_mr, dp);
        bf16_pairs_along(t->dow, dvp, t->dout, t->ldo, b->rows_mr, dvp);
#if TILES
        bf16_column_pairs(t->qr, t->q, t->ldq, b->rows_mr / 2, dp);
        bf16_column_pairs(t->dor, t->dout, t->ldo, b->rows_mr / 2, dvp);
#else
        bf16_pairs_of_rows(t->qr, dp, t->q, t->ldq, 0, b->rows_mr / 2, dp);
        bf16_pairs_of_rows(t->dor, dvp, t->dout, t->ldo, 0, b->rows_mr / 2, dvp);
#endif
    }
#endif
    FN(load_rows)(t->o, t->ldo, FN(row_ptr)(p, OR_O, b->u, b->i0), w[OR_O].row_stride, b->rows,
                  dv, b->rows, w[OR_O].dtype, 1);
    FN(load_rows)(t->lse, 1, FN(row_ptr)(p, OR_LSE, b->u, b->i0), w[OR_LSE].row_stride, b->rows,
                  1, b->rows, w[OR_LSE].dtype, 1);
    for (int r = 0; r < b->rows; r++) {
        REAL acc = 0;
        for (int x = 0; x < dv; x++)
            acc += t->dout[(or_ssize)r * t->ldo + x] * t->o[(or_ssize)r * t->ldo + x];
        t->di[r] = acc;
    }
}

/* Rows [r0, r0 + m) of s and dpm, S and dP of key block j0 (ncols computed, kcols of them keys
 * read), become the kept P (for dV) and dS (for dQ, dK); both are 0 past the columns computed
 * and dS before column skip. */
static inline __attribute__((always_inline)) void
FN(bwd_probs)(const or_problem *p, const FN(bwd_tiles) *t, const FN(bwd_rows) *b, or_ssize j0,
              int r0, int m, int ncols, int kcols, int skip)
{
    const REAL drop_scale = (REAL)p->prm.drop_scale;
    for (int r = r0; r < r0 + m; r++) {
        REAL *prow = t->s + (or_ssize)r * BC, *dprow = t->dpm + (or_ssize)r * BC;
        const REAL lr = r < b->rows && ncols > 0 ? t->lse[r] : -INFINITY;
        if (lr == -INFINITY) {      /* padding, or a row that sees nothing here */
            memset(prow, 0, sizeof(REAL) * BC);
            memset(dprow, 0, sizeof(REAL) * BC);
            continue;
        }
        FN(exp_row_lanes)(prow, 1, lr, ncols, 0);   /* the forward's exps */
        if (p->prm.dropout) {
            or_dropout_row(p->prm.seed, (uint64_t)b->u, (uint32_t)(b->i0 + r), (uint32_t)j0,
                           kcols, p->prm.threshold, t->keep);
            for (int c = 0; c < kcols; c++) {
                const REAL kept = t->keep[c] ? drop_scale : 0;
                dprow[c] = prow[c] * (dprow[c] * kept - t->di[r]);
                prow[c] *= kept;
            }
            for (int c = kcols; c < ncols; c++)     /* dS^T q reads cols_mr */
                dprow[c] = 0;
        } else {
            for (int c = 0; c < ncols; c++)
                dprow[c] = prow[c] * (dprow[c] - t->di[r]);
        }
        for (int c = ncols; c < BC; c++)
            prow[c] = dprow[c] = 0;
        if (p->prm.softcap > 0)
            for (int c = 0; c < kcols; c++)
                dprow[c] *= t->dcap[(or_ssize)r * BC + c];
        for (int c = 0; c < skip; c++)  /* P = 0 there, but dP may be inf */
            dprow[c] = 0;
    }
}

/* A query block against the keys [lo, hi) of key block j0: S and dP, then P and dS, by strips
 * of rows; dQ += dS K; dV += P^T dO, dK += dS^T q. */
static inline __attribute__((always_inline)) void
FN(bwd_key_block)(const or_problem *p, const FN(bwd_tiles) *t, const FN(bwd_rows) *b,
                  or_ssize j0, or_ssize lo, or_ssize hi, const int dots)
{
    const int d = p->d, dv = p->dv, dp = FN(pad)(d), dvp = FN(pad)(dv);
    const int rows = b->rows, rows_mr = b->rows_mr;
    const int cols = (int)(hi - j0 < BC ? hi - j0 : BC), cols_mr = (cols + MR - 1) / MR * MR;
    const int skip = (int)(j0 < lo ? lo - j0 : 0);  /* keys before lo: dS is 0 */
    const or_ssize jt = j0 - t->kb;                 /* key j0's row in the part's tiles */
#if DOTS
    const int d2 = (d + 1) / 2, dv2 = (dv + 1) / 2;
#endif
    /* A block that the right edge of the mask cuts (a causal diagonal) goes in SR-row strips,
     * each over the key columns it can see, as in the forward: row r sees the columns
     * c <= r + reach. */
    const or_ssize reach = b->i0 + b->nk - b->nq + p->prm.right - j0;
    const int cut = p->prm.right >= 0 && reach + 1 < cols, sr = cut ? SR : rows_mr;
    for (int r0 = 0; r0 < rows_mr; r0 += sr) {
        const int m = rows_mr - r0 < sr ? rows_mr - r0 : sr;
        const or_ssize end = cut ? r0 + m + reach : cols;   /* past the last column */
        const int ncols = end <= 0 ? 0 : FN(pad)((int)(end < cols ? end : cols));
        const int kcols = ncols < cols ? ncols : cols;    /* keys read, transformed */
        REAL *sb = t->s + (or_ssize)r0 * BC, *db = t->dpm + (or_ssize)r0 * BC;
        if (ncols > 0) {
#if DOTS
            if (dots)
                bf16_rows_gemm(sb, BC, t->qw + (or_ssize)r0 * dp, dp,
                               (const uint32_t *)t->kt + jt / BC * KLD * d2, KLD, m, ncols, d2,
                               (REAL)p->prm.scale, 0);
            else
#endif
            FN(gemm)(sb, BC, t->q + (or_ssize)r0 * t->ldq, t->ldq, 1, t->kt + jt / BC * KLD * d,
                     KLD, m, ncols, d, 0, 0);                           /* S = q K^T */
            FN(transform_scores)(p, rows - r0 < m ? rows - r0 : m, kcols, b->i0 + r0, j0, b->nq,
                                 b->nk, b->slope, sb, t->dcap + (or_ssize)r0 * BC);
#if DOTS
            if (dots)
                bf16_rows_gemm(db, BC, t->dow + (or_ssize)r0 * dvp, dvp,
                               (const uint32_t *)t->vt + jt / BC * KLD * dv2, KLD, m, ncols, dv2,
                               1, 0);
            else
#endif
            FN(gemm)(db, BC, t->dout + (or_ssize)r0 * t->ldo, t->ldo, 1,
                     t->vt + jt / BC * KLD * dv, KLD, m, ncols, dv, 0, 0);  /* dP = dO V^T */
        }
        FN(bwd_probs)(p, t, b, j0, r0, m, ncols, kcols, skip);
#if DOTS
        if (dots) {     /* P, dS as pairs of rows; dS pairs along keys in place */
            bf16_pairs_of_rows(t->prr, BC, t->s, BC, r0 / 2, (r0 + m) / 2, BC);
            bf16_pairs_of_rows(t->dsr, BC, t->dpm, BC, r0 / 2, (r0 + m) / 2, BC);
            bf16_pairs_along((uint32_t *)db, BC, db, BC, m, ncols);
            if (kcols > skip)
                bf16_rows_gemm(b->dq + (or_ssize)r0 * t->ldq, t->ldq, (const uint32_t *)db + skip / 2, BC,
                               (const uint32_t *)t->k + (jt + skip) / 2 * dp, dp, m, dp,
                               (kcols + 1) / 2 - skip / 2, 1, 1);
            continue;
        }
#endif
        if (kcols > skip)                                               /* dQ += dS K */
            FN(gemm)(b->dq + (or_ssize)r0 * t->ldq, t->ldq, db + skip, BC, 1,
                     t->k + (jt + skip) * t->ldq, t->ldq, m, dp, kcols - skip, 2, 1);
    }
    /* dV += P^T dO, dK += dS^T q; in a cut block SR keys at a time, from the first row that
     * sees them (P and dS are 0 above it) */
    const int sk = cut ? SR : cols_mr;
#if TILES
    /* dK^T and dV^T: keys are the columns, in whole tiles */
    for (int c0 = 0; dots && c0 < cols; c0 += cut ? W : BC) {
        const int n = cut ? W : FN(pad)(cols);
        const int rlo = cut && c0 - reach > 0 ? (int)(c0 - reach) : 0;
        if (rlo >= rows)
            break;
        const int x0 = rlo / 2, pairs = (rows + 1) / 2 - x0;
        bf16_rows_gemm(t->dvt + jt + c0, t->ldt, t->dor + x0, BR / 2,
                       t->prr + (or_ssize)x0 * BC + c0, BC, dvp, n, pairs, 1, 1);
        bf16_rows_gemm(t->dkt + jt + c0, t->ldt, t->qr + x0, BR / 2,
                       t->dsr + (or_ssize)x0 * BC + c0, BC, dp, n, pairs, 1, 1);
    }
    for (int c0 = 0; !dots && c0 < cols_mr; c0 += sk) {
#else
    for (int c0 = 0; c0 < cols_mr; c0 += sk) {
#endif
        const int n = cols_mr - c0 < sk ? cols_mr - c0 : sk;
        const int rlo = cut && c0 - reach > 0 ? (int)(c0 - reach) : 0;
        if (rlo >= rows)
            break;
#if DOTS
        if (dots) {     /* from the pair of rows that holds rlo */
            const int x0 = rlo / 2, pairs = (rows + 1) / 2 - x0;
            bf16_gemm(t->dvacc + (jt + c0) * t->ldo, t->ldo, t->prr + (or_ssize)x0 * BC + c0, 1,
                      BC, t->dor + (or_ssize)x0 * dvp, dvp, n, dvp, pairs, 1, 1);
            bf16_gemm(t->dk + (jt + c0) * t->ldq, t->ldq, t->dsr + (or_ssize)x0 * BC + c0, 1, BC,
                      t->qr + (or_ssize)x0 * dp, dp, n, dp, pairs, 1, 1);
            continue;
        }
#endif
        FN(gemm)(t->dvacc + (jt + c0) * t->ldo, t->ldo, t->s + (or_ssize)rlo * BC + c0, 1, BC,
                 t->dout + (or_ssize)rlo * t->ldo, t->ldo, n, dvp, rows - rlo, 2, 1);
        FN(gemm)(t->dk + (jt + c0) * t->ldq, t->ldq, t->dpm + (or_ssize)rlo * BC + c0, 1, BC,
                 t->q + (or_ssize)rlo * t->ldq, t->ldq, n, dp, rows - rlo, 2, 1);
    }
}

/* A query block's dQ (rows of ld REALs, before the scale) into the output: dQ = scale dS K, and
 * 0 in a row that sees no key, even where its dS of 0 met a NaN key that another row of the
 * block sees (0 * NaN). lse: a tile of BR REALs. */
static inline __attribute__((always_inline)) void
FN(bwd_store_dq)(const or_problem *p, REAL *lse, or_ssize u, or_ssize i0, int rows, REAL *dq,
                 int ld)
{
    const or_view *w = p->view;
    const REAL scale = (REAL)p->prm.scale;
    FN(load_rows)(lse, 1, FN(row_ptr)(p, OR_LSE, u, i0), w[OR_LSE].row_stride, rows, 1, rows,
                  w[OR_LSE].dtype, 1);
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < p->d; x++)
            dq[(or_ssize)r * ld + x] = lse[r] != -INFINITY ? dq[(or_ssize)r * ld + x] * scale : 0;
    FN(store_rows)(FN(row_ptr)(p, OR_DQ, u, i0), w[OR_DQ].row_stride, dq, ld, rows, p->d,
                   w[OR_DQ].dtype);
}

/* Part `part`'s dQ of the query block of unit u from row i0 in part_dq. */
static inline REAL *FN(part_dq_rows)(const or_job *job, or_ssize u, or_ssize part, or_ssize i0)
{
    const or_ssize group = job->p->prm.group, kvu = u / group;
    const size_t row = ((size_t)(kvu * job->parts + part) * (size_t)group + (size_t)(u % group))
                           * (size_t)(job->blocks * BR) + (size_t)i0;
    return (REAL *)job->part_dq + row * (size_t)job->part_ld;
}

/* One work item: a part of a kv unit's keys (the whole unit where there is one part); it owns dK
 * and dV of those keys and either the dQ of the unit's query heads or, with parts, their dQ of
 * its keys alone in part_dq, so no two workers ever write the same element and no atomics are
 * needed. Its keys go in chunks (bwd_chunk), each against every query block of the unit's query
 * heads. */
static inline __attribute__((always_inline)) void
FN(bwd_unit)(void *vjob, or_ssize item, int worker, const int dots)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize kvu = job->order[item] / job->parts, part = job->order[item] % job->parts;
    const int d = p->d, dv = p->dv;
    const or_ssize nk = p->nk[kvu * p->prm.group], kb = part * job->part_keys;
    const or_ssize ke = nk - kb < job->part_keys ? nk : kb + job->part_keys, nkp = ke - kb;
    const or_ssize chunk = FN(bwd_chunk)(job, dots);
    const size_t dq_rows = FN(bwd_dq_rows)(job, dots);
    const FN(bwd_tiles) t = FN(bwd_tiles_of)(job, worker, kb, nkp, dots);
    const or_view *w = p->view;
#if DOTS
    if (dots) {     /* t.ldq, t.ldo: d and dv rounded up to W (bwd_ld) */
        bf16_pack_row_pairs((uint32_t *)t.k, t.ldq, p, OR_K, kvu, kb, nkp, d);
        bf16_pack_blocks((uint32_t *)t.kt, p, OR_K, kvu, kb, nkp, d);
        bf16_pack_blocks((uint32_t *)t.vt, p, OR_V, kvu, kb, nkp, dv);
#if TILES
        memset(t.dkt, 0, sizeof(float) * (size_t)t.ldt * (size_t)t.ldq);
        memset(t.dvt, 0, sizeof(float) * (size_t)t.ldt * (size_t)t.ldo);
#endif
    } else
#endif
    {
        FN(load_rows)(t.k, t.ldq, FN(row_ptr)(p, OR_K, kvu, kb), w[OR_K].row_stride, nkp, d, nkp,
                      w[OR_K].dtype, 1);
        FN(load_cols_blocked)(t.kt, FN(row_ptr)(p, OR_K, kvu, kb), w[OR_K].row_stride, nkp, d,
                              w[OR_K].dtype);
        FN(load_cols_blocked)(t.vt, FN(row_ptr)(p, OR_V, kvu, kb), w[OR_V].row_stride, nkp, dv,
                              w[OR_V].dtype);
    }
    memset(t.dk, 0, sizeof(REAL) * (size_t)(nkp + MR) * (size_t)t.ldq);
    memset(t.dvacc, 0, sizeof(REAL) * (size_t)(nkp + MR) * (size_t)t.ldo);
    /* keys [k0, k0 + chunk) of the part against every query block; once, empty, where it has
     * no keys */
    for (or_ssize k0 = kb; k0 < ke || k0 == kb; k0 += chunk) {
        const or_ssize k1 = ke - k0 < chunk ? ke : k0 + chunk;
        for (or_ssize g = 0; g < p->prm.group; g++) {
            const or_ssize u = kvu * p->prm.group + g;
            for (or_ssize i0 = 0; i0 < p->nq[u]; i0 += BR) {
                FN(bwd_rows) b = {.u = u, .i0 = i0, .nq = p->nq[u], .nk = nk,
                                  .slope = p->slopes ? (REAL)p->slopes[u] : 0, .dq = t.dq};
                b.rows = (int)(b.nq - i0 < BR ? b.nq - i0 : BR);
                b.rows_mr = (b.rows + MR - 1) / MR * MR;
                if (job->parts > 1)
                    b.dq = FN(part_dq_rows)(job, u, part, i0);    /* part_ld: t.ldq */
                else if (dq_rows)
                    b.dq = t.dqall + ((size_t)g * (size_t)(job->nq_max + MR) + (size_t)i0) * t.ldq;
                if (k0 == kb)
                    memset(b.dq, 0, sizeof(REAL) * (size_t)b.rows_mr * (size_t)t.ldq);
                or_ssize lo, hi;
                or_key_range(p->prm.left, p->prm.right, b.nq, nk, i0, i0 + b.rows, &lo, &hi);
                lo = lo > k0 ? lo : k0;
                hi = hi < k1 ? hi : k1;
                if (lo < hi) {
                    FN(bwd_load_rows)(p, &t, &b, dots);
                    for (or_ssize j0 = lo - lo % BC; j0 < hi; j0 += BC)
                        FN(bwd_key_block)(p, &t, &b, j0, lo, hi, dots);
                }
                if (k1 == ke && job->parts == 1)    /* dQ is whole after the last chunk */
                    FN(bwd_store_dq)(p, t.lse, u, i0, b.rows, b.dq, t.ldq);
            }
        }
    }
#if TILES
    for (or_ssize j = 0; dots && j < nkp; j++) {
        for (int c = 0; c < t.ldq; c++)
            t.dk[j * t.ldq + c] = t.dkt[(or_ssize)c * t.ldt + j];
        for (int c = 0; c < t.ldo; c++)
            t.dvacc[j * t.ldo + c] = t.dvt[(or_ssize)c * t.ldt + j];
    }
#endif
    if (dots)       /* dK = scale dS^T q: q was not pre-multiplied */
        for (or_ssize x = 0; x < nkp * t.ldq; x++)
            t.dk[x] *= (REAL)p->prm.scale;
    FN(store_rows)(FN(row_ptr)(p, OR_DK, kvu, kb), w[OR_DK].row_stride, t.dk, t.ldq, nkp, d,
                   w[OR_DK].dtype);
    FN(store_rows)(FN(row_ptr)(p, OR_DV, kvu, kb), w[OR_DV].row_stride, t.dvacc, t.ldo, nkp, dv,
                   w[OR_DV].dtype);
}

static void FN(bwd_item)(void *vjob, or_ssize item, int worker)
{
    FN(bwd_unit)(vjob, item, worker, 0);
}

#if DOTS
static void bf16_bwd_item(void *vjob, or_ssize item, int worker)
{
    bf16_tiles_begin();
    FN(bwd_unit)(vjob, item, worker, 1);
    bf16_tiles_end();
}
#endif

/* A work item after a backward of several parts: a query block's dQ, the parts' added in part
 * order (those with keys: a part past its unit's keys had no item), stored. */
static void FN(bwd_sum_item)(void *vjob, or_ssize item, int worker)
{
    const or_job *job = vjob;
    const or_problem *p = job->p;
    const or_ssize u = item / job->blocks, i0 = item % job->blocks * BR;
    if (i0 >= p->nq[u])
        return;
    const int ld = job->part_ld, rows = (int)(p->nq[u] - i0 < BR ? p->nq[u] - i0 : BR);
    const or_ssize nk = p->nk[u], parts = nk > 0 ? (nk + job->part_keys - 1) / job->part_keys : 1;
    REAL *dq = FN(part_dq_rows)(job, u, 0, i0);
    for (or_ssize part = 1; part < parts; part++) {
        const REAL *add = FN(part_dq_rows)(job, u, part, i0);
        for (or_ssize x = 0; x < (or_ssize)rows * ld; x++)
            dq[x] += add[x];
    }
    FN(bwd_store_dq)(p, (REAL *)(job->scratch + (size_t)worker * job->per_worker), u, i0, rows,
                     dq, ld);
}

#undef W
#undef KLD
#undef DOTS
#undef TILES
#undef EXP_COARSE
