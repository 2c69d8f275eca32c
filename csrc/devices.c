/* devices.c - the device registry: what devices() lists, what a `device=` string means, which
 * device "auto" picks, and the stats() counters of each.
 *
 * Index 0 is the native CPU path, index 1 + i the i-th OpenCL device (id "opencl:i").
 * Auto choice: ORCHARD_DEVICE when set, else the OpenCL GPU with the most compute units, else
 * the native path. CPUs through OpenCL (PoCL) are never chosen automatically: on the machines
 * measured (README, Performance) the native path is faster on the same cores.
 * ORCHARD_AUTO_ANY_OPENCL=1 lets auto consider OpenCL devices of every kind: a test hook
 * (builds with ORCHARD_TEST_HOOKS=1 only), so that the fallback of an automatically chosen
 * device can be exercised on PoCL where no GPU is present.
 */
#include <ctype.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cl_runtime.h"
#include "pyorchard.h"

/* The native path's counters apart, so that a device="cpu" call never loads OpenCL (its
 * library, a CPU driver's threads and signal handlers, what a fork()ed child cannot use). */
static or_counters native_counters;
static or_counters *cl_counters;    /* one per OpenCL device (and a spare, so that calloc is
                                       never asked for 0), for the life of the process */
static int ndevices = 1;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void)
{
#ifdef ORCHARD_HAVE_OPENCL
    ndevices = 1 + or_cl_count();
#endif
    cl_counters = calloc((size_t)ndevices, sizeof(or_counters));
    if (cl_counters == NULL)
        abort();    /* a few dozen bytes at import time: nothing sensible is left to do */
}

int or_device_count(void)
{
    pthread_once(&once, init);
    return ndevices;
}

or_counters *or_device_counters(int device)
{
    if (device == 0)
        return &native_counters;
    or_device_count();
    return &cl_counters[device - 1];
}

#ifdef ORCHARD_HAVE_OPENCL
static const or_cl_info *cl_info(int index) { return or_cl_info_get(index - 1); }
#endif

size_t or_device_align(int index)
{
#ifdef ORCHARD_HAVE_OPENCL
    if (index > 0)
        return cl_info(index)->base_align;
#endif
    return 1;       /* the native path only needs aligned elements, which NumPy reports */
}

int or_device_fp64(int index)
{
#ifdef ORCHARD_HAVE_OPENCL
    if (index > 0)
        return cl_info(index)->fp64;
#endif
    return 1;
}

/* OR_EDEVICE, the sentence in err, while an ORCHARD_CL_* variable stops OpenCL device index's
 * calls (cl_runtime.c or_cl_environment_problem); OR_OK otherwise and for the native path. */
int or_device_environment(int index, or_error *err)
{
#ifdef ORCHARD_HAVE_OPENCL
    if (index > 0 && or_cl_environment_problem(err->msg, sizeof(err->msg)))
        return OR_EDEVICE;
#endif
    return OR_OK;
}

/* The tuned block sizes of an OpenCL device (cl_runtime.c); 0 for none, or the native path. */
int or_device_tuned_blocks(int index, int *bq, int *bk)
{
#ifdef ORCHARD_HAVE_OPENCL
    if (index > 0)
        return or_cl_tuned_blocks(index - 1, bq, bk);
#endif
    return 0;
}

int or_device_save_tuned_blocks(int index, int bq, int bk)
{
#ifdef ORCHARD_HAVE_OPENCL
    if (index > 0)
        return or_cl_save_tuned_blocks(index - 1, bq, bk);
#endif
    return 0;
}

int or_device_program_blocks(int index, int d, const char **family, int *bq, int *bk,
                             or_error *err)
{
#ifdef ORCHARD_HAVE_OPENCL
    or_cl_program prog;
    const int rc = or_cl_get_program(index - 1, OR_F32, d, d, or_device_counters(index), &prog,
                                     err);
    if (rc == OR_OK) {
        *family = or_cl_families[prog.family].name;
        *bq = prog.bq;
        *bk = prog.bk;
    }
    return rc;
#else
    snprintf(err->msg, sizeof(err->msg), "orchard_ops was built without OpenCL headers");
    return OR_EDEVICE;
#endif
}

PyObject *or_device_id(int index)
{
    return index == 0 ? PyUnicode_FromString("cpu") : PyUnicode_FromFormat("opencl:%d", index - 1);
}

