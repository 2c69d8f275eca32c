/* problem.c - from checked arguments to the or_problem the kernels read (orchard.h).
 *
 * The outputs, allocated aligned for the device; the per-unit tables (query and key lengths,
 * each operand's offset of every unit, ALiBi slopes) of the dense and varlen layouts; and the
 * view of every operand. An or_call owns all of it until or_call_clear.
 */
#include "pyorchard.h"

void or_call_clear(or_call *c)
{
    /* releasing an operand may run Python code (a DLPack producer's deleter, a base object's
     * __del__), which must neither see nor replace the call's exception */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int s = 0; s < OR_NSLOTS; s++) {
        Py_CLEAR(c->arr[s]);
        Py_CLEAR(c->dev[s]);
        PyMem_Free(c->offs[s]);
        c->offs[s] = NULL;
    }
    Py_CLEAR(c->new_kv[0]);
    Py_CLEAR(c->new_kv[1]);
    Py_CLEAR(c->pool[0]);
    Py_CLEAR(c->pool[1]);
    Py_CLEAR(c->cu_q);
    Py_CLEAR(c->cu_k);
    Py_CLEAR(c->used_k);
    Py_CLEAR(c->pages);
    Py_CLEAR(c->leftpad);
    Py_CLEAR(c->alibi);
    PyMem_Free(c->page_list);
    PyMem_Free(c->page_first);
    c->page_list = NULL;
    c->page_first = NULL;
    PyMem_Free(c->nq);
    PyMem_Free(c->nk);
    PyMem_Free(c->slopes);
    c->nq = c->nk = NULL;
    c->slopes = NULL;
    PyErr_Restore(type, value, tb);
}

/* The shapes of out and lse implied by q and v. */
void or_out_shapes(or_call *c, npy_intp *oshape, npy_intp *lshape, int *ond, int *lnd)
{
    PyArrayObject *q = c->arr[OR_Q];
    int nd = PyArray_NDIM(q);
    for (int i = 0; i < nd - 1; i++)
        oshape[i] = PyArray_DIM(q, i);
    oshape[nd - 1] = c->p.dv;
    *ond = nd;
    if (c->varlen) {            /* (H, total_q), as FlashAttention-2 */
        lshape[0] = PyArray_DIM(q, 1);
        lshape[1] = PyArray_DIM(q, 0);
        *lnd = 2;
    } else {
        for (int i = 0; i < nd - 1; i++)
            lshape[i] = PyArray_DIM(q, i);
        *lnd = nd - 1;
    }
}

/* Whether axis bx of a goes inside axis ax (1), outside (-1), or either (0: a stride of 0, or
 * equal strides and sizes), as torch's infer_dense_strides compares them. */
static int inner_first(PyArrayObject *a, int ax, int bx)
{
    npy_intp sa = PyArray_STRIDE(a, ax), sb = PyArray_STRIDE(a, bx);
    sa = sa < 0 ? -sa : sa;
    sb = sb < 0 ? -sb : sb;
    if (sa == 0 || sb == 0)
        return 0;
    if (sa != sb)
        return sa < sb ? -1 : 1;
    return PyArray_DIM(a, ax) > PyArray_DIM(a, bx);
}

/* Outputs are aligned for the device, so that kernels can write them in place, and laid out
 * in memory in the axis order of `like` (an operand of the same rank, or NULL for C order),
 * as torch's empty_like: for a (B, N, H, D) tensor seen as (B, H, N, D), the output is the
 * same view of contiguous (B, N, H, D) memory, so that its caller's transpose back needs no
 * copy. The last axis stays innermost. A call on DeviceArrays (C order) gets DeviceArrays.
 * Zeroed for OpenCL devices only: the native kernels write every element of their outputs
 * (every row of every unit, rows that see no key included), and zeroing them first kept the
 * calling thread while the others waited: without it B4 H8 N1024 D64 took 0.977x the time
 * backward, 0.989x forward, 0.975x causal (AMD EPYC, 2 threads). */
