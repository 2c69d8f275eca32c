/* attn_native.c - exact attention on the CPU: tiled online-softmax forward, recomputing
 * backward, both O(N) in memory.
 *
 * Forward (FlashAttention-2, Dao 2023): for a block of BR query rows, stream over blocks of BC
 * keys, keep a running max m and sum l per row, rescale the output accumulator when m grows;
 * lse = m + log l. Work items are kv units (fwd_unit_item) or, where units are too few to keep
 * the threads busy, (unit, query block), spread over the thread pool.
 * Backward: for every query block, recompute P = exp(S - lse) block by block and use
 * D = rowsum(dO * O): dV += P^T dO, dP = dO V^T, dS = P (dP - D), dQ += dS K, dK += dS^T Q.
 * A work item is a part of a kv unit's keys (all query heads of a GQA group, in order; the
 * whole unit where units alone are items enough), so every dK and dV element is summed by one
 * thread in a fixed order, and dQ too, or else each part's dQ goes to a buffer and the parts'
 * are added in part order after: bit-identical for any thread count.
 *
 * Layouts: every operand is a view (orchard.h); rows are contiguous, units and rows strided.
 * float16 is loaded into float tiles and rounded once on store.
 */
#include <stdlib.h>

#include "native.h"

static size_t round_up(size_t n) { return (n + 63) & ~(size_t)63; }

/* Runs fn over n_items on at most most_workers threads, with per-worker scratch of
 * `per_worker` bytes. */
static int run_job(or_job *job, or_ssize n_items, or_ssize most_workers, or_task fn)
{
    if (n_items == 0)
        return OR_OK;
    int nworkers = or_pool_acquire(n_items < most_workers ? n_items : most_workers);
    job->scratch = aligned_alloc(64, job->per_worker * (size_t)nworkers);
    if (job->scratch == NULL) {
        or_pool_release(nworkers);
        return OR_ENOMEM;
    }
    or_pool_run(nworkers, n_items, fn, job);
    free(job->scratch);
    or_pool_release(nworkers);
    return OR_OK;
}

/* Work items in decreasing order of cost for the dynamic pool, so that it never ends on one
 * long item while the other workers idle (longest first): a ragged varlen batch or a causal
 * mask makes items of very different sizes. Items come in groups of per_group (a kv unit's):
 * groups in decreasing order of their total cost, each group's items in decreasing order of
 * their own (ties in index order), so that a group's keys and values stay in cache while its
 * items run (a causal forward of 32 units of 4,096 keys at D 128 ran 20 % faster than with
 * items ordered by cost alone, which interleaved every unit and read all their keys and
 * values from memory). Every output element still belongs to one item (or is added from its
 * parts' buffers in part order: a backward's dQ), so the order changes no result. Items of
 * cost -1 (no rows: an empty sequence of a varlen batch, a query block past its unit's
 * queries) have no output element and are left out: *live receives how many
 * the order holds (a batch padded to 4,096 sequences, one of them real, 8 heads: each empty
 * item took 0.2-0.7 us to sort and hand out, 6.7-24 ms a call). NULL when out of memory. */
typedef struct {
    double group_cost, cost;
    or_ssize group, item;
} costed;

static int by_cost(const void *a, const void *b)
{
    const costed *x = a, *y = b;
    if (x->group_cost != y->group_cost)
        return x->group_cost < y->group_cost ? 1 : -1;
    if (x->group != y->group)
        return x->group < y->group ? -1 : 1;
    if (x->cost != y->cost)
        return x->cost < y->cost ? 1 : -1;
    return (x->item > y->item) - (x->item < y->item);
}

static or_ssize *costly_first(const or_job *job, or_ssize n, or_ssize per_group,
                              double (*cost)(const or_job *job, or_ssize item), or_ssize *live)
{
    const size_t m = (size_t)(n > 0 ? n : 1);
    costed *c = malloc(sizeof(costed) * m);
    double *group_cost = calloc(m, sizeof(double));
    or_ssize *order = malloc(sizeof(or_ssize) * m);
    if (c != NULL && group_cost != NULL && order != NULL) {
        *live = 0;
        for (or_ssize i = 0; i < n; i++) {
            const double ci = cost(job, i);
            if (ci < 0)
                continue;
            c[(*live)++] = (costed){0, ci, i / per_group, i};
            group_cost[i / per_group] += ci;
        }
        for (or_ssize i = 0; i < *live; i++)
            c[i].group_cost = group_cost[c[i].group];
        qsort(c, (size_t)*live, sizeof(costed), by_cost);
        for (or_ssize i = 0; i < *live; i++)
            order[i] = c[i].item;
    } else {
        free(order);
        order = NULL;
    }
    free(group_cost);
    free(c);
    return order;
}

