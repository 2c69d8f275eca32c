/* module.c - the orchard_ops module: its functions, method table, state and initialisation.
 *
 * Every attention call is handled the same way: parse the arguments once into an or_opts,
 * check them and the operands (args.c), build the or_problem in an or_call (problem.c), run
 * the kernels with the GIL released, and release everything the or_call owns on one cleanup
 * path. Each failure sets exactly one exception.
 */
#define ORCHARD_MODULE_C
#include <time.h>

#include "pyorchard.h"

static or_module_state *get_state(PyObject *module)
{
    return (or_module_state *)PyModule_GetState(module);
}

/* ------------------------------------------------------------------ running */

/* Raises the exception a failed device call deserves: OrchardOutOfMemory for the
 * out-of-memory codes, OrchardError otherwise, with the build log when there is one.
 * CL_INVALID_BUFFER_SIZE (-61) counts as out of memory: clCreateBuffer returns it for a buffer
 * larger than the device's CL_DEVICE_MAX_MEM_ALLOC_SIZE, a buffer that cannot be allocated. */
PyObject *or_device_error(or_module_state *st, const char *func, int device, const or_error *err)
{
    int oom = err->cl_code == -4 || err->cl_code == -5 || err->cl_code == -6
              || err->cl_code == -61;
    PyObject *id = or_device_id(device);
    if (id == NULL)
        return NULL;
    PyErr_Format(oom ? st->oom : st->error, "%s() on %S: %s%s%s", func, id, err->msg,
                 err->log ? "\nbuild log:\n" : "", err->log ? err->log : "");
    Py_DECREF(id);
    return NULL;
}

static int compute(or_call *c, int backward, or_error *err)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (c->device.index == 0)
        rc = backward ? or_native_bwd(&c->p) : or_native_fwd(&c->p);
    else if (backward)
        rc = or_cl_bwd(c->device.index - 1, &c->p, c->ct, err);
    else
        rc = or_cl_fwd(c->device.index - 1, &c->p, c->ct, err);
    Py_END_ALLOW_THREADS
    return rc;
}

static PyObject *run(or_call *c, or_module_state *st, int backward)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    or_error err = {0};
    int rc = compute(c, backward, &err);
    if (rc == OR_EDEVICE && c->device.automatic) {
        /* auto choice: a device that cannot run falls back to the native path, said once */
        static int warned;
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))  /* once, whatever the threads */
            or_log("orchard: %s failed on the automatically chosen OpenCL device (%s); "
                   "using the native CPU path", c->func, err.msg);
        free(err.log);
        err.log = NULL;
        c->device.index = 0;
        c->ct = or_device_counters(0);
        rc = compute(c, backward, &err);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (rc != OR_OK) {
        PyObject *none = rc == OR_ENOMEM
                             ? PyErr_Format(PyExc_MemoryError, "%s(): the kernels' working "
                                            "memory cannot be allocated", c->func)
                             : or_device_error(st, c->func, c->device.index, &err);
        free(err.log);
        return none;
    }
    OR_COUNT(c->ct, fwd_calls, !backward);
    OR_COUNT(c->ct, decode_calls, !backward && (c->device.index == 0 ? or_native_decodes(&c->p)
                                                                      : or_is_decode(&c->p)));
    OR_COUNT(c->ct, bwd_calls, backward);

    if (or_env_flag("ORCHARD_DEBUG_FLASH_ATN")) {
        PyObject *qs = or_operand_shape(c, OR_Q), *ks = or_operand_shape(c, OR_K);
        PyObject *id = or_device_id(c->device.index);
        if (qs == NULL || ks == NULL || id == NULL) {
            Py_XDECREF(qs);
            Py_XDECREF(ks);
            Py_XDECREF(id);
            return NULL;
        }
        or_log("orchard: %s device=%s q=%s k=%s dv=%d dtype=%s time=%.3f ms", c->func,
               PyUnicode_AsUTF8(id), PyUnicode_AsUTF8(qs), PyUnicode_AsUTF8(ks), c->p.dv,
               or_dtypes[c->p.view[OR_Q].dtype].name,
               (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6);
        Py_DECREF(qs);
        Py_DECREF(ks);
        Py_DECREF(id);
    }
    /* (out, lse) or (dq, dk, dv): DeviceArrays for device-resident operands, torch tensors
     * when the operands were */
    const int first = backward ? OR_DQ : OR_O, count = backward ? 3 : 2;
    PyObject *result = PyTuple_New(count);
    for (int i = 0; result != NULL && i < count; i++) {
        const int s = first + i;
        PyObject *r = NULL;
        if (c->dev[s] != NULL) {
            r = Py_NewRef(c->dev[s]);
        } else if (c->seqlen_first && s != OR_LSE) {   /* back in the operands' axis order */
            PyArrayObject *a = or_swap_seq_heads(c, s, c->arr[s]);
            r = a == NULL ? NULL : or_result_like(c->st, c->like, a, c->dt[s]);
            Py_XDECREF(a);
        } else {
            r = or_result_like(c->st, c->like, c->arr[s], c->dt[s]);
        }
        if (r == NULL)
            Py_CLEAR(result);
        else
            PyTuple_SET_ITEM(result, i, r);
    }
    return result;
}