int or_new_output(or_call *c, int slot, int nd, const npy_intp *shape, or_dtype dt,
                  PyArrayObject *like)
{
    if (c->resident)
        return or_device_output(c, slot, nd, shape, dt);
    npy_intp dims[NPY_MAXDIMS];
    int order[NPY_MAXDIMS];     /* memory order: outermost axis first */
    for (int i = 0; i < nd; i++)
        order[i] = i;
    if (like != NULL) {
        /* the leading axes as torch's empty_like orders a tensor's (infer_dense_strides'
         * insertion sort, innermost first): an axis goes inward past those of larger
         * |stride|, or of equal stride and larger size, and stops at one of smaller stride; an
         * axis of stride 0 (expanded) is passed over, compared with none, so that it keeps its
         * place among the others (sorted outermost by stride 0, it had come innermost) */
        const int n = nd - 1;
        int inward[NPY_MAXDIMS];
        for (int i = 0; i < n; i++)
            inward[i] = n - 1 - i;
        for (int i = 1; i < n; i++)
            for (int d1 = i, d0 = i - 1; d0 >= 0; d0--) {
                const int c = inner_first(like, inward[d0], inward[d1]);
                if (c < 0)
                    break;
                if (c > 0) {
                    const int t = inward[d0];
                    inward[d0] = inward[d1];
                    inward[d1] = t;
                    d1 = d0;
                }
            }
        for (int i = 0; i < n; i++)
            order[i] = inward[n - 1 - i];
    }
    for (int i = 0; i < nd; i++)
        dims[i] = shape[order[i]];
    PyArrayObject *mem = or_new_aligned(nd, dims, or_dtypes[dt].typenum,
                                        or_device_align(c->device.index), c->device.index != 0);
    if (mem == NULL && PyErr_ExceptionMatches(PyExc_MemoryError)) {    /* say whose memory */
        static const char *names[OR_NSLOTS] = OR_SLOT_NAMES;
        or_restate(PyExc_MemoryError, "%s(): the result '%s' cannot be allocated", c->func,
                   names[slot]);
    }
    if (mem != NULL) {
        npy_intp axes[NPY_MAXDIMS];     /* axis order[i] of the output is axis i of mem */
        for (int i = 0; i < nd; i++)
            axes[order[i]] = i;
        PyArray_Dims perm = {axes, nd};
        c->arr[slot] = (PyArrayObject *)PyArray_Transpose(mem, &perm);
        Py_DECREF(mem);
    }
    c->dt[slot] = dt;
    return c->arr[slot] ? 0 : -1;
}

/* Dense layout: views over the leading dims, constant lengths; a forward over a KV cache
 * (seqused_k, leftpad_k) gives unit (b, h) keys leftpad[b] to used[b] of its rows. */
static int dense_tables(or_call *c)
{
    PyArrayObject *q = c->arr[OR_Q];
    int nd = PyArray_NDIM(q);
    or_ssize n = 1;
    for (int i = 0; i < nd - 2; i++)
        n *= PyArray_DIM(q, i);
    c->p.n_units = n;
    if (!(c->nq = or_alloc_units(n, sizeof(or_ssize)))
        || !(c->nk = or_alloc_units(n, sizeof(or_ssize))))
        return -1;
    const int64_t *used = c->used_k ? PyArray_DATA(c->used_k) : NULL;
    const int64_t *lp = c->leftpad ? PyArray_DATA(c->leftpad) : NULL;
    const or_ssize h = c->heads, hkv = h / c->p.prm.group;
    for (or_ssize u = 0; u < n; u++) {
        c->nq[u] = PyArray_DIM(q, nd - 2);
        c->nk[u] = (used ? used[u / h] : PyArray_DIM(c->arr[OR_K], nd - 2)) - (lp ? lp[u / h] : 0);
    }
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL)
            continue;
        /* lse has one dimension less: its "rows" are its elements */
        int nlead = s == OR_LSE ? PyArray_NDIM(c->arr[s]) - 1 : PyArray_NDIM(c->arr[s]) - 2;
        if (!(c->offs[s] = or_lead_offsets(c->arr[s], nlead)))
            return -1;
        c->p.view[s].row_stride = PyArray_STRIDE(c->arr[s], nlead);
        if (lp != NULL && (s == OR_K || s == OR_V))     /* keys from the left padding on */
            for (or_ssize w = 0; w < n / c->p.prm.group; w++)
                c->offs[s][w] += (or_ssize)lp[w / hkv] * c->p.view[s].row_stride;
    }
    return 0;
}

