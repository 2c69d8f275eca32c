/* args.c - the arguments of an attention call, checked before anything is allocated for it.
 *
 * Options that do not depend on shapes (dropout_p, softcap, window, seed), the operands (their
 * dtypes, q/k/v shapes with GQA, the shapes out, lse and dout must have), scale, and the
 * cu_seqlens/max_seqlen of a varlen call; the shapes given to dropout_mask(). Every check that
 * fails raises one exception naming the argument and returns -1.
 */
#include <float.h>
#include <limits.h>
#include <math.h>

#include "pyorchard.h"

/* A window entry past this is unbounded (-1): longer than any sequence, and the mask's sums
 * (kernels/params.h or_key_range) stay within int64 */
#define OR_WINDOW_MAX ((long long)1 << 62)

static const char *slot_name[OR_NSLOTS] = OR_SLOT_NAMES;

int or_bad_value(void)
{
    if (!(PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError)
          || PyErr_ExceptionMatches(PyExc_OverflowError)))
        return 0;
    PyErr_Clear();
    return 1;
}

/* An integer argument (int, numpy integer, anything with __index__) as a long long, one
 * beyond its range as LLONG_MAX or LLONG_MIN (so that the caller's range check says what is
 * wrong, and a window of 2**63 is as unbounded as one of 2**62); returns 0, or -1: with no
 * exception set when it is not an integer (the caller names the argument), with the exception
 * of any other failure (MemoryError, KeyboardInterrupt in an __index__) kept, which the
 * caller passes on. */
static int not_a_value(void)
{
    or_bad_value();
    return -1;
}

int or_as_integer(PyObject *obj, long long *out)
{
    PyObject *i = PyNumber_Index(obj);
    if (i == NULL)
        return not_a_value();
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (*out == -1 && PyErr_Occurred())
        return not_a_value();
    if (overflow)
        *out = overflow > 0 ? LLONG_MAX : LLONG_MIN;
    return 0;
}

/* The text of the str obj as UTF-8, or NULL with TypeError where obj is no str and ValueError
 * where it holds a NUL character (C would read "cpu\0x" as "cpu") or a lone surrogate (no
 * UTF-8); what is the argument as messages name it ("'device'"). */
const char *or_text_arg(const char *func, const char *what, PyObject *obj)
{
    Py_ssize_t len = 0;
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &len) : NULL;
    if (s == NULL && !PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a str, not %.100s", func, what,
                     Py_TYPE(obj)->tp_name);
    } else if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s(): %s must be valid UTF-8 text, got %R", func, what,
                     obj);
    } else if (s != NULL && (size_t)len != strlen(s)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must not hold a NUL character, got %R", func,
                     what, obj);
        s = NULL;
    }
    return s;
}

/* The exception for an integer argument obj that is bad (a bool, or or_as_integer failed) or
 * out of range: TypeError for a bool or what is no int, ValueError for an int too large. */
static PyObject *int_error(PyObject *obj, int bad)
{
    return bad && (!PyLong_Check(obj) || PyBool_Check(obj)) ? PyExc_TypeError : PyExc_ValueError;
}

int or_int_arg(const char *func, const char *name, PyObject *obj, long long lo, long long hi,
               long long *out)
{
    /* a bool is an int to Python, but True for a count is a mistake, not 1 */
    const int bad = PyBool_Check(obj) || or_as_integer(obj, out) < 0;
    if (!bad && *out >= lo && *out <= hi)
        return 0;
    if (!PyErr_Occurred())
        PyErr_Format(int_error(obj, bad), "%s(): '%s' must be an int in %lld..%lld, got %.100R",
                     func, name, lo, hi, obj);
    return -1;
}

/* ValueError "func(): 'name' what, got value". */
static int number_error(or_call *c, const char *name, const char *what, double value)
{
    PyObject *got = PyFloat_FromDouble(value);
    if (got != NULL)
        PyErr_Format(PyExc_ValueError, "%s(): '%s' %s, got %R", c->func, name, what, got);
    Py_XDECREF(got);
    return -1;
}

/* A real-number argument (NULL: 0) as a double; -1 with TypeError naming it otherwise (a bool
 * included, as a probability or a cap it is a mistake). */
static int real_arg(or_call *c, const char *name, PyObject *obj, double *out)
{
    *out = 0.0;
    if (obj == NULL)
        return 0;
    if (!PyBool_Check(obj) && !PyArray_IsScalar(obj, Bool)) {
        *out = PyFloat_AsDouble(obj);
        if (!(*out == -1.0 && PyErr_Occurred()))
            return 0;
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {     /* an int past float's range */
            PyErr_Clear();
            PyObject *zero = PyLong_FromLong(0);
            int negative = zero != NULL ? PyObject_RichCompareBool(obj, zero, Py_LT) : -1;
            Py_XDECREF(zero);
            if (negative < 0 && !or_bad_value())
                return -1;
            *out = negative > 0 ? -INFINITY : INFINITY;
            return 0;
        }
        if (!or_bad_value())
            return -1;
    }
    PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a number, got %.100R", c->func, name, obj);
    return -1;
}

