/* attn_opencl.c - runs an attention problem (orchard.h) on an OpenCL device.
 *
 * Each operand becomes one buffer over the array's own memory: on a device that shares host
 * memory (CPUs through PoCL, integrated GPUs) with CL_MEM_USE_HOST_PTR, so inputs are read in
 * place and outputs land directly in the returned NumPy arrays; on a discrete GPU with an
 * explicit copy in and out (counted in stats()). A device-resident operand (a DeviceArray,
 * or_view.mem) is its own buffer: used as it is, never copied, and not released here. The
 * per-unit offsets and lengths travel in one "meta" buffer (kernels/common.cl), so dense,
 * strided, GQA and varlen inputs run the same kernels; paged keys and values (a block_table)
 * are one buffer over all their pages, with each kv unit's page list in the meta table, or,
 * where the device would copy them whole (or cannot hold them in one buffer), a copy of the
 * pages the call reads. A forward with few query rows per unit
 * (or_is_decode) runs the split-KV decode instead (kernels/flash_decode.cl): partial outputs
 * per key split into scratch buffers, then one combining pass.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cl_runtime.h"
#include "orchard.h"

#ifndef ORCHARD_HAVE_OPENCL

static int no_opencl(or_error *err)
{
    snprintf(err->msg, sizeof(err->msg), "orchard_ops was built without OpenCL headers");
    return OR_EDEVICE;
}
int or_cl_fwd(int i, const or_problem *p, or_counters *ct, or_error *err) { return no_opencl(err); }
int or_cl_bwd(int i, const or_problem *p, or_counters *ct, or_error *err) { return no_opencl(err); }

#else

typedef struct {
    const or_problem *p;
    const or_cl_info *info;
    or_cl_program prog;
    or_error *err;
    or_counters *ct;
    cl_mem mem[OR_NSLOTS];
    cl_mem meta, slopes, di, dqacc, dummy;
    cl_mem part, part_ml;       /* decode: the splits' partial outputs, their max and sum */
    cl_kernel kernel[3];
    unsigned outputs;           /* bit per slot written by the kernels */
    int in_place;               /* buffers over host memory, else explicit copies */
    size_t shift[OR_NSLOTS];    /* bytes an in-place buffer starts before its array */
    char *lo[OR_NSLOTS];        /* the host address the operand's buffer starts at (after the
                                   shift): its array's lowest, or its pages' */
    or_ssize rows;              /* query rows of every unit: the backward's per-row buffers */
    /* paged K and V copied as the pages the call reads (compact_pages): page p of K and V
     * is page slot[p] of the copies, which hold n_used pages; NULL when read in place */
    or_ssize *slot, n_used;
} launch_t;

#define TRY(L, expr, name)                                                                   \
    do {                                                                                     \
        cl_int rc_ = (expr);                                                                 \
        if (rc_ != CL_SUCCESS)                                                               \
            return or_cl_fail((L)->err, rc_, name);                                          \
    } while (0)

/* A buffer for `what`: a failure names it and the sizes. */
static int new_buffer(launch_t *L, const char *what, cl_mem_flags flags, size_t size, void *host,
                      cl_mem *out)
{
    return or_cl_new_buffer(L->prog.api, L->prog.ctx, L->info, flags, size, host, what, out,
                            L->err);
}

/* A buffer for slot s: a failure names the argument. */
static int slot_buffer(launch_t *L, int s, cl_mem_flags flags, size_t size, void *host)
{
    static const char *const names[OR_NSLOTS] = OR_SLOT_NAMES;
    char what[32];
    snprintf(what, sizeof(what), "'%s'", names[s]);
    return new_buffer(L, what, flags, size, host, &L->mem[s]);
}

/* The entries [t0, t1) of kv unit w's row of block_table that the call reads: the pages from
 * its first key's (after the left padding) to its last key's. */
static void read_pages(const or_problem *p, or_ssize w, or_ssize *t0, or_ssize *t1)
{
    const or_pages *pg = &p->pages;
    *t0 = pg->first[w] / pg->rows;
    *t1 = (pg->first[w] + p->nk[w * p->prm.group] + pg->rows - 1) / pg->rows;
}