/* Query rows [i0, i0 + rows) of unit u times the keys of [kb, ke) they see. */
static double rows_cost(const or_problem *p, or_ssize u, or_ssize i0, or_ssize rows,
                        or_ssize kb, or_ssize ke)
{
    or_ssize lo, hi;
    or_key_range(p->prm.left, p->prm.right, p->nq[u], p->nk[u], i0, i0 + rows, &lo, &hi);
    lo = lo > kb ? lo : kb;
    hi = hi < ke ? hi : ke;
    return (double)rows * (double)(hi > lo ? hi - lo : 0);
}

static double fwd_cost(const or_job *job, or_ssize item)   /* a query block (fwd_item) */
{
    const or_ssize u = item / job->blocks, i0 = (item % job->blocks) * BR, nq = job->p->nq[u];
    return i0 < nq ? rows_cost(job->p, u, i0, nq - i0 < BR ? nq - i0 : BR, 0, job->p->nk[u]) : -1;
}

/* The query blocks of kv unit kvu's heads times the keys of [kb, ke) each sees; -1 where the
 * unit has neither query rows nor keys there: nothing to compute or store. */
static double keys_cost(const or_problem *p, or_ssize kvu, or_ssize kb, or_ssize ke)
{
    double c = 0;
    or_ssize rows = ke - kb;
    for (or_ssize u = kvu * p->prm.group; u < (kvu + 1) * p->prm.group; u++) {
        rows += p->nq[u];
        for (or_ssize i0 = 0; i0 < p->nq[u]; i0 += BR)
            c += rows_cost(p, u, i0, p->nq[u] - i0 < BR ? p->nq[u] - i0 : BR, kb, ke);
    }
    return rows > 0 ? c : -1;
}

static double unit_cost(const or_job *job, or_ssize kvu)   /* a kv unit (fwd_unit_item) */
{
    return keys_cost(job->p, kvu, 0, job->p->nk[kvu * job->p->prm.group]);
}

static double part_cost(const or_job *job, or_ssize item)  /* a part of a unit (bwd_item) */
{
    const or_ssize kvu = item / job->parts, kb = item % job->parts * job->part_keys;
    const or_ssize nk = job->p->nk[kvu * job->p->prm.group];
    if (kb > 0 && kb >= nk)
        return -1;      /* past the unit's keys */
    return keys_cost(job->p, kvu, kb, nk - kb < job->part_keys ? nk : kb + job->part_keys);
}

/* Decoding (attn_decode_impl.h): enough (kv units, split) items to keep every core busy on one
 * token, each at least a few blocks of keys long, so that the combine stays cheap; but a
 * thread more only per DECODE_WORKER_BYTES (1.5 MiB) of keys and values: waking a worker
 * costs 20-30 us here, about what one thread takes to read 1 MiB, and steps over caches of up
 * to 1 MiB ran 1.0-4x slower on two threads than on one (two were faster from 2 MiB on). */
#define DECODE_ITEMS 128
#define DECODE_MIN_BLOCKS 3
#define DECODE_WORKER_BYTES (3 << 19)
/* Steps over this many bytes of keys and values ask for every line ahead (attn_decode_impl.h
 * decode_ahead): over fewer, contiguous rows are left to the hardware's stream prefetcher. */
#define DECODE_STREAM_BYTES (16 << 20)
/* Side-by-side units' keys per chunk (side_by_side): all their pieces of 8 rows in turn (64 KB
 * at 32 heads of bfloat16, D 128) were read at 1.0-1.2x the speed of contiguous rows, of 32 rows
 * 0.8-0.9x, of 128 rows (a block) 0.6-0.8x */
#define DECODE_SPAN_BYTES (64 << 10)