/* Checks the options that do not depend on shapes and stores them in c->p. */
/* A flag: a bool (Python's or NumPy's) or the int 0 or 1; truthiness would read the string
 * "False" as true. */
static int flag_arg(or_call *c, const char *name, PyObject *obj, int *out)
{
    long long flag = -1;
    if (PyBool_Check(obj) || PyArray_IsScalar(obj, Bool))
        flag = PyObject_IsTrue(obj);
    else if ((PyLong_Check(obj) || PyArray_IsScalar(obj, Integer))
             && or_as_integer(obj, &flag) < 0 && PyErr_Occurred())
        return -1;
    if (flag != 0 && flag != 1) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a bool, got %.100R", c->func, name,
                     obj);
        return -1;
    }
    *out = (int)flag;
    return 0;
}

int or_check_options(or_call *c, const or_opts *o)
{
    or_problem *p = &c->p;
    double dropout_p, softcap;
    if (real_arg(c, "dropout_p", o->dropout_p, &dropout_p) < 0
        || real_arg(c, "softcap", o->softcap, &softcap) < 0)
        return -1;
    if (!(dropout_p >= 0.0 && dropout_p < 1.0))
        return number_error(c, "dropout_p", "must be in [0, 1)", dropout_p);
    if (!(softcap >= 0.0 && isfinite(softcap)))
        return number_error(c, "softcap", "must be a finite number >= 0", softcap);
    p->prm.softcap = softcap;
    p->prm.dropout = dropout_p > 0.0;
    p->prm.threshold = or_dropout_threshold(dropout_p);
    p->prm.drop_scale = 1.0 / (1.0 - dropout_p);

    p->prm.left = p->prm.right = -1;
    if (o->window != NULL && (!PySequence_Check(o->window) || PySequence_Size(o->window) != 2)) {
        if (PyErr_Occurred() && !or_bad_value())
            return -1;
        PyErr_Format(PyExc_TypeError, "%s(): 'window' must be a pair (left, right) of ints, "
                     "got %.100R", c->func, o->window);
        return -1;
    }
    long long lr[2] = {-1, -1};
    for (int i = 0; o->window != NULL && i < 2; i++) {
        PyObject *item = PySequence_GetItem(o->window, i);
        if (item == NULL)
            return -1;
        /* a bool is an int to Python, but not a bound */
        const int bad = PyBool_Check(item) || or_as_integer(item, &lr[i]) < 0;
        PyObject *error = int_error(item, bad);
        Py_DECREF(item);
        if (bad || lr[i] < -1) {
            if (!PyErr_Occurred())
                PyErr_Format(error, "%s(): 'window' entries must be ints >= -1 (-1 = "
                             "unbounded), got %R", c->func, o->window);
            return -1;
        }
    }
    /* past any sequence's length a window is unbounded: so, and the mask's sums never overflow */
    p->prm.left = lr[0] > OR_WINDOW_MAX ? -1 : (or_ssize)lr[0];
    p->prm.right = lr[1] > OR_WINDOW_MAX ? -1 : (or_ssize)lr[1];
    int causal;
    if (flag_arg(c, "causal", o->causal, &causal) < 0
        || flag_arg(c, "seqlen_first", o->seqlen_first, &c->seqlen_first) < 0)
        return -1;
    if (causal)
        p->prm.right = 0;

    if (o->seed == NULL)
        return 0;       /* seed 0 */
    /* a bool is an int to Python, but seed=True is a mistake, not seed 1 */
    PyObject *seed_int = PyBool_Check(o->seed) ? NULL : PyNumber_Index(o->seed);
    if (seed_int == NULL) {
        if (PyErr_Occurred() && !or_bad_value())
            return -1;
        PyErr_Format(PyExc_TypeError, "%s(): 'seed' must be an int, not %.100s", c->func,
                     Py_TYPE(o->seed)->tp_name);
        return -1;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(seed_int);
    Py_DECREF(seed_int);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!or_bad_value())
            return -1;
        PyErr_Format(PyExc_ValueError, "%s(): 'seed' must be in [0, 2**64), got %R", c->func,
                     o->seed);
        return -1;
    }
    p->prm.seed = (uint64_t)seed;
    return 0;
}

double or_compute_max(const or_call *c)
{
    return c->p.view[OR_Q].dtype == OR_F64 ? DBL_MAX : FLT_MAX;
}