/* Whether paged K and V travel as a copy of the pages the call reads: on a device without
 * shared memory, which would otherwise copy every page of the pool each call, and where the
 * pool is larger than one buffer may be (a buffer over it in place starts up to base_align
 * bytes before it: operand_buffers). Resident pages are read where they lie. */
static int compact_pages(const launch_t *L)
{
    const or_pages *pg = &L->p->pages;
    if (pg->rows == 0 || L->p->view[OR_K].mem != NULL)
        return 0;
    return !L->in_place || !or_cl_buffer_fits(L->info, pg->nbytes[0] + L->info->base_align)
           || !or_cl_buffer_fits(L->info, pg->nbytes[1] + L->info->base_align);
}

/* The pages the call reads, numbered in order of first use: L->slot of each (-1: unread). */
static int number_pages(launch_t *L)
{
    const or_problem *p = L->p;
    if (!(L->slot = malloc(sizeof(or_ssize) * (size_t)p->pages.count)))
        return OR_ENOMEM;
    for (or_ssize i = 0; i < p->pages.count; i++)
        L->slot[i] = -1;
    for (or_ssize w = 0; w < p->n_units / p->prm.group; w++) {
        or_ssize t0, t1;
        read_pages(p, w, &t0, &t1);
        for (or_ssize t = t0; t < t1; t++)
            if (L->slot[p->pages.table[w][t]] < 0)
                L->slot[p->pages.table[w][t]] = L->n_used++;
    }
    return OR_OK;
}

/* A buffer holding the pages the call reads of slot s (K or V), one after another, each as
 * many bytes as its view (page 0) spans. */
static int compact_buffer(launch_t *L, int s)
{
    const or_problem *p = L->p;
    const or_view *w = &p->view[s];
    const or_ssize stride = s == OR_K ? p->pages.k_stride : p->pages.v_stride;
    char *host = malloc(w->nbytes * (size_t)L->n_used + 1);
    if (host == NULL)
        return OR_ENOMEM;
    for (or_ssize i = 0; i < p->pages.count; i++)
        if (L->slot[i] >= 0)
            memcpy(host + w->nbytes * (size_t)L->slot[i], w->lo + i * stride, w->nbytes);
    OR_COUNT(L->ct, staged_buffers, 1);
    OR_COUNT(L->ct, bytes_staged, w->nbytes * (size_t)L->n_used);
    if (!L->in_place) {
        OR_COUNT(L->ct, host_to_device, 1);
        OR_COUNT(L->ct, host_to_device_bytes, w->nbytes * (size_t)L->n_used);
    }
    L->lo[s] = w->lo;
    int rc = slot_buffer(L, s, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                         w->nbytes * (size_t)L->n_used + 1, host);
    free(host);
    return rc;
}

/* One buffer per operand, over the whole extent of its array (of all its pages, for paged K
 * and V read in place). */
static int operand_buffers(launch_t *L)
{
    int rc = new_buffer(L, "a placeholder", CL_MEM_READ_WRITE, 64, NULL, &L->dummy);
    if (rc == OR_OK && compact_pages(L))
        rc = number_pages(L);
    for (int s = 0; rc == OR_OK && s < OR_NSLOTS; s++) {
        const or_view *w = &L->p->view[s];
        const int out = (L->outputs >> s) & 1,
                  paged = L->p->pages.rows > 0 && (s == OR_K || s == OR_V);
        if (w->offs == NULL)
            continue;
        if (paged && L->slot != NULL) {
            rc = compact_buffer(L, s);
            continue;
        }
        char *lo = paged ? L->p->pages.lo[s - OR_K] : w->lo;
        const size_t nbytes = paged ? L->p->pages.nbytes[s - OR_K] : w->nbytes;
        L->lo[s] = lo;
        if (nbytes == 0) {              /* nothing to read or write: any buffer will do */
            L->mem[s] = L->dummy;
            continue;
        }
        if (w->mem != NULL) {
            L->mem[s] = (cl_mem)w->mem;
            continue;
        }
        cl_mem_flags flags = out ? CL_MEM_READ_WRITE : CL_MEM_READ_ONLY;
        char *host = lo;
        if (L->in_place) {
            /* the device takes host memory on its base alignment: the buffer starts there,
             * before the array (in the same page), and the kernels' offsets skip the gap */
            host -= (uintptr_t)lo % L->info->base_align;
            flags |= CL_MEM_USE_HOST_PTR;
        } else if (!out) {
            flags |= CL_MEM_COPY_HOST_PTR;
            OR_COUNT(L->ct, host_to_device, 1);
            OR_COUNT(L->ct, host_to_device_bytes, nbytes);
        }
        L->shift[s] = (size_t)(lo - host);
        rc = slot_buffer(L, s, flags, nbytes + L->shift[s], (L->in_place || !out) ? host : NULL);
    }
    return rc;
}