/* Kv units whose rows lie side by side, as the heads of a sequence do in FlashAttention's
 * (batch, keys, kv heads, D) caches, paged or not: the rows of one unit alone are short pieces
 * far apart, and one core read 256-byte pieces 8 KB apart at 0.6x the speed of contiguous rows
 * here (AMD EPYC), all pieces of 8 rows in turn at 1.0-1.2x. How many consecutive units (a
 * divisor of n_kv) lie so, in every such group, with the same keys; 1 if none. */
static or_ssize side_by_side(const or_problem *p, or_ssize n_kv)
{
    const or_view *k = &p->view[OR_K], *v = &p->view[OR_V];
    const or_pages *pg = &p->pages;
    or_ssize heads = 1;
    while (heads < n_kv && k->offs[heads] - k->offs[0] == heads * p->d * k->itemsize
           && v->offs[heads] - v->offs[0] == heads * p->dv * v->itemsize)
        heads++;
    if (heads == 1 || n_kv % heads || heads * p->d * k->itemsize > k->row_stride
        || heads * p->dv * v->itemsize > v->row_stride)
        return 1;
    for (or_ssize g = 0; g < n_kv; g += heads)
        for (or_ssize h = g + 1; h < g + heads; h++) {
            const or_ssize i = h - g;
            if (k->offs[h] - k->offs[g] != i * p->d * k->itemsize
                || v->offs[h] - v->offs[g] != i * p->dv * v->itemsize
                || p->nk[h * p->prm.group] != p->nk[g * p->prm.group]
                || p->nq[h * p->prm.group] != p->nq[g * p->prm.group]
                || (pg->rows && (pg->table[h] != pg->table[g] || pg->first[h] != pg->first[g])))
                return 1;
        }
    return heads;
}

static int decode_fwd(const or_problem *p, const or_kernels *kern, int dbl)
{
    const size_t real = dbl ? sizeof(double) : sizeof(float), lanes = (size_t)kern->width / real;
    const or_ssize bc = kern->block_keys;
    const or_ssize group = p->prm.group, n_kv = p->n_units / group;
    const size_t dp = (p->d + lanes - 1) / lanes * lanes, dvp = (p->dv + lanes - 1) / lanes * lanes;
    const size_t row_bytes = (size_t)p->d * (size_t)or_dtypes[p->view[OR_K].dtype].itemsize
                             + (size_t)p->dv * (size_t)or_dtypes[p->view[OR_V].dtype].itemsize;
    or_ssize nk_max = 0, nq_max = 0;
    size_t kv_bytes = 0;
    for (or_ssize u = 0; u < p->n_units; u++) {
        nk_max = p->nk[u] > nk_max ? p->nk[u] : nk_max;
        nq_max = p->nq[u] > nq_max ? p->nq[u] : nq_max;
        if (u % group == 0)
            kv_bytes += (size_t)p->nk[u] * row_bytes;
    }
    if (nq_max == 0)
        return OR_OK;   /* no output rows */
    const or_ssize heads = side_by_side(p, n_kv);
    const or_ssize per_item = (DECODE_ITEMS * heads + n_kv - 1) / n_kv;    /* splits */
    or_ssize keys = (nk_max + per_item - 1) / per_item;
    keys = keys < DECODE_MIN_BLOCKS * bc ? DECODE_MIN_BLOCKS * bc : (keys + bc - 1) / bc * bc;
    /* side-by-side units a span of at most DECODE_SPAN_BYTES of keys at a time */
    or_ssize step = bc;
    while (step % (2 * OR_DECODE_KEYS) == 0
           && (size_t)(heads * step * p->d) * or_dtypes[p->view[OR_K].dtype].itemsize
                  > DECODE_SPAN_BYTES)
        step /= 2;
    const size_t rows = (size_t)(group * nq_max);
    or_job job = {.p = p, .split_keys = keys,
                  .splits = nk_max > 0 ? (nk_max + keys - 1) / keys : 1,
                  .stream_lines = kv_bytes >= DECODE_STREAM_BYTES, .heads = heads,
                  .step_keys = heads > 1 ? step : bc};
    job.part_stride = (or_ssize)((rows * (dvp + 2) + lanes - 1) / lanes * lanes);
    const size_t slots = (size_t)(n_kv * job.splits);     /* one per kv unit and split */
    if (slots > SIZE_MAX / real / (size_t)job.part_stride)
        return OR_ENOMEM;
    job.part = aligned_alloc(64, real * (size_t)job.part_stride * slots);
    job.splits_done = calloc((size_t)n_kv, sizeof(int));
    int rc = OR_ENOMEM;
    if (job.part != NULL && job.splits_done != NULL) {
        /* q and s tiles and P as bfloat16 pairs (sets with bfloat16 dot products), one each
         * per unit of an item, the dropout keep row, then a row of out for the merge */
        job.per_worker = round_up(real * (size_t)heads * rows * (dp + (size_t)bc)
                                  + sizeof(uint32_t) * (size_t)heads * rows * (size_t)bc / 2 + bc)
                         + round_up(real * dvp);
        rc = run_job(&job, n_kv / heads * job.splits,
                     (or_ssize)(kv_bytes / DECODE_WORKER_BYTES) + 1, kern->decode_item[dbl]);
    }
    free(job.splits_done);
    free(job.part);
    return rc;
}

