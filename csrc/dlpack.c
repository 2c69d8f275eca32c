/* dlpack.c - operands handed over through DLPack (torch tensors, JAX arrays, ...), and results
 * handed back as torch tensors when the inputs were.
 *
 * An object with __dlpack__ (other than a NumPy array, which NumPy reads directly) gives a
 * DLManagedTensor: its memory becomes a NumPy array of the same shape and strides, no copy,
 * whose base owns the tensor and calls its deleter when the array goes. That is how bfloat16
 * comes in: NumPy has no such type, so the array holds its bits as uint16 and the dtype
 * travels beside it (dtypes.h). The structs below are DLPack's stable ABI (dlpack.h): the
 * unversioned tensor of v0.8, and the versioned one of v1 that a producer gives when asked
 * with max_version, as the Python array API asks consumers to.
 */
#include "pyorchard.h"

typedef struct {
    int32_t device_type;        /* kDLCPU = 1; CUDA, OpenCL, ... otherwise */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;               /* kDLFloat = 2, kDLBfloat = 4 (dtypes.h's DLPack column) */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;           /* in elements; NULL: C-contiguous */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    struct { uint32_t major, minor; } version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;             /* DL_READ_ONLY, DL_IS_COPIED */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

enum { DL_CPU = 1, DL_MAJOR_VERSION = 1, DL_READ_ONLY = 1, DL_IS_COPIED = 2 };

/* A producer's tensor, unversioned (m) or versioned (mv): the other is NULL. */
typedef struct {
    DLManagedTensor *m;
    DLManagedTensorVersioned *mv;
} managed;

static void release(managed t)
{
    if (t.m != NULL && t.m->deleter != NULL)
        t.m->deleter(t.m);
    if (t.mv != NULL && t.mv->deleter != NULL)
        t.mv->deleter(t.mv);
}

/* The destructors of the capsules that own a producer's tensor while an array views it. */
static void release_managed(PyObject *capsule)
{
    release((managed){PyCapsule_GetPointer(capsule, "orchard.dltensor"), NULL});
}

static void release_versioned(PyObject *capsule)
{
    release((managed){NULL, PyCapsule_GetPointer(capsule, "orchard.dltensor_versioned")});
}

/* obj.__dlpack__(max_version=(1, 0)), or obj.__dlpack__() from a producer that takes no
 * max_version (a TypeError, as the array API has older producers answer): a new reference,
 * or NULL with an exception. */
static PyObject *call_dlpack(or_module_state *st, PyObject *obj)
{
    PyObject *method = PyObject_GetAttr(obj, st->dlpack_name);
    if (method == NULL)
        return NULL;
    PyObject *capsule = PyObject_VectorcallDict(method, NULL, 0, st->dlpack_versioned);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_CallNoArgs(method);
    }
    Py_DECREF(method);
    return capsule;
}

/* What the hand-over calls of torch, read from sys.modules["torch"] once per module into the
 * tuple st->torch (looked up by name at every call, they had cost 4 us of a 14 us call on
 * three tensors: benchmarks/flash_attn_overhead.py). A call holds its own reference to the
 * tuple: the Python code it runs (a check, an export) could make orchard read another module.
 * T_TENSOR is None for a module without tensors (a stand-in without Tensor, to_dlpack,
 * from_numpy, Tensor.view or the dtypes), whose objects are read as any DLPack producer's;
 * T_IS_NEG is None in a torch from before lazy negation; T_GRAD_MODE (torch.is_grad_enabled),
 * T_INFERENCE_MODE (torch.is_inference_mode_enabled) and T_WRITTEN
 * (torch.autograd.graph.increment_version), for the caches a call writes, None where torch
 * lacks them; T_DTYPE + i torch's dtype i, None for the ones NumPy has. */
enum { T_MODULE, T_TENSOR, T_TO_DLPACK, T_FROM_NUMPY, T_VIEW, T_IS_NEG, T_GRAD_MODE,
       T_INFERENCE_MODE, T_WRITTEN, T_DTYPE, T_SIZE = T_DTYPE + OR_NDTYPES };
#define TORCH(t, i) PyTuple_GET_ITEM(t, i)

/* obj.name, for what only a call that writes a cache needs: None where it cannot be read
 * (an Exception, cleared: a stand-in module's, a lazy import's), so that reading operands never
 * depends on it; NULL with any other exception (KeyboardInterrupt). obj None: None. */