int or_check_scale(or_call *c, const or_opts *o)
{
    const double max = or_compute_max(c);
    if (c->p.prm.softcap > max)
        return number_error(c, "softcap", "must be finite in float32, the kernels' type for "
                            "these operands", c->p.prm.softcap);
    /* The native kernels multiply by 1 / softcap: where that overflows, a score of 0 became
     * 0 * inf, NaN (and where the cap rounds to 0, OpenCL read no softcap) */
    const double cap = max == FLT_MAX ? (double)(float)c->p.prm.softcap : c->p.prm.softcap;
    if (c->p.prm.softcap > 0 && 1.0 / cap > max)     /* (a cap that rounds to 0: inf) */
        return number_error(c, "softcap", max == FLT_MAX
                            ? "is too small for float32, the kernels' type for these operands "
                              "(1 / softcap overflows): pass 0 or at least 2.94e-39"
                            : "is too small for float64 (1 / softcap overflows): pass 0 or at "
                              "least 5.57e-309", c->p.prm.softcap);
    if (o->scale == Py_None) {
        c->p.prm.scale = 1.0 / sqrt((double)c->p.d);
        return 0;
    }
    double s;
    if (real_arg(c, "scale", o->scale, &s) < 0)
        return -1;
    if (!isfinite(s)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'scale' must be finite, got %R", c->func, o->scale);
        return -1;
    }
    if (fabs(s) > max)
        return number_error(c, "scale", "must be finite in float32, the kernels' type for these "
                            "operands", s);
    c->p.prm.scale = s;
    return 0;
}

/* The device of a call. DeviceArray operands (all of them or none) run where they live, which
 * `device`, when given, must name; host operands run where `device` resolves to. */
int or_call_device(or_call *c, PyObject *device, PyObject **objs, const int *slots, int n)
{
    int first = -1, where = -1;     /* the first DeviceArray operand and its device */
    for (int i = 0; i < n; i++) {
        int d = or_device_array_index(c->st, objs[i]);
        if (d >= 0 && first < 0) {
            first = i;
            where = d;
        }
    }
    if (first < 0)
        return or_resolve_device(c->func, device, &c->device);
    for (int i = 0; i < n; i++) {
        int d = or_device_array_index(c->st, objs[i]);
        if (d < 0) {
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s' is a host array but '%s' is a "
                         "DeviceArray: pass all operands on the device (to_device) or none",
                         c->func, slot_name[slots[i]], slot_name[slots[first]]);
            return -1;
        }
        if (d != where) {
            PyObject *a = or_device_id(d), *b = or_device_id(where);
            if (a != NULL && b != NULL)
                PyErr_Format(PyExc_ValueError, "%s(): argument '%s' is on %S but '%s' is on %S",
                             c->func, slot_name[slots[i]], a, slot_name[slots[first]], b);
            Py_XDECREF(a);
            Py_XDECREF(b);
            return -1;
        }
    }
    c->resident = 1;
    c->device.index = where;
    c->device.automatic = 0;        /* no fallback: the native path cannot read device memory */
    if (device == Py_None        /* "auto", as None, leaves the choice: the operands' device */
        || (PyUnicode_Check(device) && PyUnicode_CompareWithASCIIString(device, "auto") == 0))
        return 0;
    or_device_choice named;
    if (or_resolve_device(c->func, device, &named) < 0)
        return -1;
    if (named.index != where) {
        PyObject *id = or_device_id(where);
        if (id != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): 'device' is %R but the operands are "
                         "DeviceArrays on %S", c->func, device, id);
        Py_XDECREF(id);
        return -1;
    }
    return 0;
}

/* "(2, 128, 8, 64)": dims of operand `slot` (its view in arr[], or a shape it must have) in
 * the caller's axis order, for messages: seqlen_first views' axes -3 and -2 swapped back. */
static PyObject *caller_shape(or_call *c, int slot, int nd, const npy_intp *dims)
{
    npy_intp d[NPY_MAXDIMS];
    if (nd > 0)     /* (a 0-d array's dims are NULL) */
        memcpy(d, dims, sizeof(npy_intp) * (size_t)nd);
    if (c->seqlen_first && slot != OR_LSE && nd >= 3) {
        d[nd - 3] = dims[nd - 2];
        d[nd - 2] = dims[nd - 3];
    }
    return or_dims_str(nd, d);
}

PyObject *or_operand_shape(or_call *c, int slot)
{
    return caller_shape(c, slot, PyArray_NDIM(c->arr[slot]), PyArray_DIMS(c->arr[slot]));
}