/* Which instance of a set's items (native.h OR_IN_*) computes p: bfloat16 dot products where the
 * set has them and every operand they multiply is bfloat16 (q, k, v, and dO in a backward),
 * float16 on tiles where the set has them (a forward) and q, k and v are float16. */
static int instance(const or_problem *p, const or_task *items, int dbl, int backward)
{
    const or_view *w = p->view;
    const int bf16 = w[OR_Q].dtype == OR_BF16 && w[OR_K].dtype == OR_BF16
                     && w[OR_V].dtype == OR_BF16 && (!backward || w[OR_DO].dtype == OR_BF16);
    const int f16 = w[OR_Q].dtype == OR_F16 && w[OR_K].dtype == OR_F16 && w[OR_V].dtype == OR_F16;
    return dbl                                  ? OR_IN_DOUBLE
           : bf16 && items[OR_IN_BF16_DOTS]     ? OR_IN_BF16_DOTS
           : f16 && items[OR_IN_F16_TILES]      ? OR_IN_F16_TILES
                                                : OR_IN_FLOAT;
}

/* Forward work items of a whole kv unit each where there are at least this many units per
 * thread, else one per query block after a pre-pass over all units. A unit's item packs its
 * keys and values into its worker's scratch and runs its query blocks while they are in
 * cache; the pre-pass wrote every unit's before the query blocks read them back, from memory
 * once they outgrow the caches, and the pool started twice. Against that (A/B, Sapphire
 * Rapids, 2 threads): N 1024 D 64 float32 0.93-0.96x the time, causal 0.95x, bfloat16 0.91x,
 * float16 0.88x; N 256 0.80-0.84x, N 100 0.70-0.76x. At 4 units per thread, N 2048-4096 D 128
 * took 1.05-1.11x the time (B 1 H 8): the threads then work on different units, each reading
 * its own keys and values, and the last unit leaves a thread idle for longer than a query
 * block does. */
#define FWD_UNITS_PER_THREAD 8

static void fwd_unit_item(void *vjob, or_ssize item, int worker)
{
    or_job *job = vjob;
    const or_ssize kvu = job->units[item], per_unit = job->p->prm.group * job->blocks;
    job->pack(job, kvu, worker);
    for (or_ssize b = kvu * per_unit; b < (kvu + 1) * per_unit; b++)
        job->fwd(job, b, worker);
}

static void pack_item(void *vjob, or_ssize item, int worker)     /* the forward's pre-pass */
{
    or_job *job = vjob;
    job->pack(job, job->packs[item], worker);
}

/* Whether or_native_fwd takes the split-KV decode for p: a decode step (orchard.h), but on
 * bfloat16 dot products only up to the kernel set's decode_bf16_rows query rows a unit. */
int or_native_decodes(const or_problem *p)
{
    const or_kernels *kern = or_native_kernels();
    const int dbl = or_dtypes[p->view[OR_Q].dtype].compute_size == sizeof(double);
    if (!or_is_decode(p))
        return 0;
    if (instance(p, kern->fwd_item, dbl, 0) != OR_IN_BF16_DOTS)
        return 1;
    for (or_ssize u = 0; u < p->n_units; u++)
        if (p->nq[u] > kern->decode_bf16_rows)
            return 0;
    return 1;
}

