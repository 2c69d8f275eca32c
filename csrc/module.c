/* module.c - the orchard_ops module: argument parsing, validation, and the calls into the
 * kernels.
 *
 * Every attention call is handled the same way: parse the arguments once into an opts_t,
 * turn the operands into arrays (marshal.c), check shapes and options while building an
 * or_problem in a call_t, run the kernels with the GIL released, and release everything the
 * call_t owns on one cleanup path. Each failure sets exactly one exception.
 */
#define ORCHARD_MODULE_C
#include <math.h>
#include <time.h>

#include "pyorchard.h"

#define MAX_HEAD_DIM 256
/* Index limits. The dropout stream numbers a score's row and column with 32 bits each
 * (kernels/params.h) and the OpenCL kernels count the query heads of a GQA group
 * in an int; larger sizes are refused with ValueError before anything is allocated, rather
 * than computed wrongly. Everything else is indexed with 64 bits. */
#define MAX_SEQ_LEN 0xFFFFFFFFLL        /* rows or keys of one sequence: < 2**32 */
#define MAX_HEADS 0x7FFFFFFFLL          /* query heads: < 2**31 */

typedef struct {
    PyObject *error;        /* OrchardError(RuntimeError) */
    PyObject *oom;          /* OrchardOutOfMemory(OrchardError, MemoryError) */
} module_state;

static module_state *get_state(PyObject *module)
{
    return (module_state *)PyModule_GetState(module);
}

/* ------------------------------------------------------------------ options */

typedef struct {
    PyObject *scale, *window, *alibi, *seed, *device, *max_q, *max_k;
    double dropout_p, softcap;
    int causal;
} opts_t;

/* One attention call in flight: what it owns and the problem handed to the kernels. */
typedef struct {
    const char *func;
    int varlen;
    PyArrayObject *arr[OR_NSLOTS];
    or_ssize *offs[OR_NSLOTS];
    PyArrayObject *cu_q, *cu_k;     /* int64 copies of cu_seqlens */
    or_ssize *nq, *nk;
    double *slopes;
    or_ssize heads;                 /* query heads H (dense: size of dim -3, or 1) */
    or_device_choice device;
    or_counters *ct;                /* the chosen device's counters */
    or_problem p;
} call_t;

static void call_clear(call_t *c)
{
    for (int s = 0; s < OR_NSLOTS; s++) {
        Py_CLEAR(c->arr[s]);
        PyMem_Free(c->offs[s]);
        c->offs[s] = NULL;
    }
    Py_CLEAR(c->cu_q);
    Py_CLEAR(c->cu_k);
    PyMem_Free(c->nq);
    PyMem_Free(c->nk);
    PyMem_Free(c->slopes);
    c->nq = c->nk = NULL;
    c->slopes = NULL;
}

static const char *slot_name[OR_NSLOTS] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"};

/* An integer argument (int, numpy integer, anything with __index__) as a long long; returns
 * 0, or -1 with no exception set when it is not an integer or does not fit. */
static int as_integer(PyObject *obj, long long *out)
{
    PyObject *i = PyNumber_Index(obj);
    if (i == NULL) {
        PyErr_Clear();
        return -1;
    }
    *out = PyLong_AsLongLong(i);
    Py_DECREF(i);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* Checks the options that do not depend on shapes and stores them in c->p. */
static int check_options(call_t *c, const opts_t *o)
{
    or_problem *p = &c->p;
    if (!(o->dropout_p >= 0.0 && o->dropout_p < 1.0)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'dropout_p' must be in [0, 1)", c->func);
        return -1;
    }
    if (!(o->softcap >= 0.0 && isfinite(o->softcap))) {
        PyErr_Format(PyExc_ValueError, "%s(): 'softcap' must be a finite number >= 0", c->func);
        return -1;
    }
    p->prm.softcap = o->softcap;
    p->prm.dropout = o->dropout_p > 0.0;
    p->prm.threshold = or_dropout_threshold(o->dropout_p);
    p->prm.drop_scale = 1.0 / (1.0 - o->dropout_p);

    p->prm.left = p->prm.right = -1;
    if (o->window != NULL && (!PySequence_Check(o->window) || PySequence_Size(o->window) != 2)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): 'window' must be a pair (left, right) of ints",
                     c->func);
        return -1;
    }
    long long lr[2] = {-1, -1};
    for (int i = 0; o->window != NULL && i < 2; i++) {
        PyObject *item = PySequence_GetItem(o->window, i);
        if (item == NULL)
            return -1;
        int bad = as_integer(item, &lr[i]) < 0;
        Py_DECREF(item);
        if (bad || lr[i] < -1) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'window' entries must be ints >= -1 (-1 = unbounded), got %R",
                         c->func, o->window);
            return -1;
        }
    }
    p->prm.left = (or_ssize)lr[0];
    p->prm.right = (or_ssize)lr[1];
    if (o->causal && (p->prm.right < 0 || p->prm.right > 0))
        p->prm.right = 0;

    if (o->seed == NULL)
        return 0;       /* seed 0 */
    PyObject *seed_int = PyNumber_Index(o->seed);
    if (seed_int == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): 'seed' must be an int, not %.100s", c->func,
                     Py_TYPE(o->seed)->tp_name);
        return -1;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(seed_int);
    Py_DECREF(seed_int);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s(): 'seed' must be in [0, 2**64), got %R", c->func,
                     o->seed);
        return -1;
    }
    p->prm.seed = (uint64_t)seed;
    return 0;
}

