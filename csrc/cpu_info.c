/* cpu_info.c - the facts devices() reports for the native CPU path, the choice of its kernel
 * set (native_isa.c) from Python and ORCHARD_ISA, and the check of the environment variables
 * that configure it (ORCHARD_ISA, ORCHARD_NUM_THREADS). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native.h"
#include "pyorchard.h"

/* The value of the first "key : value" line of /proc/cpuinfo, or `fallback`. */
static void cpuinfo_field(const char *key, char *out, size_t size, const char *fallback)
{
    snprintf(out, size, "%s", fallback);
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f == NULL)
        return;
    char line[512];
    size_t klen = strlen(key);
    while (fgets(line, sizeof(line), f) != NULL) {
        char *colon = strchr(line, ':');
        if (strncmp(line, key, klen) != 0 || colon == NULL)
            continue;
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        v[strcspn(v, "\n")] = '\0';
        snprintf(out, size, "%s", v);
        break;
    }
    fclose(f);
}

static const char *simd_level(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return "avx512";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "avx2";
    return "sse2";
#else
    return "portable";
#endif
}

/* The names of the kernel sets this CPU runs, narrowest first, as a tuple. */
static PyObject *isa_names(void)
{
    const or_kernels *sets[OR_MAX_KERNEL_SETS];
    const int n = or_native_isas(sets, OR_MAX_KERNEL_SETS);
    PyObject *names = PyTuple_New(n);
    for (int i = 0; names != NULL && i < n; i++) {
        PyObject *name = PyUnicode_FromString(sets[i]->name);
        if (name == NULL)
            Py_CLEAR(names);
        else
            PyTuple_SET_ITEM(names, i, name);
    }
    return names;
}

/* An ORCHARD_ISA the CPU cannot run: import goes on with the widest set (so that a console
 * script can report the variable in its one error line), and devices() and every call that
 * resolves a device raise, until set_native_isa() chooses a set. Used with the GIL held. */
static char bad_isa_env[128];

static int no_such_set(const char *what, const char *name)
{
    PyObject *names = isa_names();
    if (names != NULL) {
        PyErr_Format(PyExc_ValueError, "%s='%s': not a kernel set this CPU runs; expected one of %R",
                     what, name, names);
        Py_DECREF(names);
    }
    return -1;
}

int or_select_isa(const char *what, const char *name)
{
    if (or_set_native_isa(name) < 0)
        return no_such_set(what, name);
    bad_isa_env[0] = '\0';
    return 0;
}

void or_isa_from_environment(void)
{
    const char *isa = getenv("ORCHARD_ISA");
    if (isa != NULL && *isa != '\0' && or_set_native_isa(isa) < 0)
        snprintf(bad_isa_env, sizeof(bad_isa_env), "%s", isa);
}

int or_check_environment(void)
{
    if (bad_isa_env[0])
        return no_such_set("ORCHARD_ISA", bad_isa_env);
    const char *threads = or_bad_threads_env();
    if (threads != NULL) {
        PyErr_Format(PyExc_ValueError, "ORCHARD_NUM_THREADS='%s': not a thread count; expected "
                     "an integer in 1..%d", threads, OR_MAX_THREADS);
        return -1;
    }
    return 0;
}

PyObject *or_cpu_device_info(void)
{
    char name[256], vendor[128];
    cpuinfo_field("model name", name, sizeof(name), "CPU");
    cpuinfo_field("vendor_id", vendor, sizeof(vendor), "unknown");
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    long l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    PyObject *isas = isa_names();
    if (isas == NULL)
        return NULL;
    PyObject *info = Py_BuildValue(
        "{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:L, s:L, s:i, s:O, s:O, s:O, s:s, s:s, s:O, s:s}",
        "id", "cpu", "name", name, "vendor", vendor, "kind", "cpu", "backend", "native",
        "platform", "orchard native", "driver_version", ORCHARD_VERSION,
        "compute_units", or_cpu_count(),
        "global_mem_bytes", (long long)(pages > 0 && page > 0 ? pages * page : 0),
        "local_mem_bytes", (long long)(l1d > 0 ? l1d : 0),
        "max_work_group_size", 1,
        "fp16", Py_True, "fp64", Py_True, "unified_memory", Py_True,
        "simd", simd_level(), "kernel_isa", or_native_kernels()->name, "kernel_isas", isas,
        "thread_runtime", or_pool_runtime());
    Py_DECREF(isas);
    return info;
}