int or_native_fwd(const or_problem *p)
{
    const int dbl = or_dtypes[p->view[OR_Q].dtype].compute_size == sizeof(double);
    const size_t real = dbl ? sizeof(double) : sizeof(float);
    const or_kernels *kern = or_native_kernels();
    if (or_native_decodes(p))
        return decode_fwd(p, kern, dbl);
    const int in = instance(p, kern->fwd_item, dbl, 0);
    const or_ssize n_kv = p->n_units / p->prm.group;
    const or_ssize bc = kern->block_keys;
    const size_t lanes = (size_t)kern->width / real, dp = (p->d + lanes - 1) / lanes * lanes,
                 dvp = (p->dv + lanes - 1) / lanes * lanes;
    /* values already REAL, in rows of whole vectors, not paged and not a multiple of 512 bytes
     * apart (or_rows_ld) are read in place; others (float16, bfloat16, float32 at d 128, and
     * float32 rows of heads side by side, (B, N, H, D), at d 64 with H even) are converted once
     * per call, not once per query block. (B, N, H, D) float32 against in place: d 64 0.96x
     * the time, causal 1.00x; d 128 0.91x (AMD EPYC, avx2). The bfloat16 dot products' pairs
     * of rows (attn_bf16_impl.h) stay dvp apart: their layout was measured there, not here. */
    const or_view *v = &p->view[OR_V];
    const int v_in_place = v->dtype == (dbl ? OR_F64 : OR_F32) && (size_t)p->dv == dvp
                           && v->row_stride % (or_ssize)real == 0 && p->pages.rows == 0
                           && or_rows_ld(v->row_stride / (or_ssize)real, real)
                              == v->row_stride / (or_ssize)real;
    /* bfloat16 pairs of rows (attn_bf16_impl.h), float16 split into two of them (hi and lo
     * side by side: attn_f16_split_impl.h), or REAL rows */
    const int pairs = in == OR_IN_BF16_DOTS || in == OR_IN_F16_TILES;
    or_job job = {.p = p, .blocks = 0, .v_in_place = v_in_place, .real = real,
                  .ldvc = in == OR_IN_BF16_DOTS   ? (or_ssize)dvp
                          : in == OR_IN_F16_TILES ? 2 * (or_ssize)dvp
                                                  : or_rows_ld((or_ssize)dvp, real),
                  .pack = kern->transpose_keys_item[in], .fwd = kern->fwd_item[in]};
    /* the kv units with rows, costliest first (an empty sequence's are left out) */
    or_ssize live_kv;
    or_ssize *kv_units = costly_first(&job, n_kv, 1, unit_cost, &live_kv);
    if (kv_units == NULL)
        return OR_ENOMEM;
    const int unit_items = live_kv >= FWD_UNITS_PER_THREAD * (or_ssize)or_get_num_threads();
    if (!unit_items) {      /* where each unit lies in the pre-pass's kt and vc */
        job.kt_off = malloc(sizeof(or_ssize) * (size_t)(n_kv + 1) * 2);
        if (job.kt_off == NULL) {
            free(kv_units);
            return OR_ENOMEM;
        }
        job.vc_off = job.kt_off + n_kv + 1;
        job.kt_off[0] = job.vc_off[0] = 0;
    }
    /* split float16 keys: d rounded up to pairs of bfloat16, twice (hi, lo) */
    const int kd = in == OR_IN_F16_TILES ? p->d + p->d % 2 : p->d;
    or_ssize kt_most = 0, vc_most = 0;      /* one unit's, the largest */
    for (or_ssize w = 0; w < n_kv; w++) {
        const or_ssize nk = p->nk[w * p->prm.group], kt = or_blocks_size(nk, (int)bc, real, kd),
                       vc = (pairs ? (nk + 1) / 2 : nk) * job.ldvc;
        if (!unit_items) {
            job.kt_off[w + 1] = job.kt_off[w] + kt;
            job.vc_off[w + 1] = job.vc_off[w] + vc;
        }
        kt_most = kt > kt_most ? kt : kt_most;
        vc_most = vc > vc_most ? vc : vc_most;
    }
    for (or_ssize u = 0; u < p->n_units; u++) {
        or_ssize b = (p->nq[u] + BR - 1) / BR;
        job.blocks = b > job.blocks ? b : job.blocks;
    }
    /* q, s, o, m, l tiles (attn_native_impl.h) and the dropout keep row */
    job.per_worker = round_up(real * (BR * dp + BR * bc + BR * dvp + 2 * BR) + bc);
    int rc = OR_ENOMEM;
    if (unit_items) {
        /* then the unit's keys and values, as the shared buffers would hold them */
        job.unit_kt = job.per_worker;
        job.unit_vc = job.unit_kt + round_up(real * (size_t)kt_most + 64);
        job.per_worker = job.unit_vc + (v_in_place ? 0 : round_up(real * (size_t)vc_most + 1));
        job.units = kv_units;
        rc = run_job(&job, live_kv, live_kv, fwd_unit_item);
    } else {
        job.kt = malloc(real * (size_t)job.kt_off[n_kv] + 64);
        job.vc = v_in_place ? NULL
                            : aligned_alloc(64, round_up(real * (size_t)job.vc_off[n_kv] + 1));
        if (job.kt != NULL && (v_in_place || job.vc != NULL)) {
            /* the pre-pass needs no scratch, but run_job hands every worker a slice of its size */
            job.packs = kv_units;
            rc = run_job(&job, live_kv, live_kv, pack_item);
            or_ssize live;
            job.order = rc == OR_OK ? costly_first(&job, p->n_units * job.blocks,
                                                      p->prm.group * job.blocks, fwd_cost, &live)
                                    : NULL;
            if (job.order != NULL)
                rc = run_job(&job, live, live, job.fwd);
            else
                rc = OR_ENOMEM;
        }
    }
    free(job.order);
    free(kv_units);
    free(job.kt);
    free(job.vc);
    free(job.kt_off);
    return rc;
}