static int check_scale(call_t *c, const opts_t *o)
{
    if (o->scale == Py_None) {
        c->p.prm.scale = 1.0 / sqrt((double)c->p.d);
        return 0;
    }
    double s = PyFloat_AsDouble(o->scale);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): 'scale' must be a number or None, not %.100s",
                     c->func, Py_TYPE(o->scale)->tp_name);
        return -1;
    }
    if (!isfinite(s)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'scale' must be finite, got %R", c->func, o->scale);
        return -1;
    }
    c->p.prm.scale = s;
    return 0;
}

/* ------------------------------------------------------------------ shapes */

static int shape_error(call_t *c, const char *name, const char *what)
{
    PyObject *shape = c->arr[OR_Q] ? or_shape_str(c->arr[OR_Q]) : NULL;
    PyErr_Format(PyExc_ValueError, "%s(): argument '%s' %s (q has shape %S)", c->func, name, what,
                 shape ? shape : Py_None);
    Py_XDECREF(shape);
    return -1;
}

/* Converts the input operands named in `slots` and checks that they share q's dtype. */
static int load_operands(call_t *c, PyObject **objs, const int *slots, int n)
{
    const size_t align = or_device_align(c->device.index);
    for (int i = 0; i < n; i++) {
        int s = slots[i];
        c->arr[s] = or_operand(objs[i], c->func, slot_name[s], c->ct, align);
        if (c->arr[s] == NULL)
            return -1;
    }
    or_dtype dt = OR_F32;
    or_dtype_of(c->arr[OR_Q], &dt);     /* or_operand checked it */
    c->p.view[OR_Q].dtype = dt;
    for (int i = 0; i < n; i++) {
        int s = slots[i];
        or_dtype got = OR_F32;
        or_dtype_of(c->arr[s], &got);
        if (s == OR_LSE && got != (dt == OR_F64 ? OR_F64 : OR_F32)) {
            /* lse of another float type is accepted and converted to the kernels' own */
            PyArrayObject *cast = or_staged_copy(c->arr[s], dt == OR_F64 ? NPY_FLOAT64 : NPY_FLOAT32,
                                                 align);
            if (cast == NULL)
                return -1;
            OR_COUNT(c->ct, staged_buffers, 1);
            OR_COUNT(c->ct, bytes_staged, PyArray_NBYTES(cast));
            Py_SETREF(c->arr[s], cast);
        } else if (s != OR_LSE && got != dt) {
            PyErr_Format(PyExc_TypeError, "%s(): argument '%s' has dtype %S but 'q' has %S",
                         c->func, slot_name[s], (PyObject *)PyArray_DESCR(c->arr[s]),
                         (PyObject *)PyArray_DESCR(c->arr[OR_Q]));
            return -1;
        }
    }
    if (dt == OR_F64 && !or_device_fp64(c->device.index)) {
        PyObject *id = or_device_id(c->device.index);
        if (id != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%s(): float64 needs cl_khr_fp64, which device %S lacks; use float32 "
                         "or device='cpu'", c->func, id);
        Py_XDECREF(id);
        return -1;
    }
    return 0;
}

/* Checks q, k, v and fills d, dv, group. Dense layout: (..., N, D) with matching leading
 * dims, or 4-D GQA. Varlen: (total, H, D). */
static int check_qkv(call_t *c)
{
    PyArrayObject *q = c->arr[OR_Q], *k = c->arr[OR_K], *v = c->arr[OR_V];
    int nd = PyArray_NDIM(q);
    if (c->varlen ? nd != 3 : nd < 2)
        return shape_error(c, "q", c->varlen ? "must be 3-D (total_q, H, D)"
                                              : "must have at least 2 dimensions (..., N, D)");
    if (PyArray_NDIM(k) != nd)
        return shape_error(c, "k", "must have as many dimensions as q");
    if (PyArray_NDIM(v) != nd)
        return shape_error(c, "v", "must have as many dimensions as q");
    npy_intp d = PyArray_DIM(q, nd - 1), dv = PyArray_DIM(v, nd - 1);
    if (d < 1 || d > MAX_HEAD_DIM)
        return shape_error(c, "q", "must have a head dim (last dimension) in 1..256");
    if (PyArray_DIM(k, nd - 1) != d)
        return shape_error(c, "k", "must have the head dim (last dimension) of q");
    if (dv < 1 || dv > MAX_HEAD_DIM)
        return shape_error(c, "v", "must have a head dim (last dimension) in 1..256");
    c->p.d = (int)d;
    c->p.dv = (int)dv;
    /* the key-sequence axis: varlen packs (total, H, D), dense is (..., N, D) */
    int seq = c->varlen ? 0 : nd - 2;
    if (PyArray_DIM(v, seq) != PyArray_DIM(k, seq))
        return shape_error(c, "v", "must have as many keys as k");
    int head = c->varlen ? 1 : nd == 4 ? 1 : -1;    /* the axis where GQA may differ */
    for (int i = 0; i < nd - 1; i++) {
        if (i == seq || (c->varlen && i == 0))
            continue;
        if (i != head && PyArray_DIM(k, i) != PyArray_DIM(q, i))
            return shape_error(c, "k", "must have the batch dimensions of q");
        if (PyArray_DIM(v, i) != PyArray_DIM(k, i))
            return shape_error(c, "v", "must have the batch and head dimensions of k");
    }
    if (!c->varlen && PyArray_DIM(q, seq) > MAX_SEQ_LEN)
        return shape_error(c, "q", "must have fewer than 2**32 query rows (dimension -2)");
    if (!c->varlen && PyArray_DIM(k, seq) > MAX_SEQ_LEN)
        return shape_error(c, "k", "must have fewer than 2**32 keys (dimension -2)");
    c->p.prm.group = 1;
    c->heads = nd >= 3 ? PyArray_DIM(q, c->varlen ? 1 : nd - 3) : 1;
    if (c->heads > MAX_HEADS)
        return shape_error(c, "q", "must have fewer than 2**31 heads");
    if (head >= 0) {
        npy_intp h = PyArray_DIM(q, head), hkv = PyArray_DIM(k, head);
        if (hkv == 0 ? h != 0 : h % hkv != 0)
            return shape_error(c, "k", "must have a number of heads dividing q's (GQA/MQA)");
        c->p.prm.group = hkv ? h / hkv : 1;
    }
    return 0;
}

