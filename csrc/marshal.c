/* marshal.c - from Python objects to the views the kernels read (orchard.h).
 *
 * Anything NumPy can view as an array is accepted. An array whose last dimension is
 * contiguous, aligned and in native byte order is read in place through its strides
 * (zero-copy); anything else is copied once into an aligned, C-contiguous staging array.
 * Both decisions are counted, and logged under ORCHARD_TENSOR_PROFILE=1.
 */
#include "pyorchard.h"

int or_dtype_of(PyArrayObject *a, or_dtype *dt)
{
    PyArray_Descr *descr = PyArray_DESCR(a);
    if (descr->kind != 'f')
        return -1;
    switch (PyArray_ITEMSIZE(a)) {
    case 2: *dt = OR_F16; return 0;
    case 4: *dt = OR_F32; return 0;
    case 8: *dt = OR_F64; return 0;
    default: return -1;
    }
}

static int readable_in_place(PyArrayObject *a)
{
    int nd = PyArray_NDIM(a);
    if (!PyArray_ISNOTSWAPPED(a) || !PyArray_ISALIGNED(a))
        return 0;
    return nd == 0 || PyArray_DIM(a, nd - 1) <= 1
           || PyArray_STRIDE(a, nd - 1) == PyArray_ITEMSIZE(a);
}

PyArrayObject *or_operand(PyObject *obj, const char *func, const char *name, or_counters *ct)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (a == NULL) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError))
            return NULL;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' cannot be viewed as an array (%S)",
                     func, name, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    or_dtype dt;
    if (or_dtype_of(a, &dt) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): argument '%s' must be a float16, float32 or float64 array, not %S",
                     func, name, (PyObject *)PyArray_DESCR(a));
        Py_DECREF(a);
        return NULL;
    }
    if (readable_in_place(a)) {
        ct->zero_copy_buffers++;
        if (or_log_enabled("ORCHARD_TENSOR_PROFILE"))
            or_log("orchard: %s %s: zero-copy, %zd bytes in place", func, name, PyArray_NBYTES(a));
        return a;
    }
    PyArray_Descr *native = PyArray_DescrFromType(PyArray_TYPE(a));  /* native byte order */
    PyArrayObject *staged = (PyArrayObject *)PyArray_FromArray(
        a, native, NPY_ARRAY_CARRAY | NPY_ARRAY_ENSURECOPY);
    Py_DECREF(a);
    if (staged == NULL)
        return NULL;
    ct->staged_buffers++;
    ct->bytes_staged += PyArray_NBYTES(staged);
    if (or_log_enabled("ORCHARD_TENSOR_PROFILE"))
        or_log("orchard: %s %s: staged, %zd bytes copied", func, name, PyArray_NBYTES(staged));
    return staged;
}

static or_ssize *alloc_offsets(or_ssize n)
{
    if (n < 0 || (size_t)n >= PY_SSIZE_T_MAX / sizeof(or_ssize)) {
        PyErr_NoMemory();
        return NULL;
    }
    or_ssize *offs = PyMem_Malloc(sizeof(or_ssize) * (size_t)(n + 1));
    if (offs == NULL)
        PyErr_NoMemory();
    return offs;
}

/* Byte offset of element [i0, ..., i_{nlead-1}, 0, ...] for every index over the first nlead
 * dimensions, in row-major order: the per-unit offsets of a dense operand. */
or_ssize *or_lead_offsets(PyArrayObject *a, int nlead)
{
    or_ssize n = 1;
    for (int i = 0; i < nlead; i++)
        n *= PyArray_DIM(a, i);     /* cannot overflow: the array exists */
    or_ssize *offs = alloc_offsets(n);
    if (offs == NULL)
        return NULL;
    npy_intp idx[NPY_MAXDIMS] = {0};
    for (or_ssize u = 0; u < n; u++) {
        or_ssize off = 0;
        for (int i = 0; i < nlead; i++)
            off += idx[i] * PyArray_STRIDE(a, i);
        offs[u] = off;
        for (int i = nlead - 1; i >= 0; i--) {     /* odometer step */
            if (++idx[i] < PyArray_DIM(a, i))
                break;
            idx[i] = 0;
        }
    }
    return offs;
}

/* Per-unit offsets of a packed varlen operand: unit (b, h) starts at sequence position cu[b]
 * along seq_axis and at head h along head_axis. */
or_ssize *or_varlen_offsets(PyArrayObject *a, const int64_t *cu, or_ssize nseq, or_ssize heads,
                            int seq_axis, int head_axis)
{
    or_ssize *offs = alloc_offsets(nseq * heads);
    if (offs == NULL)
        return NULL;
    for (or_ssize b = 0; b < nseq; b++)
        for (or_ssize h = 0; h < heads; h++)
            offs[b * heads + h] = (or_ssize)cu[b] * PyArray_STRIDE(a, seq_axis)
                                  + h * PyArray_STRIDE(a, head_axis);
    return offs;
}

/* "(2, 8, 128, 64)" for messages and logs. */
PyObject *or_shape_str(PyArrayObject *a)
{
    PyObject *t = PyTuple_New(PyArray_NDIM(a));
    if (t == NULL)
        return NULL;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        PyObject *d = PyLong_FromSsize_t(PyArray_DIM(a, i));
        if (d == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, d);
    }
    PyObject *s = PyObject_Str(t);
    Py_DECREF(t);
    return s;
}
