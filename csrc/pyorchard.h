/* pyorchard.h - declarations shared by the Python-facing files of orchard_ops
 * (module.c, args.c, problem.c, marshal.c, dlpack.c, device_array.c, dtypes.c, devices.c,
 * cpu_info.c, log.c).
 * The kernels
 * include orchard.h only. */
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

/* module.c: the module's state */
typedef struct {
    PyObject *error;            /* OrchardError(RuntimeError) */
    PyObject *oom;              /* OrchardOutOfMemory(OrchardError, MemoryError) */
    PyTypeObject *device_array; /* DeviceArray (device_array.c) */
    PyObject *torch_name, *dlpack_name;     /* "torch", "__dlpack__", interned */
    PyObject *dlpack_versioned; /* {"max_version": (1, 0)}, __dlpack__'s keywords */
    PyObject *torch;            /* what dlpack.c calls of torch, read once per module */
} or_module_state;
/* Raises OrchardError, or OrchardOutOfMemory for the out-of-memory codes, for a failed device
 * call of func on device index `device`; returns NULL. */
PyObject *or_device_error(or_module_state *st, const char *func, int device, const or_error *err);

/* marshal.c */
/* Replaces the pending exception by one of `type` whose message is format's words and, in
 * parentheses, the pending one's (NumPy's or torch's own, said of an argument); NULL. */
PyObject *or_restate(PyObject *type, const char *format, ...);
PyArrayObject *or_unreadable(const char *func, const char *name, int own_words);
/* An operand as an array over its memory (NumPy's array of it where it is no array or
 * tensor), its dtype in *dt, nothing copied yet; *copied 1 where or_stage will copy it as its
 * own type, 2 where it is neither an ndarray nor a DLPack tensor (NumPy's array of it may be
 * memory of its own), else 0: whether a write reaches the operand. A call checks its shapes
 * between the two, so that a wrong one fails before copying a huge broadcast view. The array
 * is a view of orchard's own, whose shape and strides no Python code run later in the call
 * (a scale's __float__, an __array__) can change under the checks already made. */
PyArrayObject *or_operand_view(or_module_state *st, PyObject *obj, const char *func,
                               const char *name, or_dtype *dt, int *copied);
/* a (its reference taken) as the kernels read it: itself where they can in place as typenum,
 * else an aligned C-ordered copy as typenum; counted in ct where it is not NULL */
PyArrayObject *or_stage(PyArrayObject *a, int typenum, const char *func, const char *name,
                        or_counters *ct, size_t align);
void or_extent(PyArrayObject *a, char **lo, size_t *nbytes);
PyArrayObject *or_staged_copy(PyArrayObject *a, int typenum, size_t align);
PyArrayObject *or_new_aligned(int nd, const npy_intp *dims, int typenum, size_t align,
                              int zeroed);
void *or_alloc_units(or_ssize n, size_t elsize);
or_ssize *or_lead_offsets(PyArrayObject *a, int nlead);
or_ssize *or_varlen_offsets(PyArrayObject *a, const int64_t *cu, or_ssize nseq, or_ssize heads,
                            int seq_axis, int head_axis);
PyObject *or_shape_str(PyArrayObject *a);
PyObject *or_values_str(PyArrayObject *a, PyObject *obj);
PyObject *or_dims_str(int nd, const npy_intp *dims);

/* dlpack.c */
PyArrayObject *or_from_dlpack(or_module_state *st, PyObject *obj, const char *func,
                              const char *name, or_dtype *dt);
PyArrayObject *or_values(or_module_state *st, PyObject *obj, const char *func, const char *name);
PyObject *or_result_like(or_module_state *st, PyObject *like, PyArrayObject *a, or_dtype dt);
/* For a cache a call writes: where obj is a torch tensor, *why says why torch would not have it
 * written so (it requires grad; an inference tensor outside inference mode), else NULL; 0, or
 * -1 with an exception */
int or_torch_write_refusal(or_module_state *st, PyObject *obj, const char **why);
/* 1 where obj is a torch tensor that requires grad in grad mode (autograd would record what
 * torch wrote from it), 0 where not, -1 with an exception */