/* ValueError "func(): argument 'name' what (q has shape .., k .., v ..)". */
static int shape_error(or_call *c, const char *name, const char *what)
{
    PyObject *shapes[3] = {NULL, NULL, NULL};
    int made = 0;       /* stop at a MemoryError, and let it stand */
    for (int s = OR_Q; s <= OR_V && made == s - OR_Q; s++) {
        shapes[s - OR_Q] = c->arr[s] ? or_operand_shape(c, s) : Py_NewRef(Py_None);
        made += shapes[s - OR_Q] != NULL;
    }
    if (made == 3)
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' %s (q has shape %S, k %S, v %S)",
                     c->func, name, what, shapes[0], shapes[1], shapes[2]);
    for (int i = 0; i < 3; i++)
        Py_XDECREF(shapes[i]);
    return -1;
}


/* An OpenCL device chosen automatically that cannot take a call (float64 without
 * cl_khr_fp64) hands it to the native path, as one whose kernels fail does
 * (module.c run); returns 1 if it did. (Operands are staged later, for the device chosen.) */
static int native_if_automatic(or_call *c)
{
    if (!c->device.automatic || c->device.index == 0)
        return 0;
    c->device.index = 0;
    c->ct = or_device_counters(0);
    return 1;
}
/* The (..., nheads, seqlen, headdim) view of a seqlen_first operand or result, a new
 * reference; NULL with the exception set. */
PyArrayObject *or_swap_seq_heads(or_call *c, int slot, PyArrayObject *a)
{
    const int nd = PyArray_NDIM(a);
    if (nd < 3) {
        PyErr_Format(PyExc_ValueError, "%s(): with seqlen_first=True, argument '%s' must be "
                     "(..., seqlen, nheads, headdim), got %d dimension%s", c->func,
                     slot_name[slot], nd, nd == 1 ? "" : "s");
        return NULL;
    }
    return (PyArrayObject *)PyArray_SwapAxes(a, nd - 3, nd - 2);
}

/* Reads the input operands named in `slots` as arrays (views: or_stage_operands copies what
 * must be copied once the shapes are checked) and checks that they share q's dtype. */
int or_load_operands(or_call *c, PyObject **objs, const int *slots, int n)
{
    if (c->seqlen_first && c->resident) {
        PyErr_Format(PyExc_TypeError, "%s(): seqlen_first=True takes host arrays or tensors, "
                     "not DeviceArrays (their layout is fixed on the device)", c->func);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        int s = slots[i];
        c->obj[s] = objs[i];
        if (c->resident) {
            c->dev[s] = Py_NewRef(objs[i]);
            c->arr[s] = or_device_array_layout(objs[i], &c->dt[s]);
        } else {
            c->arr[s] = or_operand_view(c->st, objs[i], c->func, slot_name[s], &c->dt[s],
                                        &c->staged[s]);
            c->pending[s] = 1;
        }
        if (c->arr[s] == NULL)
            return -1;
        if (c->seqlen_first && s != OR_LSE) {
            PyArrayObject *view = or_swap_seq_heads(c, s, c->arr[s]);
            if (view == NULL)
                return -1;
            Py_SETREF(c->arr[s], view);
        }
    }
    const or_dtype dt = c->dt[OR_Q], lse = or_dtypes[dt].lse;
    c->p.view[OR_Q].dtype = dt;
    for (int i = 0; i < n; i++) {
        int s = slots[i];
        const or_dtype got = c->dt[s];
        /* a DeviceArray lse is used as it is: converting it would cross to the host */
        if (s == OR_LSE && got != lse && (!or_dtypes[got].numpy || c->resident)) {
            PyErr_Format(PyExc_TypeError, "%s(): argument 'lse' has dtype %s; it must be %s",
                         c->func, or_dtypes[got].name, or_dtypes[lse].name);
            return -1;
        } else if (s == OR_LSE && got != lse) {
            /* lse of another float type is accepted, and staged as the kernels' own */
            c->dt[s] = lse;
        } else if (s != OR_LSE && got != dt) {
            PyErr_Format(PyExc_TypeError, "%s(): argument '%s' has dtype %s but 'q' has %s",
                         c->func, slot_name[s], or_dtypes[got].name, or_dtypes[dt].name);
            return -1;
        }
    }
    if (or_dtypes[dt].compute_size == sizeof(double) && !or_device_fp64(c->device.index)
        && !native_if_automatic(c)) {
        PyObject *id = or_device_id(c->device.index);
        if (id != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%s(): %s needs cl_khr_fp64, which device %S lacks; use float32 "
                         "or device='cpu'", c->func, or_dtypes[dt].name, id);
        Py_XDECREF(id);
        return -1;
    }
    return 0;
}

/* Paged k and v (c->pool, or_check_paged_kv) as the kernels read them: the pages' geometry and
 * extent recorded, page 0 left as the operand. */
