/* attn_decode_impl.h - the native split-KV decode forward (Flash-Decoding), written once over
 * REAL; native_kernels.h includes it after attn_native_impl.h (whose tiles and score transform it
 * shares) for float and for double, and attn_native.c runs it when or_is_decode (orchard.h).
 *
 * A decode step has few query rows per head, so the query-block parallelism of the forward
 * leaves cores idle and its whole-cache key transposition costs more than the attention. Here a
 * work item is (kv unit, split): the R = group x nq query rows of one GQA group against one
 * contiguous range of keys, read once, in order, a block of BC keys at a time (or (kv units,
 * split) where units' rows lie side by side: job->heads of them, whose blocks are read a chunk
 * of job->step_keys keys of each unit in turn, attn_native.c side_by_side; decode_split):
 *   q    R x dp        the group's query rows, pre-multiplied by scale (row g * nq + i is
 *                      query row i of the group's head g)
 *   k, v               read in place, in their own dtype, through a list of row addresses
 *                      per block (so a paged cache is read where its pages lie), widened to
 *                      REAL in registers (no tile: a float16/bfloat16 step would otherwise
 *                      write and reread a float copy of the cache); NKEYS rows at a time, so
 *                      that one tree of shuffles sums NKEYS dot products (decode_totals)
 *   s    R x BC        scores, then probabilities (the forward's s tile), one per unit
 * (a set with AVX512-BF16 multiplies a bfloat16 step's q, k, P and v as they lie, in pairs,
 * instead of widening them: attn_decode_bf16_impl.h; q unscaled, P also as words in pw).
 * and leaves, per row, its partial (unnormalised output o, running max m, sum l) in part.
 * The item that finishes a kv unit's last split then merges its splits exactly, in split order
 * (one job per step, not a second one for the merge: waking the workers again cost as much as
 * a short step's work):
 *   M = max m_s,  L = sum l_s e^(m_s - M),  out = sum o_s e^(m_s - M) / L,  lse = M + log L.
 * Split boundaries and blocks depend only on the shapes and strides (attn_native.c
 * decode_fwd), so results do not depend on the number of threads.
 */

#define DVL (VBYTES / (int)sizeof(REAL))    /* lanes of FN(vec) */
#define NKEYS OR_DECODE_KEYS
/* query rows per pass over the keys: their accumulators, their q vectors and a key vector must
 * fit the register file (32 vectors with AVX-512, 16 otherwise). 4 rows (over NKEYS / 2 keys at
 * a time) were 4 % faster than 2 rows at a time for bfloat16, and for float32 once their sums
 * stayed in registers (decode_dots: a cached GQA step 0.95x the time). */
#define DROWS (VBYTES == 64 ? 4 : 1)
/* accumulators of a value tile (decode_pv_tile): with two value vectors and the rows'
 * weights they must fit the register file */
#define PV_ACC (VBYTES == 64 ? 16 : 8)
/* bfloat16 steps' products on AVX512-BF16 dot products, where the set has them; the AMX set
 * (Intel's CPUs, VDPBF16PS at half rate) widens: a 32 / 8-head step 0.85x the time of its dot
 * products (Sapphire Rapids, benchmarks/decode.py) */
#if defined(OR_BF16_DOTS) && REAL_SIZE == 4 && !defined(OR_AMX_TILES)
#define DECODE_DOTS 1
#else
#define DECODE_DOTS 0
#endif

/* The partial results of one kv unit's split (slot kvu x splits + split) in job->part, in REALs:
 * o (R x dvp), then m, then l. */
static inline REAL *FN(decode_part)(const or_job *job, or_ssize slot)
{
    return (REAL *)job->part + slot * job->part_stride;
}

/* Element i of a key or value row of dtype dt, as REAL. dt is a constant wherever this is
 * inlined (decode_item's dispatch), so the switch folds away. */
static inline __attribute__((always_inline)) REAL FN(decode_load)(const char *row, int i,
                                                                  or_dtype dt)
{
    switch (dt) {
#define OR_LOAD(id, tag, ...) case id: return (REAL)or_load_##tag(row, i);
    OR_DTYPES(OR_LOAD)
#undef OR_LOAD
    }
    return 0;
}

/* Bytes of an element of dtype dt. */
static inline __attribute__((always_inline)) int FN(decode_size)(or_dtype dt)
{
    switch (dt) {
#define OR_SIZE(id, tag, name, npy, numpy, dlpack, size, ...) case id: return size;
    OR_DTYPES(OR_SIZE)
#undef OR_SIZE
    }
    return 0;
}

#if REAL_SIZE == 4   /* 16-bit lane 2j from a zero vector, 2j + 1 from lane j of h */
#  if VBYTES / REAL_SIZE == 16
#    define BF16_SPREAD 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31
#  elif VBYTES / REAL_SIZE == 8
#    define BF16_SPREAD 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15
#  elif VBYTES / REAL_SIZE == 4
#    define BF16_SPREAD 0, 4, 0, 5, 0, 6, 0, 7
#  endif
#endif

/* Elements [i, i + DVL) of such a row as a vector, widened in registers (a float16 or
 * bfloat16 cache is never written out as floats). */