/* Whether kv unit w of a paged call starts a page list: the kv heads of a batch entry share
 * one (its row of block_table, from the same left padding). */
static int starts_list(const or_problem *p, or_ssize w)
{
    return w == 0 || p->pages.table[w] != p->pages.table[w - 1]
           || p->pages.first[w] != p->pages.first[w - 1];
}

/* The words of the page lists of a paged call (0 when not paged): each list the pages its
 * kv units read. */
static size_t page_words(const or_problem *p)
{
    size_t words = 0;
    for (or_ssize w = 0; p->pages.rows > 0 && w < p->n_units / p->prm.group; w++) {
        or_ssize t0, t1;
        read_pages(p, w, &t0, &t1);
        words += starts_list(p, w) ? (size_t)(t1 - t0) : 0;
    }
    return words;
}

/* The meta table (params.h): row strides and the pages' geometry, then per unit its element
 * offsets, nq, nk, its first row in the backward's per-row buffers and its page list, then the
 * page lists (the pages' numbers in the buffers of K and V). */
static int meta_buffer(launch_t *L)
{
    const or_problem *p = L->p;
    const or_pages *pg = &p->pages;
    const size_t units_end = OR_META_HEAD + (size_t)p->n_units * OR_UNIT_WORDS,
                 words = units_end + page_words(p);
    cl_long *meta = calloc(words, sizeof(cl_long));
    if (meta == NULL)
        return OR_ENOMEM;
    for (int s = 0; s < OR_NSLOTS; s++) {
        const or_view *w = &p->view[s];
        if (w->offs != NULL)
            meta[s] = w->row_stride / w->itemsize;
    }
    if (pg->rows > 0) {     /* a copy's pages lie as many bytes apart as each spans */
        meta[OR_META_PAGE_ROWS] = pg->rows;
        meta[OR_META_PAGE_K] = (L->slot ? (or_ssize)p->view[OR_K].nbytes : pg->k_stride)
                               / p->view[OR_K].itemsize;
        meta[OR_META_PAGE_V] = (L->slot ? (or_ssize)p->view[OR_V].nbytes : pg->v_stride)
                               / p->view[OR_V].itemsize;
    }
    size_t list = units_end, list_end = units_end;
    for (or_ssize u = 0; u < p->n_units; u++) {
        cl_long *row = meta + OR_META_HEAD + u * OR_UNIT_WORDS;
        const or_ssize kv = u / p->prm.group;
        for (int s = 0; s < OR_NSLOTS; s++) {
            const or_view *w = &p->view[s];
            int kv_side = s == OR_K || s == OR_V || s == OR_DK || s == OR_DV;
            /* in integers: a resident operand's base and lo address no memory */
            if (w->offs != NULL && w->nbytes > 0)
                row[s] = ((w->base - L->lo[s]) + w->offs[kv_side ? kv : u]
                          + (or_ssize)L->shift[s]) / w->itemsize;
        }
        row[OR_UNIT_NQ] = p->nq[u];
        row[OR_UNIT_NK] = p->nk[u];
        row[OR_UNIT_ROW0] = L->rows;
        L->rows += p->nq[u];
        row[OR_UNIT_PAGES] = -1;
        if (pg->rows == 0)
            continue;
        if (u % p->prm.group == 0 && starts_list(p, kv)) {
            or_ssize t0, t1;
            read_pages(p, kv, &t0, &t1);
            list = list_end;
            for (or_ssize t = t0; t < t1; t++)
                meta[list_end++] = L->slot ? L->slot[pg->table[kv][t]] : pg->table[kv][t];
        }
        row[OR_UNIT_PAGES] = (cl_long)list;
        row[OR_UNIT_FIRST] = pg->first[kv] % pg->rows;     /* within its list's first page */
    }
    int rc = new_buffer(L, "the call's tables", CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                        words * sizeof(cl_long), meta, &L->meta);
    free(meta);
    return rc;
}