/* Paged k and v (or_check_key_ranges): kv unit (b, h) reads sequence b's row of pages from its
 * leftpad on, at head h's offset within a page row. */
static int paged_tables(or_call *c, or_ssize nseq, or_ssize hkv)
{
    const int64_t *tbl = PyArray_DATA(c->pages), *lp = c->leftpad ? PyArray_DATA(c->leftpad) : NULL;
    const npy_intp width = PyArray_DIM(c->pages, 1);
    if (!(c->page_list = or_alloc_units(nseq * hkv, sizeof(*c->page_list)))
        || !(c->page_first = or_alloc_units(nseq * hkv, sizeof(or_ssize))))
        return -1;
    for (int s = OR_K; s <= OR_V; s++) {
        if (!(c->offs[s] = or_alloc_units(nseq * hkv, sizeof(or_ssize))))
            return -1;
        for (or_ssize w = 0; w < nseq * hkv; w++)
            c->offs[s][w] = (w % hkv) * PyArray_STRIDE(c->arr[s], 1);
        c->p.view[s].row_stride = PyArray_STRIDE(c->arr[s], 0);
    }
    for (or_ssize w = 0; w < nseq * hkv; w++) {
        c->page_list[w] = tbl + (w / hkv) * width;
        c->page_first[w] = lp ? lp[w / hkv] : 0;
    }
    c->p.pages.table = c->page_list;
    c->p.pages.first = c->page_first;
    return 0;
}

/* Varlen layout: unit (b, h) is sequence b of head h. */
static int varlen_tables(or_call *c)
{
    const int64_t *cq = PyArray_DATA(c->cu_q), *ck = PyArray_DATA(c->cu_k);
    const int64_t *used = c->used_k ? PyArray_DATA(c->used_k) : NULL;
    or_ssize nseq = PyArray_DIM(c->cu_q, 0) - 1, h = c->heads, hkv = h / c->p.prm.group;
    c->p.n_units = nseq * h;
    if (!(c->nq = or_alloc_units(nseq * h, sizeof(or_ssize)))
        || !(c->nk = or_alloc_units(nseq * h, sizeof(or_ssize))))
        return -1;
    const int64_t *lp = c->leftpad ? PyArray_DATA(c->leftpad) : NULL;
    for (or_ssize b = 0; b < nseq; b++)
        for (or_ssize i = 0; i < h; i++) {
            c->nq[b * h + i] = cq[b + 1] - cq[b];
            c->nk[b * h + i] = (used ? used[b] : ck[b + 1] - ck[b]) - (lp ? lp[b] : 0);
        }
    if (c->pages != NULL && paged_tables(c, nseq, hkv) < 0)
        return -1;
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL || (c->pages != NULL && (s == OR_K || s == OR_V)))
            continue;
        int kv_side = s == OR_K || s == OR_V || s == OR_DK || s == OR_DV;
        int seq_axis = s == OR_LSE ? 1 : 0, head_axis = s == OR_LSE ? 0 : 1;
        c->offs[s] = or_varlen_offsets(c->arr[s], kv_side ? ck : cq, nseq, kv_side ? hkv : h,
                                       seq_axis, head_axis);
        if (c->offs[s] == NULL)
            return -1;
        if (lp != NULL && (s == OR_K || s == OR_V))     /* keys from the left padding on */
            for (or_ssize w = 0; w < nseq * hkv; w++)
                c->offs[s][w] += (or_ssize)lp[w / hkv] * PyArray_STRIDE(c->arr[s], 0);
        c->p.view[s].row_stride = PyArray_STRIDE(c->arr[s], seq_axis);
    }
    return 0;
}

/* ALiBi slopes: (H,) or the unit grid (dense: q.shape[:-2]; varlen: (B, H)), checked before
 * the operands are staged and kept in c->alibi, a float64 copy (the caller's array could
 * change before the table is built: a DeviceArray call's outputs release the GIL). */