static PyObject *optional_attr(PyObject *obj, const char *name)
{
    PyObject *got = obj != Py_None ? PyObject_GetAttrString(obj, name) : Py_NewRef(Py_None);
    if (got == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        got = Py_NewRef(Py_None);
    }
    return got;
}

/* The tuple for `module`, or NULL with an exception. */
static PyObject *read_torch(PyObject *module)
{
    PyObject *t = PyTuple_New(T_SIZE);
    if (t == NULL)
        return NULL;
    PyObject **item = &PyTuple_GET_ITEM(t, 0);  /* a new tuple's items, all NULL */
    item[T_MODULE] = Py_NewRef(module);
    PyObject *tensor = PyObject_GetAttrString(module, "Tensor");
    int ok = tensor != NULL
             && (item[T_TO_DLPACK] = PyObject_GetAttrString(module, "to_dlpack")) != NULL
             && (item[T_FROM_NUMPY] = PyObject_GetAttrString(module, "from_numpy")) != NULL
             && (item[T_VIEW] = PyObject_GetAttrString(tensor, "view")) != NULL;
    for (int i = 0; ok && i < OR_NDTYPES; i++)
        ok = or_dtypes[i].numpy
             || (item[T_DTYPE + i] = PyObject_GetAttrString(module, or_dtypes[i].name)) != NULL;
    if (ok && !(item[T_IS_NEG] = PyObject_GetAttrString(tensor, "is_neg"))
        && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear();
    if (ok && !PyErr_Occurred()) {
        PyObject *autograd = optional_attr(module, "autograd");
        PyObject *graph = autograd ? optional_attr(autograd, "graph") : NULL;
        if (graph != NULL && (item[T_GRAD_MODE] = optional_attr(module, "is_grad_enabled"))
            && (item[T_INFERENCE_MODE] = optional_attr(module, "is_inference_mode_enabled")))
            item[T_WRITTEN] = optional_attr(graph, "increment_version");
        Py_XDECREF(autograd);
        Py_XDECREF(graph);
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_XDECREF(tensor);
            Py_DECREF(t);
            return NULL;
        }
        PyErr_Clear();
    }
    if (ok)
        item[T_TENSOR] = tensor;
    else
        Py_XDECREF(tensor);
    for (int i = 0; i < T_SIZE; i++)
        if (item[i] == NULL)
            item[i] = Py_NewRef(Py_None);
    return t;
}

/* Whether obj is a torch.Tensor: 1 with *torch a new reference to st->torch, 0 (*torch NULL),
 * or -1 with an exception. torch is never imported here: a tensor implies it. */