/* Checks an extra operand (dout, out, lse) against the shape it must have. */
static int check_like(call_t *c, int slot, const npy_intp *shape, int nd)
{
    PyArrayObject *a = c->arr[slot];
    int ok = PyArray_NDIM(a) == nd;
    for (int i = 0; ok && i < nd; i++)
        ok = PyArray_DIM(a, i) == shape[i];
    if (ok)
        return 0;
    PyObject *want = PyTuple_New(nd);
    if (want == NULL)
        return -1;
    for (int i = 0; i < nd; i++)
        PyTuple_SET_ITEM(want, i, PyLong_FromSsize_t(shape[i]));
    PyObject *got = or_shape_str(a);
    PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must have shape %S, got %S", c->func,
                 slot_name[slot], want, got ? got : Py_None);
    Py_DECREF(want);
    Py_XDECREF(got);
    return -1;
}

/* The shapes of out and lse implied by q and v. */
static void out_shapes(call_t *c, npy_intp *oshape, npy_intp *lshape, int *ond, int *lnd)
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

/* Outputs are aligned for the device, so that kernels can write them in place. */
static int new_output(call_t *c, int slot, int nd, const npy_intp *shape, or_dtype dt)
{
    static const int typenum[] = {NPY_FLOAT16, NPY_FLOAT32, NPY_FLOAT64};
    c->arr[slot] = or_new_aligned(nd, shape, typenum[dt], or_device_align(c->device.index));
    return c->arr[slot] ? 0 : -1;
}

/* ------------------------------------------------------------------ per-unit tables */

static or_ssize *alloc_units(or_ssize n, size_t elsize)
{
    /* n comes from a product of dimensions that a stride-0 view can make huge */
    void *mem = (size_t)n < PY_SSIZE_T_MAX / elsize ? PyMem_Malloc(elsize * (size_t)(n + 1))
                                                   : NULL;
    if (mem == NULL)
        PyErr_NoMemory();
    return mem;
}

/* Dense layout: views over the leading dims, constant lengths. */
static int dense_tables(call_t *c)
{
    PyArrayObject *q = c->arr[OR_Q];
    int nd = PyArray_NDIM(q);
    or_ssize n = 1;
    for (int i = 0; i < nd - 2; i++)
        n *= PyArray_DIM(q, i);
    c->p.n_units = n;
    if (!(c->nq = alloc_units(n, sizeof(or_ssize))) || !(c->nk = alloc_units(n, sizeof(or_ssize))))
        return -1;
    for (or_ssize u = 0; u < n; u++) {
        c->nq[u] = PyArray_DIM(q, nd - 2);
        c->nk[u] = PyArray_DIM(c->arr[OR_K], nd - 2);
    }
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL)
            continue;
        /* lse has one dimension less: its "rows" are its elements */
        int nlead = s == OR_LSE ? PyArray_NDIM(c->arr[s]) - 1 : PyArray_NDIM(c->arr[s]) - 2;
        if (!(c->offs[s] = or_lead_offsets(c->arr[s], nlead)))
            return -1;
        c->p.view[s].row_stride = PyArray_STRIDE(c->arr[s], nlead);
    }
    return 0;
}

/* cu_seqlens as a validated int64 array of B + 1 offsets ending at `total`. */
static PyArrayObject *check_cu_seqlens(call_t *c, PyObject *obj, const char *name,
                                       npy_intp total, npy_intp *max_len)
{
    PyArrayObject *raw = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (raw == NULL)
        return NULL;
    if (!PyArray_ISINTEGER(raw) || PyArray_NDIM(raw) != 1 || PyArray_DIM(raw, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): '%s' must be a 1-D integer array of B + 1 offsets",
                     c->func, name);
        Py_DECREF(raw);
        return NULL;
    }
    PyArrayObject *cu = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)raw, PyArray_DescrFromType(NPY_INT64), 1, 1,
        NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST, NULL);
    Py_DECREF(raw);
    if (cu == NULL)
        return NULL;
    const int64_t *v = PyArray_DATA(cu);
    npy_intp n = PyArray_DIM(cu, 0);
    *max_len = 0;
    int ok = v[0] == 0 && v[n - 1] == total;
    for (npy_intp i = 1; ok && i < n; i++) {
        ok = v[i] >= v[i - 1];
        *max_len = v[i] - v[i - 1] > *max_len ? v[i] - v[i - 1] : *max_len;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): '%s' must start at 0, never decrease and end at %zd (the packed "
                     "length)", c->func, name, total);
        Py_DECREF(cu);
        return NULL;
    }
    if (*max_len > MAX_SEQ_LEN) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): '%s' must describe sequences shorter than 2**32, got one of %zd",
                     c->func, name, *max_len);
        Py_DECREF(cu);
        return NULL;
    }
    return cu;
}