static inline __attribute__((always_inline)) FN(vec) FN(decode_vec)(const char *row, int i,
                                                                   or_dtype dt)
{
    FN(vec) v;
    if (dt == (REAL_SIZE == 8 ? OR_F64 : OR_F32)) {
        memcpy(&v, row + (size_t)i * REAL_SIZE, sizeof(v));
        return v;
    }
#if REAL_SIZE == 4
    if (dt == OR_BF16) {    /* the top halves of floats: one shuffle with zeros */
        typedef uint16_t hvec __attribute__((vector_size(VBYTES / 2)));
        typedef uint16_t wvec __attribute__((vector_size(VBYTES)));
        hvec h;
        memcpy(&h, row + (size_t)i * 2, sizeof(h));
        const wvec w = __builtin_shufflevector((hvec){0}, h, BF16_SPREAD);
        memcpy(&v, &w, sizeof(v));
        return v;
    }
#endif
    REAL lane[DVL];
    for (int t = 0; t < DVL; t++)
        lane[t] = FN(decode_load)(row, i + t, dt);
    memcpy(&v, lane, sizeof(v));
    return v;
}

/* bfloat16 keys and values are widened a pair of vectors at a time, out of order: a bfloat16 is
 * the top half of a float, so the 32-bit lanes of 2 DVL raw elements hold element 2j in their
 * low half and 2j + 1 in their high half, and one shift and one mask give the even elements
 * and the odd ones as floats, where widening in order costs a cross-lane shuffle of several
 * operations per vector. Query rows and output accumulators hold elements
 * [0, decode_paired) in the same order (decode_deal), so that dot products and weighted sums
 * of rows come out the same. */
#if REAL_SIZE == 4
static inline __attribute__((always_inline)) void
FN(decode_bf16_pair)(const char *row, int i, FN(vec) *even, FN(vec) *odd)
{
    typedef uint32_t uvec __attribute__((vector_size(VBYTES)));
    uvec u;
    memcpy(&u, row + (size_t)i * 2, sizeof(u));
    const uvec e = u << 16, o = u & 0xffff0000u;
    memcpy(even, &e, sizeof(e));
    memcpy(odd, &o, sizeof(o));
}
#endif

/* Elements of a row of n held in pairs' order: whole blocks of 2 DVL, bfloat16 only. */
static inline __attribute__((always_inline)) int FN(decode_paired)(int n, or_dtype dt)
{
    return REAL_SIZE == 4 && dt == OR_BF16 ? n - n % (2 * DVL) : 0;
}

/* The element of a block of 2 DVL that position j holds in pairs' order: its even elements,
 * then its odd ones; or, where the products are bfloat16 dot products (dots), in unpacked order:
 * of each 16-byte lane's 8 elements, its first 4 in the first vector, its last 4 in the second
 * (attn_decode_bf16_impl.h). */
static inline __attribute__((always_inline)) int FN(decode_slot)(int j, int dots)
{
    const int lane = j % DVL, second = j / DVL;
    return dots ? lane / 4 * 8 + second * 4 + lane % 4 : 2 * lane + second;
}

/* Elements [0, n) of a row (n a multiple of 2 DVL) from natural order to pairs' order, or
 * back. to_pairs and dots are constants where inlined, so the moves are (a loop over decode_slot
 * was 12 % of a short GQA step's time). */
static inline __attribute__((always_inline)) void
FN(decode_deal)(REAL *x, int n, int to_pairs, int dots)
{
    for (int i = 0; i < n; i += 2 * DVL) {
        REAL t[2 * DVL];
#pragma GCC unroll 32
        for (int j = 0; j < 2 * DVL; j++) {
            if (to_pairs)
                t[j] = x[i + FN(decode_slot)(j, dots)];
            else
                t[FN(decode_slot)(j, dots)] = x[i + j];
        }
        memcpy(x + i, t, sizeof(t));
    }
}

/* s[r * BC + t] = scale x the total of the lanes of a[r * nk + t], for r < nr, t < nk (nr x nk
 * at most 2 NKEYS, a power of two): one transpose-and-add tree of shuffles for all of a pass's
 * sums (fold_vectors; a reduction per key cost as much as its dot product), always in the same
 * order. All at once, not a row at a time: keeping every row's sums until the end had held 2
 * NKEYS vectors more than the register file has (spilled at every step). */
static inline __attribute__((always_inline)) void
FN(decode_totals)(FN(vec) *a, const int nr, const int nk, REAL *s, REAL scale)
{
    const int m = FN(fold_vectors)(a, nr * nk, 0);
    REAL total[2 * NKEYS > DVL ? 2 * NKEYS : DVL];  /* total j in place j */
    for (int i = 0; i < m; i++) {
        const FN(vec) x = a[i] * scale;
        memcpy(total + i * DVL, &x, sizeof(x));
    }
    for (int r = 0; r < nr; r++)
        memcpy(s + (or_ssize)r * BC, total + r * nk, sizeof(REAL) * (size_t)nk);
}
#undef BF16_SPREAD

/* Asks for n rows of len bytes each, for the next block: a few at a time between the work on
 * this one (one core alone reads a strided or paged cache at well below the machine's bandwidth
 * otherwise), into L2 (prefetcht1: 3-10 % faster than into L1 at 4,096 keys, measured). */