/* Shared by the four attention entry points once arguments are parsed. objs holds the
 * positional operands in the order of `slots`. */
static PyObject *attention(PyObject *module, or_call *c, or_opts *o, PyObject **objs,
                           const int *slots, int nobj, PyObject *cuq, PyObject *cuk)
{
    or_module_state *st = get_state(module);
    int backward = nobj == 6;
    PyObject *result = NULL;
    npy_intp oshape[NPY_MAXDIMS], lshape[NPY_MAXDIMS];
    int ond, lnd;

    c->like = objs[0];
    c->st = st;
    if (or_check_options(c, o) < 0 || or_call_device(c, o->device, objs, slots, nobj) < 0)
        goto done;
    c->ct = or_device_counters(c->device.index);
    if (or_load_operands(c, objs, slots, nobj) < 0
        || (o->block_table != Py_None && or_check_paged_kv(c) < 0)
        || or_check_qkv(c) < 0 || or_check_scale(c, o) < 0
        || (c->varlen && or_check_varlen(c, o, cuq, cuk) < 0)
        || or_check_key_ranges(c, o) < 0 || or_check_alibi(c, o->alibi) < 0)
        goto done;
    or_dtype dt = c->p.view[OR_Q].dtype;
    or_out_shapes(c, oshape, lshape, &ond, &lnd);
    if ((backward && (or_check_like(c, OR_DO, oshape, ond) < 0
                      || or_check_like(c, OR_O, oshape, ond) < 0
                      || or_check_like(c, OR_LSE, lshape, lnd) < 0))
        || or_stage_operands(c) < 0)
        goto done;
    if (backward) {
        for (int s = OR_DQ; s <= OR_DV; s++) {
            PyArrayObject *like = c->arr[s - OR_DQ + OR_Q];
            if (or_new_output(c, s, PyArray_NDIM(like), PyArray_DIMS(like), dt, like) < 0)
                goto done;
        }
    } else if (or_new_output(c, OR_O, ond, oshape, dt, c->arr[OR_Q]) < 0
               || or_new_output(c, OR_LSE, lnd, lshape, or_dtypes[dt].lse, NULL) < 0) {
        goto done;
    }
    /* the cache takes its new rows once every argument is checked (theirs last) */
    if (or_build_problem(c) < 0 || or_load_new_kv(c, o) < 0 || or_write_new_kv(c) < 0)
        goto done;
    result = run(c, st, backward);
done:
    or_call_clear(c);
    return result;
}

#define OPTION_KWLIST "window", "alibi_slopes", "softcap", "seed", "device"
#define OPTION_FORMAT "$OOOOO"
#define OPTION_ARGS &o.window, &o.alibi, &o.softcap, &o.seed, &o.device
#define OPTS_INIT {.scale = Py_None, .causal = Py_False, .alibi = Py_None, .device = Py_None, \
                   .max_q = Py_None, .max_k = Py_None, .seqused_k = Py_None, \
                   .block_table = Py_None, .leftpad_k = Py_None, .seqlen_first = Py_False, \
                   .k_new = Py_None, .v_new = Py_None}

static const int FWD_SLOTS[] = {OR_Q, OR_K, OR_V};
static const int BWD_SLOTS[] = {OR_DO, OR_Q, OR_K, OR_V, OR_O, OR_LSE};

static PyObject *flash_attn_fwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q", "k", "v", "scale", "dropout_p", "causal", OPTION_KWLIST,
                             "seqused_k", "leftpad_k", "seqlen_first", "k_new", "v_new", NULL};
    or_opts o = OPTS_INIT;
    PyObject *x[3];
    or_call c = {.func = "flash_attn_fwd"};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOO" OPTION_FORMAT "OOOOO:flash_attn_fwd",
                                     kwlist, &x[0], &x[1], &x[2], &o.scale, &o.dropout_p,
                                     &o.causal, OPTION_ARGS, &o.seqused_k, &o.leftpad_k,
                                     &o.seqlen_first, &o.k_new, &o.v_new))
        return NULL;
    return attention(module, &c, &o, x, FWD_SLOTS, 3, NULL, NULL);
}