int or_native_bwd(const or_problem *p)
{
    const int dbl = or_dtypes[p->view[OR_Q].dtype].compute_size == sizeof(double);
    const size_t real = dbl ? sizeof(double) : sizeof(float);
    const or_kernels *kern = or_native_kernels();
    or_job job = {.p = p, .nk_max = 0, .nq_max = 0};
    for (or_ssize u = 0; u < p->n_units; u++) {
        job.nk_max = p->nk[u] > job.nk_max ? p->nk[u] : job.nk_max;
        job.nq_max = p->nq[u] > job.nq_max ? p->nq[u] : job.nq_max;
    }
    const size_t most = (SIZE_MAX / 4) / (real * 2 * (OR_MAX_HEAD_DIM + 64));
    if ((size_t)job.nk_max > most || (size_t)job.nq_max > most / (size_t)p->prm.group)
        return OR_ENOMEM;
    const int in = instance(p, kern->bwd_item, dbl, 1);
    const or_ssize n_kv = p->n_units / p->prm.group, bc = kern->block_keys;
    /* parts of each unit's keys (orchard.h OR_BWD_ITEMS), their dQ rows (each query head's
     * blocks of BR rows) part_ld REALs apart */
    job.blocks = (job.nq_max + BR - 1) / BR;
    job.part_ld = or_bwd_ld(p->d, kern->width, real, in == OR_IN_BF16_DOTS);
    const double part_bytes = (double)real * job.part_ld * (double)p->n_units * job.blocks * BR;
    job.parts = or_bwd_parts(n_kv, job.nk_max, bc, part_bytes, (double)OR_BWD_PART_DQ_BYTES,
                             &job.part_keys);
    job.per_worker = round_up(real * kern->bwd_scratch[in](&job) + (size_t)bc);
    const size_t dq_bytes = (size_t)part_bytes * (size_t)job.parts;
    job.part_dq = job.parts > 1 ? aligned_alloc(64, round_up(dq_bytes)) : NULL;
    or_ssize live;
    job.order = job.parts == 1 || job.part_dq != NULL
                    ? costly_first(&job, n_kv * job.parts, job.parts, part_cost, &live) : NULL;
    int rc = job.order != NULL ? run_job(&job, live, live, kern->bwd_item[in]) : OR_ENOMEM;
    if (rc == OR_OK && job.parts > 1) {     /* the parts' dQ added and stored */
        const or_ssize items = p->n_units * job.blocks;
        job.per_worker = round_up(real * BR);
        rc = run_job(&job, items, items, kern->bwd_sum_item[dbl]);
    }
    free(job.order);
    free(job.part_dq);
    return rc;
}
