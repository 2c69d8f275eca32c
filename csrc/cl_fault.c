/* cl_fault.c - fault injection: ORCHARD_FAULT makes chosen OpenCL calls fail, so tests can
 * show that every failure becomes the documented exception, leaks nothing, and that the
 * device works again afterwards.
 *
 *   ORCHARD_FAULT="clCreateBuffer:3"                  the 3rd clCreateBuffer of the process fails
 *   ORCHARD_FAULT="clBuildProgram:1,clFinish:2+"      N+ = the Nth use and every later one
 *   ORCHARD_FAULT="clEnqueueMapBuffer:1:CL_OUT_OF_HOST_MEMORY"   another error code
 *
 * The loader (cl_loader.c) hands its function table to or_cl_fault_install, which replaces the
 * named entries with wrappers that count their calls and fail instead of calling the driver
 * when their turn comes; every call site goes through the table, so none of them changes.
 * A failing call returns what the driver would: NULL with *errcode_ret set, or the code. Each
 * call has a default code of its kind: allocation -> CL_MEM_OBJECT_ALLOCATION_FAILURE or
 * CL_OUT_OF_RESOURCES/CL_OUT_OF_HOST_MEMORY, build -> CL_BUILD_PROGRAM_FAILURE, enqueue ->
 * CL_OUT_OF_RESOURCES, map -> CL_MAP_FAILURE.
 *
 * A test hook: compiled in only when setup.py runs with ORCHARD_TEST_HOOKS=1.
 */
#if defined(ORCHARD_HAVE_OPENCL) && defined(ORCHARD_TEST_HOOKS)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cl_api.h"

/* The calls that can be made to fail, with their default error. */
#define OR_CL_FAULTS(X)                                                                      \
    X(clCreateContext, CL_OUT_OF_HOST_MEMORY)                                                \
    X(clCreateCommandQueue, CL_OUT_OF_RESOURCES)                                             \
    X(clCreateProgramWithSource, CL_OUT_OF_HOST_MEMORY)                                      \
    X(clCreateProgramWithBinary, CL_OUT_OF_HOST_MEMORY)                                      \
    X(clBuildProgram, CL_BUILD_PROGRAM_FAILURE)                                              \
    X(clCreateKernel, CL_OUT_OF_RESOURCES)                                                   \
    X(clSetKernelArg, CL_OUT_OF_RESOURCES)                                                   \
    X(clGetKernelWorkGroupInfo, CL_OUT_OF_RESOURCES)                                         \
    X(clCreateBuffer, CL_MEM_OBJECT_ALLOCATION_FAILURE)                                      \
    X(clEnqueueWriteBuffer, CL_OUT_OF_RESOURCES)                                             \
    X(clEnqueueReadBuffer, CL_OUT_OF_RESOURCES)                                              \
    X(clEnqueueMapBuffer, CL_MAP_FAILURE)                                                    \
    X(clEnqueueUnmapMemObject, CL_OUT_OF_RESOURCES)                                          \
    X(clEnqueueNDRangeKernel, CL_OUT_OF_RESOURCES)                                           \
    X(clFinish, CL_OUT_OF_RESOURCES)

enum {
#define OR_FAULT_ENUM(name, code) F_##name,
    OR_CL_FAULTS(OR_FAULT_ENUM)
#undef OR_FAULT_ENUM
    NFAULTS
};

static const char *const fault_names[NFAULTS] = {
#define OR_FAULT_NAME(name, code) #name,
    OR_CL_FAULTS(OR_FAULT_NAME)
#undef OR_FAULT_NAME
};

typedef struct {
    long long at;           /* the use that fails (1-based); 0 = never */
    int sticky;             /* "N+": that use and every later one */
    cl_int code;
    long long calls;        /* uses so far, counted atomically: calls come from any thread */
} fault_t;

static fault_t faults[NFAULTS];
static or_cl_api real;      /* the driver's entry points, which the wrappers call */

/* 1 if this use of call f is to fail; *code is then its error. */
static int trips(int f, cl_int *code)
{
    const fault_t *ft = &faults[f];
    if (ft->at == 0)
        return 0;
    long long n = __atomic_add_fetch(&faults[f].calls, 1, __ATOMIC_RELAXED);
    *code = ft->code;
    return ft->sticky ? n >= ft->at : n == ft->at;
}

