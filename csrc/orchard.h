/* orchard.h - types shared by the parts of orchard_ops.
 *
 * The kernels never see Python objects. The module turns every call into an or_problem:
 * a list of "units" (one batch-head each), and for every operand a view giving the byte
 * offset of each unit's first row and the byte stride between rows. The last dimension of
 * every operand is contiguous; anything else was staged into a copy by marshal.c.
 */
#ifndef ORCHARD_H
#define ORCHARD_H

#include <stddef.h>
#include <stdint.h>

#include "dtypes.h"
#include "params.h"     /* kernels/: slots, score parameters, mask rule, Philox */

typedef ptrdiff_t or_ssize;

/* Limits, checked by args.c before anything is allocated. The dropout stream numbers a
 * score's row and column with 32 bits each (kernels/params.h) and the OpenCL
 * kernels count the query heads of a GQA group in an int; larger sizes are refused with
 * ValueError rather than computed wrongly. Everything else is indexed with 64 bits. */
#define OR_MAX_SEQ_LEN 0xFFFFFFFFLL         /* rows or keys of one sequence: < 2**32 */
#define OR_MAX_HEADS 0x7FFFFFFFLL           /* query heads: < 2**31 */
#define OR_STR(x) OR_STR_(x)                /* a macro's value as a string literal */
#define OR_STR_(x) #x

typedef struct {
    char *base;             /* data pointer of the array */
    char *lo;               /* lowest address of the array's memory, and its extent: */
    size_t nbytes;          /*   what a device buffer must cover */
    int itemsize;
    or_dtype dtype;
    or_ssize row_stride;    /* bytes between rows (between elements, for lse) */
    void *mem;              /* a device-resident operand's cl_mem (a DeviceArray), whose base
                               and lo then only place the offsets (they address no memory);
                               NULL for host memory */
    const or_ssize *offs;   /* byte offset of each unit's row 0; q-side slots are indexed
                               by query unit, k/v/dk/dv slots by kv unit */
} or_view;

/* Paged keys and values (FlashAttention's block_table), when rows > 0: K and V lie in pages of
 * `rows` rows, k_stride and v_stride bytes apart, and key j of kv unit w is row r of page
 * table[w][t], (t, r) = divmod(first[w] + j, rows), at that row's address plus offs[w] (the
 * head's offset within a row) in its view. The forward reads them in place on every device (the
 * OpenCL kernels through the meta table's page lists, kernels/params.h); no backward takes
 * pages. */
typedef struct {
    or_ssize rows;                  /* keys per page; 0: K and V are not paged */
    or_ssize count;                 /* pages in K and V */
    or_ssize k_stride, v_stride;
    char *lo[2];                    /* the extent of all of K's pages and of V's (the views */
    size_t nbytes[2];               /*   of K and V cover page 0) */
    const int64_t *const *table;    /* per kv unit: its sequence's row of the block table */
    const or_ssize *first;          /* per kv unit: the page position of its key 0 */
} or_pages;

typedef struct {
    or_ssize n_units;       /* query batch-heads; unit index = dropout batch-head index */
    const or_ssize *nq;     /* per unit: query rows */
    const or_ssize *nk;     /* per unit: key rows */
    int d, dv;
    or_params prm;          /* scale, masks, softcap, dropout, GQA group: what kernels read */
    const double *slopes;   /* per unit ALiBi slope when prm.has_alibi, else NULL */
    or_view view[OR_NSLOTS];
    or_pages pages;
} or_problem;

/* Decoding: a forward whose units all have at most OR_DECODE_MAX_QUERIES query rows (one
 * new token, or a few speculative ones) takes the split-KV path of its backend (Flash-Decoding):
 * the keys of every kv unit are split across threads or work-groups, all query rows of a GQA
 * group share one read of each key and value, and one exact pass combines the splits. */
#define OR_DECODE_MAX_QUERIES 16
static inline int or_is_decode(const or_problem *p)
{
    for (or_ssize u = 0; u < p->n_units; u++)
        if (p->nq[u] > OR_DECODE_MAX_QUERIES)
            return 0;
    return p->n_units > 0;
}

/* Backward work items: where there are fewer kv units than OR_BWD_ITEMS, each unit's keys go
 * in parts, an item each (a task of the native path's threads, a work-group of the OpenCL tiled
 * family's, which a CPU device runs on its cores), so that a call of fewer kv units than threads
 * still keeps every thread busy: enough parts for OR_BWD_ITEMS items or more, as long as the
 * longest unit's parts keep OR_BWD_PART_KEYS keys or more (rounded up to whole blocks; its last
 * part and a shorter unit's hold the rest), the part count, and with it every result bit,
 * following from the problem alone, never the thread count. Each part keeps its dQ (of its keys
 * alone, every query row of its unit) in a buffer of its own, the parts' added in part order
 * after; at most OR_BWD_PART_DQ_BYTES of them (less where a device's buffers are smaller). */