static int check_max_seqlen(call_t *c, PyObject *given, const char *name, npy_intp actual)
{
    if (given == Py_None)
        return 0;
    long long m;
    if (as_integer(given, &m) < 0 || m < actual) {
        PyErr_Format(PyExc_ValueError, "%s(): '%s' must be an int >= %zd, the longest sequence",
                     c->func, name, actual);
        return -1;
    }
    return 0;
}

/* cu_seqlens and max_seqlen of a varlen call, checked before any output is allocated. */
static int check_varlen(call_t *c, const opts_t *o, PyObject *cuq_obj, PyObject *cuk_obj)
{
    npy_intp maxq, maxk;
    c->cu_q = check_cu_seqlens(c, cuq_obj, "cu_seqlens_q", PyArray_DIM(c->arr[OR_Q], 0), &maxq);
    if (c->cu_q == NULL)
        return -1;
    c->cu_k = check_cu_seqlens(c, cuk_obj, "cu_seqlens_k", PyArray_DIM(c->arr[OR_K], 0), &maxk);
    if (c->cu_k == NULL)
        return -1;
    if (PyArray_DIM(c->cu_q, 0) != PyArray_DIM(c->cu_k, 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'cu_seqlens_k' must have as many entries as 'cu_seqlens_q'", c->func);
        return -1;
    }
    if (check_max_seqlen(c, o->max_q, "max_seqlen_q", maxq) < 0
        || check_max_seqlen(c, o->max_k, "max_seqlen_k", maxk) < 0)
        return -1;
    return 0;
}

/* Varlen layout: unit (b, h) is sequence b of head h. */
static int varlen_tables(call_t *c)
{
    const int64_t *cq = PyArray_DATA(c->cu_q), *ck = PyArray_DATA(c->cu_k);
    or_ssize nseq = PyArray_DIM(c->cu_q, 0) - 1, h = c->heads, hkv = h / c->p.prm.group;
    c->p.n_units = nseq * h;
    if (!(c->nq = alloc_units(nseq * h, sizeof(or_ssize)))
        || !(c->nk = alloc_units(nseq * h, sizeof(or_ssize))))
        return -1;
    for (or_ssize b = 0; b < nseq; b++)
        for (or_ssize i = 0; i < h; i++) {
            c->nq[b * h + i] = cq[b + 1] - cq[b];
            c->nk[b * h + i] = ck[b + 1] - ck[b];
        }
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL)
            continue;
        int kv_side = s == OR_K || s == OR_V || s == OR_DK || s == OR_DV;
        int seq_axis = s == OR_LSE ? 1 : 0, head_axis = s == OR_LSE ? 0 : 1;
        c->offs[s] = or_varlen_offsets(c->arr[s], kv_side ? ck : cq, nseq, kv_side ? hkv : h,
                                       seq_axis, head_axis);
        if (c->offs[s] == NULL)
            return -1;
        c->p.view[s].row_stride = PyArray_STRIDE(c->arr[s], seq_axis);
    }
    return 0;
}

/* ALiBi slopes, one per unit. Accepted shapes: (H,) or the unit grid (dense: q.shape[:-2];
 * varlen: (B, H)). */
static int alibi_table(call_t *c, PyObject *obj)
{
    if (obj == Py_None)
        return 0;
    PyArrayObject *a = (PyArrayObject *)PyArray_FromAny(
        obj, PyArray_DescrFromType(NPY_FLOAT64), 0, 0, NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST,
        NULL);
    if (a == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s(): 'alibi_slopes' must be an array of floats",
                         c->func);
        }
        return -1;
    }
    or_ssize n = c->p.n_units, h = c->heads, size = PyArray_SIZE(a);
    int nd = PyArray_NDIM(a), per_head = nd <= 1 && size == h, per_unit = 0;
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
            per_unit = PyArray_DIM(a, i) == (c->varlen ? grid[i] : PyArray_DIM(c->arr[OR_Q], i));
    }
    if (!per_head && !per_unit) {
        PyObject *got = or_shape_str(a);
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'alibi_slopes' must have shape (H,) or (B, H) (one slope per query "
                     "head), got %S", c->func, got ? got : Py_None);
        Py_XDECREF(got);
        Py_DECREF(a);
        return -1;
    }
    c->slopes = (double *)alloc_units(n, sizeof(double));
    if (c->slopes != NULL) {
        const double *v = PyArray_DATA(a);
        for (or_ssize u = 0; u < n; u++)
            c->slopes[u] = per_head ? v[h > 0 ? u % h : 0] : v[u];
    }
    Py_DECREF(a);
    return c->slopes ? 0 : -1;
}

/* ------------------------------------------------------------------ running */

/* Raises the exception a failed device call deserves: OrchardOutOfMemory for the
 * out-of-memory codes, OrchardError otherwise, with the build log when there is one.
 * CL_INVALID_BUFFER_SIZE (-61) counts as out of memory: clCreateBuffer returns it for a buffer
 * larger than the device's CL_DEVICE_MAX_MEM_ALLOC_SIZE, a buffer that cannot be allocated. */
static PyObject *device_error(module_state *st, call_t *c, const or_error *err)
{
    int oom = err->cl_code == -4 || err->cl_code == -5 || err->cl_code == -6
              || err->cl_code == -61;
    PyObject *id = or_device_id(c->device.index);
    if (id == NULL)
        return NULL;
    PyErr_Format(oom ? st->oom : st->error, "%s() on %S: %s%s%s", c->func, id, err->msg,
                 err->log ? "\nbuild log:\n" : "", err->log ? err->log : "");
    Py_DECREF(id);
    return NULL;
}