static inline __attribute__((always_inline)) void
FN(decode_prefetch)(const char *const *rows, int n, int len)
{
    for (int t = 0; t < n; t++)
        for (int b = 0; b < len; b += 64)
            __builtin_prefetch(rows[t] + b, 0, 2);
}

#if DECODE_DOTS
#include "attn_decode_bf16_impl.h"
#endif

/* s[r * BC + t] = q row r . key row t, for r < nr (a constant), t < NKEYS (keys of dtype dt at
 * kr[t]), NKEYS / 2 keys at a time for more than 2 rows: at least 8 independent sums hide
 * the FMA latency, and each key vector is loaded and widened once for the nr rows. */
static inline __attribute__((always_inline)) void
FN(decode_dots)(REAL *s, const REAL *q, int dp, const char *const *kr, int d, or_dtype dt,
                REAL scale, const int nr, const char *const *pf, int npf, int plen)
{
#if DECODE_DOTS
    if (dt == OR_BF16) {    /* q: unscaled words (decode_begin) */
        decode_bf16_dots(s, (const uint32_t *)q, dp, kr, d, scale, nr);
        return;
    }
#endif
    const int HALF = nr > 2 ? NKEYS / 2 : NKEYS;  /* fewer sums would not hide the latency */
    const int dvec = d - d % DVL;
#pragma GCC unroll 2
    for (int h = 0; h < NKEYS; h += HALF) {
        /* this half's sums, a[r * HALF + t]: constant indices, never addressed, so kept in
         * registers (summed in memory, they were stored back at every step) */
        FN(vec) a[2 * NKEYS] = {0};
        int i = 0;
#if REAL_SIZE == 4
        for (; i < FN(decode_paired)(d, dt); i += 2 * DVL) {
            FN(vec) xe[DROWS], xo[DROWS];
            for (int r = 0; r < nr; r++) {
                memcpy(&xe[r], q + (or_ssize)r * dp + i, sizeof(xe[r]));
                memcpy(&xo[r], q + (or_ssize)r * dp + i + DVL, sizeof(xo[r]));
            }
            for (int t = 0; t < HALF; t++) {
                FN(vec) ye, yo;
                FN(decode_bf16_pair)(kr[h + t], i, &ye, &yo);
                for (int r = 0; r < nr; r++) {  /* two FMAs (a + (b + c) would be three ops) */
                    a[r * HALF + t] += xe[r] * ye;
                    a[r * HALF + t] += xo[r] * yo;
                }
            }
        }
#endif
        for (; i < dvec; i += DVL) {
            FN(vec) x[DROWS];
            for (int r = 0; r < nr; r++)
                memcpy(&x[r], q + (or_ssize)r * dp + i, sizeof(x[r]));
            for (int t = 0; t < HALF; t++) {
                if (i < plen && h + t < npf)
                    __builtin_prefetch(pf[h + t] + i * (int)sizeof(REAL), 0, 2);
                const FN(vec) y = FN(decode_vec)(kr[h + t], i, dt);
                for (int r = 0; r < nr; r++)
                    a[r * HALF + t] += x[r] * y;
            }
        }
        FN(decode_totals)(a, nr, HALF, s + h, 1);
    }
    for (int r = 0; r < nr; r++)
        for (int i = dvec; i < d; i++)
            for (int t = 0; t < NKEYS; t++)
                s[(or_ssize)r * BC + t] += q[(or_ssize)r * dp + i] * FN(decode_load)(kr[t], i, dt);
}

/* The address of row j of kv unit kvu in K or V (slot), paged or not. */
static inline __attribute__((always_inline)) const char *
FN(decode_row)(const or_problem *p, int slot, or_ssize kvu, or_ssize j)
{
    or_ssize run;
    return or_kv_row(p, slot, kvu, j, &run);
}

/* Whether rows [j, j + n) of kv unit kvu in K or V (slot), of len bytes, lie back to back (as
 * far as the first and last show), and where after, right after row j - 1. */
static inline __attribute__((always_inline)) int
FN(decode_run)(const or_problem *p, int slot, or_ssize kvu, or_ssize j, int n, int len,
               int after)
{
    if (n <= 0)
        return 0;
    const char *first = FN(decode_row)(p, slot, kvu, j);
    return (!after || FN(decode_row)(p, slot, kvu, j - 1) + len == first)
           && FN(decode_row)(p, slot, kvu, j + n - 1) == first + (or_ssize)(n - 1) * len;
}

/* Asks for the first line of each 4 KB page begun by rows [c, c + n) of len bytes from start
 * (and for row c's first line where c is 0): the hardware's stream prefetcher fetches
 * contiguous rows, but it stops at each page and starts again only on a miss there (contiguous
 * caches 4-8 % faster with these than without). */
static inline __attribute__((always_inline)) void
FN(decode_pages)(const char *start, int c, int n, int len)
{
    const uintptr_t from = (uintptr_t)start + (uintptr_t)c * (uintptr_t)len;
    const uintptr_t end = from + (uintptr_t)n * (uintptr_t)len;
    for (uintptr_t a = c ? (from + 4095) & ~(uintptr_t)4095 : from; a < end; a = (a | 4095) + 1)
        __builtin_prefetch((const char *)a, 0, 2);
}

