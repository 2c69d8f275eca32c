/* cl_loader.c - finds the OpenCL ICD loader at run time (see cl_api.h).
 *
 * Order: a runtime already in the process (a preloaded one such as Oclgrind's, so
 * `oclgrind python ...` checks our kernels), then the library named by ORCHARD_OPENCL_LIBRARY,
 * else libOpenCL.so.1 and libOpenCL.so. A missing library or entry point means "no OpenCL".
 * Once the table is filled, ORCHARD_FAULT may wrap some of its entries (cl_fault.c); a
 * malformed ORCHARD_FAULT disables OpenCL and says why on stderr, rather than run a test
 * without the faults it asked for.
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
    if (env == NULL && fill(RTLD_DEFAULT) == 0) {
        loaded = &api;
        return;
    }
    const char *names[] = {env, env ? NULL : "libOpenCL.so.1", env ? NULL : "libOpenCL.so"};
    for (int i = 0; i < 3; i++) {
        if (names[i] == NULL)
            continue;
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            load_error = "the OpenCL ICD loader (libOpenCL.so.1) was not found";
            continue;
        }
        if (fill(h) == 0) {
            loaded = &api;
            return;
        }
        load_error = "the OpenCL library lacks OpenCL 1.2 entry points";
        dlclose(h);
    }
}

static void load(void)
{
    find();
    if (loaded != NULL && or_cl_fault_install(&api, &load_error) < 0) {
        loaded = NULL;
        fprintf(stderr, "orchard: %s; OpenCL is disabled\n", load_error);
    }
}

const or_cl_api *or_cl_load(const char **why)
{
    pthread_once(&once, load);
    if (why != NULL)
        *why = loaded ? NULL : load_error;
    return loaded;
}

const char *or_cl_error_name(cl_int err)
{
    switch (err) {
#define N(x) case x: return #x;
    N(CL_SUCCESS) N(CL_DEVICE_NOT_FOUND) N(CL_DEVICE_NOT_AVAILABLE) N(CL_COMPILER_NOT_AVAILABLE)
    N(CL_MEM_OBJECT_ALLOCATION_FAILURE) N(CL_OUT_OF_RESOURCES) N(CL_OUT_OF_HOST_MEMORY)
    N(CL_PROFILING_INFO_NOT_AVAILABLE) N(CL_MEM_COPY_OVERLAP) N(CL_IMAGE_FORMAT_MISMATCH)
    N(CL_IMAGE_FORMAT_NOT_SUPPORTED) N(CL_BUILD_PROGRAM_FAILURE) N(CL_MAP_FAILURE)
    N(CL_MISALIGNED_SUB_BUFFER_OFFSET) N(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
    N(CL_COMPILE_PROGRAM_FAILURE) N(CL_LINKER_NOT_AVAILABLE) N(CL_LINK_PROGRAM_FAILURE)
    N(CL_DEVICE_PARTITION_FAILED) N(CL_KERNEL_ARG_INFO_NOT_AVAILABLE) N(CL_INVALID_VALUE)
    N(CL_INVALID_DEVICE_TYPE) N(CL_INVALID_PLATFORM) N(CL_INVALID_DEVICE) N(CL_INVALID_CONTEXT)
    N(CL_INVALID_QUEUE_PROPERTIES) N(CL_INVALID_COMMAND_QUEUE) N(CL_INVALID_HOST_PTR)
    N(CL_INVALID_MEM_OBJECT) N(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR) N(CL_INVALID_IMAGE_SIZE)
    N(CL_INVALID_SAMPLER) N(CL_INVALID_BINARY) N(CL_INVALID_BUILD_OPTIONS) N(CL_INVALID_PROGRAM)
    N(CL_INVALID_PROGRAM_EXECUTABLE) N(CL_INVALID_KERNEL_NAME) N(CL_INVALID_KERNEL_DEFINITION)
    N(CL_INVALID_KERNEL) N(CL_INVALID_ARG_INDEX) N(CL_INVALID_ARG_VALUE) N(CL_INVALID_ARG_SIZE)
    N(CL_INVALID_KERNEL_ARGS) N(CL_INVALID_WORK_DIMENSION) N(CL_INVALID_WORK_GROUP_SIZE)
    N(CL_INVALID_WORK_ITEM_SIZE) N(CL_INVALID_GLOBAL_OFFSET) N(CL_INVALID_EVENT_WAIT_LIST)
    N(CL_INVALID_EVENT) N(CL_INVALID_OPERATION) N(CL_INVALID_GL_OBJECT)
    N(CL_INVALID_BUFFER_SIZE) N(CL_INVALID_MIP_LEVEL) N(CL_INVALID_GLOBAL_WORK_SIZE)
    N(CL_INVALID_PROPERTY) N(CL_INVALID_IMAGE_DESCRIPTOR) N(CL_INVALID_COMPILER_OPTIONS)
    N(CL_INVALID_LINKER_OPTIONS) N(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef N
    default: return "CL_UNKNOWN_ERROR";
    }
}
#endif