static int stage_pages(or_call *c)
{
    for (int s = OR_K; s <= OR_V; s++) {
        PyArrayObject *pool = c->pool[s - OR_K];
        c->pool[s - OR_K] = NULL;
        if (c->pending[s])
            pool = or_stage(pool, or_dtypes[c->dt[s]].typenum, c->func, slot_name[s], c->ct,
                            or_device_align(c->device.index));
        c->pending[s] = 0;
        PyArrayObject *page0 = pool ? (PyArrayObject *)PySequence_GetItem((PyObject *)pool, 0)
                                    : NULL;
        if (page0 != NULL) {
            *(s == OR_K ? &c->p.pages.k_stride : &c->p.pages.v_stride) = PyArray_STRIDE(pool, 0);
            or_extent(pool, &c->p.pages.lo[s - OR_K], &c->p.pages.nbytes[s - OR_K]);
            Py_SETREF(c->arr[s], page0);
        }
        Py_XDECREF(pool);
        if (page0 == NULL)
            return -1;
    }
    return 0;
}

/* Operand s as the kernels read it, if it is still the caller's view (or_stage): a
 * seqlen_first one copied in its own axis order, as its results are laid out. */
static int stage_operand(or_call *c, int s)
{
    if ((s == OR_K || s == OR_V) && c->pool[s - OR_K] != NULL)
        return stage_pages(c);
    if (!c->pending[s])
        return 0;
    c->pending[s] = 0;
    const int swap = c->seqlen_first && s != OR_LSE;
    PyArrayObject *a = swap ? or_swap_seq_heads(c, s, c->arr[s])
                            : (PyArrayObject *)Py_NewRef(c->arr[s]);
    if (a != NULL)
        a = or_stage(a, or_dtypes[c->dt[s]].typenum, c->func, slot_name[s], c->ct,
                     or_device_align(c->device.index));
    if (a != NULL && swap)
        Py_SETREF(a, or_swap_seq_heads(c, s, a));
    if (a == NULL)
        return -1;
    Py_SETREF(c->arr[s], a);
    return 0;
}

int or_stage_operands(or_call *c)
{
    for (int s = 0; s < OR_NSLOTS; s++)
        if (stage_operand(c, s) < 0)
            return -1;
    return 0;
}

/* Checks q, k, v and fills d, dv, group. Dense layout: (..., N, D) with matching leading
 * dims, or 4-D GQA. Varlen: (total, H, D). */
int or_check_qkv(or_call *c)
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
    if (d < 1 || d > OR_MAX_HEAD_DIM)
        return shape_error(c, "q", "must have a head dim (last dimension) in 1.."
                                   OR_STR(OR_MAX_HEAD_DIM));
    if (PyArray_DIM(k, nd - 1) != d)
        return shape_error(c, "k", "must have the head dim (last dimension) of q");
    if (dv < 1 || dv > OR_MAX_HEAD_DIM)
        return shape_error(c, "v", "must have a head dim (last dimension) in 1.."
                                   OR_STR(OR_MAX_HEAD_DIM));
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
    const int seq_dim = c->seqlen_first ? -3 : -2;     /* in the caller's axis order */
    char what[64];
    if (!c->varlen && PyArray_DIM(q, seq) > OR_MAX_SEQ_LEN) {
        snprintf(what, sizeof(what), "must have fewer than 2**32 query rows (dimension %d)",
                 seq_dim);
        return shape_error(c, "q", what);
    }
    if (!c->varlen && PyArray_DIM(k, seq) > OR_MAX_SEQ_LEN) {
        snprintf(what, sizeof(what), "must have fewer than 2**32 keys (dimension %d)", seq_dim);
        return shape_error(c, "k", what);
    }
    c->p.prm.group = 1;
    c->heads = nd >= 3 ? PyArray_DIM(q, c->varlen ? 1 : nd - 3) : 1;
    if (c->heads > OR_MAX_HEADS)
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
int or_check_like(or_call *c, int slot, const npy_intp *shape, int nd)
{
    PyArrayObject *a = c->arr[slot];
    int ok = PyArray_NDIM(a) == nd;
    for (int i = 0; ok && i < nd; i++)
        ok = PyArray_DIM(a, i) == shape[i];
    if (ok)
        return 0;
    PyObject *want = caller_shape(c, slot, nd, shape);
    PyObject *got = want != NULL ? or_operand_shape(c, slot) : NULL;
    if (got != NULL)    /* else its MemoryError stands */
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must have shape %S, got %S", c->func,
                     slot_name[slot], want, got);
    Py_XDECREF(want);
    Py_XDECREF(got);
    return -1;
}

/* raw (an integer array; its reference is taken) as a C-ordered int64 copy of nd dimensions;
 * ValueError naming it where a value of an unsigned array lies past int64's range, which the
 * cast would wrap to a negative number (a message would show that number). */
