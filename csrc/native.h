/* native.h - the contract between the native drivers (attn_native.c), which plan a call and
 * hand out its work items, and the kernels, compiled once per instruction set (isa_*.c, each
 * including native_kernels.h) and chosen at run time (native_isa.c).
 *
 * A kernel set is a table of work-item functions, each in a float instance (float16, bfloat16
 * and float32 inputs) and a double one (float64), the forward's also in a bfloat16 one in sets
 * with bfloat16 dot products, plus the tile width its tiles are padded to.
 */
#ifndef ORCHARD_NATIVE_H
#define ORCHARD_NATIVE_H

#include "orchard.h"

/* Query rows per block (key rows per block, BC, are the kernel set's). Each block streams its
 * unit's keys and values from L2 or L3, so taller blocks read them less often per product:
 * 192 against 96, one process, best of 20-40 calls each (Sapphire Rapids, set amx, 2 threads):
 * B2 H16 N4096 D128 float32 forward 0.96x the time, backward 0.96x; B2 H8 N4096 D128
 * bfloat16 forward 0.90x, backward 0.84x; B4 H8 N1024 D64 0.92-1.01x; float16 1.00x; set
 * avx2 on the same machine 0.98-1.00x (an AMD EPYC had read 0.97-1.03x). */
#define BR 192
/* Bytes of a backward's chunk of keys (attn_native_impl.h bwd_chunk). A unit's whole key
 * range per query block fell off a cliff on two threads of a Sapphire Rapids Xeon: D 128 ran at
 * 0.78x the GFLOP/s at N 4096 that it had at N 2048. In chunks of 4 MiB, A/B against whole
 * units: N 8192-16384 D 128 0.90x the time, N 4096 D 256 0.87x; 1 MiB left D 256 one block of
 * keys a chunk, its query blocks loaded for each, 1.04-1.06x. */
#define OR_BWD_CHUNK_BYTES ((size_t)4 << 20)
/* Leading dimension of a transposed block of bc keys (load_cols_blocked) of REALs of `real`
 * bytes: a cache line more than bc. Rows 512 bytes apart (bc 128 floats) fall in 8 of the 64
 * L1 sets, and the 128 rows of a column panel at d 128 overflowed their 12 ways. */
#define OR_BLOCK_LD(bc, real) ((bc) + 64 / (int)(real))

/* Leading dimension of a tile of rows of `cols` REALs that a matrix product reads down its
 * columns (the forward's values, P V): a cache line more where the rows would lie a multiple of
 * 512 bytes apart, for the same reason: float32 forward at d 128 0.95x the time (AVX2 EPYC,
 * 2 threads); at d 64 (256 bytes) padding measured 1.02x, so it stops at 512. */
static inline or_ssize or_rows_ld(or_ssize cols, size_t real)
{
    return cols * (or_ssize)real % 512 == 0 ? cols + 64 / (or_ssize)real : cols;
}

/* Leading dimension of the backward's tiles of rows of d REALs of `real` bytes (q, dO, O, k, dQ,
 * dK, dV), d padded to the set's tile width (bytes): or_rows_ld's, so that a column panel of
 * them (the right-hand side of dK += dS^T q, dV += P^T dO, dQ += dS K, BR or BC rows) does not
 * fall in a few L1 sets; with dots (bfloat16 dot products) the padded d alone, on which their
 * pair tiles are laid out. */
static inline int or_bwd_ld(int d, int width, size_t real, int dots)
{
    const int lanes = width / (int)real, padded = (d + lanes - 1) / lanes * lanes;
    return dots ? padded : (int)or_rows_ld(padded, real);
}

/* REALs of the transposed blocks of nk keys of `cols` columns each. */
static inline or_ssize or_blocks_size(or_ssize nk, int bc, size_t real, int cols)
{
    return (nk / bc + 1) * OR_BLOCK_LD(bc, real) * (or_ssize)cols;
}

/* Address of row j of kv unit kvu in K or V (slot), paged or not (orchard.h), and in *run how
 * many rows from it on lie stride apart (to its page's end). */
static inline const char *or_kv_row(const or_problem *p, int slot, or_ssize kvu, or_ssize j,
                                    or_ssize *run)
{
    const or_view *w = &p->view[slot];
    const or_pages *pg = &p->pages;
    if (pg->rows == 0) {
        *run = p->nk[kvu * p->prm.group] - j;
        return w->base + w->offs[kvu] + j * w->row_stride;
    }
    const or_ssize pos = pg->first[kvu] + j, r = pos % pg->rows;
    *run = pg->rows - r;
    return w->base + pg->table[kvu][pos / pg->rows] * (slot == OR_K ? pg->k_stride : pg->v_stride)
           + w->offs[kvu] + r * w->row_stride;
}