static int contains_nocase(const char *hay, const char *needle)
{
    size_t n = strlen(needle);
    for (; *hay; hay++)
        if (strncasecmp(hay, needle, n) == 0)
            return 1;
    return n == 0;
}

#ifdef ORCHARD_HAVE_OPENCL
/* How an OpenCL device ranks for "opencl": a real device above a simulator (Oclgrind calls
 * itself a GPU, and runs a call thousands of times slower), a GPU above any other kind. */
static int cl_rank(const or_cl_info *in)
{
    return (contains_nocase(in->platform, "oclgrind") ? 0 : 2) + (strcmp(in->kind, "gpu") == 0);
}
#endif

/* The best OpenCL device for "opencl" (highest cl_rank, then the most compute units), or
 * with gpus_only the best real GPU (-1: none). */
static int best_opencl(int gpus_only)
{
    int best = -1;
#ifdef ORCHARD_HAVE_OPENCL
    for (int d = 1; d < or_device_count(); d++) {
        const or_cl_info *in = cl_info(d), *b = best > 0 ? cl_info(best) : NULL;
        const int rank = cl_rank(in);
        if (gpus_only && rank != 3)
            continue;
        if (b == NULL || rank > cl_rank(b)
            || (rank == cl_rank(b) && in->compute_units > b->compute_units))
            best = d;
    }
#endif
    return best;
}

/* The index a device string names, or -1. */
static int lookup(const char *s)
{
    if (strcmp(s, "cpu") == 0)
        return 0;
    if (strcmp(s, "opencl") == 0)
        return best_opencl(0);
    if (strncmp(s, "opencl:", 7) != 0 || s[7] == '\0')
        return -1;
    const char *rest = s + 7;
    char *end;
    long n = strtol(rest, &end, 10);
    if (*end == '\0' && isdigit((unsigned char)rest[0]))
        return n >= 0 && n < or_device_count() - 1 ? (int)n + 1 : -1;
#ifdef ORCHARD_HAVE_OPENCL
    for (int d = 1; d < or_device_count(); d++)     /* a name, as PYOPENCL_CTX takes */
        if (contains_nocase(cl_info(d)->name, rest) || contains_nocase(cl_info(d)->platform, rest))
            return d;
#endif
    return -1;
}

static PyObject *available_ids(void)
{
    PyObject *ids = PyList_New(0);
    for (int d = 0; ids != NULL && d < or_device_count(); d++) {
        PyObject *id = or_device_id(d);
        if (id == NULL || PyList_Append(ids, id) < 0)
            Py_CLEAR(ids);
        Py_XDECREF(id);
    }
    return ids;
}

/* Why no OpenCL device is listed (no library, no platform, a bad ORCHARD_OPENCL_LIBRARY...),
 * or NULL when some are. */
const char *or_opencl_unavailable(void)
{
#ifdef ORCHARD_HAVE_OPENCL
    return or_cl_unavailable_reason();
#else
    return "this orchard_ops was built without the OpenCL backend (no CL/cl.h at build time)";
#endif
}

static int unknown_device(const char *func, const char *what, const char *name)
{
    PyObject *ids = available_ids();
    const char *why = strncasecmp(name, "opencl", 6) == 0 ? or_opencl_unavailable() : NULL;
    if (ids != NULL)
        PyErr_Format(PyExc_ValueError, "%s(): %s '%s' is not an available device (available: "
                     "%S)%s%s", func, what, name, ids, why ? "; no OpenCL device: " : "",
                     why ? why : "");
    Py_XDECREF(ids);
    return -1;
}

int or_resolve_device(const char *func, PyObject *device, or_device_choice *out)
{
    out->automatic = 0;
    if (or_check_environment() < 0)
        return -1;
    if (device != Py_None && !PyUnicode_Check(device)) {
        PyErr_Format(PyExc_TypeError, "%s(): 'device' must be a str or None, not %.100s", func,
                     Py_TYPE(device)->tp_name);
        return -1;
    }
    const char *name = device == Py_None ? "auto" : or_text_arg(func, "'device'", device);
    if (name == NULL)
        return -1;
    if (strcmp(name, "auto") != 0) {
        out->index = lookup(name);
        return out->index >= 0 ? 0 : unknown_device(func, "'device'", name);
    }
    const char *env = getenv("ORCHARD_DEVICE");
    if (env != NULL && env[0] != '\0' && strcmp(env, "auto") != 0) {
        out->index = lookup(env);
        return out->index >= 0 ? 0 : unknown_device(func, "ORCHARD_DEVICE", env);
    }
    int gpus_only = 1;
#ifdef ORCHARD_TEST_HOOKS
    gpus_only = !or_env_flag("ORCHARD_AUTO_ANY_OPENCL");
#endif
    int best = best_opencl(gpus_only);
    out->index = best > 0 ? best : 0;
    out->automatic = 1;
    return 0;
}