static PyObject *flash_attn_bwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dout", "q", "k", "v", "out", "lse", "scale", "dropout_p", "causal",
                             OPTION_KWLIST, "seqlen_first", NULL};
    or_opts o = OPTS_INIT;
    PyObject *x[6];
    or_call c = {.func = "flash_attn_bwd"};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OOO" OPTION_FORMAT "O:flash_attn_bwd",
                                     kwlist, &x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &o.scale,
                                     &o.dropout_p, &o.causal, OPTION_ARGS, &o.seqlen_first))
        return NULL;
    return attention(module, &c, &o, x, BWD_SLOTS, 6, NULL, NULL);
}

static PyObject *flash_attn_varlen_fwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                             "max_seqlen_k", "scale", "dropout_p", "causal", OPTION_KWLIST,
                             "seqused_k", "block_table", "leftpad_k", "k_new", "v_new", NULL};
    or_opts o = OPTS_INIT;
    PyObject *x[3], *cuq, *cuk;
    or_call c = {.func = "flash_attn_varlen_fwd", .varlen = 1};
    if (!PyArg_ParseTupleAndKeywords(args, kw,
                                     "OOOOO|OOOOO" OPTION_FORMAT "OOOOO:flash_attn_varlen_fwd",
                                     kwlist, &x[0], &x[1], &x[2], &cuq, &cuk, &o.max_q, &o.max_k,
                                     &o.scale, &o.dropout_p, &o.causal, OPTION_ARGS,
                                     &o.seqused_k, &o.block_table, &o.leftpad_k, &o.k_new,
                                     &o.v_new))
        return NULL;
    return attention(module, &c, &o, x, FWD_SLOTS, 3, cuq, cuk);
}

static PyObject *flash_attn_varlen_bwd(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                             "max_seqlen_q", "max_seqlen_k", "scale", "dropout_p", "causal",
                             OPTION_KWLIST, NULL};
    or_opts o = OPTS_INIT;
    PyObject *x[6], *cuq, *cuk;
    or_call c = {.func = "flash_attn_varlen_bwd", .varlen = 1};
    if (!PyArg_ParseTupleAndKeywords(args, kw,
                                     "OOOOOOOO|OOOOO" OPTION_FORMAT ":flash_attn_varlen_bwd",
                                     kwlist, &x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &cuq, &cuk,
                                     &o.max_q, &o.max_k, &o.scale, &o.dropout_p, &o.causal,
                                     OPTION_ARGS))
        return NULL;
    return attention(module, &c, &o, x, BWD_SLOTS, 6, cuq, cuk);
}

/* ------------------------------------------------------------------ the rest of the API */

PyDoc_STRVAR(dropout_mask_doc,
"dropout_mask(q_shape, k_shape, dropout_p, seed=0) -> bool array q_shape[:-2] + (Nq, Nk)\n\n"
"The keep-decisions every backend draws for these shapes (True = kept).");

