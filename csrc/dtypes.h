/* dtypes.h - the element types orchard_ops reads and writes, listed once.
 *
 * A row of OR_DTYPES gives a type's or_dtype, its tag, name, NumPy type number, itemsize, the
 * storage bits the OpenCL kernels are built for (OR_STORAGE), the C type it is computed in
 * (the native kernels' REAL) and the or_dtype of its lse. The tag names its two conversions:
 * or_load_TAG(row, i), element i of a row as a value its compute type holds exactly, and
 * or_store_TAG(row, i, x), x rounded once into element i. The enum, the or_dtypes table, the
 * native kernels' load and store cases and the OpenCL storage bits are generated from the
 * rows, so a new type is one row and its two conversions.
 */
#ifndef ORCHARD_DTYPES_H
#define ORCHARD_DTYPES_H

/*   or_dtype tag  name       NumPy        size bits compute lse */
#define OR_DTYPES(X)                                                    \
    X(OR_F16,  f16, "float16", NPY_FLOAT16, 2,   16,  float,  OR_F32)   \
    X(OR_F32,  f32, "float32", NPY_FLOAT32, 4,   32,  float,  OR_F32)   \
    X(OR_F64,  f64, "float64", NPY_FLOAT64, 8,   64,  double, OR_F64)

typedef _Float16 or_half;       /* IEEE binary16, NumPy's float16 */

#define or_load_f16(row, i) (((const or_half *)(row))[i])
#define or_store_f16(row, i, x) (((or_half *)(row))[i] = (or_half)(x))
#define or_load_f32(row, i) (((const float *)(row))[i])
#define or_store_f32(row, i, x) (((float *)(row))[i] = (float)(x))
#define or_load_f64(row, i) (((const double *)(row))[i])
#define or_store_f64(row, i, x) (((double *)(row))[i] = (double)(x))

typedef enum {
#define OR_DTYPE_ENUM(dt, ...) dt,
    OR_DTYPES(OR_DTYPE_ENUM)
#undef OR_DTYPE_ENUM
} or_dtype;

/* apart from the enum, so that a switch over every or_dtype is complete */
enum {
#define OR_DTYPE_ONE(...) + 1
    OR_NDTYPES = 0 OR_DTYPES(OR_DTYPE_ONE)
#undef OR_DTYPE_ONE
};

typedef struct {
    const char *name;
    int typenum;                /* NumPy's */
    int itemsize;
    int compute_size;           /* sizeof the compute type */
    or_dtype lse;
} or_dtype_info;

extern const or_dtype_info or_dtypes[OR_NDTYPES];      /* dtypes.c, indexed by or_dtype */

/* One row's OpenCL storage bits, as an initialiser: {OR_DTYPES(OR_DTYPE_CL_BITS)} */
#define OR_DTYPE_CL_BITS(dt, tag, name, npy, size, bits, ...) bits,

#endif