#ifdef ORCHARD_HAVE_OPENCL
/* The kernel family an OpenCL device runs, the blocks orchard-tune times for it (None and
 * an empty list while ORCHARD_CL_FAMILY names no family), and the ORCHARD_CL_* variable that
 * stops its calls (environment_error: a sentence, or None). */
static int add_family(PyObject *item, int cl_index)
{
    const int f = or_cl_family_of(cl_index);
    PyObject *name = f < 0 ? Py_None : PyUnicode_FromString(or_cl_families[f].name), *blocks;
    if (f < 0) {
        Py_INCREF(name);
        blocks = PyList_New(0);
    } else {
        const int(*c)[2] = or_cl_families[f].candidates;
        const int n = (int)(sizeof(or_cl_families[f].candidates) / sizeof(*c));
        blocks = PyList_New(n);
        for (int i = 0; blocks != NULL && i < n; i++) {
            PyObject *pair = Py_BuildValue("(ii)", c[i][0], c[i][1]);
            if (pair == NULL)
                Py_CLEAR(blocks);
            else
                PyList_SET_ITEM(blocks, i, pair);
        }
    }
    char msg[256];
    PyObject *problem = or_cl_environment_problem(msg, sizeof(msg)) ? PyUnicode_FromString(msg)
                                                                     : Py_NewRef(Py_None);
    int rc = name && blocks && problem ? PyDict_SetItemString(item, "kernel_family", name) : -1;
    if (rc == 0)
        rc = PyDict_SetItemString(item, "block_candidates", blocks);
    if (rc == 0)
        rc = PyDict_SetItemString(item, "environment_error", problem);
    Py_XDECREF(name);
    Py_XDECREF(blocks);
    Py_XDECREF(problem);
    return rc;
}
#endif

/* devices(): the native CPU, then every OpenCL device. */
PyObject *or_devices_list(void)
{
    if (or_check_environment() < 0)
        return NULL;
    PyObject *list = PyList_New(0), *item = NULL;
    if (list == NULL)
        return NULL;
    item = or_cpu_device_info();
    if (item == NULL || PyList_Append(list, item) < 0)
        goto fail;
    Py_CLEAR(item);
#ifdef ORCHARD_HAVE_OPENCL
    for (int d = 1; d < or_device_count(); d++) {
        const or_cl_info *in = cl_info(d);
        PyObject *id = or_device_id(d);
        if (id == NULL)
            goto fail;
        item = Py_BuildValue(
            "{s:N, s:s, s:s, s:s, s:s, s:s, s:s, s:I, s:K, s:K, s:K, s:n, s:O, s:O, s:O, s:O, s:s, s:n}",
            "id", id, "name", in->name, "vendor", in->vendor, "kind", in->kind,
            "backend", "opencl", "platform", in->platform, "driver_version", in->driver,
            "compute_units", in->compute_units, "global_mem_bytes", in->global_mem,
            "local_mem_bytes", in->local_mem, "max_alloc_bytes", in->max_alloc,
            "max_work_group_size", (Py_ssize_t)in->max_work_group,
            "fp16", in->fp16 ? Py_True : Py_False, "fp64", in->fp64 ? Py_True : Py_False,
            "unified_memory", in->unified ? Py_True : Py_False,
            "subgroups", in->subgroups ? Py_True : Py_False, "opencl_version", in->version,
            "mem_base_addr_align", (Py_ssize_t)in->base_align);
        if (item == NULL || add_family(item, d - 1) < 0 || PyList_Append(list, item) < 0)
            goto fail;
        Py_CLEAR(item);
    }
#endif
    return list;
fail:
    Py_XDECREF(item);
    Py_DECREF(list);
    return NULL;
}