static int dbl(const launch_t *L) { return or_dtypes[L->p->view[OR_Q].dtype].compute_size == 8; }

static int slopes_buffer(launch_t *L)
{
    const or_problem *p = L->p;
    if (p->slopes == NULL || p->n_units == 0) {
        L->slopes = L->dummy;
        return OR_OK;
    }
    size_t real = dbl(L) ? sizeof(double) : sizeof(float);
    void *host = malloc(real * (size_t)p->n_units);
    if (host == NULL)
        return OR_ENOMEM;
    for (or_ssize u = 0; u < p->n_units; u++) {
        if (dbl(L))
            ((double *)host)[u] = p->slopes[u];
        else
            ((float *)host)[u] = (float)p->slopes[u];
    }
    int rc = new_buffer(L, "'alibi_slopes'", CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                        real * (size_t)p->n_units, host, &L->slopes);
    free(host);
    return rc;
}

static int set_mem(launch_t *L, cl_kernel k, int *idx, cl_mem m)
{
    TRY(L, L->prog.api->clSetKernelArg(k, (*idx)++, sizeof(cl_mem), &m), "clSetKernelArg");
    return OR_OK;
}

static int set_long(launch_t *L, cl_kernel k, int *idx, cl_long v)
{
    TRY(L, L->prog.api->clSetKernelArg(k, (*idx)++, sizeof(v), &v), "clSetKernelArg");
    return OR_OK;
}

/* The arguments after the buffers: meta, slopes and the parameter struct (params.h), with
 * float reals for float programs. */
static int set_params(launch_t *L, cl_kernel k, int *idx)
{
    const or_params *prm = &L->p->prm;
    or_params_f prm_f;
#define OR_COPY_FIELD(kind, name) prm_f.name = prm->name;
    OR_PARAMS(OR_COPY_FIELD)
#undef OR_COPY_FIELD
    int rc = set_mem(L, k, idx, L->meta);
    if (rc == OR_OK)
        rc = set_mem(L, k, idx, L->slopes);
    if (rc != OR_OK)
        return rc;
    TRY(L, L->prog.api->clSetKernelArg(k, (*idx)++, dbl(L) ? sizeof(*prm) : sizeof(prm_f),
                                       dbl(L) ? (const void *)prm : (const void *)&prm_f),
        "clSetKernelArg");
    return OR_OK;
}

/* Creates kernel `slot` named `name` and sets its leading buffer arguments. */
static int kernel_with(launch_t *L, int slot, const char *name, const int *slots, int n, int *idx)
{
    cl_int rc;
    L->kernel[slot] = L->prog.api->clCreateKernel(L->prog.program, name, &rc);
    if (L->kernel[slot] == NULL)
        return or_cl_fail(L->err, rc, "clCreateKernel");
    *idx = 0;
    for (int i = 0; i < n; i++) {
        int st = set_mem(L, L->kernel[slot], idx, slots[i] < 0 ? L->di : L->mem[slots[i]]);
        if (st != OR_OK)
            return st;
    }
    return OR_OK;
}

/* Enqueues a kernel over global[0..2] work-items in work-groups of local (NULL: the
 * runtime's choice); nothing when there is no work. */
static int enqueue_nd(launch_t *L, cl_kernel k, const size_t global[3], const size_t *local)
{
    if (global[0] == 0 || global[1] == 0 || global[2] == 0)
        return OR_OK;
    TRY(L, L->prog.api->clEnqueueNDRangeKernel(L->prog.queue, k, 3, NULL, global, local, 0, NULL,
                                               NULL), "clEnqueueNDRangeKernel");
    return OR_OK;
}

/* Enqueues a kernel over ceil(rows / group_rows) work-groups of `lanes` work-items per unit:
 * lanes = group_rows for the row-per-work-item kernels, 1 for the tiled forward. */