int or_torch_recorded(or_module_state *st, PyObject *obj);
/* tells autograd that obj, where it is a torch tensor, was written (its version counter, as
 * torch's own writes bump it); 0, or -1 with an exception */
int or_torch_written(or_module_state *st, PyObject *obj);

/* cpu_info.c */
PyObject *or_cpu_device_info(void);
int or_select_isa(const char *what, const char *name);     /* 0, or -1 with ValueError */
void or_isa_from_environment(void);                         /* at import: never fails */
int or_check_environment(void);     /* -1 with ValueError if ORCHARD_ISA or ORCHARD_NUM_THREADS is one orchard cannot use */

/* devices.c */
typedef struct {
    int index;              /* 0 = native cpu, 1 + i = OpenCL device i */
    int automatic;          /* chosen by device=None/"auto" without ORCHARD_DEVICE: may fall back */
} or_device_choice;
int or_resolve_device(const char *func, PyObject *device, or_device_choice *out);
PyObject *or_device_id(int index);
PyObject *or_devices_list(void);
const char *or_opencl_unavailable(void);      /* why no OpenCL device is listed, or NULL */
size_t or_device_align(int index);
int or_device_fp64(int index);
int or_device_tuned_blocks(int index, int *bq, int *bk);
int or_device_save_tuned_blocks(int index, int bq, int bk);
int or_device_environment(int index, or_error *err);
/* The kernel family and blocks of the float32 program for head dim d that OpenCL device index
 * runs (built, or loaded from the cache, as a call would): the environment, a tuned record
 * and the family's local-memory rule applied. OR_OK, or an error code with err set. */
int or_device_program_blocks(int index, int d, const char **family, int *bq, int *bk,
                             or_error *err);

/* The options of an attention call as parsed (checked by or_check_options); window NULL =
 * (-1, -1), seed, dropout_p and softcap NULL = 0. */
typedef struct {
    PyObject *scale, *window, *alibi, *seed, *device, *max_q, *max_k, *seqused_k;
    PyObject *block_table, *leftpad_k;      /* paged K and V, left padding (varlen fwd), or None */
    PyObject *dropout_p, *softcap, *causal;
    PyObject *seqlen_first;     /* dense operands (..., seqlen, nheads, headdim) */
    PyObject *k_new, *v_new;    /* new keys and values written into k and v (forwards) */
} or_opts;

/* One attention call in flight: what it owns and the problem handed to the kernels. */
typedef struct {
    const char *func;
    int varlen;
    PyArrayObject *arr[OR_NSLOTS];
    or_dtype dt[OR_NSLOTS];         /* each operand's (bfloat16 arrays hold uint16 bits) */
    int staged[OR_NSLOTS];          /* or_operand_view's *copied: a write to arr[s] would not
                                     * (1) or might not (2) reach the operand */
    int pending[OR_NSLOTS];         /* arr[s] is still the operand's view: or_stage_operands */
    PyArrayObject *pool[2];         /* paged k and v whole, until staged (args.c stage_pages) */
    PyObject *like;                 /* the first operand: results come back as its kind */
    PyObject *obj[OR_NSLOTS];       /* each operand as given (borrowed), else NULL */
    or_module_state *st;
    int resident;                   /* the operands are DeviceArrays: so are the results */
    int seqlen_first;               /* arr[] holds (..., nheads, seqlen, headdim) views of
                                     * operands (..., seqlen, nheads, headdim), lse aside;
                                     * results are given back in the operands' axis order */
    PyObject *dev[OR_NSLOTS];       /* each DeviceArray operand or result, else NULL */
    or_ssize *offs[OR_NSLOTS];
    PyArrayObject *cu_q, *cu_k;     /* int64 copies of cu_seqlens */
    PyArrayObject *used_k;          /* int64 copy of seqused_k, or NULL */
    PyArrayObject *pages, *leftpad; /* int64 copies of block_table and leftpad_k, or NULL */
    const int64_t **page_list;      /* per kv unit: its row of pages (or_pages.table) */
    or_ssize *page_first;           /* per kv unit: its leftpad (or_pages.first) */
    or_ssize *nq, *nk;
    PyArrayObject *alibi;           /* float64 copy of alibi_slopes (or_check_alibi), or NULL */
    double *slopes;
    or_ssize heads;                 /* query heads H (dense: size of dim -3, or 1) */
    or_device_choice device;
    or_counters *ct;                /* the chosen device's counters */
    PyArrayObject *new_kv[2];       /* k_new and v_new, C-contiguous (kv unit, n, D) copies */
    or_problem p;
} or_call;

