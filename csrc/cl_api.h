/* cl_api.h - the OpenCL entry points orchard uses, reached through a table filled at run time.
 *
 * orchard_ops never links libOpenCL: cl_loader.c opens the ICD loader (libOpenCL.so.1) with
 * dlopen when devices are first listed, so the module imports and the native path works on a
 * machine with no OpenCL at all. Built without the OpenCL headers, ORCHARD_HAVE_OPENCL is
 * undefined and the OpenCL backend is left out entirely.
 */
#ifndef ORCHARD_CL_API_H
#define ORCHARD_CL_API_H
#ifdef ORCHARD_HAVE_OPENCL

#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>

#define OR_CL_FUNCTIONS(X)                                                                   \
    X(clGetPlatformIDs) X(clGetPlatformInfo) X(clGetDeviceIDs) X(clGetDeviceInfo)            \
    X(clCreateContext) X(clReleaseContext) X(clCreateCommandQueue)                           \
    X(clReleaseCommandQueue) X(clCreateProgramWithSource) X(clCreateProgramWithBinary)       \
    X(clBuildProgram) X(clGetProgramBuildInfo) X(clGetProgramInfo) X(clReleaseProgram)       \
    X(clCreateKernel) X(clReleaseKernel) X(clSetKernelArg) X(clGetKernelWorkGroupInfo)       \
    X(clCreateBuffer) X(clReleaseMemObject) X(clEnqueueWriteBuffer) X(clEnqueueReadBuffer)   \
    X(clEnqueueMapBuffer) X(clEnqueueUnmapMemObject) X(clEnqueueNDRangeKernel) X(clFinish)

typedef struct {
#define OR_CL_FIELD(name) __typeof__(&name) name;
    OR_CL_FUNCTIONS(OR_CL_FIELD)
#undef OR_CL_FIELD
} or_cl_api;

/* The table, or NULL when no usable OpenCL library was found (the reason is in *why). */
const or_cl_api *or_cl_load(const char **why);

/* cl_errors.c */
const char *or_cl_error_name(cl_int err);

#ifdef ORCHARD_TEST_HOOKS
/* cl_fault.c: when ORCHARD_FAULT is set, replaces the entries it names with wrappers that fail
 * on their Nth use (for tests). Returns -1, with *why set, when the variable is malformed. */
int or_cl_fault_install(or_cl_api *api, const char **why);
#endif

#endif
#endif
