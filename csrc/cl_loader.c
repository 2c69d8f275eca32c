/* cl_loader.c - finds the OpenCL ICD loader at run time (see cl_api.h).
 *
 * Order: a runtime already in the process (a preloaded one such as Oclgrind's, so
 * `oclgrind python ...` checks our kernels), then the library named by ORCHARD_OPENCL_LIBRARY,
 * else libOpenCL.so.1 and libOpenCL.so. A missing library or entry point means "no OpenCL".
 * In a build with ORCHARD_TEST_HOOKS, once the table is filled, ORCHARD_FAULT may wrap some
 * of its entries (cl_fault.c); a malformed ORCHARD_FAULT disables OpenCL and says why on
 * stderr, rather than run a test without the faults it asked for.
 */
#ifdef ORCHARD_HAVE_OPENCL
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cl_api.h"

static or_cl_api api;
static const or_cl_api *loaded;
static const char *load_error = "not loaded";
static char named_error[600];       /* load_error naming ORCHARD_OPENCL_LIBRARY's value */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int fill(void *handle)
{
#define OR_CL_SYM(name)                                                                      \
    if ((api.name = (__typeof__(api.name))dlsym(handle, #name)) == NULL)                     \
        return -1;
    OR_CL_FUNCTIONS(OR_CL_SYM)
#undef OR_CL_SYM
    return 0;
}

static void find(void)
{
    const char *env = getenv("ORCHARD_OPENCL_LIBRARY");
    if (env != NULL && env[0] == '\0')
        env = NULL;                 /* empty: unset, as every other variable */
    if (env == NULL && fill(RTLD_DEFAULT) == 0) {
        loaded = &api;
        return;
    }
    const char *names[] = {env, env ? NULL : "libOpenCL.so.1", env ? NULL : "libOpenCL.so"};
    for (int i = 0; i < 3; i++) {
        if (names[i] == NULL)
            continue;
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h == NULL && env != NULL) {
            const char *why = dlerror();
            snprintf(named_error, sizeof(named_error),
                     "ORCHARD_OPENCL_LIBRARY='%.200s' cannot be opened (%.300s)", env,
                     why ? why : "dlopen failed");
            load_error = named_error;
        } else if (h == NULL) {
            load_error = "the OpenCL ICD loader (libOpenCL.so.1) was not found";
        } else if (fill(h) == 0) {
            loaded = &api;
            return;
        } else {
            if (env != NULL)
                snprintf(named_error, sizeof(named_error), "ORCHARD_OPENCL_LIBRARY='%.200s' "
                         "lacks OpenCL 1.2 entry points", env);
            load_error = env != NULL ? named_error
                                     : "the OpenCL library lacks OpenCL 1.2 entry points";
            dlclose(h);
        }
    }
}

static void load(void)
{
    find();
#ifdef ORCHARD_TEST_HOOKS
    if (loaded != NULL && or_cl_fault_install(&api, &load_error) < 0) {
        loaded = NULL;
        fprintf(stderr, "orchard: %s; OpenCL is disabled\n", load_error);
    }
#endif
}

const or_cl_api *or_cl_load(const char **why)
{
    pthread_once(&once, load);
    if (why != NULL)
        *why = loaded ? NULL : load_error;
    return loaded;
}
#endif
