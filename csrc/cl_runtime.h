/* cl_runtime.h - OpenCL devices, their contexts and queues, and the attention programs built
 * for them (cl_runtime.c); program binaries are cached on disk (cl_cache.c). */
#ifndef ORCHARD_CL_RUNTIME_H
#define ORCHARD_CL_RUNTIME_H
#ifdef ORCHARD_HAVE_OPENCL

#include "cl_api.h"
#include "orchard.h"

typedef struct {
    char name[256], vendor[256], platform[256], platform_version[256], driver[256], version[256];
    const char *kind;               /* "cpu", "gpu" or "accelerator" */
    unsigned compute_units;
    unsigned long long global_mem, local_mem;
    size_t max_work_group;
    int fp16, fp64, unified;
    int subgroups;                  /* cl_khr_subgroups or cl_intel_subgroups */
    size_t base_align;              /* CL_DEVICE_MEM_BASE_ADDR_ALIGN, in bytes */
    unsigned long long max_alloc;   /* CL_DEVICE_MAX_MEM_ALLOC_SIZE: the largest buffer */
    unsigned float_width;           /* CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT */
} or_cl_info;

/* A kernel family (params.h's OR_FAMILY_*): one row of or_cl_families. */
typedef struct {
    const char *name;               /* ORCHARD_CL_FAMILY, logs, tuned-block records */
    const char *device_kind;        /* chosen for devices of this kind; NULL: all others */
    const char *fwd, *bwd;          /* forward kernel; backward kernel after flash_bwd_prep */
    const char *bwd2;               /* the backward's second kernel: dK, dV over key rows (rows,
                                       wg), the key parts' dQ added (tiled) */
    const char *decode;             /* the split-KV forward for decoding (flash_decode.cl),
                                       before flash_decode_combine */
    int bq, bk;                     /* default blocks: rows family (work-group rows, keys per
                                       local tile), tiled family (query rows, keys per block),
                                       wg family (block rows, tile rows: wg.cl) */
    int candidates[5][2];           /* the blocks orchard-tune times */
    /* its local-memory rule: fits (bq, bk) to the device; 0 when nothing fits */
    int (*fit)(const or_cl_info *in, size_t real, int d, int dv, int vw, int *bq, int *bk);
    /* the forward's own rule, where its tiles or its best blocks differ from the others' (NULL:
     * the forward runs on the fitted (bq, bk)); it starts from the default blocks or
     * ORCHARD_CL_BLOCK_Q/K, not from a tuned record */
    void (*fit_fwd)(const or_cl_info *in, size_t real, int d, int dv, int vw, int *bq,
                    int *bk);
    /* the backward's own rule, where its best blocks differ (NULL: it runs on the fitted
     * blocks); not where a tuned record or ORCHARD_CL_BLOCK_K sets its keys */
    void (*fit_bwd)(const or_cl_info *in, size_t real, int d, int dv, int vw, int *bq,
                    int *bk);
    /* 1: its decode kernel has blocks of its own (SQ, SK), fitted from the defaults or
     * ORCHARD_CL_BLOCK_Q/K, not from a tuned record; 0: it runs on the backward's (the rows
     * family's split kernel, sharing the rows forward's helpers) */
    int decode_blocks;
} or_cl_family;

extern const or_cl_family or_cl_families[OR_NFAMILIES];

/* Everything a call needs to run on a device; owned by the runtime, valid until exit. */
typedef struct {
    const or_cl_api *api;
    cl_context ctx;
    cl_command_queue queue;
    cl_program program;
    int family;                     /* OR_FAMILY_ROWS, OR_FAMILY_TILED or OR_FAMILY_WG */
    int sq, sk;                     /* the split-KV decode's (decode_blocks), else bq, bk */
    int fq, fk;                     /* the forward's (fit_fwd), else bq, bk */
    int bq, bk;                     /* the backward's: the family's blocks, as in or_cl_family,
                                       from a tuned record or the environment, fitted */
    int prep_rows;                  /* work-group rows of flash_bwd_prep */
    int tile_d;                     /* head dim padded to whole register tiles (tiles.cl DT) */
} or_cl_program;

int or_cl_count(void);                              /* discovers devices on first use */
int or_cl_forked(void);     /* a child fork()ed after OpenCL was loaded: no OpenCL calls */
const or_cl_info *or_cl_info_get(int i);
const char *or_cl_unavailable_reason(void);         /* why there are none, or NULL */

/* The program for (dtype, d, dv) on device i: built or loaded from the cache once. */
int or_cl_get_program(int i, or_dtype dt, int d, int dv, or_counters *ct, or_cl_program *out,
                      or_error *err);

/* The kernel family device i runs (ORCHARD_CL_FAMILY overrides the table's choice; a device
 * whose local memory cannot hold the smallest tiles still falls back to the rows family). */
int or_cl_family_of(int i);

/* The first ORCHARD_CL_* environment variable set to a value orchard cannot use, as a
 * sentence in msg (size bytes): 1; 0 when there is none. Programs are not built meanwhile. */
int or_cl_environment_problem(char *msg, size_t size);

/* Block sizes tuned for device i (orchard-tune), for the kernel family it runs:
 * read (1 when there is a record) and stored (1 when written; not with the cache off). */
int or_cl_tuned_blocks(int i, int *bq, int *bk);
int or_cl_save_tuned_blocks(int i, int bq, int bk);

/* The api, context and queue of device i, made on first use: for buffers that outlive a call
 * (device_array.c). */
typedef struct {
    const or_cl_api *api;
    cl_context ctx;
    cl_command_queue queue;
} or_cl_queue_t;
int or_cl_queue(int i, or_cl_queue_t *out, or_error *err);

/* Fills err for a failed call; returns OR_EDEVICE. */
int or_cl_fail(or_error *err, cl_int code, const char *call);
/* Fills err for a buffer of nbytes for `what` (the argument it holds, say) that clCreateBuffer
 * did not make, with code, naming the sizes; returns OR_EDEVICE. */
int or_cl_buffer_fail(or_error *err, cl_int code, const char *what, size_t nbytes,
                      const or_cl_info *in);
/* Whether the device of `in` can make a buffer of nbytes: at most its largest (where that is
 * known: a failed query leaves 0). */
int or_cl_buffer_fits(const or_cl_info *in, size_t nbytes);
/* A buffer of nbytes on the device of `in`: clCreateBuffer's, where the size is one the device
 * can make (past its largest the specification's CL_INVALID_BUFFER_SIZE, asking nothing). */
int or_cl_new_buffer(const or_cl_api *api, cl_context ctx, const or_cl_info *in,
                     cl_mem_flags flags, size_t nbytes, void *host, const char *what, cl_mem *out,
                     or_error *err);

/* cl_cache.c: program binaries on disk, keyed by a hash of everything that shapes them. */
unsigned char *or_cache_load(const char *key, size_t *size);
int or_cache_store(const char *key, const unsigned char *binary, size_t size);
void or_cache_key(char out[33], const char *const *parts, int nparts);

#endif
#endif