static int enqueue(launch_t *L, cl_kernel k, or_ssize rows, or_ssize units, int group_rows,
                   int lanes)
{
    if (rows <= 0 || units <= 0)
        return OR_OK;
    const size_t groups = ((size_t)rows + (size_t)group_rows - 1) / (size_t)group_rows;
    const size_t global[3] = {groups * (size_t)lanes, (size_t)units, 1},
                 local[3] = {(size_t)lanes, 1, 1};
    return enqueue_nd(L, k, global, local);
}

/* Enqueues a kernel of the wg family over ceil(rows / bq) blocks per unit, a work-group of
 * (OR_WG_LANES, bq / OR_WG_TM) work-items each (kernels/wg.cl): bq is the program's fq in the
 * forward, its bq in the backward. */
static int enqueue_wg(launch_t *L, cl_kernel k, or_ssize rows, or_ssize units, int block_rows)
{
    if (rows <= 0 || units <= 0)
        return OR_OK;
    const size_t bq = (size_t)block_rows, groups = ((size_t)rows + bq - 1) / bq,
                 global[3] = {groups * OR_WG_LANES, bq / OR_WG_TM, (size_t)units},
                 local[3] = {OR_WG_LANES, bq / OR_WG_TM, 1};
    return enqueue_nd(L, k, global, local);
}

/* Waits for the kernels and brings the outputs to the host arrays (resident outputs stay). */
static int finish_outputs(launch_t *L)
{
    const or_cl_api *api = L->prog.api;
    for (int s = 0; s < OR_NSLOTS; s++) {
        const or_view *w = &L->p->view[s];
        if (!((L->outputs >> s) & 1) || w->offs == NULL || w->nbytes == 0 || w->mem != NULL)
            continue;
        if (!L->in_place) {
            TRY(L, api->clEnqueueReadBuffer(L->prog.queue, L->mem[s], CL_TRUE, 0, w->nbytes, w->lo,
                                            0, NULL, NULL), "clEnqueueReadBuffer");
            OR_COUNT(L->ct, device_to_host, 1);
            OR_COUNT(L->ct, device_to_host_bytes, w->nbytes);
            continue;
        }
        cl_int rc;      /* mapping makes the device's writes visible in the host memory */
        void *ptr = api->clEnqueueMapBuffer(L->prog.queue, L->mem[s], CL_TRUE, CL_MAP_READ,
                                            L->shift[s], w->nbytes, 0, NULL, NULL, &rc);
        if (ptr == NULL)
            return or_cl_fail(L->err, rc, "clEnqueueMapBuffer");
        TRY(L, api->clEnqueueUnmapMemObject(L->prog.queue, L->mem[s], ptr, 0, NULL, NULL),
            "clEnqueueUnmapMemObject");
    }
    TRY(L, api->clFinish(L->prog.queue), "clFinish");
    return OR_OK;
}

static void release(launch_t *L)
{
    const or_cl_api *api = L->prog.api;
    free(L->slot);
    if (api == NULL)
        return;
    /* after a failure, kernels already enqueued may still write into host memory that the
     * caller is about to free (or to fill from the native fallback): wait for them first */
    if (L->prog.queue != NULL)
        api->clFinish(L->prog.queue);
    for (int i = 0; i < 3; i++)
        if (L->kernel[i])
            api->clReleaseKernel(L->kernel[i]);
    for (int s = 0; s < OR_NSLOTS; s++)
        if (L->mem[s] && L->mem[s] != L->dummy && L->mem[s] != L->p->view[s].mem)
            api->clReleaseMemObject(L->mem[s]);
    if (L->meta)
        api->clReleaseMemObject(L->meta);
    if (L->slopes && L->slopes != L->dummy)
        api->clReleaseMemObject(L->slopes);
    if (L->di)
        api->clReleaseMemObject(L->di);
    if (L->dqacc)
        api->clReleaseMemObject(L->dqacc);
    if (L->part)
        api->clReleaseMemObject(L->part);
    if (L->part_ml)
        api->clReleaseMemObject(L->part_ml);
    if (L->dummy)
        api->clReleaseMemObject(L->dummy);
}