static PyArrayObject *as_int64(or_call *c, PyArrayObject *raw, const char *name, int nd)
{
    /* a copy: what is checked is what the kernels read, whatever another thread, or a call's
     * own write of new keys (kv_append.c) into memory a table shares, does to the argument */
    PyArrayObject *a = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)raw, PyArray_DescrFromType(NPY_INT64), nd, nd,
        NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST | NPY_ARRAY_ENSURECOPY, NULL);
    const int64_t *v = a != NULL && PyArray_ISUNSIGNED(raw) ? PyArray_DATA(a) : NULL;
    for (npy_intp i = 0; v != NULL && i < PyArray_SIZE(a); i++)
        if (v[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must hold values below 2**63, got %llu "
                         "at flat index %zd", c->func, name, (unsigned long long)v[i], i);
            Py_CLEAR(a);
            break;
        }
    Py_DECREF(raw);
    return a;
}

/* cu_seqlens as a validated int64 array of B + 1 offsets ending at `total`. */
static PyArrayObject *check_cu_seqlens(or_call *c, PyObject *obj, const char *name,
                                       npy_intp total, npy_intp *max_len)
{
    PyArrayObject *raw = or_values(c->st, obj, c->func, name);
    if (raw == NULL)
        return NULL;
    if (!PyArray_ISINTEGER(raw) || PyArray_NDIM(raw) != 1 || PyArray_DIM(raw, 0) < 1) {
        PyObject *got = or_values_str(raw, obj);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must be a 1-D integer array of B + 1 "
                         "offsets, got %U", c->func, name, got);
        Py_XDECREF(got);
        Py_DECREF(raw);
        return NULL;
    }
    PyArrayObject *cu = as_int64(c, raw, name, 1);
    if (cu == NULL)
        return NULL;
    const int64_t *v = PyArray_DATA(cu);
    npy_intp n = PyArray_DIM(cu, 0);
    *max_len = 0;
    int ok = v[0] == 0 && (total < 0 || v[n - 1] == total);     /* total < 0: paged k */
    for (npy_intp i = 1; ok && i < n; i++) {
        ok = v[i] >= v[i - 1];
        *max_len = v[i] - v[i - 1] > *max_len ? v[i] - v[i - 1] : *max_len;
    }
    if (!ok) {
        PyObject *got = PyObject_CallMethod((PyObject *)cu, "tolist", NULL);
        if (got != NULL && total < 0)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must start at 0 and never decrease, "
                         "got %.200R", c->func, name, got);
        else if (got != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%s(): '%s' must start at 0, never decrease and end at %zd (the packed "
                         "length), got %.200R", c->func, name, total, got);
        Py_XDECREF(got);
        Py_DECREF(cu);
        return NULL;
    }
    if (*max_len > OR_MAX_SEQ_LEN) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): '%s' must describe sequences shorter than 2**32, got one of %zd",
                     c->func, name, *max_len);
        Py_DECREF(cu);
        return NULL;
    }
    return cu;
}

static int check_max_seqlen(or_call *c, PyObject *given, const char *name, npy_intp actual)
{
    if (given == Py_None)
        return 0;
    long long m;
    const int bad = PyBool_Check(given) || or_as_integer(given, &m) < 0;
    if (bad || m < actual) {
        if (!PyErr_Occurred())
            PyErr_Format(int_error(given, bad), "%s(): '%s' must be an int >= "
                         "%zd, the longest sequence, got %.100R", c->func, name, actual, given);
        return -1;
    }
    return 0;
}

/* The sequences of a call: varlen, one per entry of cu_seqlens_k after the first; dense, one
 * per index of q's dimensions before the heads ((B, H, N, D): B). */
static npy_intp sequences(const or_call *c)
{
    if (c->varlen)
        return PyArray_DIM(c->cu_k, 0) - 1;
    PyArrayObject *q = c->arr[OR_Q];
    npy_intp n = 1;
    for (int i = 0; i < PyArray_NDIM(q) - 3; i++)
        n *= PyArray_DIM(q, i);
    return n;
}

/* The keys of sequence b's slot: its span of cu_seqlens_k, or dense, all of k's rows. */
static int64_t slot_keys(const or_call *c, npy_intp b)
{
    if (!c->varlen)
        return PyArray_DIM(c->arr[OR_K], PyArray_NDIM(c->arr[OR_K]) - 2);
    const int64_t *ck = PyArray_DATA(c->cu_k);
    return ck[b + 1] - ck[b];
}

/* seqused_k as an int64 array of B key counts, each within its sequence's slot (slot_keys);
 * returns the largest, or -1. */
