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

typedef ptrdiff_t or_ssize;

typedef enum { OR_F16 = 0, OR_F32 = 1, OR_F64 = 2 } or_dtype;

/* Operand slots of a call; forward uses Q..LSE, backward all of them. */
enum { OR_Q, OR_K, OR_V, OR_O, OR_LSE, OR_DO, OR_DQ, OR_DK, OR_DV, OR_NSLOTS };

typedef struct {
    char *base;             /* data pointer of the array */
    or_dtype dtype;
    or_ssize row_stride;    /* bytes between rows (between elements, for lse) */
    const or_ssize *offs;   /* byte offset of each unit's row 0; q-side slots are indexed
                               by query unit, k/v/dk/dv slots by kv unit */
} or_view;

typedef struct {
    or_ssize n_units;       /* query batch-heads; unit index = dropout batch-head index */
    or_ssize group;         /* query heads per kv head: unit u reads kv unit u / group */
    const or_ssize *nq;     /* per unit: query rows */
    const or_ssize *nk;     /* per unit: key rows */
    int d, dv;
    double scale;
    double softcap;         /* 0 = off */
    const double *slopes;   /* per unit ALiBi slope, or NULL */
    or_ssize left, right;   /* visible keys j - (i + nk - nq) in [-left, right]; -1 = unbounded;
                               causal is already folded into right */
    int dropout;            /* 0 = off */
    uint32_t drop_threshold;/* keep iff philox word >= threshold */
    double drop_scale;      /* 1 / (1 - p) */
    uint64_t seed;
    or_view view[OR_NSLOTS];
} or_problem;

/* Status codes of the compute functions (they run without the GIL). */
enum { OR_OK = 0, OR_ENOMEM = 1 };

/* attn_native.c */
int or_native_fwd(const or_problem *p);
int or_native_bwd(const or_problem *p);

/* threadpool.c: work items 0..n-1 handed out dynamically; worker ids are 0..nworkers-1. */
typedef void (*or_task)(void *ctx, or_ssize item, int worker);
int  or_pool_acquire(or_ssize n_items);     /* how many workers this call may use (>= 1) */
void or_pool_run(int nworkers, or_ssize n_items, or_task fn, void *ctx);
void or_pool_release(int nworkers);
void or_set_num_threads(int n);
int  or_get_num_threads(void);
int  or_cpu_count(void);

#endif