/* Object-creating calls report through errcode_ret, which callers may pass as NULL. */
#define FAIL_OBJECT(f)                                                                       \
    do {                                                                                     \
        cl_int code_;                                                                        \
        if (trips(F_##f, &code_)) {                                                          \
            if (errcode_ret != NULL)                                                         \
                *errcode_ret = code_;                                                        \
            return NULL;                                                                     \
        }                                                                                    \
    } while (0)

#define FAIL_STATUS(f)                                                                       \
    do {                                                                                     \
        cl_int code_;                                                                        \
        if (trips(F_##f, &code_))                                                            \
            return code_;                                                                    \
    } while (0)

static cl_context CL_API_CALL w_clCreateContext(
    const cl_context_properties *props, cl_uint n, const cl_device_id *devs,
    void(CL_CALLBACK *notify)(const char *, const void *, size_t, void *), void *user,
    cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateContext);
    return real.clCreateContext(props, n, devs, notify, user, errcode_ret);
}

static cl_command_queue CL_API_CALL w_clCreateCommandQueue(
    cl_context ctx, cl_device_id dev, cl_command_queue_properties props, cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateCommandQueue);
    return real.clCreateCommandQueue(ctx, dev, props, errcode_ret);
}

static cl_program CL_API_CALL w_clCreateProgramWithSource(
    cl_context ctx, cl_uint n, const char **src, const size_t *lens, cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateProgramWithSource);
    return real.clCreateProgramWithSource(ctx, n, src, lens, errcode_ret);
}

static cl_program CL_API_CALL w_clCreateProgramWithBinary(
    cl_context ctx, cl_uint n, const cl_device_id *devs, const size_t *lens,
    const unsigned char **bins, cl_int *status, cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateProgramWithBinary);
    return real.clCreateProgramWithBinary(ctx, n, devs, lens, bins, status, errcode_ret);
}

static cl_int CL_API_CALL w_clBuildProgram(
    cl_program prog, cl_uint n, const cl_device_id *devs, const char *options,
    void(CL_CALLBACK *notify)(cl_program, void *), void *user)
{
    FAIL_STATUS(clBuildProgram);
    return real.clBuildProgram(prog, n, devs, options, notify, user);
}

static cl_kernel CL_API_CALL w_clCreateKernel(cl_program prog, const char *name,
                                              cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateKernel);
    return real.clCreateKernel(prog, name, errcode_ret);
}

static cl_int CL_API_CALL w_clSetKernelArg(cl_kernel k, cl_uint index, size_t size,
                                           const void *value)
{
    FAIL_STATUS(clSetKernelArg);
    return real.clSetKernelArg(k, index, size, value);
}

static cl_int CL_API_CALL w_clGetKernelWorkGroupInfo(
    cl_kernel k, cl_device_id dev, cl_kernel_work_group_info what, size_t size, void *value,
    size_t *size_ret)
{
    FAIL_STATUS(clGetKernelWorkGroupInfo);
    return real.clGetKernelWorkGroupInfo(k, dev, what, size, value, size_ret);
}

static cl_mem CL_API_CALL w_clCreateBuffer(cl_context ctx, cl_mem_flags flags, size_t size,
                                           void *host, cl_int *errcode_ret)
{
    FAIL_OBJECT(clCreateBuffer);
    return real.clCreateBuffer(ctx, flags, size, host, errcode_ret);
}

static cl_int CL_API_CALL w_clEnqueueWriteBuffer(
    cl_command_queue q, cl_mem m, cl_bool blocking, size_t offset, size_t size, const void *ptr,
    cl_uint nwait, const cl_event *wait, cl_event *event)
{
    FAIL_STATUS(clEnqueueWriteBuffer);
    return real.clEnqueueWriteBuffer(q, m, blocking, offset, size, ptr, nwait, wait, event);
}

static cl_int CL_API_CALL w_clEnqueueReadBuffer(
    cl_command_queue q, cl_mem m, cl_bool blocking, size_t offset, size_t size, void *ptr,
    cl_uint nwait, const cl_event *wait, cl_event *event)
{
    FAIL_STATUS(clEnqueueReadBuffer);
    return real.clEnqueueReadBuffer(q, m, blocking, offset, size, ptr, nwait, wait, event);
}