static PyObject *dropout_mask(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"q_shape", "k_shape", "dropout_p", "seed", NULL};
    PyObject *qs, *ks, *p, *seed_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:dropout_mask", kwlist, &qs, &ks, &p,
                                     &seed_obj))
        return NULL;
    npy_intp qd[NPY_MAXDIMS], kd[NPY_MAXDIMS];
    int qn = or_parse_shape(qs, "q_shape", qd);
    int kn = qn < 0 ? -1 : or_parse_shape(ks, "k_shape", kd);
    if (kn < 0)
        return NULL;
    /* the shapes an attention call takes (args.c or_check_qkv): k of q's rank and head dim,
     * with q's dimensions before the rows, a 4-D k's heads dividing q's */
    int fits = kn == qn && kd[kn - 1] == qd[qn - 1];
    for (int i = 0; fits && i < qn - 2; i++)
        fits = kd[i] == qd[i] || (qn == 4 && i == 1 && (kd[i] == 0 ? qd[i] == 0
                                                                  : qd[i] % kd[i] == 0));
    if (!fits) {
        PyErr_Format(PyExc_ValueError, "dropout_mask(): 'k_shape' %.100R does not go with "
                     "'q_shape' %.100R: k must have q's dimensions before the rows (4-D: heads "
                     "dividing q's) and q's head dim", ks, qs);
        return NULL;
    }
    if (qd[qn - 1] < 1 || qd[qn - 1] > OR_MAX_HEAD_DIM) {
        PyErr_Format(PyExc_ValueError, "dropout_mask(): 'q_shape' %.100R must have a head dim "
                     "(last dimension) in 1.." OR_STR(OR_MAX_HEAD_DIM) ", as attention takes", qs);
        return NULL;
    }
    or_opts o = OPTS_INIT;
    o.seed = seed_obj;
    o.dropout_p = p;
    or_call c = {.func = "dropout_mask"};
    if (or_check_options(&c, &o) < 0)
        return NULL;
    if (qd[qn - 2] > OR_MAX_SEQ_LEN || kd[kn - 2] > OR_MAX_SEQ_LEN) {
        PyErr_Format(PyExc_ValueError, "dropout_mask(): '%s' must have fewer than 2**32 rows "
                     "(dimension -2), got %zd", qd[qn - 2] > OR_MAX_SEQ_LEN ? "q_shape" : "k_shape",
                     qd[qn - 2] > OR_MAX_SEQ_LEN ? qd[qn - 2] : kd[kn - 2]);
        return NULL;
    }
    npy_intp shape[NPY_MAXDIMS];
    for (int i = 0; i < qn - 1; i++)
        shape[i] = qd[i];
    shape[qn - 1] = kd[kn - 2];
    PyArrayObject *mask = (PyArrayObject *)PyArray_SimpleNew(qn, shape, NPY_BOOL);
    if (mask == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
        /* NumPy's "array is too big", said of the arguments */
        PyObject *type, *value, *tb, *dims = NULL;
        PyErr_Fetch(&type, &value, &tb);
        if ((dims = or_dims_str(qn, shape)) != NULL)
            PyErr_Format(PyExc_ValueError, "dropout_mask(): 'q_shape' and 'k_shape' give a mask "
                         "of shape %U, more than NumPy can hold (%S)", dims,
                         value ? value : Py_None);
        Py_XDECREF(dims);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    if (mask == NULL)
        return NULL;
    if (PyArray_SIZE(mask) == 0)    /* and the loop below might count to 2**60 for nothing */
        return (PyObject *)mask;
    or_ssize units = 1, nq = qd[qn - 2], nk = kd[kn - 2];
    for (int i = 0; i < qn - 2; i++)
        units *= qd[i];
    unsigned char *out = PyArray_DATA(mask);
    Py_BEGIN_ALLOW_THREADS
    for (or_ssize u = 0; u < units; u++)
        for (or_ssize i = 0; i < nq; i++)
            for (or_ssize j = 0; j < nk; j += INT_MAX) {    /* or_dropout_row counts in int */
                int n = nk - j < INT_MAX ? (int)(nk - j) : INT_MAX;
                or_dropout_row(c.p.prm.seed, (uint64_t)u, (uint32_t)i, (uint32_t)j, n,
                               c.p.prm.threshold, out);
                out += n;
            }
    Py_END_ALLOW_THREADS
    return (PyObject *)mask;
}

static PyObject *devices(PyObject *module, PyObject *unused)
{
    return or_devices_list();
}

