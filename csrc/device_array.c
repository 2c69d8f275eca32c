/* device_array.c - DeviceArray: an array held in an OpenCL device's own memory.
 *
 * to_device(array, device) copies a C-contiguous image of the array into a buffer of the
 * device (CL_MEM_READ_WRITE, owned by the object); .numpy() copies it back into a new array.
 * The attention functions take DeviceArray operands in place and then return their results
 * as DeviceArrays on the same device, so a chain of calls crosses the host bus only where the
 * caller asks it to. Layout: C-contiguous, shape (d0, ..., d{nd-1}), one of the dtypes of
 * dtypes.h; a buffer of nbytes = product(shape) * itemsize bytes (none when that is 0).
 *
 * The argument checks and per-unit tables (args.c, problem.c) read shapes and strides from
 * NumPy arrays. A DeviceArray operand appears there as its layout: a NumPy array of its shape,
 * dtype and C strides whose data pointer is `anchor` below, memory nothing reads or writes
 * (the kernels get the cl_mem through or_view.mem, and the offsets computed from the layout).
 */
#include <stdio.h>

#include "cl_runtime.h"
#include "pyorchard.h"

typedef struct {
    PyObject_HEAD
    int device;                 /* device index (1 + OpenCL index; devices.c) */
    or_dtype dtype;
    int nd;
    npy_intp dims[NPY_MAXDIMS];
    size_t nbytes;
    void *mem;                  /* its cl_mem; NULL when nbytes is 0 */
    const void *api;            /* the or_cl_api that made it, to release it without the
                                   device's lock (held while programs build) */
} device_array;

static _Alignas(64) char anchor[64];   /* the data pointer of layouts: never dereferenced */

/* ------------------------------------------------------------------ buffers */

#ifdef ORCHARD_HAVE_OPENCL
/* A buffer of nbytes for `what` on device index `device`, filled from host when it is not
 * NULL. */
static int buffer_new(int device, const char *what, size_t nbytes, const void *host, void **mem,
                      const void **api_out, or_error *err)
{
    or_cl_queue_t cq;
    int rc = or_cl_queue(device - 1, &cq, err);
    if (rc != OR_OK)
        return rc;
    cl_mem_flags flags = CL_MEM_READ_WRITE | (host ? CL_MEM_COPY_HOST_PTR : 0);
    *api_out = cq.api;
    return or_cl_new_buffer(cq.api, cq.ctx, or_cl_info_get(device - 1), flags, nbytes,
                            (void *)host, what, (cl_mem *)mem, err);
}

/* OR_OK where device index `device` can hold nbytes in one buffer: asked before a host copy
 * is made for it. */
static int buffer_fits(int device, const char *what, size_t nbytes, or_error *err)
{
    const or_cl_info *in = or_cl_info_get(device - 1);
    return or_cl_buffer_fits(in, nbytes)
               ? OR_OK : or_cl_buffer_fail(err, CL_INVALID_BUFFER_SIZE, what, nbytes, in);
}

static int buffer_read(int device, void *mem, size_t nbytes, void *host, or_error *err)
{
    or_cl_queue_t cq;
    int rc = or_cl_queue(device - 1, &cq, err);
    if (rc != OR_OK)
        return rc;
    cl_int code = cq.api->clEnqueueReadBuffer(cq.queue, (cl_mem)mem, CL_TRUE, 0, nbytes, host, 0,
                                              NULL, NULL);
    return code == CL_SUCCESS ? OR_OK : or_cl_fail(err, code, "clEnqueueReadBuffer");
}

static void buffer_free(const void *api, void *mem)
{
    if (!or_cl_forked())    /* a forked child's copy of the parent's buffer: left alone */
        ((const or_cl_api *)api)->clReleaseMemObject((cl_mem)mem);
}
#else
/* built without OpenCL there is no device to name, so no DeviceArray is ever made */
static int no_opencl(or_error *err)
{
    snprintf(err->msg, sizeof(err->msg), "orchard_ops was built without OpenCL headers");
    return OR_EDEVICE;
}
static int buffer_new(int device, const char *what, size_t nbytes, const void *host, void **mem,
                      const void **api_out, or_error *err)
{
    return no_opencl(err);
}
static int buffer_fits(int device, const char *what, size_t nbytes, or_error *err)
{
    return no_opencl(err);
}
static int buffer_read(int device, void *mem, size_t nbytes, void *host, or_error *err)
{
    return no_opencl(err);
}
static void buffer_free(const void *api, void *mem) {}
#endif