static npy_intp check_seqused_k(or_call *c, PyObject *obj)
{
    const npy_intp nseq = sequences(c);
    PyArrayObject *raw = or_values(c->st, obj, c->func, "seqused_k");
    if (raw == NULL)
        return -1;
    if (!PyArray_ISINTEGER(raw) || PyArray_NDIM(raw) != 1 || PyArray_DIM(raw, 0) != nseq) {
        PyObject *got = or_values_str(raw, obj);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): 'seqused_k' must be a 1-D integer array of %zd "
                         "key counts (one per sequence), got %U", c->func, nseq, got);
        Py_XDECREF(got);
        Py_DECREF(raw);
        return -1;
    }
    c->used_k = as_int64(c, raw, "seqused_k", 1);
    if (c->used_k == NULL)
        return -1;
    const int64_t *used = PyArray_DATA(c->used_k);
    npy_intp max_len = 0;
    for (npy_intp b = 0; b < nseq; b++) {
        if (used[b] < 0 || used[b] > slot_keys(c, b)) {
            PyErr_Format(PyExc_ValueError, "%s(): 'seqused_k'[%zd] = %lld must lie in [0, %lld], "
                         "the keys of that sequence in %s", c->func, b, (long long)used[b],
                         (long long)slot_keys(c, b), c->varlen ? "cu_seqlens_k" : "k");
            return -1;
        }
        max_len = used[b] > max_len ? used[b] : max_len;
    }
    return max_len;
}

/* cu_seqlens and max_seqlen of a varlen call, checked before any output is allocated. */
int or_check_varlen(or_call *c, const or_opts *o, PyObject *cuq_obj, PyObject *cuk_obj)
{
    npy_intp maxq, maxk;
    c->cu_q = check_cu_seqlens(c, cuq_obj, "cu_seqlens_q", PyArray_DIM(c->arr[OR_Q], 0), &maxq);
    if (c->cu_q == NULL)
        return -1;
    c->cu_k = check_cu_seqlens(c, cuk_obj, "cu_seqlens_k",
                               c->p.pages.rows ? -1 : PyArray_DIM(c->arr[OR_K], 0), &maxk);
    if (c->cu_k == NULL)
        return -1;
    if (PyArray_DIM(c->cu_q, 0) != PyArray_DIM(c->cu_k, 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'cu_seqlens_k' must have as many entries as 'cu_seqlens_q'", c->func);
        return -1;
    }
    if (o->seqused_k != Py_None && (maxk = check_seqused_k(c, o->seqused_k)) < 0)
        return -1;
    if (check_max_seqlen(c, o->max_q, "max_seqlen_q", maxq) < 0
        || check_max_seqlen(c, o->max_k, "max_seqlen_k", maxk) < 0)
        return -1;
    return 0;
}

/* Paged k and v (a block_table given): each (num_pages, page_size, Hkv, D). Records the pages'
 * count and size, keeps the pools in c->pool (stage_pages records their strides and extent,
 * what a device buffer over all of them covers, from the memory the kernels read) and leaves
 * page 0, a (page_size, Hkv, D) view, as the operand, so that the varlen checks and tables see
 * k and v as for packed sequences. */
int or_check_paged_kv(or_call *c)
{
    PyArrayObject *k = c->arr[OR_K], *v = c->arr[OR_V];
    if (PyArray_NDIM(k) != 4 || PyArray_NDIM(v) != 4 || PyArray_DIM(k, 0) < 1
        || PyArray_DIM(k, 1) < 1 || PyArray_DIM(v, 0) != PyArray_DIM(k, 0)
        || PyArray_DIM(v, 1) != PyArray_DIM(k, 1) || PyArray_DIM(v, 2) != PyArray_DIM(k, 2)) {
        PyObject *ks = or_shape_str(k), *vs = ks ? or_shape_str(v) : NULL;
        if (vs != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): with a 'block_table', 'k' and 'v' must be "
                         "pages (num_pages >= 1, page_size >= 1, Hkv, D) of one geometry, got %S "
                         "and %S", c->func, ks, vs);
        Py_XDECREF(ks);
        Py_XDECREF(vs);
        return -1;
    }
    c->p.pages.count = PyArray_DIM(k, 0);
    c->p.pages.rows = PyArray_DIM(k, 1);
    for (int s = OR_K; s <= OR_V; s++) {
        PyArrayObject *page0 = (PyArrayObject *)PySequence_GetItem((PyObject *)c->arr[s], 0);
        if (page0 == NULL)
            return -1;
        c->pool[s - OR_K] = c->arr[s];
        c->arr[s] = page0;
    }
    /* a DeviceArray's pages are where they lie; a host array's once staged */
    return c->resident ? stage_operand(c, OR_K) : 0;
}