#define OR_BWD_ITEMS 16
#define OR_BWD_PART_KEYS 1024
#define OR_BWD_PART_DQ_BYTES ((size_t)256 << 20)

/* The parts of a backward of n_kv kv units, the longest of nk_max keys, in blocks of bk keys,
 * part_bytes the dQ buffer of one part, most_bytes what all may take (OR_BWD_PART_DQ_BYTES or
 * less): their count, and in *part_keys the keys of each (the last part's rest excepted). */
static inline or_ssize or_bwd_parts(or_ssize n_kv, or_ssize nk_max, or_ssize bk, double part_bytes,
                                    double most_bytes, or_ssize *part_keys)
{
    or_ssize parts = n_kv > 0 ? (OR_BWD_ITEMS + n_kv - 1) / n_kv : 1;
    if (parts > nk_max / OR_BWD_PART_KEYS)
        parts = nk_max / OR_BWD_PART_KEYS;
    if (parts > 1 && parts * part_bytes > most_bytes)
        parts = (or_ssize)(most_bytes / part_bytes);
    if (parts <= 1 || part_bytes == 0) {    /* part_bytes 0: no query rows to share */
        *part_keys = nk_max;
        return 1;
    }
    *part_keys = ((nk_max + parts - 1) / parts + bk - 1) / bk * bk;
    return (nk_max + *part_keys - 1) / *part_keys;
}

/* Status codes of the compute functions (they run without the GIL). */
enum { OR_OK = 0, OR_ENOMEM = 1, OR_EDEVICE = 2 };

/* A device failure, filled without the GIL and raised by module.c as OrchardError (or
 * OrchardOutOfMemory for the out-of-memory codes). */
typedef struct {
    int cl_code;            /* the OpenCL error code, 0 if none */
    char msg[512];          /* "clBuildProgram failed: CL_BUILD_PROGRAM_FAILURE (-11)" */
    char *log;              /* build log, malloc'd, or NULL */
} or_error;

/* Counters of stats(), one set per device; updated with atomics, from any thread. */
typedef struct {
    long long fwd_calls, decode_calls, bwd_calls, zero_copy_buffers, staged_buffers, bytes_staged,
        kernel_builds, cache_hits;
    /* operand data copied between host memory and device-owned buffers: to_device() and
     * DeviceArray.numpy(), and a host-array call's copies on a device without shared memory */
    long long host_to_device, host_to_device_bytes, device_to_host, device_to_host_bytes;
} or_counters;
#define OR_COUNT(ct, field, n) __atomic_fetch_add(&(ct)->field, (long long)(n), __ATOMIC_RELAXED)

/* devices.c: index 0 is the native CPU, 1 + i the i-th OpenCL device */
int or_device_count(void);
or_counters *or_device_counters(int device);

/* attn_opencl.c: the OpenCL backend (OR_EDEVICE when built without it) */
int or_cl_fwd(int cl_index, const or_problem *p, or_counters *ct, or_error *err);
int or_cl_bwd(int cl_index, const or_problem *p, or_counters *ct, or_error *err);

/* attn_native.c */
int or_native_fwd(const or_problem *p);
int or_native_decodes(const or_problem *p);     /* or_native_fwd takes the split-KV path */
int or_native_bwd(const or_problem *p);

/* threadpool.c: work items 0..n-1 handed out dynamically; worker ids are 0..nworkers-1. */
typedef void (*or_task)(void *ctx, or_ssize item, int worker);
int  or_pool_acquire(or_ssize n_items);     /* how many workers this call may use (>= 1) */
void or_pool_run(int nworkers, or_ssize n_items, or_task fn, void *ctx);
void or_pool_release(int nworkers);
#define OR_MAX_THREADS 4096
/* The largest OpenCL block (rows or keys) a tuned record or ORCHARD_CL_BLOCK_Q/K may name. */
#define OR_CL_MAX_BLOCK 4096
void or_set_num_threads(int n);     /* 1..OR_MAX_THREADS */
int  or_get_num_threads(void);
const char *or_bad_threads_env(void);   /* an ORCHARD_NUM_THREADS not in 1..OR_MAX_THREADS, or NULL */
const char *or_pool_runtime(void);    /* "orchard", or "openmp: " and its runtime's file */
int  or_cpu_count(void);

/* cl_cache.c: the cache directory (made, 0700) in out; 0 when the cache is off or impossible */
int or_cache_dir(char *out, size_t size);

/* log.c: an on/off variable (on: set to anything but empty, 0, false, no or off, in any
 * case), and the optional diagnostic logs */
int or_env_flag(const char *env_name);
void or_log(const char *fmt, ...);

#endif