static PyObject *opencl_unavailable(PyObject *module, PyObject *unused)
{
    const char *why = or_opencl_unavailable();
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

/* The id of the device that `device` names, errors reported as func's. */
static PyObject *device_id_of(const char *func, PyObject *device)
{
    or_device_choice choice;
    if (or_resolve_device(func, device, &choice) < 0)
        return NULL;
    return or_device_id(choice.index);
}

static PyObject *default_device(PyObject *module, PyObject *unused)
{
    return device_id_of("default_device", Py_None);
}

PyDoc_STRVAR(resolve_device_doc,
"resolve_device(device) -> the id of the device that device= names: None or \"auto\" (the\n"
"automatic choice, default_device()), \"cpu\", \"opencl\" (the best OpenCL device),\n"
"\"opencl:N\" or \"opencl:NAME\" (a substring of a device or platform name). ValueError when it\n"
"names no available device, TypeError when it is not a str or None.");

static PyObject *resolve_device(PyObject *module, PyObject *device)
{
    return device_id_of("resolve_device", device);
}

PyDoc_STRVAR(cache_dir_doc,
"cache_dir() -> str or None: the folder of the OpenCL program cache and tuned block sizes,\n"
"made private to the user if missing: ORCHARD_CACHE_DIR, else $XDG_CACHE_HOME/orchard, else\n"
"~/.cache/orchard. None when the cache is off (ORCHARD_NO_CACHE=1) or no folder can be made.");

static PyObject *cache_dir(PyObject *module, PyObject *unused)
{
    char dir[4096];
    if (!or_cache_dir(dir, sizeof(dir)))
        Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(dir);
}

#define OR_COUNTER_FIELDS(X) X(fwd_calls) X(decode_calls) X(bwd_calls) X(zero_copy_buffers) X(staged_buffers) \
    X(bytes_staged) X(kernel_builds) X(cache_hits) X(host_to_device) X(host_to_device_bytes)    \
    X(device_to_host) X(device_to_host_bytes)

static PyObject *counters_dict(const or_counters *ct)
{
    PyObject *d = PyDict_New(), *v;
#define OR_PUT(field)                                                                        \
    v = d ? PyLong_FromLongLong(__atomic_load_n(&ct->field, __ATOMIC_RELAXED)) : NULL;       \
    if (v == NULL || PyDict_SetItemString(d, #field, v) < 0)                                 \
        Py_CLEAR(d);                                                                         \
    Py_XDECREF(v);
    OR_COUNTER_FIELDS(OR_PUT)
#undef OR_PUT
    return d;
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict of counters (fwd_calls, decode_calls, bwd_calls, zero_copy_buffers,\n"
"staged_buffers, bytes_staged, kernel_builds, cache_hits, host_to_device,\n"
"host_to_device_bytes, device_to_host, device_to_host_bytes), totals over all devices, and\n"
"'per_device': {device id: the same counters}.");

static PyObject *stats(PyObject *module, PyObject *unused)
{
    or_counters sum = {0};
    PyObject *per = PyDict_New(), *total = NULL;
    for (int d = 0; per != NULL && d < or_device_count(); d++) {
        const or_counters *ct = or_device_counters(d);
#define OR_ADD(field) sum.field += __atomic_load_n(&ct->field, __ATOMIC_RELAXED);
        OR_COUNTER_FIELDS(OR_ADD)
#undef OR_ADD
        PyObject *id = or_device_id(d), *one = counters_dict(ct);
        if (id == NULL || one == NULL || PyDict_SetItem(per, id, one) < 0)
            Py_CLEAR(per);
        Py_XDECREF(id);
        Py_XDECREF(one);
    }
    if (per != NULL && (total = counters_dict(&sum)) != NULL
        && PyDict_SetItemString(total, "per_device", per) < 0)
        Py_CLEAR(total);
    Py_XDECREF(per);
    return total;
}

static PyObject *reset_stats(PyObject *module, PyObject *unused)
{
    for (int d = 0; d < or_device_count(); d++) {
        or_counters *ct = or_device_counters(d);
#define OR_ZERO(field) __atomic_store_n(&ct->field, 0, __ATOMIC_RELAXED);
        OR_COUNTER_FIELDS(OR_ZERO)
#undef OR_ZERO
    }
    Py_RETURN_NONE;
}

static PyObject *set_num_threads(PyObject *module, PyObject *arg)
{
    long long n;
    if (or_int_arg("set_num_threads", "n", arg, 1, OR_MAX_THREADS, &n) < 0)
        return NULL;
    or_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *get_num_threads(PyObject *module, PyObject *unused)
{
    if (or_check_environment() < 0)     /* no count to tell: every call refuses the setting */
        return NULL;
    return PyLong_FromLong(or_get_num_threads());
}

/* The OpenCL device a tuning function names, or -1 with the exception set: also while an
 * ORCHARD_CL_* variable stops its calls, as any call's (ORCHARD_CL_FAMILY picks the record
 * read or stored: one naming no family had been a silent None or False). */
static int opencl_device(PyObject *module, const char *func, PyObject *device)
{
    or_device_choice choice;
    or_error err = {0};
    if (or_resolve_device(func, device, &choice) < 0)
        return -1;
    if (choice.index == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): 'device' must be an OpenCL device, not the native "
                     "path (its blocks are fixed)", func);
        return -1;
    }
    if (or_device_environment(choice.index, &err) != OR_OK) {
        or_device_error(PyModule_GetState(module), func, choice.index, &err);
        return -1;
    }
    return choice.index;
}

static PyObject *tuned_blocks(PyObject *module, PyObject *device)
{
    int index = opencl_device(module, "tuned_blocks", device), bq, bk;
    if (index < 0)
        return NULL;
    if (!or_device_tuned_blocks(index, &bq, &bk))
        Py_RETURN_NONE;
    return Py_BuildValue("(ii)", bq, bk);
}

static PyObject *program_blocks(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "head_dim", NULL};
    PyObject *device, *head_dim = NULL;
    long long d = 64;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:program_blocks", kwlist, &device, &head_dim)
        || (head_dim != NULL
            && or_int_arg("program_blocks", "head_dim", head_dim, 1, OR_MAX_HEAD_DIM, &d) < 0))
        return NULL;
    const int index = opencl_device(module, "program_blocks", device);
    if (index < 0)
        return NULL;
    or_error err = {0};
    const char *family = NULL;
    int bq = 0, bk = 0, rc;
    Py_BEGIN_ALLOW_THREADS      /* a first build takes seconds */
    rc = or_device_program_blocks(index, (int)d, &family, &bq, &bk, &err);
    Py_END_ALLOW_THREADS
    if (rc != OR_OK)
        return or_device_error(PyModule_GetState(module), "program_blocks", index, &err);
    return Py_BuildValue("(sii)", family, bq, bk);
}

static PyObject *save_tuned_blocks(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "block_q", "block_k", NULL};
    PyObject *device, *given[2];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO:save_tuned_blocks", kwlist, &device,
                                     &given[0], &given[1]))
        return NULL;
    long long bq, bk;
    if (or_int_arg("save_tuned_blocks", "block_q", given[0], 1, OR_CL_MAX_BLOCK, &bq) < 0
        || or_int_arg("save_tuned_blocks", "block_k", given[1], 1, OR_CL_MAX_BLOCK, &bk) < 0)
        return NULL;
    int index = opencl_device(module, "save_tuned_blocks", device);
    if (index < 0)
        return NULL;
    return PyBool_FromLong(or_device_save_tuned_blocks(index, (int)bq, (int)bk));
}

