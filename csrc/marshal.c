/* marshal.c - from Python objects to the views the kernels read (orchard.h).
 *
 * DLPack producers (dlpack.c) and anything NumPy can view as an array are accepted. An array
 * whose last dimension is contiguous, aligned and in native byte order is read in place
 * through its strides (zero-copy); anything else is copied once into an aligned,
 * C-contiguous staging array.
 * Both decisions are counted, and logged under ORCHARD_TENSOR_PROFILE=1.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pyorchard.h"

/* The dtype of a NumPy array (bfloat16 arrives only through DLPack: dlpack.c). */
static int or_dtype_of(PyArrayObject *a, or_dtype *dt)
{
    for (int i = 0; i < OR_NDTYPES; i++)
        if (or_dtypes[i].numpy && PyArray_TYPE(a) == or_dtypes[i].typenum) {
            *dt = (or_dtype)i;
            return 0;
        }
    return -1;
}

/* "float16, float32 or float64": the dtypes of dtypes.h that NumPy arrays can hold, for
 * messages (bfloat16 comes through DLPack only). */
static PyObject *dtype_names(void)
{
    int last = 0;
    for (int i = 0; i < OR_NDTYPES; i++)
        last = or_dtypes[i].numpy ? i : last;
    PyObject *names = PyUnicode_FromString(or_dtypes[0].name);
    for (int i = 1; names != NULL && i <= last; i++)
        if (or_dtypes[i].numpy)
            Py_SETREF(names, PyUnicode_FromFormat("%U%s%s", names, i < last ? ", " : " or ",
                                                  or_dtypes[i].name));
    return names;
}

/* The memory an array touches: its lowest address and the bytes from there to its end. */
void or_extent(PyArrayObject *a, char **lo, size_t *nbytes)
{
    char *low = PyArray_BYTES(a), *high = low;
    *lo = low;
    *nbytes = 0;
    if (PyArray_SIZE(a) == 0)
        return;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        npy_intp span = (PyArray_DIM(a, i) - 1) * PyArray_STRIDE(a, i);
        if (span < 0)
            low += span;
        else
            high += span;
    }
    *lo = low;
    *nbytes = (size_t)(high - low) + (size_t)PyArray_ITEMSIZE(a);
}

/* Whether the kernels can read a's memory as it is: aligned elements in native byte order, the
 * last dimension contiguous. (A device that wants more alignment gets a buffer that starts
 * before the array: attn_opencl.c.) */
static int readable_in_place(PyArrayObject *a)
{
    int nd = PyArray_NDIM(a);
    if (!PyArray_ISNOTSWAPPED(a) || !PyArray_ISALIGNED(a))
        return 0;
    return nd == 0 || PyArray_DIM(a, nd - 1) <= 1
           || PyArray_STRIDE(a, nd - 1) == PyArray_ITEMSIZE(a);
}

/* The largest aligned buffers freed lately, up to SPARES of them, each of at most SPARE_MAX
 * bytes and SPARE_TOTAL together, kept for the next arrays of their size or a little less.
 * Staging an operand call after call (alongside an output of the same size) otherwise took
 * fresh pages from the kernel each time (glibc returned the two freed buffers together), and
 * their zeroing was 4 % of a float32 forward of (4, 8, 1024, 64) (perf: clear_page); glibc's
 * malloc keeps freed memory of up to 32 MiB for reuse in the same way. With one spare, a
 * staged forward there still took 307 fresh pages a call and a backward (three outputs) about
 * 3,700.
 * Only touched with the GIL held (allocation here, the capsule's destructor), which serialises
 * it. */
#define SPARES 4
#define SPARE_MAX ((size_t)32 << 20)
#define SPARE_TOTAL ((size_t)64 << 20)
static struct {
    void *mem;
    size_t nbytes;
} spares[SPARES];

/* The spare buffer of fewest bytes, or -1 where none is held. */
static int smallest_spare(void)
{
    int s = -1;
    for (int i = 0; i < SPARES; i++)
        if (spares[i].mem != NULL && (s < 0 || spares[i].nbytes < spares[s].nbytes))
            s = i;
    return s;
}