static int compute(call_t *c, int backward, or_error *err)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (c->device.index == 0)
        rc = backward ? or_native_bwd(&c->p) : or_native_fwd(&c->p);
    else if (backward)
        rc = or_cl_bwd(c->device.index - 1, &c->p, c->ct, err);
    else
        rc = or_cl_fwd(c->device.index - 1, &c->p, c->ct, err);
    Py_END_ALLOW_THREADS
    return rc;
}

static PyObject *run(call_t *c, module_state *st, int backward)
{
    for (int s = 0; s < OR_NSLOTS; s++) {
        if (c->arr[s] == NULL)
            continue;
        or_view *w = &c->p.view[s];
        w->base = PyArray_BYTES(c->arr[s]);
        w->offs = c->offs[s];
        w->itemsize = (int)PyArray_ITEMSIZE(c->arr[s]);
        or_extent(c->arr[s], &w->lo, &w->nbytes);
        or_dtype_of(c->arr[s], &w->dtype);
    }
    c->p.nq = c->nq;
    c->p.nk = c->nk;
    c->p.slopes = c->slopes;
    c->p.prm.has_alibi = c->slopes != NULL;

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    or_error err = {0};
    int rc = compute(c, backward, &err);
    if (rc == OR_EDEVICE && c->device.automatic) {
        /* auto choice: a device that cannot run falls back to the native path, said once */
        static int warned;
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))  /* once, whatever the threads */
            or_log("orchard: %s failed on the automatically chosen OpenCL device (%s); "
                   "using the native CPU path", c->func, err.msg);
        free(err.log);
        err.log = NULL;
        c->device.index = 0;
        c->ct = or_device_counters(0);
        rc = compute(c, backward, &err);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (rc != OR_OK) {
        PyObject *none = rc == OR_ENOMEM ? PyErr_NoMemory() : device_error(st, c, &err);
        free(err.log);
        return none;
    }
    OR_COUNT(c->ct, fwd_calls, !backward);
    OR_COUNT(c->ct, bwd_calls, backward);

    if (or_log_enabled("ORCHARD_DEBUG_FLASH_ATN")) {
        PyObject *qs = or_shape_str(c->arr[OR_Q]), *ks = or_shape_str(c->arr[OR_K]);
        PyObject *id = or_device_id(c->device.index);
        if (qs == NULL || ks == NULL || id == NULL) {
            Py_XDECREF(qs);
            Py_XDECREF(ks);
            Py_XDECREF(id);
            return NULL;
        }
        or_log("orchard: %s device=%s q=%s k=%s dv=%d dtype=%s time=%.3f ms", c->func,
               PyUnicode_AsUTF8(id), PyUnicode_AsUTF8(qs), PyUnicode_AsUTF8(ks), c->p.dv,
               c->p.view[OR_Q].dtype == OR_F16 ? "float16"
               : c->p.view[OR_Q].dtype == OR_F32 ? "float32" : "float64",
               (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6);
        Py_DECREF(qs);
        Py_DECREF(ks);
        Py_DECREF(id);
    }
    if (backward)
        return PyTuple_Pack(3, c->arr[OR_DQ], c->arr[OR_DK], c->arr[OR_DV]);
    return PyTuple_Pack(2, c->arr[OR_O], c->arr[OR_LSE]);
}

/* Shared by the four attention entry points once arguments are parsed. objs holds the
 * positional operands in the order of `slots`. */
static PyObject *attention(PyObject *module, call_t *c, opts_t *o, PyObject **objs,
                           const int *slots, int nobj, PyObject *cuq, PyObject *cuk)
{
    module_state *st = get_state(module);
    int backward = nobj == 6;
    PyObject *result = NULL;
    npy_intp oshape[NPY_MAXDIMS], lshape[NPY_MAXDIMS];
    int ond, lnd;

    if (check_options(c, o) < 0 || or_resolve_device(c->func, o->device, &c->device) < 0)
        goto done;
    c->ct = or_device_counters(c->device.index);
    if (load_operands(c, objs, slots, nobj) < 0
        || check_qkv(c) < 0 || check_scale(c, o) < 0
        || (c->varlen && check_varlen(c, o, cuq, cuk) < 0))
        goto done;
    or_dtype dt = c->p.view[OR_Q].dtype;
    out_shapes(c, oshape, lshape, &ond, &lnd);
    if (backward) {
        if (check_like(c, OR_DO, oshape, ond) < 0 || check_like(c, OR_O, oshape, ond) < 0
            || check_like(c, OR_LSE, lshape, lnd) < 0)
            goto done;
        for (int s = OR_DQ; s <= OR_DV; s++) {
            PyArrayObject *like = c->arr[s - OR_DQ + OR_Q];
            if (new_output(c, s, PyArray_NDIM(like), PyArray_DIMS(like), dt) < 0)
                goto done;
        }
    } else if (new_output(c, OR_O, ond, oshape, dt) < 0
               || new_output(c, OR_LSE, lnd, lshape, dt == OR_F64 ? OR_F64 : OR_F32) < 0) {
        goto done;
    }
    if ((c->varlen ? varlen_tables(c) : dense_tables(c)) < 0
        || alibi_table(c, o->alibi) < 0)
        goto done;
    result = run(c, st, backward);
done:
    call_clear(c);
    return result;
}