static or_ssize longest(const or_ssize *n, or_ssize count)
{
    or_ssize m = 0;
    for (or_ssize i = 0; i < count; i++)
        m = n[i] > m ? n[i] : m;
    return m;
}

/* Program, operand buffers, meta table and slopes: what every launch needs. */
static int prepare(launch_t *L, int i, const or_problem *p, unsigned outputs, or_counters *ct,
                   or_error *err)
{
    memset(L, 0, sizeof(*L));
    L->p = p;
    L->err = err;
    L->ct = ct;
    L->outputs = outputs;
    L->info = or_cl_info_get(i);
    L->in_place = L->info->unified;
#ifdef ORCHARD_TEST_HOOKS
    /* ORCHARD_CL_TRANSFERS=1: explicit copies as on a discrete GPU, to test that path on any
     * device (and to give Oclgrind's uninitialised-read checker memory it has seen written) */
    L->in_place = L->in_place && !or_env_flag("ORCHARD_CL_TRANSFERS");
#endif
    int rc = or_cl_get_program(i, p->view[OR_Q].dtype, p->d, p->dv, ct, &L->prog, err);
    if (rc == OR_OK)
        rc = operand_buffers(L);
    if (rc == OR_OK)
        rc = meta_buffer(L);
    if (rc == OR_OK)
        rc = slopes_buffer(L);
    return rc;
}

/* The forward of the program's family: the forward's fq query rows per work-group (the rows
 * family's bq), a work-item each (rows), one in all (tiled) or a micro-tile layout (wg). */
static int fwd_kernel(launch_t *L)
{
    static const int args[] = {OR_Q, OR_K, OR_V, OR_O, OR_LSE};
    const or_problem *p = L->p;
    int idx, rc = kernel_with(L, 0, or_cl_families[L->prog.family].fwd, args, 5, &idx);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[0], &idx);
    if (rc == OR_OK && L->prog.family == OR_FAMILY_WG)
        return enqueue_wg(L, L->kernel[0], longest(p->nq, p->n_units), p->n_units, L->prog.fq);
    if (rc == OR_OK)
        rc = enqueue(L, L->kernel[0], longest(p->nq, p->n_units), p->n_units, L->prog.fq,
                     L->prog.family == OR_FAMILY_TILED ? 1 : L->prog.fq);
    return rc;
}

/* Split-KV decoding: work-groups the split kernel should give each compute unit, and the
 * fewest key blocks (bk keys) per split, so that the partial outputs and their combination stay
 * small beside the keys and values read. */
#define DECODE_GROUPS_PER_CU 4
#define DECODE_MIN_BLOCKS 4

/* Keys per split, a multiple of bk: from the shapes and the device's compute units only, so
 * that a call's result never depends on timing. */
static or_ssize decode_chunk(const launch_t *L, or_ssize nk_max, or_ssize groups)
{
    const or_ssize bk = L->prog.sk, want = DECODE_GROUPS_PER_CU * (or_ssize)L->info->compute_units,
                   most = (nk_max + DECODE_MIN_BLOCKS * bk - 1) / (DECODE_MIN_BLOCKS * bk);
    or_ssize splits = groups > 0 ? (want + groups - 1) / groups : 1;   /* 0: no query rows */
    splits = splits > most ? most : splits;
    splits = splits < 1 ? 1 : splits;
    const or_ssize chunk = (nk_max + splits - 1) / splits;
    return chunk < 1 ? bk : (chunk + bk - 1) / bk * bk;
}

/* flash_decode_split over (row blocks, splits, kv units) into the scratch buffers, then
 * flash_decode_combine over (query rows, units) into out and lse. */