/* One native call: the problem, its plan and its temporary buffers. */
typedef struct {
    const or_problem *p;
    char *scratch;          /* nworkers slices of per_worker bytes */
    size_t per_worker;
    or_ssize *order;        /* forward, backward: the items in the order they are handed out */
    or_ssize blocks;        /* forward, backward: query blocks per unit */
    char *kt;               /* forward: every kv unit's keys transposed (see transpose_keys) */
    or_ssize *kt_off;       /* forward: offset of each kv unit in kt, in REALs */
    char *vc;               /* forward: values converted to REAL rows of dvp (ldvc apart) */
    or_ssize *vc_off;       /* forward: offset of each kv unit in vc, in REALs */
    or_ssize ldvc;          /* forward: REALs from one row of vc to the next */
    int v_in_place;         /* forward: values read where they are, not from vc */
    size_t real;            /* forward: bytes of the instance's REAL */
    /* forward with an item per kv unit (attn_native.c fwd_unit_item): the units in the order
     * they are handed out, each packed into its worker's scratch at these byte offsets by
     * `pack` (the instance's transpose_keys_item), then its query blocks run by `fwd` (its
     * fwd_item, order NULL); units NULL where a pre-pass packs the units into kt and vc */
    or_ssize *units;
    const or_ssize *packs;  /* forward pre-pass: the kv units it packs, those with rows */
    size_t unit_kt, unit_vc;
    or_task pack, fwd;
    or_ssize nk_max;        /* backward: longest key sequence */
    or_ssize nq_max;        /* backward: longest query sequence */
    or_ssize parts;         /* backward: parts of each kv unit's keys, an item each */
    or_ssize part_keys;     /* backward: keys per part (a multiple of BC; nk_max if one part) */
    /* backward of several parts: each item's dQ, of its part's keys alone, for every query
     * row of its unit (blocks x BR rows a query head, or_bwd_ld apart); bwd_sum_item adds a
     * query block's over the parts, in part order, and stores it */
    char *part_dq;
    int part_ld;            /* backward: REALs from one row of part_dq to the next (the tiles') */
    or_ssize splits;        /* decode: splits per kv unit, of split_keys keys each */
    or_ssize split_keys;
    char *part;             /* decode: every item's partial results (attn_decode_impl.h) */
    int *splits_done;       /* decode: per kv unit, its splits finished (atomic) */
    or_ssize part_stride;   /* decode: REALs per item in part */
    int stream_lines;       /* decode: every line of the next block asked for, contiguous or not */
    or_ssize heads;         /* decode: kv units per item (side by side in memory, else 1) */
    or_ssize step_keys;     /* decode: keys per chunk read (BC, or fewer for side-by-side units) */
} or_job;

/* Forward: where kv unit kvu's keys transposed and values converted lie for `worker`: in the
 * call's kt and vc after a pre-pass, or in the worker's scratch where its item packed them. */
static inline void *or_unit_kt(const or_job *job, or_ssize kvu, int worker)
{
    return job->units ? job->scratch + (size_t)worker * job->per_worker + job->unit_kt
                      : job->kt + job->real * (size_t)job->kt_off[kvu];
}

static inline void *or_unit_vc(const or_job *job, or_ssize kvu, int worker)
{
    return job->units ? job->scratch + (size_t)worker * job->per_worker + job->unit_vc
                      : job->vc + job->real * (size_t)job->vc_off[kvu];
}

/* The instances of a set's kernels, by what they compute in: the indexes of or_kernels' arrays.
 * OR_IN_BF16_DOTS: the forward and backward for bfloat16 q, k, v (and dO) with their matrix
 * products on bfloat16 dot products (attn_bf16_impl.h); OR_IN_F16_TILES: the forward for
 * float16 q, k, v on AMX tiles, each value split into two bfloat16 (attn_f16_split_impl.h; its
 * backward is the float one). NULL in sets without them. */
enum { OR_IN_FLOAT, OR_IN_DOUBLE, OR_IN_BF16_DOTS, OR_IN_F16_TILES, OR_N_INSTANCES };

/* The work-item functions of one instruction set, by instance (OR_IN_*); decode_item and
 * bwd_sum_item by REAL (0: float, 1: double). */
typedef struct {
    const char *name;           /* ORCHARD_ISA's value for this set */
    int width;                  /* bytes: tile rows (d, dv) are padded to a multiple of it */
    int block_keys;             /* BC: keys per block */
    /* the most query rows a unit of a decode step (orchard.h or_is_decode) on bfloat16 dot
     * products (OR_IN_BF16_DOTS) may have for the split-KV path; more go to the forward */
    int decode_bf16_rows;
    or_task transpose_keys_item[OR_N_INSTANCES], fwd_item[OR_N_INSTANCES],
        bwd_item[OR_N_INSTANCES], bwd_sum_item[2], decode_item[2];
    size_t (*bwd_scratch[OR_N_INSTANCES])(const or_job *job);   /* REALs per worker */
} or_kernels;

/* Keys per step of the decode's score and value loops (attn_decode_impl.h): a block of keys is
 * a multiple of it. */
#define OR_DECODE_KEYS 8

#define OR_MAX_KERNEL_SETS 8    /* room for every set isa_*.c compiles */

/* native_isa.c: the set in use (chosen at import: the widest this CPU runs, or ORCHARD_ISA),
 * the sets this CPU can run, best last, and a switch between them (-1 if name is not one). */
const or_kernels *or_native_kernels(void);
int or_native_isas(const or_kernels **out, int max);
int or_set_native_isa(const char *name);

#endif
