/* params.h - the contract between the host (csrc/) and the kernels (the native ones in csrc/
 * and the OpenCL C ones beside this file), written once in the subset of C99 that OpenCL C 1.2
 * also accepts. The C files include it; setup.py embeds it ahead of the .cl sources, so every
 * OpenCL program starts with it.
 *
 *   - the operand slots and the per-unit meta table the OpenCL kernels index;
 *   - the score parameters (or_params), passed to every attention kernel as one struct;
 *   - the mask rule: which keys a query row sees (key_range / query_range);
 *   - the dropout stream: Philox4x32-10, keyed by (seed, batch-head, row, column);
 *   - the OpenCL kernel families, the wg family's work-group layout, and the local tiles of
 *     each kernel, from which the host sizes its blocks; the row of the split-KV decode's
 *     scratch.
 *
 * Adding a score modifier: a field in OR_PARAMS, the rule below if it masks, and its use in
 * the kernels.
 */
#ifndef ORCHARD_PARAMS_H
#define ORCHARD_PARAMS_H

/* OpenCL storage codes (-DOR_STORAGE), one per row of csrc/dtypes.h */
#define OR_STORAGE_F16 16
#define OR_STORAGE_F32 32
#define OR_STORAGE_F64 64
#define OR_STORAGE_BF16 116

#ifdef __OPENCL_C_VERSION__
typedef long or_i64;
typedef ulong or_u64;
typedef int or_i32;
typedef uint or_u32;
#define OR_FN inline
/* the compute type of a program: double for float64 storage, else float */
#if OR_STORAGE == OR_STORAGE_F64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define REAL_T double
#else
#define REAL_T float
#endif
typedef REAL_T real;
#else
#include <stdint.h>
typedef int64_t or_i64;
typedef uint64_t or_u64;
typedef int32_t or_i32;
typedef uint32_t or_u32;
#define OR_FN static inline
#endif

#define OR_MAX_HEAD_DIM 256     /* largest head dim (q/k and v); build_info() tells Python */

/* Operand slots of a call; forward uses Q..LSE, backward all of them. */
#define OR_Q 0
#define OR_K 1
#define OR_V 2
#define OR_O 3
#define OR_LSE 4
#define OR_DO 5
#define OR_DQ 6
#define OR_DK 7
#define OR_DV 8
#define OR_NSLOTS 9
/* the slots' names, as the Python API names the arguments (host code's messages) */
#define OR_SLOT_NAMES {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}

/* The OpenCL meta table (64-bit words). A header of OR_META_HEAD words: OR_NSLOTS row strides in
 * elements, then the geometry of a paged call's keys and values (FlashAttention's block_table;
 * zeros when not paged): keys per page and the K and V page strides in elements. Then per
 * unit OR_NSLOTS element offsets followed by nq, nk, the unit's first row in the backward's
 * per-row buffers (D and dQ accumulators): the nq of the units before it, so that they hold
 * the rows there are (a packed batch of many short sequences and one long one, padded to its
 * longest, needed gigabytes); and, for paged keys, the word of the table where its page list
 * starts (-1: not paged) and the row of its key 0 in the list's first page. The page lists
 * (page numbers, from the first page a unit reads) follow the units: key j of a paged kv unit
 * is row (first + j) % rows of page list[(first + j) / rows], its offset and row stride within
 * that page those of slot K or V. */
#define OR_META_PAGE_ROWS OR_NSLOTS
#define OR_META_PAGE_K (OR_NSLOTS + 1)
#define OR_META_PAGE_V (OR_NSLOTS + 2)
#define OR_META_HEAD (OR_NSLOTS + 3)
#define OR_UNIT_WORDS (OR_NSLOTS + 5)
#define OR_UNIT_NQ OR_NSLOTS
#define OR_UNIT_NK (OR_NSLOTS + 1)
#define OR_UNIT_ROW0 (OR_NSLOTS + 2)
#define OR_UNIT_PAGES (OR_NSLOTS + 3)
#define OR_UNIT_FIRST (OR_NSLOTS + 4)

/* The score parameters: X(kind, name), in struct order. 64-bit fields first, then the reals,
 * then the 32-bit ones, so that host and device lay the struct out alike. REAL is float, or
 * double for float64 problems. */