/* ------------------------------------------------------------------ the object */

/* A DeviceArray of this shape and dtype on device index `device`, its buffer filled from
 * host (C-contiguous, nbytes) or left for kernels to write (host NULL). func names the
 * caller in errors, what the array. */
static PyObject *device_array_new(or_module_state *st, const char *func, const char *what,
                                  int device, int nd,
                                  const npy_intp *dims, or_dtype dt, const void *host)
{
    device_array *a = PyObject_New(device_array, st->device_array);
    if (a == NULL)
        return NULL;
    a->device = device;
    a->dtype = dt;
    a->nd = nd;
    a->nbytes = (size_t)or_dtypes[dt].itemsize;
    for (int i = 0; i < nd; i++) {
        a->dims[i] = dims[i];
        a->nbytes *= (size_t)dims[i];       /* cannot overflow: a host array this size exists */
    }
    a->mem = NULL;
    a->api = NULL;
    if (a->nbytes == 0)
        return (PyObject *)a;
    or_error err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = buffer_new(device, what, a->nbytes, host, &a->mem, &a->api, &err);
    Py_END_ALLOW_THREADS
    if (rc != OR_OK) {
        Py_DECREF(a);
        return or_device_error(st, func, device, &err);
    }
    return (PyObject *)a;
}

static void device_array_dealloc(PyObject *self)
{
    device_array *a = (device_array *)self;
    PyTypeObject *type = Py_TYPE(self);
    if (a->mem != NULL)
        buffer_free(a->api, a->mem);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyObject *shape_tuple(const device_array *a)
{
    PyObject *t = PyTuple_New(a->nd);
    for (int i = 0; t != NULL && i < a->nd; i++) {
        PyObject *n = PyLong_FromSsize_t(a->dims[i]);
        if (n == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, i, n);
    }
    return t;
}

static PyObject *get_shape(PyObject *self, void *unused)
{
    return shape_tuple((device_array *)self);
}

static PyObject *get_dtype(PyObject *self, void *unused)
{
    return PyUnicode_FromString(or_dtypes[((device_array *)self)->dtype].name);
}

static PyObject *get_device(PyObject *self, void *unused)
{
    return or_device_id(((device_array *)self)->device);
}

static PyObject *get_nbytes(PyObject *self, void *unused)
{
    return PyLong_FromSize_t(((device_array *)self)->nbytes);
}

static PyObject *device_array_repr(PyObject *self)
{
    device_array *a = (device_array *)self;
    PyObject *shape = shape_tuple(a), *id = or_device_id(a->device), *r = NULL;
    if (shape != NULL && id != NULL)
        r = PyUnicode_FromFormat("DeviceArray(shape=%R, dtype=%s, device=%R)", shape,
                                 or_dtypes[a->dtype].name, id);
    Py_XDECREF(shape);
    Py_XDECREF(id);
    return r;
}

PyDoc_STRVAR(numpy_doc,
"numpy() -> a new C-contiguous NumPy array holding a copy of the device memory (bfloat16\n"
"comes back as its uint16 bits: NumPy has no bfloat16).");

static PyObject *device_array_numpy(PyObject *self, PyObject *unused)
{
    device_array *a = (device_array *)self;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(a->nd, a->dims,
                                                            or_dtypes[a->dtype].typenum);
    if (out == NULL || a->nbytes == 0)
        return (PyObject *)out;
    or_error err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = buffer_read(a->device, a->mem, a->nbytes, PyArray_DATA(out), &err);
    Py_END_ALLOW_THREADS
    if (rc != OR_OK) {
        Py_DECREF(out);
        return or_device_error(PyType_GetModuleState(Py_TYPE(self)), "numpy", a->device, &err);
    }
    or_counters *ct = or_device_counters(a->device);
    OR_COUNT(ct, device_to_host, 1);
    OR_COUNT(ct, device_to_host_bytes, a->nbytes);
    return (PyObject *)out;
}

static PyGetSetDef getset[] = {
    {"shape", get_shape, NULL, "tuple of ints", NULL},
    {"dtype", get_dtype, NULL, "'float16', 'float32', 'float64' or 'bfloat16'", NULL},
    {"device", get_device, NULL, "the id of the device holding it, 'opencl:N'", NULL},
    {"nbytes", get_nbytes, NULL, "bytes of device memory: product(shape) * itemsize", NULL},
    {NULL},
};

static PyMethodDef methods[] = {
    {"numpy", device_array_numpy, METH_NOARGS, numpy_doc},
    {NULL},
};

PyDoc_STRVAR(device_array_doc,
"An array in an OpenCL device's memory, made by to_device(array, device) or returned by an\n"
"attention call whose operands are DeviceArrays; .numpy() copies it back. Its buffer is\n"
"released with the object.");

static PyType_Slot slots[] = {
    {Py_tp_dealloc, device_array_dealloc},
    {Py_tp_repr, device_array_repr},
    {Py_tp_getset, getset},
    {Py_tp_methods, methods},
    {Py_tp_doc, (void *)device_array_doc},
    {0, NULL},
};

static PyType_Spec spec = {
    .name = "orchard_ops.DeviceArray",
    .basicsize = sizeof(device_array),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = slots,
};

PyTypeObject *or_device_array_type(PyObject *module)
{
    return (PyTypeObject *)PyType_FromModuleAndSpec(module, &spec, NULL);
}

/* ------------------------------------------------------------------ to_device */

PyObject *or_to_device(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"array", "device", NULL};
    PyObject *obj, *device;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:to_device", kwlist, &obj, &device))
        return NULL;
    or_module_state *st = PyModule_GetState(module);
    if (Py_IS_TYPE(obj, st->device_array)) {
        PyErr_Format(PyExc_TypeError, "to_device(): argument 'array' is already a DeviceArray "
                     "(%R); .numpy() brings it to the host", obj);
        return NULL;
    }
    or_device_choice choice;
    if (or_resolve_device("to_device", device, &choice) < 0)
        return NULL;
    if (choice.index == 0) {
        PyErr_Format(PyExc_ValueError, "to_device(): 'device' must name an OpenCL device, not "
                     "%R (the native path reads host arrays)", device);
        return NULL;
    }
    or_counters *ct = or_device_counters(choice.index);
    or_dtype dt;
    int copied;
    PyArrayObject *a = or_operand_view(st, obj, "to_device", "array", &dt, &copied);
    if (a == NULL)
        return NULL;
    or_error err = {0};
    if (buffer_fits(choice.index, "'array'", (size_t)PyArray_NBYTES(a), &err) != OR_OK) {
        Py_DECREF(a);
        return or_device_error(st, "to_device", choice.index, &err);
    }
    a = or_stage(a, PyArray_TYPE(a), "to_device", "array", ct, or_device_align(choice.index));
    if (a != NULL && !PyArray_IS_C_CONTIGUOUS(a))  /* a strided view: its C-order image */
        Py_SETREF(a, (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER));
    if (a == NULL)
        return NULL;
    PyObject *r = device_array_new(st, "to_device", "'array'", choice.index,
                                   PyArray_NDIM(a), PyArray_DIMS(a), dt, PyArray_DATA(a));
    if (r != NULL && PyArray_NBYTES(a) > 0) {   /* an empty array crosses nothing (.numpy()) */
        OR_COUNT(ct, host_to_device, 1);
        OR_COUNT(ct, host_to_device_bytes, PyArray_NBYTES(a));
    }
    Py_DECREF(a);
    return r;
}