/* args.c: each returns 0, or -1 with the exception set */
/* Whether the exception set says that a value is not a valid one (TypeError, ValueError,
 * OverflowError): then it is cleared, for the caller to raise its own, naming the argument;
 * any other (MemoryError, KeyboardInterrupt in a conversion) stays set, to be passed on. */
int or_bad_value(void);
/* The largest finite value of the type the kernels compute a call's operands in (float64:
 * double, else float): softcap, scale and slopes past it would turn inf there */
double or_compute_max(const or_call *c);
/* An int argument, saturated to LLONG_MIN..LLONG_MAX; -1: not an int (no exception), or another
 * failure (its exception) */
int or_as_integer(PyObject *obj, long long *out);
/* A str argument's UTF-8 text; NULL with TypeError or ValueError naming func and what */
const char *or_text_arg(const char *func, const char *what, PyObject *obj);
/* An int argument in lo..hi; -1 with TypeError (not an int, or a bool) or ValueError (out of
 * range) naming func and name */
int or_int_arg(const char *func, const char *name, PyObject *obj, long long lo, long long hi,
               long long *out);
int or_check_options(or_call *c, const or_opts *o);
int or_call_device(or_call *c, PyObject *device, PyObject **objs, const int *slots, int n);
int or_load_operands(or_call *c, PyObject **objs, const int *slots, int n);
/* the operands read in place or, where the kernels cannot, copied: once shapes are checked */
int or_stage_operands(or_call *c);
PyArrayObject *or_swap_seq_heads(or_call *c, int slot, PyArrayObject *a);
PyObject *or_operand_shape(or_call *c, int slot);
int or_check_qkv(or_call *c);
int or_check_scale(or_call *c, const or_opts *o);
int or_check_varlen(or_call *c, const or_opts *o, PyObject *cuq_obj, PyObject *cuk_obj);
int or_check_paged_kv(or_call *c);
int or_check_key_ranges(or_call *c, const or_opts *o);
int or_check_pages(or_call *c, npy_intp b, npy_intp t0, npy_intp t1);
int or_check_like(or_call *c, int slot, const npy_intp *shape, int nd);
int or_parse_shape(PyObject *obj, const char *name, npy_intp *dims);    /* its length or -1 */

/* device_array.c: DeviceArray, an array held in an OpenCL device's memory */
PyTypeObject *or_device_array_type(PyObject *module);  /* made once, for the module state */
PyObject *or_to_device(PyObject *module, PyObject *args, PyObject *kw);
int or_device_array_index(or_module_state *st, PyObject *obj); /* its device, -1: not one */
/* its shape, dtype and C strides as a NumPy array over no memory: what args.c and problem.c
 * read of an operand */
PyArrayObject *or_device_array_layout(PyObject *obj, or_dtype *dt);
void *or_device_array_mem(PyObject *obj);               /* its cl_mem (NULL: no bytes) */
/* a result of a call on DeviceArrays: c->dev[slot], c->arr[slot] its layout */
int or_device_output(or_call *c, int slot, int nd, const npy_intp *shape, or_dtype dt);

/* kv_append.c: k_new and v_new checked against the built problem and copied, then written
 * into k and v just before the kernels run */
int or_load_new_kv(or_call *c, const or_opts *o);
int or_write_new_kv(or_call *c);

/* problem.c */
void or_out_shapes(or_call *c, npy_intp *oshape, npy_intp *lshape, int *ond, int *lnd);
int or_new_output(or_call *c, int slot, int nd, const npy_intp *shape, or_dtype dt,
                  PyArrayObject *like);
/* alibi_slopes checked (before staging), then every per-unit table and view built */
int or_check_alibi(or_call *c, PyObject *obj);
int or_build_problem(or_call *c);
void or_call_clear(or_call *c);

#endif
