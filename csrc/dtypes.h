/* dtypes.h - the element types orchard_ops reads and writes, listed once.
 *
 * A row of OR_DTYPES gives a type's or_dtype, its tag, name, the NumPy type number of its
 * memory and whether NumPy arrays of that type are this dtype (NumPy has no bfloat16: its
 * arrays are held as uint16, and an operand is bfloat16 only when it says so through DLPack),
 * its DLPack type code (kDLFloat 2, kDLBfloat 4), its itemsize, the storage code the OpenCL
 * kernels are built for (OR_STORAGE, kernels/params.h), the C type it is computed in (the
 * native kernels' REAL) and the or_dtype of its lse. The tag names its two conversions:
 * or_load_TAG(row, i), element i of a row as a value its compute type holds exactly, and
 * or_store_TAG(row, i, x), x rounded once into element i. The enum, the or_dtypes table, the
 * native kernels' load and store cases and the OpenCL storage codes are generated from the
 * rows, so a new type is one row and its two conversions.
 */
#ifndef ORCHARD_DTYPES_H
#define ORCHARD_DTYPES_H

/*   or_dtype tag   name        NumPy    NumPy's DLPack size OpenCL storage  compute lse */
#define OR_DTYPES(X)                                                                          \
    X(OR_F16,  f16,  "float16",  NPY_FLOAT16, 1,  2,     2,   OR_STORAGE_F16,  float,  OR_F32) \
    X(OR_F32,  f32,  "float32",  NPY_FLOAT32, 1,  2,     4,   OR_STORAGE_F32,  float,  OR_F32) \
    X(OR_F64,  f64,  "float64",  NPY_FLOAT64, 1,  2,     8,   OR_STORAGE_F64,  double, OR_F64) \
    X(OR_BF16, bf16, "bfloat16", NPY_UINT16,  0,  4,     2,   OR_STORAGE_BF16, float,  OR_F32)

#include <stdint.h>
#include <string.h>

typedef _Float16 or_half;       /* IEEE binary16, NumPy's float16 */

#define or_load_f16(row, i) or_half_to_float(((const uint16_t *)(row))[i])
#define or_store_f16(row, i, x) (((or_half *)(row))[i] = (or_half)(x))
#define or_load_f32(row, i) (((const float *)(row))[i])
#define or_store_f32(row, i, x) (((float *)(row))[i] = (float)(x))
#define or_load_f64(row, i) (((const double *)(row))[i])
#define or_store_f64(row, i, x) (((double *)(row))[i] = (double)(x))
#define or_load_bf16(row, i) or_bf16_to_float(((const uint16_t *)(row))[i])
#define or_store_bf16(row, i, x) (((uint16_t *)(row))[i] = or_float_to_bf16((float)(x)))

/* float16 widened by integer operations and one exact multiply, which compilers vectorise
 * where a (float)_Float16 cast stays one scalar instruction per element without AVX512-FP16
 * (5 % of a float16 forward here); exact, subnormals, inf and NaN included. */
static inline float or_half_to_float(uint16_t h)
{
    const uint32_t em = h & 0x7FFFu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t u = em << 13;
    float f;
    memcpy(&f, &u, sizeof(f));
    f *= 0x1p112f;                              /* rebias the exponent: 2^(127 - 15) */
    memcpy(&u, &f, sizeof(u));
    if (em >= 0x7C00u)                          /* inf and NaN keep an all-ones exponent */
        u = (em << 13) | 0x7F800000u;
    u |= sign;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* bfloat16 is the top half of a float: widening is exact; narrowing rounds to nearest even
 * (as torch does) and keeps NaN a NaN. */
static inline float or_bf16_to_float(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t or_float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

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
    int typenum;                /* NumPy's, of the memory */
    int numpy;                  /* NumPy arrays of typenum are this dtype */
    int dlpack;                 /* DLPack's type code (its bits: 8 * itemsize) */
    int itemsize;
    int compute_size;           /* sizeof the compute type */
    or_dtype lse;
} or_dtype_info;

extern const or_dtype_info or_dtypes[OR_NDTYPES];      /* dtypes.c, indexed by or_dtype */

/* One row's OpenCL storage code (kernels/params.h), as an initialiser:
 * {OR_DTYPES(OR_DTYPE_CL_STORAGE)} */
#define OR_DTYPE_CL_STORAGE(dt, tag, name, npy, numpy, dlpack, size, storage, ...) storage,

#endif
