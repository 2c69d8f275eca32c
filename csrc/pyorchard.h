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

/* Counters reported by stats(); only touched with the GIL held. */
typedef struct {
    long long fwd_calls, bwd_calls, zero_copy_buffers, staged_buffers, bytes_staged,
        kernel_builds, cache_hits;
} or_counters;

/* marshal.c */
PyArrayObject *or_operand(PyObject *obj, const char *func, const char *name, or_counters *ct);
int or_dtype_of(PyArrayObject *a, or_dtype *dt);
or_ssize *or_lead_offsets(PyArrayObject *a, int nlead);
or_ssize *or_varlen_offsets(PyArrayObject *a, const int64_t *cu, or_ssize nseq, or_ssize heads,
                            int seq_axis, int head_axis);
PyObject *or_shape_str(PyArrayObject *a);

/* cpu_info.c */
PyObject *or_cpu_device_info(void);

/* log.c */
int or_log_enabled(const char *env_name);
void or_log(const char *fmt, ...);

#endif