/* Whether the next n rows, from row j, of kv unit kvu in K or V (slot) continue the rows before
 * them back to back: then they are asked for a page at a time, since the stream prefetcher
 * fetches the rest and a prefetch per line only competes with the loads (contiguous caches 2-5 %
 * faster without them, strided and paged ones 4-30 % slower) - in steps over less than
 * DECODE_STREAM_BYTES (attn_native.c, job->stream_lines). Over more, an AMD EPYC's (Zen 4)
 * stream prefetcher fell behind: asking for every line there made steps over 16-32 MB of keys
 * and values 0.69-0.85x the time (and over 4-8 MB 1.06-1.11x). */
static inline __attribute__((always_inline)) int
FN(decode_ahead)(const or_job *job, int slot, or_ssize kvu, or_ssize j, int n, int len)
{
    return !job->stream_lines && FN(decode_run)(job->p, slot, kvu, j, n, len, 1);
}

/* s[r * BC + c] = q row r . key row c, for r < rows, c < cols rounded up to NKEYS (kr holds
 * that many row addresses; scale multiplies the bfloat16 dots' sums, whose q is unscaled).
 * Meanwhile asks for the n_next rows of len bytes at next, NKEYS at a time: a page at a time
 * where k_pages, else a line at a time; and for as many values' rows (from v_next, vlen bytes a
 * row) a page at a time where v_pages (else decode_pv asks for them). Pages spread over the
 * block were 5-7 % faster than all asked for at its start. */
static inline __attribute__((always_inline)) void
FN(decode_scores)(REAL *s, const REAL *q, int rows, int dp, const char *const *kr, int cols,
                  int d, or_dtype dt, REAL scale, const char *const *next, int n_next, int len,
                  int k_pages, const char *v_next, int v_pages, int vlen)
{
    for (int c = 0; c < cols; c += NKEYS) {
        const int n = n_next - c < NKEYS ? n_next - c : NKEYS;
        const int fine = dt == OR_F32 && c < n_next && !k_pages;
        if (c < n_next && k_pages)
            FN(decode_pages)(next[0], c, n, len);
        else if (c < n_next && !fine)
            FN(decode_prefetch)(next + c, n, len);
        if (c < n_next && v_pages)
            FN(decode_pages)(v_next, c, n, vlen);
        int r = 0;
        for (; DROWS > 2 && r + DROWS <= rows; r += DROWS)
            FN(decode_dots)(s + (or_ssize)r * BC + c, q + (or_ssize)r * dp, dp, kr + c, d, dt,
                            scale, DROWS, next + c, fine && r == 0 ? n : 0, len);
        for (; DROWS > 1 && r + 2 <= rows; r += 2)
            FN(decode_dots)(s + (or_ssize)r * BC + c, q + (or_ssize)r * dp, dp, kr + c, d, dt,
                            scale, 2, next + c, fine && r == 0 ? n : 0, len);
        for (; r < rows; r++)
            FN(decode_dots)(s + (or_ssize)r * BC + c, q + (or_ssize)r * dp, dp, kr + c, d, dt,
                            scale, 1, next + c, fine && r == 0 ? n : 0, len);
    }
}

/* Output vectors [x, x + nx DVL) of rows [0, nr) of o (in pairs' order where paired) += P V over
 * the key columns [0, kcols) (a multiple of NKEYS; value rows at vr): the nr x nx accumulators
 * stay in registers for the whole block, each taking one FMA per key (accumulating in memory, 8
 * keys at a time, made each output vector a chain of dependent FMAs that left the FMA units
 * idle). Keys are added in order, one at a time, as the reference sum would. nr, nx and paired
 * are constants wherever this is inlined. Asks for n_next rows of the next block meanwhile. */