/* A freed array's buffer becomes a spare where it is larger than spares that must go to make
 * room for it (a slot, and SPARE_TOTAL); else it is freed. */
static void free_staging(PyObject *capsule)
{
    void *mem = PyCapsule_GetPointer(capsule, "orchard.staging");
    const size_t nbytes = (size_t)(uintptr_t)PyCapsule_GetContext(capsule);
    size_t held = 0;
    int slot = -1;
    if (nbytes > SPARE_MAX) {
        free(mem);
        return;
    }
    for (int i = 0; i < SPARES; i++) {
        held += spares[i].nbytes;
        slot = spares[i].mem == NULL ? i : slot;
    }
    while (slot < 0 || held + nbytes > SPARE_TOTAL) {
        const int s = smallest_spare();
        if (s < 0 || spares[s].nbytes >= nbytes) {
            free(mem);
            return;
        }
        held -= spares[s].nbytes;
        free(spares[s].mem);
        spares[s].mem = NULL;
        spares[s].nbytes = 0;
        slot = s;
    }
    spares[slot].mem = mem;
    spares[slot].nbytes = nbytes;
}

/* nbytes aligned to `align`: the smallest spare buffer that is large enough, is aligned so and
 * not more than twice as large (a small array does not hold on to a large buffer); else new. */
static void *aligned_memory(size_t align, size_t nbytes)
{
    int best = -1;
    for (int i = 0; i < SPARES; i++)
        if (spares[i].mem != NULL && spares[i].nbytes >= nbytes && spares[i].nbytes / 2 <= nbytes
            && (uintptr_t)spares[i].mem % align == 0
            && (best < 0 || spares[i].nbytes < spares[best].nbytes))
            best = i;
    if (best < 0)
        return aligned_alloc(align, nbytes);
    void *mem = spares[best].mem;
    spares[best].mem = NULL;
    spares[best].nbytes = 0;
    return mem;
}

/* MemoryError for an array that cannot be allocated, with its size (in a double: the exact
 * product may overflow). Steals descr. */
static PyArrayObject *no_memory(int nd, const npy_intp *dims, PyArray_Descr *descr)
{
    double bytes = (double)PyDataType_ELSIZE(descr);
    for (int i = 0; i < nd; i++)
        bytes *= (double)dims[i];
    Py_DECREF(descr);
    char text[64];      /* PyErr_Format has no %g */
    snprintf(text, sizeof(text), "cannot allocate an array of %.4g bytes", bytes);
    PyErr_SetString(PyExc_MemoryError, text);
    return NULL;
}

/* A new C-contiguous array in memory aligned to `align` bytes (a power of two), as devices
 * sharing host memory want it, of zeros where `zeroed` (OpenCL devices' outputs, problem.c
 * or_new_output; a staging copy writes every element itself); a capsule frees the memory with
 * the array. */