#define OR_PARAMS(X)                                                                         \
    X(I64, left)          /* visible keys j - (i + nk - nq) in [-left, right]; -1 = unbounded; */ \
    X(I64, right)         /*   causal is already folded into right */                        \
    X(U64, seed)          /* dropout seed */                                                 \
    X(REAL, scale)        /* score = scale * q.k ... */                                      \
    X(REAL, softcap)      /* ... then softcap * tanh(score / softcap); 0 = off */            \
    X(REAL, drop_scale)   /* 1 / (1 - dropout_p) */                                          \
    X(I32, has_alibi)     /* ... then - slope * |i + nk - nq - j|, slope per unit */         \
    X(I32, dropout)       /* 0 = off */                                                      \
    X(I32, group)         /* query heads per kv head: unit u reads kv unit u / group */      \
    X(U32, threshold)     /* dropout keeps a score iff its Philox word >= threshold */

#define OR_FIELD_I64(name) or_i64 name;
#define OR_FIELD_U64(name) or_u64 name;
#define OR_FIELD_I32(name) or_i32 name;
#define OR_FIELD_U32(name) or_u32 name;
#define OR_FIELD(kind, name) OR_FIELD_##kind(name)
#ifdef __OPENCL_C_VERSION__
#define OR_FIELD_REAL(name) real name;
typedef struct { OR_PARAMS(OR_FIELD) } or_params;
/* The host passes the size of the struct it sends (-DOR_PARAMS_SIZE): a program whose struct
 * differs fails to build here, rather than read shifted fields. */
typedef char or_params_size_matches_host[sizeof(or_params) == OR_PARAMS_SIZE ? 1 : -1];
#else
#define OR_FIELD_REAL(name) double name;
typedef struct { OR_PARAMS(OR_FIELD) } or_params;      /* the host's copy, reals in double */
#undef OR_FIELD_REAL
#define OR_FIELD_REAL(name) float name;
typedef struct { OR_PARAMS(OR_FIELD) } or_params_f;    /* what float programs receive */
#endif
#undef OR_FIELD_REAL

/* The mask rule. Query row i of nq sees key j of nk iff
 *   j >= i + nk - nq - left (when left >= 0)  and  j <= i + nk - nq + right (when right >= 0).
 * Keys [*lo, *hi) that query rows [i0, i1) may see; the rest of their rows is masked. */
OR_FN void or_key_range(or_i64 left, or_i64 right, or_i64 nq, or_i64 nk, or_i64 i0, or_i64 i1,
                        or_i64 *lo, or_i64 *hi)
{
    const or_i64 off = nk - nq;
    *lo = 0;
    *hi = nk;
    if (left >= 0 && i0 + off - left > 0)
        *lo = i0 + off - left;
    if (right >= 0 && i1 + off + right < nk)
        *hi = i1 + off + right;
    if (*hi < *lo)
        *hi = *lo;
}

/* Query rows [*lo, *hi) that may see keys [j0, j1): the inverse of or_key_range. */
OR_FN void or_query_range(or_i64 left, or_i64 right, or_i64 nq, or_i64 nk, or_i64 j0, or_i64 j1,
                          or_i64 *lo, or_i64 *hi)
{
    const or_i64 off = nk - nq;
    *lo = 0;
    *hi = nq;
    if (right >= 0 && j0 - off - right > 0)
        *lo = j0 - off - right;
    if (left >= 0 && j1 - off + left < nq)
        *hi = j1 - off + left;
}

/* Whether row i sees key j (the same rule, for one score). */
OR_FN int or_visible(or_i64 left, or_i64 right, or_i64 diag, or_i64 j)
{
    return !((left >= 0 && j < diag - left) || (right >= 0 && j > diag + right));
}

/* Dropout: Philox4x32-10 (Salmon et al., SC'11), a counter-based generator, so the
 * keep-decision of score (batch-head bh, row i, column j) is a pure function of
 * (seed, bh, i, j): backward regenerates the mask instead of storing it, and every backend
 * draws the same one.
 *   key     = (seed lo, seed hi)
 *   counter = (j / 4, i, bh lo, bh hi);   word j % 4 of the output block
 *   keep    = word >= threshold,          threshold = floor(p * 2^32)
 * Tests check it against Random123's known-answer vectors. */