static inline __attribute__((always_inline)) void
FN(decode_pv_tile)(REAL *o, int dvp, int x, const REAL *s, const uint32_t *pw,
                   const char *const *vr, int kcols, or_dtype dt, const char *const *next,
                   int n_next, int len, const int nr, const int nx, const int paired)
{
#if DECODE_DOTS
    if (paired && dt == OR_BF16) {  /* P as words (pw, decode_block) */
        decode_bf16_pv_tile(o, dvp, x, pw, vr, kcols, next, n_next, len, nr, nx);
        return;
    }
#endif
    FN(vec) acc[4][8];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 16
        for (int v = 0; v < nx; v++)
            memcpy(&acc[r][v], o + (or_ssize)r * dvp + x + v * DVL, sizeof(acc[r][v]));
    for (int c0 = 0; c0 < kcols; c0 += NKEYS) {
        if (c0 < n_next)
            FN(decode_prefetch)(next + c0, n_next - c0 < NKEYS ? n_next - c0 : NKEYS, len);
#pragma GCC unroll 4     /* 8 tripled the build's compile time (this tile has ~20 instances) */
        for (int c = c0; c < c0 + NKEYS; c++) {
#pragma GCC unroll 16
            for (int v = 0; v < nx; v += paired ? 2 : 1) {
                FN(vec) y0, y1 = {0};
#if REAL_SIZE == 4
                if (paired)
                    FN(decode_bf16_pair)(vr[c], x + v * DVL, &y0, &y1);
                else
#endif
                    y0 = FN(decode_vec)(vr[c], x + v * DVL, dt);
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    const REAL pr = s[(or_ssize)r * BC + c];
                    acc[r][v] += pr * y0;
                    if (paired && v + 1 < nx)
                        acc[r][v + 1] += pr * y1;
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 16
        for (int v = 0; v < nx; v++)
            memcpy(o + (or_ssize)r * dvp + x + v * DVL, &acc[r][v], sizeof(acc[r][v]));
}

/* Rows [0, nr) of o (rows x dvp) += their rows of P (s) V, in tiles of at most nx vectors: as
 * wide as fit (8, 4, 2 vectors; pairs of vectors where bfloat16 is paired, then single
 * vectors), then the elements past the last whole vector. The first tile asks for the n_next
 * rows of len bytes at next. */
static inline __attribute__((always_inline)) void
FN(decode_pv_rows)(REAL *o, int dvp, int dv, const REAL *s, const uint32_t *pw,
                   const char *const *vr, int kcols, or_dtype dt, const char *const *next,
                   int n_next, int len, const int nr, const int nx)
{
    const int dvec = dv - dv % DVL, paired = FN(decode_paired)(dv, dt);
    int x = 0;
#define PV_TILES(w, pairs, end) \
    for (; (w) <= nx && x + (w) * DVL <= (end); x += (w) * DVL, n_next = 0) \
        FN(decode_pv_tile)(o, dvp, x, s, pw, vr, kcols, dt, next, n_next, len, nr, w, pairs);
    PV_TILES(8, 1, paired)
    PV_TILES(4, 1, paired)
    PV_TILES(2, 1, paired)
    PV_TILES(8, 0, dvec)
    PV_TILES(4, 0, dvec)
    PV_TILES(2, 0, dvec)
    PV_TILES(1, 0, dvec)
#undef PV_TILES
    if (n_next > 0)     /* no whole vector */
        FN(decode_prefetch)(next, n_next, len);
    for (; x < dv; x++)
        for (int r = 0; r < nr; r++) {
            REAL a = o[(or_ssize)r * dvp + x];
            for (int c = 0; c < kcols; c++)
                a += s[(or_ssize)r * BC + c] * FN(decode_load)(vr[c], x, dt);
            o[(or_ssize)r * dvp + x] = a;
        }
}

/* o (rows x dvp) += P (s, rows x BC; pw, rows x BC / 2 words, for bfloat16 dots) V (value
 * rows of dtype dt at vr, cols rounded up to NKEYS, whose columns of s past cols are 0), 4, 2
 * or 1 rows at a time, each with as many accumulators as the registers hold (PV_ACC). Asks
 * for the n_next rows of len bytes at next meanwhile. */
static inline __attribute__((always_inline)) void
FN(decode_pv)(REAL *o, int dvp, int dv, const REAL *s, const uint32_t *pw, int rows,
              const char *const *vr, int cols, or_dtype dt, const char *const *next, int n_next,
              int len)
{
    const int kcols = (cols + NKEYS - 1) / NKEYS * NKEYS;
    int r = 0;
#define PV_ROWS(nr) \
    for (; (nr) * 2 <= PV_ACC && r + (nr) <= rows; r += (nr), n_next = 0) \
        FN(decode_pv_rows)(o + (or_ssize)r * dvp, dvp, dv, s + (or_ssize)r * BC, \
                           pw + (or_ssize)r * (BC / 2), vr, kcols, dt, next, n_next, len, nr, \
                           PV_ACC / (nr) < 8 ? PV_ACC / (nr) : 8);
    PV_ROWS(4)
    PV_ROWS(2)
    PV_ROWS(1)
#undef PV_ROWS
}

/* A row of zeros, long enough for any head dim and dtype. */
static const double FN(zero_row)[OR_MAX_HEAD_DIM];

/* The addresses of rows [j0, j0 + n) of kv unit kvu in K or V (slot), paged or not, then rows
 * of zeros up to a multiple of NKEYS (their scores are masked, and their weights 0 times 0
 * adds nothing, where a copy of a real row could add 0 * inf = NaN). */
static inline __attribute__((always_inline)) void
FN(decode_rows)(const or_problem *p, int slot, or_ssize kvu, or_ssize j0, int n,
                const char **out)
{
    const or_ssize stride = p->view[slot].row_stride;
    or_ssize run;
    for (int c = 0; c < n;) {
        const char *r = or_kv_row(p, slot, kvu, j0 + c, &run);
        const int m = run < n - c ? (int)run : n - c;
        for (int i = 0; i < m; i++)     /* one bound, so that it vectorises */
            out[c + i] = r + i * stride;
        c += m;
    }
    for (int c = n; c % NKEYS; c++)
        out[c] = (const char *)FN(zero_row);
}

/* The query rows of kv unit kvu into q (R x dp: pre-multiplied by scale, in pairs' order where
 * paired; for bfloat16 dots, unscaled words) and its partial results for split (o, m, l in
 * job->part) emptied. */
static inline __attribute__((always_inline)) void
FN(decode_begin)(const or_job *job, or_ssize kvu, or_ssize split, REAL *q, or_dtype dt)
{
    const or_problem *p = job->p;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0];
    const int d = p->d, dp = FN(pad)(d), dvp = FN(pad)(p->dv), rows = (int)(group * nq);
    REAL *o = FN(decode_part)(job, kvu * job->splits + split), *m = o + (or_ssize)rows * dvp;
    REAL *l = m + rows;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
    }
    memset(o, 0, sizeof(REAL) * (size_t)rows * dvp);
#if DECODE_DOTS
    if (dt == OR_BF16) {
        for (or_ssize g = 0; g < group; g++)
            bf16_load_q((uint32_t *)(q + g * nq * dp), dp, FN(row_ptr)(p, OR_Q, u0 + g, 0),
                        p->view[OR_Q].row_stride, (int)nq, (int)nq, d);
        return;
    }
#endif
    for (or_ssize g = 0; g < group; g++)
        FN(load_rows)(q + g * nq * dp, dp, FN(row_ptr)(p, OR_Q, u0 + g, 0),
                      p->view[OR_Q].row_stride, nq, d, nq, p->view[OR_Q].dtype,
                      (REAL)p->prm.scale);
    for (int r = 0; r < rows; r++)
        FN(decode_deal)(q + (or_ssize)r * dp, FN(decode_paired)(d, dt), 1, 0);
}

/* Rows [j, j + cols) of kv unit kvu, keys first: its scores s (R x BC) in columns [c, c + cols)
 * from its query rows q, asking meanwhile for the n_next rows of K or V (next) from row j_next
 * that are read after these: a page at a time where they are the keys right after these, back
 * to back (decode_ahead), else a line at a time; and then for the values after this chunk's,
 * their pages where they continue too (else decode_values asks for them). The first chunk of a
 * split (first) asks for its own pages as well. kr and kn hold row addresses. */
static inline __attribute__((always_inline)) void
FN(decode_keys)(const or_job *job, or_ssize kvu, const REAL *q, REAL *s, int c, or_ssize j,
                int cols, int first, int next, or_ssize j_next, int n_next, const char **kr,
                const char **kn, or_dtype dt)
{
    const or_problem *p = job->p;
    const int rows = (int)(p->prm.group * p->nq[kvu * p->prm.group]);
    const int len[2] = {p->d * FN(decode_size)(dt), p->dv * FN(decode_size)(dt)};
    for (int x = 0; first && x < 2; x++)    /* GQA steps 2-6 % faster with these */
        if (FN(decode_run)(p, x ? OR_V : OR_K, kvu, j, cols, len[x], 0))
            FN(decode_pages)(FN(decode_row)(p, x ? OR_V : OR_K, kvu, j), 0, cols, len[x]);
    /* both now: the values' pages asked for after the scores were 3-12 % slower */
    const int k_pages = next == OR_K && FN(decode_ahead)(job, OR_K, kvu, j_next, n_next, len[0]);
    const int v_pages = next == OR_K && FN(decode_ahead)(job, OR_V, kvu, j_next, n_next, len[1]);
    FN(decode_rows)(p, OR_K, kvu, j, cols, kr);
    if (n_next > 0)
        FN(decode_rows)(p, next, kvu, j_next, n_next, kn);
    FN(decode_scores)(s + c, q, rows, FN(pad)(p->d), kr, cols, p->d, dt, (REAL)p->prm.scale, kn,
                      n_next, len[next == OR_V], k_pages,
                      v_pages ? FN(decode_row)(p, OR_V, kvu, j_next) : NULL, v_pages, len[1]);
}

/* The online softmax of kv unit kvu's block of keys [j0, j0 + cols) for split: its scores s
 * (R x BC) masked and turned into probabilities (also as words in pw, where bfloat16 dots
 * multiply them), its partial results' m and l updated and o rescaled. */
static inline __attribute__((always_inline)) void
FN(decode_softmax)(const or_job *job, or_ssize kvu, or_ssize split, REAL *s, uint32_t *pw,
                   unsigned char *keep, or_ssize j0, int cols, or_dtype dt)
{
    const or_problem *p = job->p;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0], nk = p->nk[u0];
    const int dv = p->dv, dvp = FN(pad)(dv), rows = (int)(group * nq), ncols = FN(pad)(cols);
    const int kcols = (cols + NKEYS - 1) / NKEYS * NKEYS;
    const REAL drop_scale = (REAL)p->prm.drop_scale;
    REAL *o = FN(decode_part)(job, kvu * job->splits + split), *m = o + (or_ssize)rows * dvp;
    REAL *l = m + rows;
    for (or_ssize g = 0; g < group; g++)
        FN(transform_scores)(p, (int)nq, cols, 0, j0, nq, nk,
                             p->slopes ? (REAL)p->slopes[u0 + g] : 0, s + g * nq * BC, NULL);
    for (int r = 0; r < rows; r++) {
        REAL *srow = s + (or_ssize)r * BC, *orow = o + (or_ssize)r * dvp;
        const REAL mx = FN(row_max)(srow, ncols), mnew = mx > m[r] ? mx : m[r];
        if (mnew == -INFINITY) {    /* nothing visible to this row yet, or only NaN scores */
            for (int c = 0; c < cols; c++)
                l[r] = srow[c] != srow[c] ? srow[c] : l[r];     /* as NaN carries on */
            memset(srow, 0, sizeof(REAL) * BC);
            continue;
        }
        const REAL alpha = EXP(m[r] - mnew);
        m[r] = mnew;
        l[r] = l[r] * alpha + FN(exp_row)(srow, mnew, ncols);
        for (int c = ncols; c < kcols; c++)     /* past the tile's padding: weight 0 */
            srow[c] = 0;
        if (alpha != 1)
            for (int x = 0; x < dv; x++)
                orow[x] *= alpha;
        if (p->prm.dropout) {
            const or_ssize u = u0 + r / nq, i = r % nq;
            or_dropout_row(p->prm.seed, (uint64_t)u, (uint32_t)i, (uint32_t)j0, cols,
                           p->prm.threshold, keep);
            for (int c = 0; c < cols; c++)
                srow[c] = keep[c] ? srow[c] * drop_scale : 0;
        }
    }
#if DECODE_DOTS
    if (dt == OR_BF16)
        bf16_pairs_along(pw, BC / 2, s, BC, rows, ncols);
#endif
}