static int decode_kernels(launch_t *L)
{
    const or_problem *p = L->p;
    const or_ssize nq_max = longest(p->nq, p->n_units), nk_max = longest(p->nk, p->n_units),
                   n_kv = p->n_units / p->prm.group,
                   blocks = or_decode_blocks(nq_max, p->prm.group, L->prog.sq),
                   chunk = decode_chunk(L, nk_max, blocks * n_kv),
                   nsplit = nk_max > 0 ? (nk_max + chunk - 1) / chunk : 1;
    const size_t real = dbl(L) ? sizeof(double) : sizeof(float),
                 rows = (size_t)(p->n_units * nsplit * nq_max);
    int idx, rc = new_buffer(L, "the splits' partial outputs", CL_MEM_READ_WRITE,
                             real * (rows * OR_DECODE_ROW(p->dv) + 1), NULL, &L->part);
    if (rc == OR_OK)
        rc = new_buffer(L, "the splits' maxima and sums", CL_MEM_READ_WRITE,
                        real * (2 * rows + 1), NULL, &L->part_ml);
    static const int split_args[] = {OR_Q, OR_K, OR_V};
    if (rc == OR_OK)
        rc = kernel_with(L, 0, or_cl_families[L->prog.family].decode, split_args, 3, &idx);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[0], &idx, L->part);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[0], &idx, L->part_ml);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[0], &idx, nq_max);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[0], &idx, chunk);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[0], &idx);
    if (rc == OR_OK)
        rc = kernel_with(L, 1, "flash_decode_combine", NULL, 0, &idx);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[1], &idx, L->part);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[1], &idx, L->part_ml);
    for (int s = OR_O; rc == OR_OK && s <= OR_LSE; s++)
        rc = set_mem(L, L->kernel[1], &idx, L->mem[s]);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[1], &idx, nq_max);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[1], &idx, nsplit);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[1], &idx, L->meta);
    /* the split kernel: sq work-items per block (rows family and wg) or one (tiled) */
    const size_t lanes = L->prog.family == OR_FAMILY_TILED ? 1 : (size_t)L->prog.sq,
                 split_global[3] = {(size_t)blocks * lanes, (size_t)nsplit, (size_t)n_kv},
                 split_local[3] = {lanes, 1, 1},
                 combine_global[3] = {(size_t)nq_max, (size_t)p->n_units, 1};
    if (rc == OR_OK)
        rc = enqueue_nd(L, L->kernel[0], split_global, split_local);
    if (rc == OR_OK)
        rc = enqueue_nd(L, L->kernel[1], combine_global, NULL);
    return rc;
}

int or_cl_fwd(int i, const or_problem *p, or_counters *ct, or_error *err)
{
    launch_t L;
    int rc = prepare(&L, i, p, 1u << OR_O | 1u << OR_LSE, ct, err);
    if (rc == OR_OK)
        rc = or_is_decode(p) ? decode_kernels(&L) : fwd_kernel(&L);
    if (rc == OR_OK)
        rc = finish_outputs(&L);
    release(&L);
    return rc;
}

static const int bwd_args[] = {OR_Q, OR_K, OR_V, OR_DO, OR_LSE, -1};   /* -1: the D buffer */

/* The rows and wg families: dQ per query row (or block), then dK, dV per key row (block). */
static int row_bwd_kernels(launch_t *L)
{
    const or_cl_family *f = &or_cl_families[L->prog.family];
    int idx, rc = kernel_with(L, 1, f->bwd, bwd_args, 6, &idx);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[1], &idx, L->mem[OR_DQ]);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[1], &idx);
    if (rc == OR_OK)
        rc = kernel_with(L, 2, f->bwd2, bwd_args, 6, &idx);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[2], &idx, L->mem[OR_DK]);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[2], &idx, L->mem[OR_DV]);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[2], &idx);
    return rc;
}

/* The tiled family: a part of a kv unit's keys per work-item (orchard.h or_bwd_parts), each
 * part's dQ in an accumulator of the rows of every unit; then flash_bwd_tiled_dq adds the
 * parts' for each query row. */