#define OPTION_KWLIST "window", "alibi_slopes", "softcap", "seed", "device"
#define OPTION_FORMAT "$OOdOO"
#define OPTION_ARGS &o.window, &o.alibi, &o.softcap, &o.seed, &o.device
/* window NULL = (-1, -1), seed NULL = 0 */
#define OPTS_INIT {.scale = Py_None, .window = NULL, .alibi = Py_None, .seed = NULL, \
                   .device = Py_None, .max_q = Py_None, .max_k = Py_None}

static const int FWD_SLOTS[] = {OR_Q, OR_K, OR_V};
static const int BWD_SLOTS[] = {OR_DO, OR_Q, OR_K, OR_V, OR_O, OR_LSE};

static PyObject *flash_attn_fwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q", "k", "v", "scale", "dropout_p", "causal", OPTION_KWLIST, NULL};
    opts_t o = OPTS_INIT;
    PyObject *x[3];
    call_t c = {.func = "flash_attn_fwd"};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|Odp" OPTION_FORMAT ":flash_attn_fwd", kwlist,
                                     &x[0], &x[1], &x[2], &o.scale, &o.dropout_p, &o.causal,
                                     OPTION_ARGS))
        return NULL;
    return attention(module, &c, &o, x, FWD_SLOTS, 3, NULL, NULL);
}

static PyObject *flash_attn_bwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dout", "q", "k", "v", "out", "lse", "scale", "dropout_p", "causal",
                             OPTION_KWLIST, NULL};
    opts_t o = OPTS_INIT;
    PyObject *x[6];
    call_t c = {.func = "flash_attn_bwd"};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|Odp" OPTION_FORMAT ":flash_attn_bwd",
                                     kwlist, &x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &o.scale,
                                     &o.dropout_p, &o.causal, OPTION_ARGS))
        return NULL;
    return attention(module, &c, &o, x, BWD_SLOTS, 6, NULL, NULL);
}

static PyObject *flash_attn_varlen_fwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                             "max_seqlen_k", "scale", "dropout_p", "causal", OPTION_KWLIST, NULL};
    opts_t o = OPTS_INIT;
    PyObject *x[3], *cuq, *cuk;
    call_t c = {.func = "flash_attn_varlen_fwd", .varlen = 1};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|OOOdp" OPTION_FORMAT ":flash_attn_varlen_fwd",
                                     kwlist, &x[0], &x[1], &x[2], &cuq, &cuk, &o.max_q, &o.max_k,
                                     &o.scale, &o.dropout_p, &o.causal, OPTION_ARGS))
        return NULL;
    return attention(module, &c, &o, x, FWD_SLOTS, 3, cuq, cuk);
}

static PyObject *flash_attn_varlen_bwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                             "max_seqlen_q", "max_seqlen_k", "scale", "dropout_p", "causal",
                             OPTION_KWLIST, NULL};
    opts_t o = OPTS_INIT;
    PyObject *x[6], *cuq, *cuk;
    call_t c = {.func = "flash_attn_varlen_bwd", .varlen = 1};
    if (!PyArg_ParseTupleAndKeywords(args, kw,
                                     "OOOOOOOO|OOOdp" OPTION_FORMAT ":flash_attn_varlen_bwd",
                                     kwlist, &x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &cuq, &cuk,
                                     &o.max_q, &o.max_k, &o.scale, &o.dropout_p, &o.causal,
                                     OPTION_ARGS))
        return NULL;
    return attention(module, &c, &o, x, BWD_SLOTS, 6, cuq, cuk);
}

/* ------------------------------------------------------------------ the rest of the API */

/* A shape argument as a list of non-negative sizes; returns its length or -1. */
static int parse_shape(PyObject *obj, const char *name, npy_intp *dims)
{
    PyObject *seq = PySequence_Check(obj) ? PySequence_Fast(obj, "") : NULL;
    if (seq == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dropout_mask(): '%s' must be a sequence of ints", name);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int ok = n >= 2 && n <= NPY_MAXDIMS;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        long long v;
        ok = as_integer(PySequence_Fast_GET_ITEM(seq, i), &v) == 0 && v >= 0 && v <= NPY_MAX_INTP;
        dims[i] = ok ? (npy_intp)v : 0;
    }
    Py_DECREF(seq);
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "dropout_mask(): '%s' must be a shape (..., N, D) of at least 2 sizes >= 0",
                     name);
        return -1;
    }
    return (int)n;
}

PyDoc_STRVAR(dropout_mask_doc,
"dropout_mask(q_shape, k_shape, dropout_p, seed=0) -> bool array q_shape[:-2] + (Nq, Nk)\n\n"
"The keep-decisions every backend draws for these shapes (True = kept).");