static int torch_tensor(or_module_state *st, PyObject *obj, PyObject **torch)
{
    *torch = NULL;
    if (PyArray_Check(obj))
        return 0;
    PyObject *module = PyDict_GetItemWithError(PyImport_GetModuleDict(), st->torch_name);
    if (module == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (module == Py_None)      /* torch blocked in sys.modules */
        return 0;
    if (st->torch == NULL || TORCH(st->torch, T_MODULE) != module) {
        Py_INCREF(module);      /* sys.modules' may go in any collection read_torch starts */
        PyObject *fresh = read_torch(module);
        Py_DECREF(module);
        if (fresh == NULL)
            return -1;
        Py_XSETREF(st->torch, fresh);
    }
    PyObject *t = Py_NewRef(st->torch), *tensor = TORCH(t, T_TENSOR);
    const int is = tensor != Py_None ? PyObject_IsInstance(obj, tensor) : 0;
    if (is == 1)
        *torch = t;
    else
        Py_DECREF(t);
    return is;
}

/* Whether autograd would record a write into or from tensor obj: it requires grad while grad
 * mode is on (torch writes one unrecorded outside it, as an optimizer's step does); -1 with an
 * exception. */
static int recorded(PyObject *torch, PyObject *obj)
{
    PyObject *grad = TORCH(torch, T_GRAD_MODE) != Py_None
                         ? PyObject_CallNoArgs(TORCH(torch, T_GRAD_MODE)) : Py_NewRef(Py_False);
    int flag = grad == NULL ? -1 : PyObject_IsTrue(grad);
    Py_XDECREF(grad);
    if (flag > 0) {
        PyObject *requires = PyObject_GetAttrString(obj, "requires_grad");
        flag = requires == NULL ? -1 : PyObject_IsTrue(requires);
        Py_XDECREF(requires);
    }
    return flag;
}

int or_torch_recorded(or_module_state *st, PyObject *obj)
{
    PyObject *torch;
    int flag = torch_tensor(st, obj, &torch);
    if (flag > 0) {
        flag = recorded(torch, obj);
        Py_DECREF(torch);
    }
    return flag;
}

int or_torch_write_refusal(or_module_state *st, PyObject *obj, const char **why)
{
    PyObject *torch;
    const int is_torch = torch_tensor(st, obj, &torch);
    if (is_torch <= 0)
        return is_torch;
    *why = NULL;
    int flag = recorded(torch, obj);
    if (flag > 0)
        *why = "requires grad, in grad mode: autograd would not see orchard_ops' write (write "
               "it with torch's indexing, or under torch.no_grad())";
    PyObject *mode = flag == 0 && TORCH(torch, T_INFERENCE_MODE) != Py_None
                         ? PyObject_CallNoArgs(TORCH(torch, T_INFERENCE_MODE)) : NULL;
    if (mode != NULL) {
        flag = PyObject_Not(mode);      /* 1: not in inference mode */
        PyObject *inference = flag > 0 ? PyObject_CallMethod(obj, "is_inference", NULL) : NULL;
        flag = flag <= 0 ? flag : inference == NULL ? -1 : PyObject_IsTrue(inference);
        Py_XDECREF(inference);
        if (flag > 0)
            *why = "is an inference tensor (made under torch.inference_mode): it can be "
                   "written only in inference mode";
    }
    Py_XDECREF(mode);
    Py_DECREF(torch);
    return PyErr_Occurred() ? -1 : 0;
}

int or_torch_written(or_module_state *st, PyObject *obj)
{
    PyObject *torch;
    const int is_torch = torch_tensor(st, obj, &torch);
    if (is_torch <= 0)
        return is_torch;
    PyObject *done = TORCH(torch, T_WRITTEN) != Py_None
                         ? PyObject_CallOneArg(TORCH(torch, T_WRITTEN), obj) : Py_NewRef(Py_None);
    Py_DECREF(torch);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

/* The NumPy type of a DLPack integer, bool or float element, or -1. */
static int numpy_type(DLDataType t)
{
    static const int ints[] = {NPY_INT8, NPY_INT16, NPY_INT32, NPY_INT64},
                     uints[] = {NPY_UINT8, NPY_UINT16, NPY_UINT32, NPY_UINT64},
                     floats[] = {-1, NPY_FLOAT16, NPY_FLOAT32, NPY_FLOAT64};
    const int i = t.bits == 8 ? 0 : t.bits == 16 ? 1 : t.bits == 32 ? 2 : t.bits == 64 ? 3 : -1;
    if (t.lanes != 1 || i < 0)
        return -1;
    switch (t.code) {
    case 0:     /* kDLInt */
        return ints[i];
    case 1:     /* kDLUInt */
        return uints[i];
    case 2:     /* kDLFloat */
        return floats[i];
    case 6:     /* kDLBool */
        return i == 0 ? NPY_BOOL : -1;
    }
    return -1;
}

/* The NumPy view of a DLPack producer's memory, with its dtype; NULL with TypeError or
 * ValueError naming the argument. dt NULL: an array of integers, booleans or floats (the
 * index arrays and ALiBi slopes), any of NumPy's types. A torch tensor is exported with
 * torch.to_dlpack, a C function (its __dlpack__ method costs ten times as much, 2.6 against
 * 0.3 us here). */
PyArrayObject *or_from_dlpack(or_module_state *st, PyObject *obj, const char *func,
                              const char *name, or_dtype *dt)
{
    PyObject *torch;
    const int is_torch = torch_tensor(st, obj, &torch);
    if (is_torch < 0)
        return NULL;
    if (is_torch && TORCH(torch, T_IS_NEG) != Py_None) {
        /* torch exports a lazily negated view's memory without its sign */
        PyObject *neg = PyObject_CallOneArg(TORCH(torch, T_IS_NEG), obj);
        const int lazy = neg == NULL ? -1 : PyObject_IsTrue(neg);
        Py_XDECREF(neg);
        if (lazy > 0)
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s' is a torch tensor with its "
                         "negative bit set (a lazily negated view, which DLPack does not "
                         "carry): pass %s.resolve_neg()", func, name, name);
        if (lazy != 0) {
            Py_DECREF(torch);
            return NULL;
        }
    }
    PyObject *capsule = is_torch ? PyObject_CallOneArg(TORCH(torch, T_TO_DLPACK), obj)
                                 : call_dlpack(st, obj);
    Py_XDECREF(torch);
    if (capsule == NULL)
        return or_unreadable(func, name, 0);
    const int versioned = PyCapsule_IsValid(capsule, "dltensor_versioned");
    managed given = {NULL, NULL};
    if (versioned)
        given.mv = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    else if (PyCapsule_IsValid(capsule, "dltensor"))
        given.m = PyCapsule_GetPointer(capsule, "dltensor");
    if (given.m == NULL && given.mv == NULL) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s': its __dlpack__() gave %.100R, not "
                     "an unused DLPack capsule (\"dltensor\" or \"dltensor_versioned\")",
                     func, name, capsule);
        Py_DECREF(capsule);
        return NULL;
    }
    if (versioned && given.mv->version.major != DL_MAJOR_VERSION) {
        /* another major version may lay the tensor out otherwise; its version, context and
         * deleter stay where they are, and dlpack.h has the consumer release it */
        const unsigned major = given.mv->version.major, minor = given.mv->version.minor;
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned") == 0) {
            release(given);
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s': its __dlpack__() gave a "
                         "DLPack %u.%u tensor; orchard reads DLPack 1.x", func, name, major,
                         minor);
        }
        Py_DECREF(capsule);
        return NULL;
    }
    const DLTensor *t = versioned ? &given.mv->dl_tensor : &given.m->dl_tensor;
    PyObject *owner = NULL;
    PyArrayObject *a = NULL;
    int found = -1, typenum = dt ? -1 : numpy_type(t->dtype);
    for (int i = 0; dt && i < OR_NDTYPES && found < 0; i++)
        if (t->dtype.code == or_dtypes[i].dlpack && t->dtype.bits == 8 * or_dtypes[i].itemsize
            && t->dtype.lanes == 1)
            typenum = or_dtypes[found = i].typenum;
    if (t->device.device_type != DL_CPU) {
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' is in device memory (DLPack device "
                     "type %d): orchard reads host memory, pass CPU tensors", func, name,
                     (int)t->device.device_type);
        goto done;
    }
    if (typenum < 0) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be %s, not DLPack type code %d "
                     "with %d bits and %d lanes", func, name, dt ? "a float16, float32, float64 "
                     "or bfloat16 array" : t->dtype.code == 4 ? "an array of integers or floats "
                     "(a bfloat16 tensor: convert it first)" : "an array of integers or floats",
                     (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes);
        goto done;
    }
    if (t->ndim < 0 || t->ndim > NPY_MAXDIMS || (t->ndim > 0 && t->shape == NULL)) {
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' has %d dimensions%s", func, name,
                     (int)t->ndim, t->shape == NULL ? " and no DLPack shape" : "");
        goto done;
    }
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    const int itemsize = t->dtype.bits / 8;
    int empty = 0;
    for (int i = t->ndim - 1; i >= 0; i--) {   /* sizes and strides a producer got wrong */
        int64_t step = 1, bytes = 0;            /* elements, then bytes, to the next index */
        int bad = t->shape[i] < 0 || t->shape[i] > NPY_MAX_INTP;
        if (t->strides != NULL)
            step = t->strides[i];
        else if (i < t->ndim - 1)               /* C order */
            bad |= __builtin_mul_overflow((int64_t)strides[i + 1] / itemsize,
                                          (int64_t)dims[i + 1], &step);
        bad |= __builtin_mul_overflow(step, (int64_t)itemsize, &bytes) || bytes > NPY_MAX_INTP
               || bytes < -NPY_MAX_INTP;
        if (bad) {
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s' has DLPack dimension %d of "
                         "size %lld and stride %lld elements", func, name, i,
                         (long long)t->shape[i], (long long)step);
            goto done;
        }
        dims[i] = (npy_intp)t->shape[i];
        strides[i] = (npy_intp)bytes;
        empty |= dims[i] == 0;
    }
    if (t->data == NULL && !empty) {   /* NumPy would allocate fresh, uninitialised memory */
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' has no memory (a DLPack tensor "
                     "whose data pointer is NULL, as a torch FakeTensor's is)", func, name);
        goto done;
    }
    /* an offset past the address space (the kernels read wherever it wrapped to); one within
     * it that is not the tensor's memory cannot be told apart */
    if (t->byte_offset > (uint64_t)NPY_MAX_INTP
        || (uintptr_t)t->data + t->byte_offset < (uintptr_t)t->data) {
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' has DLPack byte_offset %llu, past "
                     "the end of the address space", func, name,
                     (unsigned long long)t->byte_offset);
        goto done;
    }
    /* from here the capsule's tensor is ours: the protocol marks it used, and our capsule
     * (the array's base) calls its deleter */
    if (PyCapsule_SetName(capsule, versioned ? "used_dltensor_versioned" : "used_dltensor") < 0)
        goto done;
    owner = versioned ? PyCapsule_New(given.mv, "orchard.dltensor_versioned", release_versioned)
                      : PyCapsule_New(given.m, "orchard.dltensor", release_managed);
    if (owner == NULL) {    /* the MemoryError kept while the deleter, maybe Python, runs */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        release(given);
        PyErr_Restore(type, value, tb);
        goto done;
    }
    if (dt)
        *dt = (or_dtype)found;
    /* writable (what a call's new keys and values are written into: kv_append.c) where the
     * producer says so: a versioned tensor not marked read-only, or a copy whose writes the
     * caller would never see; a torch tensor (torch.to_dlpack's are unversioned; kv_append.c
     * asks torch's own rules). Another producer's unversioned tensor says neither, and may be
     * immutable (an older JAX's array): read-only. */
    const int writable = versioned ? !(given.mv->flags & (DL_READ_ONLY | DL_IS_COPIED))
                                   : is_torch;
    a = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, PyArray_DescrFromType(typenum), t->ndim, dims, strides,
        (char *)t->data + t->byte_offset, writable ? NPY_ARRAY_WRITEABLE : 0, NULL);
    if (a != NULL && PyArray_SetBaseObject(a, owner) < 0) {     /* steals owner */
        Py_CLEAR(a);
    } else if (a == NULL) {
        /* NumPy's error (a shape past its bounds: "array is too big") named for the argument,
         * and kept while the producer's deleter, which may run Python code, releases it */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_DECREF(owner);
        PyErr_Restore(type, value, tb);
        if (PyErr_ExceptionMatches(PyExc_ValueError))
            or_restate(PyExc_ValueError, "%s(): argument '%s' has a DLPack shape NumPy cannot "
                       "hold", func, name);
    }