/* Rows [j, j + cols) of kv unit kvu, values: its partial output for split += P (columns
 * [c, c + cols) of s, and of pw) V, asking meanwhile for the n_next rows of K or V (next) from
 * row j_next that are read after these a line at a time, unless decode_keys asked for their
 * pages. vr and vn hold row addresses. */
static inline __attribute__((always_inline)) void
FN(decode_values)(const or_job *job, or_ssize kvu, or_ssize split, const REAL *s,
                  const uint32_t *pw, int c, or_ssize j, int cols, int next, or_ssize j_next,
                  int n_next, const char **vr, const char **vn, or_dtype dt)
{
    const or_problem *p = job->p;
    const int rows = (int)(p->prm.group * p->nq[kvu * p->prm.group]), dv = p->dv;
    const int len[2] = {p->d * FN(decode_size)(dt), dv * FN(decode_size)(dt)};
    if (next == OR_V && FN(decode_ahead)(job, OR_V, kvu, j_next, n_next, len[1]))
        n_next = 0;
    FN(decode_rows)(p, OR_V, kvu, j, cols, vr);
    if (n_next > 0)
        FN(decode_rows)(p, next, kvu, j_next, n_next, vn);
    FN(decode_pv)(FN(decode_part)(job, kvu * job->splits + split), FN(pad)(dv), dv, s + c,
                  pw + c / 2, rows, vr, cols, dt, vn, n_next, len[next == OR_V]);
}