static PyObject *dropout_mask(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q_shape", "k_shape", "dropout_p", "seed", NULL};
    PyObject *qs, *ks, *seed_obj = NULL;
    double p;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOd|O:dropout_mask", kwlist, &qs, &ks, &p,
                                     &seed_obj))
        return NULL;
    npy_intp qd[NPY_MAXDIMS], kd[NPY_MAXDIMS];
    int qn = parse_shape(qs, "q_shape", qd), kn = qn < 0 ? -1 : parse_shape(ks, "k_shape", kd);
    if (kn < 0)
        return NULL;
    opts_t o = {.scale = Py_None, .alibi = Py_None, .seed = seed_obj, .device = Py_None,
                .dropout_p = p};
    call_t c = {.func = "dropout_mask"};
    if (check_options(&c, &o) < 0)
        return NULL;
    if (qd[qn - 2] > MAX_SEQ_LEN || kd[kn - 2] > MAX_SEQ_LEN) {
        PyErr_Format(PyExc_ValueError, "dropout_mask(): '%s' must have fewer than 2**32 rows "
                     "(dimension -2)", qd[qn - 2] > MAX_SEQ_LEN ? "q_shape" : "k_shape");
        return NULL;
    }
    npy_intp shape[NPY_MAXDIMS];
    for (int i = 0; i < qn - 1; i++)
        shape[i] = qd[i];
    shape[qn - 1] = kd[kn - 2];
    PyArrayObject *mask = (PyArrayObject *)PyArray_SimpleNew(qn, shape, NPY_BOOL);
    if (mask == NULL)
        return NULL;
    or_ssize units = 1, nq = qd[qn - 2], nk = kd[kn - 2];
    for (int i = 0; i < qn - 2; i++)
        units *= qd[i];
    unsigned char *out = PyArray_DATA(mask);
    Py_BEGIN_ALLOW_THREADS
    for (or_ssize u = 0; u < units; u++)
        for (or_ssize i = 0; i < nq; i++)
            for (or_ssize j = 0; j < nk; j += INT_MAX) {    /* or_dropout_row counts in int */
                int n = nk - j < INT_MAX ? (int)(nk - j) : INT_MAX;
                or_dropout_row(c.p.prm.seed, (uint64_t)u, (uint32_t)i, (uint32_t)j, n,
                               c.p.prm.threshold, out);
                out += n;
            }
    Py_END_ALLOW_THREADS
    return (PyObject *)mask;
}

static PyObject *devices(PyObject *module, PyObject *unused)
{
    return or_devices_list();
}

static PyObject *default_device(PyObject *module, PyObject *unused)
{
    or_device_choice choice;
    if (or_resolve_device("default_device", Py_None, &choice) < 0)
        return NULL;
    return or_device_id(choice.index);
}

#define OR_COUNTER_FIELDS(X) X(fwd_calls) X(bwd_calls) X(zero_copy_buffers) X(staged_buffers) \
    X(bytes_staged) X(kernel_builds) X(cache_hits)