static int tiled_bwd_kernels(launch_t *L, or_ssize nq_max, or_ssize nk_max, or_ssize n_kv)
{
    const size_t real = dbl(L) ? sizeof(double) : sizeof(float);
    /* the parts' dQ in one buffer (and a REAL more), within the device's largest */
    const double most = L->info->max_alloc > 0 && L->info->max_alloc < OR_BWD_PART_DQ_BYTES
                            ? (double)(L->info->max_alloc - real) : (double)OR_BWD_PART_DQ_BYTES;
    or_ssize part_keys;
    const or_ssize parts = or_bwd_parts(n_kv, nk_max, L->prog.bk,
                                        (double)real * (double)L->rows * L->prog.tile_d, most,
                                        &part_keys);
    const size_t size = real * ((size_t)parts * (size_t)L->rows * (size_t)L->prog.tile_d + 1);
    int idx, rc = new_buffer(L, "the dq accumulator", CL_MEM_READ_WRITE, size, NULL, &L->dqacc);
    if (rc == OR_OK)
        rc = kernel_with(L, 1, or_cl_families[L->prog.family].bwd, bwd_args, 6, &idx);
    for (int s = OR_DK; rc == OR_OK && s <= OR_DV; s++)
        rc = set_mem(L, L->kernel[1], &idx, L->mem[s]);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[1], &idx, L->dqacc);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[1], &idx, part_keys);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[1], &idx, L->rows);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[1], &idx);
    if (rc == OR_OK)
        rc = kernel_with(L, 2, or_cl_families[L->prog.family].bwd2, NULL, 0, &idx);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[2], &idx, L->dqacc);
    if (rc == OR_OK)
        rc = set_mem(L, L->kernel[2], &idx, L->mem[OR_DQ]);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[2], &idx, parts);
    if (rc == OR_OK)
        rc = set_long(L, L->kernel[2], &idx, L->rows);
    if (rc == OR_OK)
        rc = set_params(L, L->kernel[2], &idx);
    const size_t global[3] = {(size_t)parts, (size_t)n_kv, 1}, local[3] = {1, 1, 1},
                 sum_global[3] = {(size_t)nq_max, (size_t)L->p->n_units, 1};
    if (rc == OR_OK)
        rc = enqueue_nd(L, L->kernel[1], global, local);
    if (rc == OR_OK)
        rc = enqueue_nd(L, L->kernel[2], sum_global, NULL);
    return rc;
}

int or_cl_bwd(int i, const or_problem *p, or_counters *ct, or_error *err)
{
    launch_t L;
    int idx, rc = prepare(&L, i, p, 1u << OR_DQ | 1u << OR_DK | 1u << OR_DV, ct, err);
    const or_ssize nq_max = longest(p->nq, p->n_units), nk_max = longest(p->nk, p->n_units);
    const size_t real = dbl(&L) ? sizeof(double) : sizeof(float);
    /* D_i = rowsum(dO * O), a unit's rows from its OR_UNIT_ROW0 */
    if (rc == OR_OK)
        rc = new_buffer(&L, "the rows' dout . out", CL_MEM_READ_WRITE,
                        real * (size_t)(L.rows + 1), NULL, &L.di);
    static const int prep_args[] = {OR_DO, OR_O};
    if (rc == OR_OK && (rc = kernel_with(&L, 0, "flash_bwd_prep", prep_args, 2, &idx)) == OR_OK) {
        rc = set_mem(&L, L.kernel[0], &idx, L.meta);
        if (rc == OR_OK)
            rc = set_mem(&L, L.kernel[0], &idx, L.di);
    }
    const int wg = L.prog.family == OR_FAMILY_WG;
    const or_ssize n_kv = p->n_units / p->prm.group;
    if (rc == OR_OK)
        rc = enqueue(&L, L.kernel[0], nq_max, p->n_units, L.prog.prep_rows, L.prog.prep_rows);
    if (rc == OR_OK && L.prog.family == OR_FAMILY_TILED)
        rc = tiled_bwd_kernels(&L, nq_max, nk_max, n_kv);
    else if (rc == OR_OK && (rc = row_bwd_kernels(&L)) == OR_OK) {
        rc = wg ? enqueue_wg(&L, L.kernel[1], nq_max, p->n_units, L.prog.bq)
                : enqueue(&L, L.kernel[1], nq_max, p->n_units, L.prog.bq, L.prog.bq);
        if (rc == OR_OK)
            rc = wg ? enqueue_wg(&L, L.kernel[2], nk_max, n_kv, L.prog.bq)
                    : enqueue(&L, L.kernel[2], nk_max, n_kv, L.prog.bq, L.prog.bq);
    }
    if (rc == OR_OK)
        rc = finish_outputs(&L);
    release(&L);
    return rc;
}
#endif