/* Keys in a chunk of at most step that starts left keys before the end of a split. */
static inline int FN(decode_chunk)(or_ssize left, int step)
{
    return left <= 0 ? 0 : left < step ? (int)left : step;
}

/* One split of the job->heads kv units of one item (attn_native.c decode_fwd), whose keys and
 * values are of dtype dt, a block of BC keys at a time: their scores, then their softmax, then
 * P V, each a chunk of job->step_keys keys of every unit in turn, so that units whose rows lie
 * side by side are read a span at a time while the softmax's work is paid once per BC keys
 * (per 32 keys, as it was, it made a 32 x 8 bfloat16 step 1.2x the time in cache). */
static inline __attribute__((always_inline)) void
FN(decode_split)(const or_job *job, or_ssize item, int worker, or_dtype dt)
{
    const or_problem *p = job->p;
    const or_ssize kv0 = item / job->splits * job->heads, split = item % job->splits;
    const or_ssize group = p->prm.group, nq = p->nq[kv0 * group], nk = p->nk[kv0 * group];
    const int dp = FN(pad)(p->d), rows = (int)(group * nq), step = (int)job->step_keys;

    REAL *q = (REAL *)(job->scratch + (size_t)worker * job->per_worker);  /* heads x R x dp */
    REAL *s = q + job->heads * rows * dp;                                  /* heads x R x BC */
    uint32_t *pw = (uint32_t *)(s + job->heads * rows * BC);  /* P as words: bfloat16 dots */
    unsigned char *keep = (unsigned char *)(pw + job->heads * rows * (BC / 2));
    const char *cur[BC + NKEYS], *nxt[BC + NKEYS];     /* row addresses */

    for (or_ssize h = 0; h < job->heads; h++)
        FN(decode_begin)(job, kv0 + h, split, q + h * rows * dp, dt);
    or_ssize lo, hi;    /* the keys some row sees, cut to this split */
    or_key_range(p->prm.left, p->prm.right, nq, nk, 0, nq, &lo, &hi);
    lo = lo > split * job->split_keys ? lo : split * job->split_keys;
    hi = hi < (split + 1) * job->split_keys ? hi : (split + 1) * job->split_keys;
    for (or_ssize j0 = lo; j0 < hi; j0 += BC) {
        const int cols = (int)(hi - j0 < BC ? hi - j0 : BC);
        /* each chunk asks for the rows read after it: the same unit's next keys (values); or,
         * where a block has several chunks, the last keys' for the block's first values and
         * the last values' for the next block's first keys (so that each asks one span ahead:
         * a 32 / 8 bfloat16 step over 16,384 keys 1.0-1.1x the speed of the next keys) */
        for (int c = 0; c < cols; c += step) {
            const int n = FN(decode_chunk)(cols - c, step), turn = step < cols && c + n == cols;
            const int n_next = turn ? FN(decode_chunk)(cols, step)
                                    : FN(decode_chunk)(hi - j0 - c - n, step);
            for (or_ssize h = 0; h < job->heads; h++)
                FN(decode_keys)(job, kv0 + h, q + h * rows * dp, s + h * rows * BC, c, j0 + c, n,
                                j0 + c == lo, turn ? OR_V : OR_K, turn ? j0 : j0 + c + n, n_next,
                                cur, nxt, dt);
        }
        for (or_ssize h = 0; h < job->heads; h++)
            FN(decode_softmax)(job, kv0 + h, split, s + h * rows * BC,
                               pw + h * rows * (BC / 2), keep, j0, cols, dt);
        for (int c = 0; c < cols; c += step) {
            const int n = FN(decode_chunk)(cols - c, step), turn = step < cols && c + n == cols;
            for (or_ssize h = 0; h < job->heads; h++)
                FN(decode_values)(job, kv0 + h, split, s + h * rows * BC,
                                  pw + h * rows * (BC / 2), c, j0 + c, n, turn ? OR_K : OR_V,
                                  j0 + c + n, FN(decode_chunk)(hi - j0 - c - n, step), cur, nxt,
                                  dt);
        }
    }
    for (or_ssize h = 0; h < job->heads; h++) {
        REAL *o = FN(decode_part)(job, (kv0 + h) * job->splits + split);
        for (int r = 0; r < rows; r++)
            FN(decode_deal)(o + (or_ssize)r * FN(pad)(p->dv), FN(decode_paired)(p->dv, dt), 0,
                            DECODE_DOTS && dt == OR_BF16);
    }
}