static void *CL_API_CALL w_clEnqueueMapBuffer(
    cl_command_queue q, cl_mem m, cl_bool blocking, cl_map_flags flags, size_t offset,
    size_t size, cl_uint nwait, const cl_event *wait, cl_event *event, cl_int *errcode_ret)
{
    FAIL_OBJECT(clEnqueueMapBuffer);
    return real.clEnqueueMapBuffer(q, m, blocking, flags, offset, size, nwait, wait, event,
                                   errcode_ret);
}

static cl_int CL_API_CALL w_clEnqueueUnmapMemObject(
    cl_command_queue q, cl_mem m, void *ptr, cl_uint nwait, const cl_event *wait,
    cl_event *event)
{
    FAIL_STATUS(clEnqueueUnmapMemObject);
    return real.clEnqueueUnmapMemObject(q, m, ptr, nwait, wait, event);
}

static cl_int CL_API_CALL w_clEnqueueNDRangeKernel(
    cl_command_queue q, cl_kernel k, cl_uint dims, const size_t *offset, const size_t *global,
    const size_t *local, cl_uint nwait, const cl_event *wait, cl_event *event)
{
    FAIL_STATUS(clEnqueueNDRangeKernel);
    return real.clEnqueueNDRangeKernel(q, k, dims, offset, global, local, nwait, wait, event);
}

static cl_int CL_API_CALL w_clFinish(cl_command_queue q)
{
    FAIL_STATUS(clFinish);
    return real.clFinish(q);
}

/* The CL_* code with this name, or 1 when there is none (no error code is positive). */
static cl_int code_named(const char *name, size_t len)
{
    for (cl_int c = 0; c >= -70; c--) {
        const char *n = or_cl_error_name(c);
        if (strlen(n) == len && strncmp(n, name, len) == 0)
            return c;
    }
    return 1;
}

static const cl_int default_code[NFAULTS] = {
#define OR_FAULT_CODE(name, code) code,
    OR_CL_FAULTS(OR_FAULT_CODE)
#undef OR_FAULT_CODE
};

/* Parses one "CALL:N[+][:CL_ERROR]" entry into faults[]; returns 0, or -1 with *why set. */
static int parse_entry(const char *s, size_t len, const char **why)
{
    static char message[200];
    const char *stop = s + len, *colon = memchr(s, ':', len);
    int f = 0;
    while (colon != NULL && f < NFAULTS
           && !(strlen(fault_names[f]) == (size_t)(colon - s)
                && strncmp(fault_names[f], s, (size_t)(colon - s)) == 0))
        f++;
    char *end = NULL;
    fault_t ft = {.at = colon ? strtoll(colon + 1, &end, 10) : 0};
    int ok = colon != NULL && f < NFAULTS && end != colon + 1 && ft.at >= 1 && end <= stop;
    if (ok && end < stop && *end == '+') {
        ft.sticky = 1;
        end++;
    }
    ft.code = default_code[ok ? f : 0];
    if (ok && end < stop) {
        ft.code = *end == ':' ? code_named(end + 1, (size_t)(stop - end - 1)) : 1;
        ok = ft.code < 0;
    }
    if (!ok) {
        snprintf(message, sizeof(message),
                 "ORCHARD_FAULT entry '%.*s' is not CALL:N[+][:CL_ERROR] with a call orchard "
                 "makes (e.g. clCreateBuffer:3)", (int)len, s);
        *why = message;
        return -1;
    }
    faults[f] = ft;
    return 0;
}

int or_cl_fault_install(or_cl_api *api, const char **why)
{
    const char *spec = getenv("ORCHARD_FAULT");
    if (spec == NULL || spec[0] == '\0')
        return 0;
    while (*spec != '\0') {
        size_t len = strcspn(spec, ",");
        if (len > 0 && parse_entry(spec, len, why) < 0)
            return -1;
        spec += len + (spec[len] == ',');
    }
    real = *api;
#define OR_FAULT_WRAP(name, code)                                                            \
    if (faults[F_##name].at != 0)                                                            \
        api->name = w_##name;
    OR_CL_FAULTS(OR_FAULT_WRAP)
#undef OR_FAULT_WRAP
    return 0;
}
#endif