static PyObject *counters_dict(const or_counters *ct)
{
    PyObject *d = PyDict_New(), *v;
#define OR_PUT(field)                                                                        \
    v = d ? PyLong_FromLongLong(__atomic_load_n(&ct->field, __ATOMIC_RELAXED)) : NULL;       \
    if (v == NULL || PyDict_SetItemString(d, #field, v) < 0)                                 \
        Py_CLEAR(d);                                                                         \
    Py_XDECREF(v);
    OR_COUNTER_FIELDS(OR_PUT)
#undef OR_PUT
    return d;
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict of counters (fwd_calls, bwd_calls, zero_copy_buffers, staged_buffers,\n"
"bytes_staged, kernel_builds, cache_hits), totals over all devices, and 'per_device':\n"
"{device id: the same counters}.");

static PyObject *stats(PyObject *module, PyObject *unused)
{
    or_counters sum = {0};
    PyObject *per = PyDict_New(), *total = NULL;
    for (int d = 0; per != NULL && d < or_device_count(); d++) {
        const or_counters *ct = or_device_counters(d);
#define OR_ADD(field) sum.field += __atomic_load_n(&ct->field, __ATOMIC_RELAXED);
        OR_COUNTER_FIELDS(OR_ADD)
#undef OR_ADD
        PyObject *id = or_device_id(d), *one = counters_dict(ct);
        if (id == NULL || one == NULL || PyDict_SetItem(per, id, one) < 0)
            Py_CLEAR(per);
        Py_XDECREF(id);
        Py_XDECREF(one);
    }
    if (per != NULL && (total = counters_dict(&sum)) != NULL
        && PyDict_SetItemString(total, "per_device", per) < 0)
        Py_CLEAR(total);
    Py_XDECREF(per);
    return total;
}

static PyObject *reset_stats(PyObject *module, PyObject *unused)
{
    for (int d = 0; d < or_device_count(); d++) {
        or_counters *ct = or_device_counters(d);
#define OR_ZERO(field) __atomic_store_n(&ct->field, 0, __ATOMIC_RELAXED);
        OR_COUNTER_FIELDS(OR_ZERO)
#undef OR_ZERO
    }
    Py_RETURN_NONE;
}

static PyObject *set_num_threads(PyObject *module, PyObject *arg)
{
    long long n;
    if (as_integer(arg, &n) < 0 || n < 1 || n > 4096) {
        PyErr_SetString(PyExc_ValueError, "set_num_threads(): 'n' must be an int in 1..4096");
        return NULL;
    }
    or_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *get_num_threads(PyObject *module, PyObject *unused)
{
    return PyLong_FromLong(or_get_num_threads());
}

/* The OpenCL device a tuning function names, or -1 with the exception set. */
static int opencl_device(const char *func, PyObject *device)
{
    or_device_choice choice;
    if (or_resolve_device(func, device, &choice) < 0)
        return -1;
    if (choice.index == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): 'device' must be an OpenCL device, not the native "
                     "path (its blocks are fixed)", func);
        return -1;
    }
    return choice.index;
}

static PyObject *tuned_blocks(PyObject *module, PyObject *device)
{
    int index = opencl_device("tuned_blocks", device), bq, bk;
    if (index < 0)
        return NULL;
    if (!or_device_tuned_blocks(index, &bq, &bk))
        Py_RETURN_NONE;
    return Py_BuildValue("(ii)", bq, bk);
}

static PyObject *save_tuned_blocks(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "block_q", "block_k", NULL};
    PyObject *device;
    int bq, bk;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oii:save_tuned_blocks", kwlist, &device, &bq, &bk))
        return NULL;
    if (bq < 1 || bq > 4096 || bk < 1 || bk > 4096) {
        PyErr_Format(PyExc_ValueError, "save_tuned_blocks(): '%s' must be in 1..4096",
                     bq < 1 || bq > 4096 ? "block_q" : "block_k");
        return NULL;
    }
    int index = opencl_device("save_tuned_blocks", device);
    if (index < 0)
        return NULL;
    return PyBool_FromLong(or_device_save_tuned_blocks(index, bq, bk));
}

PyDoc_STRVAR(fwd_doc,
"flash_attn_fwd(q, k, v, scale=None, dropout_p=0.0, causal=False, *, window=(-1, -1),\n"
"               alibi_slopes=None, softcap=0.0, seed=0, device=None) -> (out, lse)\n\n"
"Exact attention softmax(scale * q k^T + bias, masked) v in O(N) memory.\n"
"q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv); 4-D k/v may have fewer heads (GQA).\n"
"out has q's dtype; lse (..., Nq) is float32 (float64 for float64 input).");
PyDoc_STRVAR(bwd_doc,
"flash_attn_bwd(dout, q, k, v, out, lse, scale=None, dropout_p=0.0, causal=False, *,\n"
"               window=(-1, -1), alibi_slopes=None, softcap=0.0, seed=0, device=None)\n"
"-> (dq, dk, dv)\n\nGradients of flash_attn_fwd; pass the same options and seed.");
PyDoc_STRVAR(varlen_fwd_doc,
"flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,\n"
"                      max_seqlen_k=None, scale=None, dropout_p=0.0, causal=False, *, ...)\n"
"-> (out, lse)\n\nPacked sequences: q (total_q, H, D), k/v (total_k, Hkv, D/Dv); "
"out (total_q, H, Dv), lse (H, total_q).");
PyDoc_STRVAR(varlen_bwd_doc,
"flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,\n"
"                      max_seqlen_q=None, max_seqlen_k=None, scale=None, dropout_p=0.0,\n"
"                      causal=False, *, ...) -> (dq, dk, dv)");

static PyMethodDef methods[] = {
    {"flash_attn_fwd", (PyCFunction)(void (*)(void))flash_attn_fwd, METH_VARARGS | METH_KEYWORDS, fwd_doc},
    {"flash_attn_bwd", (PyCFunction)(void (*)(void))flash_attn_bwd, METH_VARARGS | METH_KEYWORDS, bwd_doc},
    {"flash_attn_varlen_fwd", (PyCFunction)(void (*)(void))flash_attn_varlen_fwd,
     METH_VARARGS | METH_KEYWORDS, varlen_fwd_doc},
    {"flash_attn_varlen_bwd", (PyCFunction)(void (*)(void))flash_attn_varlen_bwd,
     METH_VARARGS | METH_KEYWORDS, varlen_bwd_doc},
    {"dropout_mask", (PyCFunction)(void (*)(void))dropout_mask, METH_VARARGS | METH_KEYWORDS,
     dropout_mask_doc},
    {"devices", devices, METH_NOARGS, "devices() -> list of dicts describing every usable device"},
    {"default_device", default_device, METH_NOARGS,
     "default_device() -> the device id used for device=None (ORCHARD_DEVICE if set)"},
    {"stats", stats, METH_NOARGS, stats_doc},
    {"reset_stats", reset_stats, METH_NOARGS, "reset_stats() -> None; zeroes every counter"},
    {"set_num_threads", set_num_threads, METH_O,
     "set_num_threads(n) -> None; threads of the native path (ORCHARD_NUM_THREADS)"},
    {"get_num_threads", get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"tuned_blocks", tuned_blocks, METH_O,
     "tuned_blocks(device) -> (block_q, block_k) stored for this OpenCL device, or None"},
    {"save_tuned_blocks", (PyCFunction)(void (*)(void))save_tuned_blocks,
     METH_VARARGS | METH_KEYWORDS,
     "save_tuned_blocks(device, block_q, block_k) -> bool; stores the block sizes that programs\n"
     "built later (in new processes) use, beside the program binaries; False if the cache is off"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    module_state *st = get_state(module);
    st->error = PyErr_NewExceptionWithDoc(
        "orchard_ops.OrchardError",
        "A device (OpenCL) failure; the message names the failing call and the CL error.",
        PyExc_RuntimeError, NULL);
    if (st->error == NULL)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->error, PyExc_MemoryError);
    if (bases == NULL)
        return -1;
    st->oom = PyErr_NewExceptionWithDoc(
        "orchard_ops.OrchardOutOfMemory", "A device ran out of memory (also a MemoryError).",
        bases, NULL);
    Py_DECREF(bases);
    if (st->oom == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "OrchardError", st->error) < 0
        || PyModule_AddObjectRef(module, "OrchardOutOfMemory", st->oom) < 0
        || PyModule_AddStringConstant(module, "__version__", ORCHARD_VERSION) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = get_state(module);
    Py_VISIT(st->error);
    Py_VISIT(st->oom);
    return 0;
}

static int module_clear(PyObject *module)
{
    module_state *st = get_state(module);
    Py_CLEAR(st->error);
    Py_CLEAR(st->oom);
    return 0;
}

static void module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "orchard_ops",
    .m_doc = "Exact FlashAttention forward and backward in O(N) memory (native CPU path).",
    .m_size = sizeof(module_state),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit_orchard_ops(void)
{
    return PyModuleDef_Init(&moduledef);
}