done:
    Py_DECREF(capsule);
    return a;
}

/* obj's values as a NumPy array, for the index arrays and ALiBi slopes: a torch tensor read
 * in place through DLPack, anything else as NumPy reads it. A torch tensor's __array__ is
 * Python code: a decode step's seqused_k and leftpad_k added 17 us to its call that way, 6 us
 * this way (benchmarks/flash_attn_overhead.py, calls between other torch operations). */
PyArrayObject *or_values(or_module_state *st, PyObject *obj, const char *func, const char *name)
{
    PyObject *torch;
    const int is_torch = torch_tensor(st, obj, &torch);
    Py_XDECREF(torch);
    if (is_torch < 0)
        return NULL;
    PyArrayObject *a = is_torch ? or_from_dlpack(st, obj, func, name, NULL)
                                : (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    return a ? a : or_unreadable(func, name, is_torch);
}

/* A result as a torch tensor over the same memory when `like` (the call's first operand) is a
 * torch tensor (torch in, torch out), else `a` itself; bfloat16 results, held as uint16 bits,
 * are viewed as torch.bfloat16. A new reference, or NULL with an exception. */
PyObject *or_result_like(or_module_state *st, PyObject *like, PyArrayObject *a, or_dtype dt)
{
    PyObject *torch;
    const int is_torch = torch_tensor(st, like, &torch);
    if (is_torch <= 0)
        return is_torch < 0 ? NULL : Py_NewRef(a);
    PyObject *t = PyObject_CallOneArg(TORCH(torch, T_FROM_NUMPY), (PyObject *)a);
    if (t != NULL && !or_dtypes[dt].numpy)
        Py_SETREF(t, PyObject_CallFunctionObjArgs(TORCH(torch, T_VIEW), t,
                                                  TORCH(torch, T_DTYPE + dt), NULL));
    Py_DECREF(torch);
    return t;
}