PyDoc_STRVAR(set_native_isa_doc,
"set_native_isa(name) -> None: runs the native path's kernels compiled for this instruction\n"
"set from now on: one of devices()[0]['kernel_isas'] (at import: the widest, or ORCHARD_ISA).");

static PyObject *set_native_isa(PyObject *module, PyObject *name)
{
    const char *s = or_text_arg("set_native_isa", "name", name);
    if (s == NULL)
        return NULL;
    if (or_select_isa("set_native_isa(): name", s) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(build_info_doc,
"build_info() -> dict: how this orchard_ops was built. 'version'; 'opencl': the OpenCL backend\n"
"is compiled in; 'test_hooks': built with ORCHARD_TEST_HOOKS=1, so that ORCHARD_FAULT,\n"
"ORCHARD_AUTO_ANY_OPENCL, ORCHARD_CL_TRANSFERS and ORCHARD_CL_LOCAL_MEM take effect;\n"
"'max_head_dim': the largest D and Dv; 'max_cl_block': the largest OpenCL block (rows or\n"
"keys) ORCHARD_CL_BLOCK_Q/K and tuned records may name; 'max_threads': the most threads\n"
"set_num_threads and ORCHARD_NUM_THREADS take; 'dtypes': the array dtypes read and written.");

static PyObject *build_info(PyObject *module, PyObject *unused)
{
#ifdef ORCHARD_HAVE_OPENCL
    PyObject *opencl = Py_True;
#else
    PyObject *opencl = Py_False;
#endif
#ifdef ORCHARD_TEST_HOOKS
    PyObject *test_hooks = Py_True;
#else
    PyObject *test_hooks = Py_False;
#endif
    PyObject *dtypes = PyTuple_New(OR_NDTYPES);
    for (int i = 0; dtypes != NULL && i < OR_NDTYPES; i++) {
        PyObject *name = PyUnicode_FromString(or_dtypes[i].name);
        if (name == NULL)
            Py_CLEAR(dtypes);
        else
            PyTuple_SET_ITEM(dtypes, i, name);
    }
    if (dtypes == NULL)
        return NULL;
    PyObject *info = Py_BuildValue("{s:s, s:O, s:O, s:i, s:i, s:i, s:O}", "version",
                                   ORCHARD_VERSION, "opencl", opencl, "test_hooks", test_hooks,
                                   "max_head_dim", OR_MAX_HEAD_DIM, "max_cl_block",
                                   OR_CL_MAX_BLOCK, "max_threads", OR_MAX_THREADS,
                                   "dtypes", dtypes);
    Py_DECREF(dtypes);
    return info;
}

PyDoc_STRVAR(fwd_doc,
"flash_attn_fwd(q, k, v, scale=None, dropout_p=0.0, causal=False, *, window=(-1, -1),\n"
"               alibi_slopes=None, softcap=0.0, seed=0, device=None, seqused_k=None,\n"
"               leftpad_k=None, seqlen_first=False, k_new=None, v_new=None) -> (out, lse)\n\n"
"Exact attention softmax(scale * q k^T + bias, masked) v in O(N) memory.\n"
"q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv); 4-D k/v may have fewer heads (GQA).\n"
"out has q's dtype; lse (..., Nq) is float32 (float64 for float64 input).\n"
"seqlen_first=True: q, k, v and out are (..., N, H, D), as FlashAttention-2's, read in\n"
"place; lse stays (..., H, Nq).\n"
"A KV cache: sequence b (an index of the dimensions before the heads, (B, H, N, D): B) uses\n"
"keys leftpad_k[b] (default 0) to seqused_k[b] (default Nk) of its Nk rows.\n"
"k_new, v_new: n new rows for every kv head, k's and v's shapes with n for Nk, written into\n"
"k and v as each sequence's last n keys and values before they are read (a KV cache's\n"
"append; q is read after it), once every argument is checked; k and v must be writable\n"
"and read in place, and torch tensors torch would write (not requiring grad in grad mode,\n"
"no inference tensor outside inference mode; their version counters are bumped).");
PyDoc_STRVAR(bwd_doc,
"flash_attn_bwd(dout, q, k, v, out, lse, scale=None, dropout_p=0.0, causal=False, *,\n"
"               window=(-1, -1), alibi_slopes=None, softcap=0.0, seed=0, device=None,\n"
"               seqlen_first=False) -> (dq, dk, dv)\n\n"
"Gradients of flash_attn_fwd; pass the same options and seed.");
PyDoc_STRVAR(varlen_fwd_doc,
"flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,\n"
"                      max_seqlen_k=None, scale=None, dropout_p=0.0, causal=False, *, ...,\n"
"                      seqused_k=None, block_table=None, leftpad_k=None, k_new=None,\n"
"                      v_new=None) -> (out, lse)\n\n"
"Packed sequences: q (total_q, H, D), k/v (total_k, Hkv, D/Dv); out (total_q, H, Dv),\n"
"lse (H, total_q). seqused_k (B,) uses only the first seqused_k[b] keys of sequence b (its\n"
"slot in k/v, from cu_seqlens_k, may be longer: a KV cache with room to grow). Sequence b's\n"
"keys are positions leftpad_k[b] (default 0) to cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or\n"
"seqused_k[b]) of its slot, or with block_table (B, max_pages) of ints of its pages: k/v\n"
"are then pages (num_pages, page_size, Hkv, D/Dv), read in place. k_new, v_new (B, n, Hkv,\n"
"D/Dv): written into k and v (their rows or pages) as each sequence's last n keys and values\n"
"before they are read, once every argument is checked.");
PyDoc_STRVAR(varlen_bwd_doc,
"flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,\n"
"                      max_seqlen_q=None, max_seqlen_k=None, scale=None, dropout_p=0.0,\n"
"                      causal=False, *, ...) -> (dq, dk, dv)");

PyDoc_STRVAR(to_device_doc,
"to_device(array, device) -> DeviceArray: a copy of array (NumPy, buffer protocol or DLPack\n"
"on the CPU; float16, bfloat16, float32 or float64) in the memory of OpenCL device `device`.\n"
"The attention functions take DeviceArray operands in place and return DeviceArrays.");

static PyMethodDef methods[] = {
    {"flash_attn_fwd", (PyCFunction)(void (*)(void))flash_attn_fwd, METH_VARARGS | METH_KEYWORDS, fwd_doc},
    {"flash_attn_bwd", (PyCFunction)(void (*)(void))flash_attn_bwd, METH_VARARGS | METH_KEYWORDS, bwd_doc},
    {"flash_attn_varlen_fwd", (PyCFunction)(void (*)(void))flash_attn_varlen_fwd,
     METH_VARARGS | METH_KEYWORDS, varlen_fwd_doc},
    {"flash_attn_varlen_bwd", (PyCFunction)(void (*)(void))flash_attn_varlen_bwd,
     METH_VARARGS | METH_KEYWORDS, varlen_bwd_doc},
    {"dropout_mask", (PyCFunction)(void (*)(void))dropout_mask, METH_VARARGS | METH_KEYWORDS,
     dropout_mask_doc},
    {"devices", devices, METH_NOARGS, "devices() -> list of dicts describing every usable device"},
    {"opencl_unavailable", opencl_unavailable, METH_NOARGS,
     "opencl_unavailable() -> None when devices() lists OpenCL devices, else why it lists none\n"
     "(no ICD loader, no platform, a bad ORCHARD_OPENCL_LIBRARY, a build without OpenCL)"},
    {"default_device", default_device, METH_NOARGS,
     "default_device() -> the device id used for device=None (ORCHARD_DEVICE if set)"},
    {"resolve_device", resolve_device, METH_O, resolve_device_doc},
    {"cache_dir", cache_dir, METH_NOARGS, cache_dir_doc},
    {"stats", stats, METH_NOARGS, stats_doc},
    {"reset_stats", reset_stats, METH_NOARGS, "reset_stats() -> None; zeroes every counter"},
    {"set_num_threads", set_num_threads, METH_O,
     "set_num_threads(n) -> None; threads of the native path (ORCHARD_NUM_THREADS)"},
    {"get_num_threads", get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"tuned_blocks", tuned_blocks, METH_O,
     "tuned_blocks(device) -> (block_q, block_k) stored for this OpenCL device, or None"},
    {"program_blocks", (PyCFunction)(void (*)(void))program_blocks, METH_VARARGS | METH_KEYWORDS,
     "program_blocks(device, head_dim=64) -> (family, block_q, block_k) that this OpenCL\n"
     "device's float32 backward of that head dim runs with (what orchard-tune stores):\n"
     "ORCHARD_CL_BLOCK_Q/K or a tuned record rounded and fitted by the family's rules\n"
     "(builds the program, as a call would)"},
    {"save_tuned_blocks", (PyCFunction)(void (*)(void))save_tuned_blocks,
     METH_VARARGS | METH_KEYWORDS,
     "save_tuned_blocks(device, block_q, block_k) -> bool; stores the block sizes that programs\n"
     "built later (in new processes) use, beside the program binaries; False if the cache is off"},
    {"set_native_isa", set_native_isa, METH_O, set_native_isa_doc},
    {"to_device", (PyCFunction)(void (*)(void))or_to_device, METH_VARARGS | METH_KEYWORDS,
     to_device_doc},
    {"build_info", build_info, METH_NOARGS, build_info_doc},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    or_module_state *st = get_state(module);
    st->error = PyErr_NewExceptionWithDoc(
        "orchard_ops.OrchardError",
        "A device (OpenCL) failure; the message names the failing call and the CL error.",
        PyExc_RuntimeError, NULL);
    if (st->error == NULL)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->error, PyExc_MemoryError);
    if (bases == NULL)
        return -1;
    st->oom = PyErr_NewExceptionWithDoc(
        "orchard_ops.OrchardOutOfMemory", "A device ran out of memory (also a MemoryError).",
        bases, NULL);
    Py_DECREF(bases);
    if (st->oom == NULL)
        return -1;
    if ((st->device_array = or_device_array_type(module)) == NULL
        || (st->torch_name = PyUnicode_InternFromString("torch")) == NULL
        || (st->dlpack_name = PyUnicode_InternFromString("__dlpack__")) == NULL
        || (st->dlpack_versioned = Py_BuildValue("{s:(ii)}", "max_version", 1, 0)) == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "OrchardError", st->error) < 0
        || PyModule_AddObjectRef(module, "OrchardOutOfMemory", st->oom) < 0
        || PyModule_AddObjectRef(module, "DeviceArray", (PyObject *)st->device_array) < 0
        || PyModule_AddStringConstant(module, "__version__", ORCHARD_VERSION) < 0)
        return -1;
    or_isa_from_environment();
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    or_module_state *st = get_state(module);
    Py_VISIT(st->error);
    Py_VISIT(st->oom);
    Py_VISIT(st->device_array);
    Py_VISIT(st->torch_name);
    Py_VISIT(st->dlpack_name);
    Py_VISIT(st->dlpack_versioned);
    Py_VISIT(st->torch);
    return 0;
}

static int module_clear(PyObject *module)
{
    or_module_state *st = get_state(module);
    Py_CLEAR(st->error);
    Py_CLEAR(st->oom);
    Py_CLEAR(st->device_array);
    Py_CLEAR(st->torch_name);
    Py_CLEAR(st->dlpack_name);
    Py_CLEAR(st->dlpack_versioned);
    Py_CLEAR(st->torch);
    return 0;
}

static void module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "orchard_ops",
    .m_doc = "Exact FlashAttention forward and backward in O(N) memory (native CPU path).",
    .m_size = sizeof(or_module_state),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit_orchard_ops(void)
{
    return PyModuleDef_Init(&moduledef);
}