OR_FN void or_philox4x32_10(or_u32 c[4], or_u32 k0, or_u32 k1)
{
    for (int round = 0; round < 10; round++) {
        const or_u64 p0 = (or_u64)0xD2511F53u * c[0];
        const or_u64 p1 = (or_u64)0xCD9E8D57u * c[2];
        const or_u32 n0 = (or_u32)(p1 >> 32) ^ c[1] ^ k0;
        const or_u32 n2 = (or_u32)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (or_u32)p1;
        c[3] = (or_u32)p0;
        c[0] = n0;
        c[2] = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* The output block of column group j / 4 of row `row`: c[j % 4] is column j's word. */
OR_FN void or_philox_block(or_u64 seed, or_u64 bh, or_u32 row, or_u32 j, or_u32 c[4])
{
    c[0] = j / 4;
    c[1] = row;
    c[2] = (or_u32)bh;
    c[3] = (or_u32)(bh >> 32);
    or_philox4x32_10(c, (or_u32)seed, (or_u32)(seed >> 32));
}

/* Whether score (bh, row, col) survives dropout. Word col % 4 is chosen bit by bit:
 * Oclgrind 21.10 mis-simulates the lookup table that LLVM makes of a four-way choice. */
OR_FN int or_dropout_keep(or_u64 seed, or_u64 bh, or_u32 row, or_u32 col, or_u32 threshold)
{
    or_u32 c[4];
    or_philox_block(seed, bh, row, col, c);
    const or_u32 lo = (col & 1) ? c[1] : c[0], hi = (col & 1) ? c[3] : c[2];
    return ((col & 2) ? hi : lo) >= threshold;
}

/* keep[c] = whether score (bh, row, j0 + c) survives, for c in [0, n): a row at a time, one
 * Philox block per four columns. */
OR_FN void or_dropout_row(or_u64 seed, or_u64 bh, or_u32 row, or_u32 j0, int n,
                          or_u32 threshold, unsigned char *keep)
{
    or_u32 block = 0xFFFFFFFFu, c[4] = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) {
        const or_u32 j = j0 + (or_u32)i;
        if (j / 4 != block) {
            block = j / 4;
            or_philox_block(seed, bh, row, j, c);
        }
        keep[i] = c[j % 4] >= threshold;
    }
}

#ifndef __OPENCL_C_VERSION__
static inline or_u32 or_dropout_threshold(double p) { return (or_u32)(p * 4294967296.0); }
#endif

/* OpenCL kernel families (the host's table in cl_runtime.c says which kernels each has and
 * when it runs; a program is built for one family, -DOR_FAMILY=...). */
#define OR_FAMILY_ROWS 0        /* a query (or key) row per work-item: GPUs */
#define OR_FAMILY_TILED 1       /* a block per single-work-item group, register tiles: CPUs */
#define OR_FAMILY_WG 2          /* a block per work-group, register micro-tiles per work-item:
                                   GPUs, as FlashAttention-2 */
#define OR_NFAMILIES 3

/* Split-KV decoding (flash_decode.cl). A row of the scratch of partial outputs holds the head
 * dim of v rounded up to 8 reals, so that the rows family, of either vector width (4 or 8),
 * writes whole vectors. */
#define OR_DECODE_ROW(dv) (((dv) + 7) / 8 * 8)

/* A work-group of the split kernel takes the query rows of bq / nq whole units of a GQA group
 * (when nq <= bq), or bq rows of one unit, so that its rows see one range of keys. Blocks that
 * `group` units of nq rows need (more for a larger nq: the host launches those of the
 * longest, and the blocks a shorter group does not need return at once): */
OR_FN or_i64 or_decode_blocks(or_i64 nq, or_i64 group, or_i64 bq)
{
    const or_i64 parts = (nq + bq - 1) / bq, per = nq > 0 && nq <= bq ? bq / nq : 1;
    return parts * ((group + per - 1) / per);
}

/* The tiled family's register tile: OR_TM(vw) rows by OR_TN(vw) columns (two vectors of vw
 * lanes). Sixteen lanes are AVX-512's: its 32 registers hold 8 x 2 accumulators; eight lanes
 * (AVX) have 16 registers, for 6 x 2. Blocks of rows and keys are whole multiples of
 * or_tiled_step(vw), the least common multiple of the two, since each serves as the rows of
 * one product and the columns of another. */
#define OR_TM(vw) ((vw) == 16 ? 8 : 6)
#define OR_TN(vw) (2 * (vw))
OR_FN int or_tiled_step(int vw)
{
    int a = OR_TM(vw), b = OR_TN(vw);
    while (b != 0) {
        const int t = a % b;
        a = b;
        b = t;
    }
    return OR_TM(vw) / a * OR_TN(vw);
}

/* Local tiles of the register-tiled kernels, X(name, reals), from the head dims d, dv, their
 * widths padded to whole register tiles dt, dvt (tiles.cl) and the blocks tq, tk. The kernels
 * declare their tiles from these lists; the host sums them to choose blocks that fit. */
#define OR_TILED_FWD_TILES(X, d, dv, dt, dvt, tq, tk)                                        \
    X(qt, (d) * (tq)) X(kb, (tk) * (d)) X(vs, (tk) * (dvt))                                  \
    X(st, (tk) * (tq)) X(o, (tq) * (dvt)) X(m, (tq)) X(l, (tq))
#define OR_TILED_DECODE_TILES(X, d, dv, dt, dvt, tq, tk)                                     \
    X(qs, (tq) * (d)) X(kt, (d) * (tk)) X(vs, (tk) * (dvt))                                  \
    X(s, (tq) * (tk)) X(o, (tq) * (dvt)) X(m, (tq)) X(l, (tq))
#define OR_TILED_BWD_TILES(X, d, dv, dt, dvt, tq, tk)                                        \
    X(kt, (d) * (tk)) X(vt, (dv) * (tk)) X(kb, (tk) * (dt))                                  \
    X(dka, (tk) * (dt)) X(dva, (tk) * (dvt))                                                 \
    X(qs, (tq) * (dt)) X(dos, (tq) * (dvt)) X(dqs, (tq) * (dt))                              \
    X(s, (tq) * (tk)) X(dp, (tq) * (tk)) X(dcap, (tq) * (tk))                                \
    X(lse_t, (tq)) X(di_t, (tq))

/* The wg family's work-group (wg.cl): OR_WG_LANES work-items share each row of a block's
 * scores, and each owns OR_WG_TM of its rows, so a block of bq rows runs
 * bq / OR_WG_TM x OR_WG_LANES work-items. bq is a multiple of OR_WG_TM, bk of OR_WG_LANES. */
#define OR_WG_LANES 16
#define OR_WG_TM 4
#define OR_WG_THREADS(bq) ((bq) / OR_WG_TM * OR_WG_LANES)

/* Its local tiles, X(name, reals), from the head dims d, dv and the blocks bq (rows of the
 * micro-tiles: query rows, or key rows in dK/dV) and bk (their columns). A tile row of n reals
 * is OR_WG_LD(n) long: whole vectors of 4 (wg.cl reads vectors), one vector more so that
 * lanes reading vectors of different rows meet different local-memory banks. The forward's row
 * reductions without subgroups (bq x OR_WG_LANES) use ps's memory. */
#define OR_WG_LD(n) (((n) + 3) / 4 * 4 + 4)
#define OR_WG_MAX(a, b) ((a) > (b) ? (a) : (b))
#define OR_WG_FWD_TILES(X, d, dv, bq, bk)                                                    \
    X(qs, (bq) * OR_WG_LD(d)) X(kvs, (bk) * OR_WG_LD(OR_WG_MAX(d, dv)))                       \
    X(ps, (bq) * OR_WG_LD(bk))
#define OR_WG_BWD_TILES(X, d, dv, bq, bk)                                                    \
    X(rs, (bq) * OR_WG_LD(d)) X(rvs, (bq) * OR_WG_LD(dv)) X(cs, (bk) * OR_WG_LD(d))           \
    X(cvs, (bk) * OR_WG_LD(dv)) X(ps, (bq) * OR_WG_LD(bk)) X(ds, (bq) * OR_WG_LD(bk))         \
    X(lse_t, (bk)) X(di_t, (bk))

#endif
