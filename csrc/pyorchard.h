/* pyorchard.h - declarations shared by the Python-facing files of orchard_ops
 * (module.c, marshal.c, cpu_info.c, log.c). The kernels include orchard.h only. */
#ifndef ORCHARD_PY_H
#define ORCHARD_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL orchard_ARRAY_API
#ifndef ORCHARD_MODULE_C
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "orchard.h"

/* marshal.c */
PyArrayObject *or_operand(PyObject *obj, const char *func, const char *name, or_counters *ct,
                          size_t align);
void or_extent(PyArrayObject *a, char **lo, size_t *nbytes);
PyArrayObject *or_staged_copy(PyArrayObject *a, int typenum, size_t align);
PyArrayObject *or_new_aligned(int nd, const npy_intp *dims, int typenum, size_t align);
int or_dtype_of(PyArrayObject *a, or_dtype *dt);
or_ssize *or_lead_offsets(PyArrayObject *a, int nlead);
or_ssize *or_varlen_offsets(PyArrayObject *a, const int64_t *cu, or_ssize nseq, or_ssize heads,
                            int seq_axis, int head_axis);
PyObject *or_shape_str(PyArrayObject *a);

/* cpu_info.c */
PyObject *or_cpu_device_info(void);

/* devices.c */
typedef struct {
    int index;              /* 0 = native cpu, 1 + i = OpenCL device i */
    int automatic;          /* chosen by device=None/"auto" without ORCHARD_DEVICE: may fall back */
} or_device_choice;
int or_resolve_device(const char *func, PyObject *device, or_device_choice *out);
PyObject *or_device_id(int index);
PyObject *or_devices_list(void);
size_t or_device_align(int index);
int or_device_fp64(int index);
int or_device_tuned_blocks(int index, int *bq, int *bk);
int or_device_save_tuned_blocks(int index, int bq, int bk);

#endif