/* Merges the splits of one kv unit and stores its rows of out and lse. */
static void FN(decode_combine)(const or_job *job, or_ssize kvu, int worker)
{
    const or_problem *p = job->p;
    const or_ssize group = p->prm.group, u0 = kvu * group, nq = p->nq[u0];
    const int dv = p->dv, dvp = FN(pad)(dv), rows = (int)(group * nq);
    REAL *out = (REAL *)(job->scratch + (size_t)(worker + 1) * job->per_worker) - dvp;
    for (int r = 0; r < rows; r++) {
        REAL mmax = -INFINITY, lsum = 0;
        for (or_ssize s = 0; s < job->splits; s++) {
            const REAL ms = FN(decode_part)(job, kvu * job->splits + s)[(or_ssize)rows * dvp + r];
            mmax = ms > mmax ? ms : mmax;
        }
        memset(out, 0, sizeof(REAL) * (size_t)dvp);
        for (or_ssize s = 0; s < job->splits; s++) {
            const REAL *part = FN(decode_part)(job, kvu * job->splits + s);
            const REAL *ml = part + (or_ssize)rows * dvp;   /* m, then l */
            const REAL ms = ml[r], ls = ml[rows + r];
            if (ls == 0)    /* no key in this split (else l > 0, or NaN even where m is -inf) */
                continue;
            const REAL f = EXP(ms - mmax);
            lsum += ls * f;
            for (int x = 0; x < dv; x++)
                out[x] += part[(or_ssize)r * dvp + x] * f;
        }
        /* lsum is 0 only for a row that saw no key; a NaN carries on */
        const REAL inv = lsum != 0 ? 1 / lsum : 0;
        const REAL lse = lsum != 0 ? mmax + LOG(lsum) : -INFINITY;
        for (int x = 0; x < dv; x++)
            out[x] *= inv;
        const or_ssize u = u0 + r / nq, i = r % nq;
        FN(store_rows)(FN(row_ptr)(p, OR_O, u, i), p->view[OR_O].row_stride, out, dvp, 1, dv,
                       p->view[OR_O].dtype);
        FN(store_rows)(FN(row_ptr)(p, OR_LSE, u, i), p->view[OR_LSE].row_stride, &lse, 1, 1, 1,
                       p->view[OR_LSE].dtype);
    }
}

/* A work item: one split of job->heads kv units, in an instance for their key and value dtype;
 * the last of a kv unit's splits to finish merges them. */
static void FN(decode_item)(void *vjob, or_ssize item, int worker)
{
    const or_job *job = vjob;
    switch (job->p->view[OR_K].dtype) {
#define OR_SPLIT(id, ...) case id: FN(decode_split)(job, item, worker, id); break;
    OR_DTYPES(OR_SPLIT)
#undef OR_SPLIT
    }
    const or_ssize kv0 = item / job->splits * job->heads;
    for (or_ssize kvu = kv0; kvu < kv0 + job->heads; kvu++)
        if (__atomic_add_fetch(&job->splits_done[kvu], 1, __ATOMIC_ACQ_REL) == job->splits)
            FN(decode_combine)(job, kvu, worker);
}

#undef DVL
#undef NKEYS
#undef DROWS
#undef PV_ACC
#undef DECODE_DOTS