/* ------------------------------------------------------------------ attention operands */

int or_device_array_index(or_module_state *st, PyObject *obj)
{
    return Py_IS_TYPE(obj, st->device_array) ? ((device_array *)obj)->device : -1;
}

PyArrayObject *or_device_array_layout(PyObject *obj, or_dtype *dt)
{
    device_array *a = (device_array *)obj;
    *dt = a->dtype;
    return (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, PyArray_DescrFromType(or_dtypes[a->dtype].typenum), a->nd, a->dims, NULL,
        anchor, 0, NULL);
}

void *or_device_array_mem(PyObject *obj)
{
    return ((device_array *)obj)->mem;
}

/* A result of a resident call: a DeviceArray on the call's device, and its layout. */
int or_device_output(or_call *c, int slot, int nd, const npy_intp *shape, or_dtype dt)
{
    static const char *const names[OR_NSLOTS] = OR_SLOT_NAMES;
    char what[32];
    snprintf(what, sizeof(what), "'%s'", names[slot]);
    c->dev[slot] = device_array_new(c->st, c->func, what, c->device.index, nd, shape, dt, NULL);
    if (c->dev[slot] == NULL)
        return -1;
    c->arr[slot] = or_device_array_layout(c->dev[slot], &c->dt[slot]);
    return c->arr[slot] ? 0 : -1;
}