int or_check_alibi(or_call *c, PyObject *obj)
{
    if (obj == Py_None)
        return 0;
    /* integers or floats as given, then as float64: a forced cast would also take booleans,
     * and complex slopes without their imaginary parts */
    PyArrayObject *raw = or_values(c->st, obj, c->func, "alibi_slopes"), *a = NULL;
    if (raw == NULL)
        return -1;      /* its error names the argument */
    if (!PyArray_ISINTEGER(raw) && !PyArray_ISFLOAT(raw)) {
        PyObject *got = or_values_str(raw, obj);
        if (got != NULL)
            PyErr_Format(PyExc_TypeError, "%s(): 'alibi_slopes' must be an array of integers or "
                         "floats, got %U", c->func, got);
        Py_XDECREF(got);
        Py_DECREF(raw);
        return -1;
    }
    /* the shape first: a wrong one may be a broadcast view too large to copy */
    or_ssize h = c->heads, size = PyArray_SIZE(raw);
    int nd = PyArray_NDIM(raw), per_head = nd <= 1 && size == h, per_unit = 0;
    if (!per_head) {
        npy_intp grid[2];
        int gnd;
        if (c->varlen) {
            grid[0] = PyArray_DIM(c->cu_q, 0) - 1;
            grid[1] = h;
            gnd = 2;
        } else {
            gnd = PyArray_NDIM(c->arr[OR_Q]) - 2;
        }
        per_unit = nd == gnd;
        for (int i = 0; per_unit && i < nd; i++)
            per_unit = PyArray_DIM(raw, i) == (c->varlen ? grid[i] : PyArray_DIM(c->arr[OR_Q], i));
    }
    if (!per_head && !per_unit) {
        PyObject *got = or_shape_str(raw);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'alibi_slopes' must have shape (H,) or (B, H) (one slope per "
                         "query head), got %S", c->func, got);
        Py_XDECREF(got);
        Py_DECREF(raw);
        return -1;
    }
    a = (PyArrayObject *)PyArray_FromAny((PyObject *)raw, PyArray_DescrFromType(NPY_FLOAT64), 0,
                                         0, NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST | NPY_ARRAY_ENSURECOPY, NULL);
    Py_DECREF(raw);
    if (a == NULL)
        return -1;
    const double *v = PyArray_DATA(a);
    for (npy_intp i = 0; i < size; i++)
        if (!(fabs(v[i]) <= or_compute_max(c))) {    /* it would make every row it touches NaN */
            PyObject *got = PyFloat_FromDouble(v[i]);
            if (got != NULL)
                PyErr_Format(PyExc_ValueError, "%s(): 'alibi_slopes' must be finite%s, got %R at "
                             "flat index %zd", c->func, isfinite(v[i]) ? " in float32, the "
                             "kernels' type for these operands" : "", got, (Py_ssize_t)i);
            Py_XDECREF(got);
            Py_DECREF(a);
            return -1;
        }
    c->alibi = a;
    return 0;
}

/* The checked slopes, one per unit: per head, or the grid's own (then one per unit). */
static int alibi_table(or_call *c)
{
    if (c->alibi == NULL)
        return 0;
    const double *v = PyArray_DATA(c->alibi);
    const or_ssize n = c->p.n_units, size = PyArray_SIZE(c->alibi);
    c->slopes = (double *)or_alloc_units(n, sizeof(double));
    for (or_ssize u = 0; c->slopes != NULL && u < n; u++)
        c->slopes[u] = v[size == n ? u : u % size];
    return c->slopes ? 0 : -1;
}

/* Fills the per-unit tables and the views: after this, c->p is what the kernels read. */
int or_build_problem(or_call *c)
{
    if ((c->varlen ? varlen_tables(c) : dense_tables(c)) < 0 || alibi_table(c) < 0)
        return -1;
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL)
            continue;
        or_view *w = &c->p.view[s];
        w->base = PyArray_BYTES(c->arr[s]);
        w->offs = c->offs[s];
        w->itemsize = (int)PyArray_ITEMSIZE(c->arr[s]);
        or_extent(c->arr[s], &w->lo, &w->nbytes);
        w->dtype = c->dt[s];
        w->mem = c->dev[s] ? or_device_array_mem(c->dev[s]) : NULL;
    }
    c->p.nq = c->nq;
    c->p.nk = c->nk;
    c->p.slopes = c->slopes;
    c->p.prm.has_alibi = c->slopes != NULL;
    return 0;
}