PyArrayObject *or_new_aligned(int nd, const npy_intp *dims, int typenum, size_t align,
                              int zeroed)
{
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL)
        return NULL;
    size_t size = 1, limit = (size_t)NPY_MAX_INTP / 2;
    for (int i = 0; i < nd; i++) {
        if (dims[i] != 0 && size > limit / (size_t)dims[i])
            return no_memory(nd, dims, descr);
        size *= (size_t)dims[i];
    }
    align = align < 64 ? 64 : align;
    if (size > (limit - align) / (size_t)PyDataType_ELSIZE(descr))
        return no_memory(nd, dims, descr);
    size_t nbytes = (size * (size_t)PyDataType_ELSIZE(descr) + align - 1) / align * align;
    nbytes = nbytes ? nbytes : align;
    void *mem = aligned_memory(align, nbytes);
    if (mem == NULL)
        return no_memory(nd, dims, descr);
    if (zeroed)
        memset(mem, 0, nbytes);
    PyObject *capsule = PyCapsule_New(mem, "orchard.staging", free_staging);
    if (capsule == NULL) {
        free(mem);
        Py_DECREF(descr);
        return NULL;
    }
    /* the size, for free_staging (setting a new capsule's context cannot fail) */
    PyCapsule_SetContext(capsule, (void *)(uintptr_t)nbytes);
    PyArrayObject *a = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, descr, nd, (npy_intp *)dims, NULL, mem, NPY_ARRAY_CARRAY, NULL);
    if (a == NULL) {                    /* descr was stolen either way */
        Py_DECREF(capsule);
        return NULL;
    }
    if (PyArray_SetBaseObject(a, capsule) < 0) {   /* steals capsule */
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* A C-contiguous, aligned copy of `a` as `typenum`. */
PyArrayObject *or_staged_copy(PyArrayObject *a, int typenum, size_t align)
{
    PyArrayObject *c = or_new_aligned(PyArray_NDIM(a), PyArray_DIMS(a), typenum, align, 0);
    if (c != NULL && PyArray_CopyInto(c, a) < 0)
        Py_CLEAR(c);
    return c;
}

PyObject *or_restate(PyObject *type, const char *format, ...)
{
    PyObject *was, *value, *tb;
    PyErr_Fetch(&was, &value, &tb);
    va_list va;
    va_start(va, format);
    PyObject *words = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (words != NULL)
        PyErr_Format(type, "%U (%S)", words, value != NULL ? value : Py_None);
    Py_XDECREF(words);
    Py_XDECREF(was);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return NULL;
}

/* NULL, after argument `name` failed to read as an array: with its error where that is a
 * MemoryError, no Exception (KeyboardInterrupt in an __array__) or, with own_words, a
 * TypeError or ValueError of dlpack.c's (they name the argument); else a TypeError naming
 * the argument, with the error's words. */
PyArrayObject *or_unreadable(const char *func, const char *name, int own_words)
{
    if (PyErr_ExceptionMatches(PyExc_MemoryError) || !PyErr_ExceptionMatches(PyExc_Exception)
        || (own_words && (PyErr_ExceptionMatches(PyExc_TypeError)
                          || PyErr_ExceptionMatches(PyExc_ValueError))))
        return NULL;
    return (PyArrayObject *)or_restate(PyExc_TypeError, "%s(): argument '%s' cannot be viewed "
                                       "as an array", func, name);
}

/* 1 where obj has the attribute, 0 where it has not, -1 with the exception of a failed look-up
 * (PyObject_HasAttr would swallow a KeyboardInterrupt or MemoryError raised by a property). */
static int has_attr(PyObject *obj, PyObject *name)
{
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got != NULL) {
        Py_DECREF(got);
        return 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

PyArrayObject *or_operand_view(or_module_state *st, PyObject *obj, const char *func,
                               const char *name, or_dtype *dt, int *copied)
{
    *copied = 0;
    const int dlpack = PyArray_Check(obj) ? 0 : has_attr(obj, st->dlpack_name);
    if (dlpack < 0)
        return or_unreadable(func, name, 0);
    PyArrayObject *a = dlpack ? or_from_dlpack(st, obj, func, name, dt)
                              : (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (a == NULL)
        return or_unreadable(func, name, dlpack);
    if (!dlpack && or_dtype_of(a, dt) < 0) {
        PyObject *names = dtype_names();
        if (names != NULL && PyArray_Check(obj))
            PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be a %U array (bfloat16: "
                         "a tensor through DLPack), not %S", func, name, names,
                         (PyObject *)PyArray_DESCR(a));
        else if (names != NULL)     /* (None read as an array of object says little) */
            PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be a %U array (bfloat16: "
                         "a tensor through DLPack), got %.100s, read as an array of %S", func,
                         name, names, Py_TYPE(obj)->tp_name, (PyObject *)PyArray_DESCR(a));
        Py_XDECREF(names);
        Py_DECREF(a);
        return NULL;
    }
    /* NumPy's array from another kind of object is memory of its own (a list's) or may be
     * (an __array__ that returns a view of a temporary): a write might never reach it */
    *copied = !dlpack && !PyArray_Check(obj) ? 2 : !readable_in_place(a);
    if (dlpack)
        return a;   /* made here, seen by no one else */
    /* A view of our own: Python code that runs later in the call (a scale's __float__, an
     * __array__, an __index__) could set the caller's array's shape or strides in place,
     * which the checks already made would not see (reads out of bounds) */
    PyArrayObject *view = (PyArrayObject *)PyArray_View(a, NULL, &PyArray_Type);
    Py_DECREF(a);
    return view;
}

PyArrayObject *or_stage(PyArrayObject *a, int typenum, const char *func, const char *name,
                        or_counters *ct, size_t align)
{
    if (readable_in_place(a) && PyArray_TYPE(a) == typenum) {
        if (ct != NULL)
            OR_COUNT(ct, zero_copy_buffers, 1);
        if (or_env_flag("ORCHARD_TENSOR_PROFILE"))
            or_log("orchard: %s %s: zero-copy, %zd bytes in place", func, name, PyArray_NBYTES(a));
        return a;
    }
    PyArrayObject *staged = or_staged_copy(a, typenum, align);   /* native byte order */
    Py_DECREF(a);
    if (staged == NULL && PyErr_ExceptionMatches(PyExc_MemoryError))
        or_restate(PyExc_MemoryError, "%s(): argument '%s' must be copied (it is not contiguous "
                   "in its last dimension, aligned and in native byte order, or not of the type "
                   "the kernels read), and the copy fails", func, name);
    if (staged == NULL)
        return NULL;
    if (ct != NULL) {
        OR_COUNT(ct, staged_buffers, 1);
        OR_COUNT(ct, bytes_staged, PyArray_NBYTES(staged));
    }
    if (or_env_flag("ORCHARD_TENSOR_PROFILE"))
        or_log("orchard: %s %s: staged, %zd bytes copied", func, name, PyArray_NBYTES(staged));
    return staged;
}

/* n + 1 entries of elsize bytes, the per-unit tables, or NULL with MemoryError: n comes from
 * a product of dimensions that a stride-0 view can make huge. */
void *or_alloc_units(or_ssize n, size_t elsize)
{
    void *mem = n >= 0 && (size_t)n < PY_SSIZE_T_MAX / elsize
                    ? PyMem_Malloc(elsize * (size_t)(n + 1)) : NULL;
    if (mem == NULL)
        PyErr_Format(PyExc_MemoryError, "cannot allocate the tables of %zd batch-heads", n);
    return mem;
}

/* Byte offset of element [i0, ..., i_{nlead-1}, 0, ...] for every index over the first nlead
 * dimensions, in row-major order: the per-unit offsets of a dense operand. */
or_ssize *or_lead_offsets(PyArrayObject *a, int nlead)
{
    or_ssize n = 1;
    for (int i = 0; i < nlead; i++)
        n *= PyArray_DIM(a, i);     /* cannot overflow: the array exists */
    or_ssize *offs = or_alloc_units(n, sizeof(or_ssize));
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
    or_ssize *offs = or_alloc_units(nseq * heads, sizeof(or_ssize));
    if (offs == NULL)
        return NULL;
    for (or_ssize b = 0; b < nseq; b++)
        for (or_ssize h = 0; h < heads; h++)
            offs[b * heads + h] = (or_ssize)cu[b] * PyArray_STRIDE(a, seq_axis)
                                  + h * PyArray_STRIDE(a, head_axis);
    return offs;
}

/* What an index or slope argument `obj` read as (`a`), for messages: "an array of dtype
 * float64 and shape (2, 2)", or obj's repr where NumPy made it an object array (not an array
 * at all). */
PyObject *or_values_str(PyArrayObject *a, PyObject *obj)
{
    if (PyArray_TYPE(a) == NPY_OBJECT)
        return PyUnicode_FromFormat("%.100R", obj);
    PyObject *shape = or_shape_str(a);
    if (shape == NULL)
        return NULL;
    PyObject *s = PyUnicode_FromFormat("an array of dtype %S and shape %U",
                                       (PyObject *)PyArray_DESCR(a), shape);
    Py_DECREF(shape);
    return s;
}

/* "(2, 8, 128, 64)" for messages and logs. */
PyObject *or_shape_str(PyArrayObject *a)
{
    return or_dims_str(PyArray_NDIM(a), PyArray_DIMS(a));
}

PyObject *or_dims_str(int nd, const npy_intp *dims)
{
    PyObject *t = PyTuple_New(nd);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < nd; i++) {
        PyObject *d = PyLong_FromSsize_t(dims[i]);
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