/* An integer array argument as an int64 array of `n` entries (rank nd: n rows when 2-D). */
static PyArrayObject *int64_array(or_call *c, PyObject *obj, const char *name, int nd,
                                  npy_intp n, const char *layout)
{
    PyArrayObject *raw = or_values(c->st, obj, c->func, name);
    if (raw == NULL)
        return NULL;
    if (!PyArray_ISINTEGER(raw) || PyArray_NDIM(raw) != nd || PyArray_DIM(raw, 0) != n) {
        PyObject *got = or_values_str(raw, obj);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must be an integer array %s: batch_size "
                         "%zd here, the sequences of the call; got %U", c->func, name, layout,
                         n, got);
        Py_XDECREF(got);
        Py_DECREF(raw);
        return NULL;
    }
    return as_int64(c, raw, name, nd);
}

/* Entries [t0, t1) of sequence b's row of block_table name pages of k and v. */
int or_check_pages(or_call *c, npy_intp b, npy_intp t0, npy_intp t1)
{
    const int64_t *row = (const int64_t *)PyArray_DATA(c->pages) + b * PyArray_DIM(c->pages, 1);
    for (npy_intp t = t0; t < t1; t++)
        if (row[t] < 0 || row[t] >= c->p.pages.count) {
            PyErr_Format(PyExc_ValueError, "%s(): 'block_table'[%zd, %zd] = %lld is not a "
                         "page: k and v hold %zd", c->func, b, t, (long long)row[t],
                         c->p.pages.count);
            return -1;
        }
    return 0;
}

/* seqused_k of a dense forward (a varlen one's: or_check_varlen), then leftpad_k and
 * block_table (varlen only) of a forward, against the sequences' key counts: each sequence's
 * left padding lies within its keys, and every page a sequence reads is listed and exists. */
int or_check_key_ranges(or_call *c, const or_opts *o)
{
    if (!c->varlen && o->seqused_k != Py_None && check_seqused_k(c, o->seqused_k) < 0)
        return -1;
    if (o->block_table == Py_None && o->leftpad_k == Py_None)
        return 0;
    const npy_intp nseq = sequences(c), page = c->p.pages.rows;
    if (o->block_table != Py_None
        && !(c->pages = int64_array(c, o->block_table, "block_table", 2, nseq,
                                    "(batch_size, max_num_pages), one row per sequence")))
        return -1;
    if (o->leftpad_k != Py_None
        && !(c->leftpad = int64_array(c, o->leftpad_k, "leftpad_k", 1, nseq, "(batch_size,)")))
        return -1;
    const int64_t *tbl = c->pages ? PyArray_DATA(c->pages) : NULL;
    const int64_t *used = c->used_k ? PyArray_DATA(c->used_k) : NULL;
    const int64_t *lp = c->leftpad ? PyArray_DATA(c->leftpad) : NULL;
    const npy_intp width = tbl ? PyArray_DIM(c->pages, 1) : 0;
    for (npy_intp b = 0; b < nseq; b++) {
        const int64_t len = used ? used[b] : slot_keys(c, b), first = lp ? lp[b] : 0;
        if (first < 0 || first > len) {
            PyErr_Format(PyExc_ValueError, "%s(): 'leftpad_k'[%zd] = %lld must lie in [0, %lld], "
                         "the keys of that sequence", c->func, b, (long long)first,
                         (long long)len);
            return -1;
        }
        if (tbl == NULL)
            continue;
        if ((len + page - 1) / page > width) {
            PyErr_Format(PyExc_ValueError, "%s(): sequence %zd has %lld keys, more than the %zd "
                         "pages of %zd in its row of 'block_table' hold", c->func, b,
                         (long long)len, width, page);
            return -1;
        }
        if (or_check_pages(c, b, first / page, (len + page - 1) / page) < 0)
            return -1;
    }
    return 0;
}

/* A shape argument as a list of non-negative sizes; returns its length or -1. */
int or_parse_shape(PyObject *obj, const char *name, npy_intp *dims)
{
    PyObject *seq = PySequence_Check(obj) ? PySequence_Fast(obj, "") : NULL;
    if (seq == NULL) {
        if (PyErr_Occurred() && !or_bad_value())
            return -1;
        PyErr_Format(PyExc_TypeError, "dropout_mask(): '%s' must be a sequence of ints, got "
                     "%.100R", name, obj);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int ok = n >= 2 && n <= NPY_MAXDIMS;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        long long v;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        /* (True is no size; LLONG_MAX, a size past 64 bits) */
        ok = !PyBool_Check(item) && or_as_integer(item, &v) == 0 && v >= 0 && v < LLONG_MAX
             && v <= NPY_MAX_INTP;
        dims[i] = ok ? (npy_intp)v : 0;
    }
    Py_DECREF(seq);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "dropout_mask(): '%s' must be a shape (..., N, D) of "
                         "at least 2 sizes in [0, 2**63 - 1), got %.100R", name, obj);
        return -1;
    }
    return (int)n;
}
