/* dtypes.c - the or_dtypes table, generated from the rows of dtypes.h. */
#include "pyorchard.h"

const or_dtype_info or_dtypes[OR_NDTYPES] = {
#define OR_DTYPE_INFO(dt, tag, name, npy, numpy, dlpack, size, storage, compute, lse) \
    [dt] = {name, npy, numpy, dlpack, size, sizeof(compute), lse},
    OR_DTYPES(OR_DTYPE_INFO)
#undef OR_DTYPE_INFO
};
