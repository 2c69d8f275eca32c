/* kv_append.c - new keys and values written into a KV cache by the forward that reads it, as
 * FlashAttention-2's flash_attn_with_kvcache appends k and v at cache_seqlens.
 *
 * k_new and v_new hold n rows for every kv unit: a dense call's in k's and v's own layout with
 * n rows on the sequence axis, a varlen call's (batch_size, n, Hkv, D / Dv). They become the
 * last n rows of each sequence (up to seqused_k, or its slot's length in cu_seqlens_k; some
 * may lie before leftpad_k, unread, in pages checked here), written into k's and v's memory,
 * rows or pages, once every argument is checked and just before the kernels run: a call
 * refused for its arguments leaves the cache as it was (one whose kernels fail later, out of
 * memory or on a device, has written it). They are copied first, so new rows that overlap the
 * cache's memory read as they were before the write; q is read after it.
 */
#include <string.h>

#include "pyorchard.h"

static const char *const names[2] = {"k_new", "v_new"};

/* The shape a varlen call's new rows, or a dense call's, must have, for messages. */
static const char *layout(const or_call *c)
{
    if (c->varlen)
        return "(batch_size, n, Hkv, D): n new rows for every sequence";
    return c->seqlen_first ? "(..., n, Hkv, D): k's shape with n new rows for its Nk"
                           : "(..., Hkv, n, D): k's shape with n new rows for its Nk";
}

/* Refuses what cannot take a write in place: a DeviceArray, a copy staged for the kernels, a
 * read-only array, rows that share memory, a torch tensor torch would not write so. */
static int check_cache(const or_call *c, int slot)
{
    const char *name = slot == OR_K ? "k" : "v";
    PyArrayObject *a = c->arr[slot];
    const char *why = NULL;
    if (c->resident)
        why = "is a DeviceArray: new rows are written into host arrays";
    else if (c->staged[slot])
        why = c->staged[slot] == 1
                  ? "is read through a copy (it is not contiguous in its last dimension, "
                    "aligned and in native byte order), so the new rows would not reach it"
                  : "is not a NumPy array or a DLPack tensor: the array NumPy makes of it may "
                    "be memory of its own, which the new rows would not reach";
    else if (!PyArray_ISWRITEABLE(a))
        why = "is read-only (as is a DLPack producer's tensor that does not say it may be "
              "written)";
    for (int i = 0; why == NULL && i < PyArray_NDIM(a) - 1; i++)
        if (PyArray_STRIDE(a, i) == 0 && PyArray_DIM(a, i) > 1)
            why = "is an expanded view (stride 0): its rows share memory";
    if (why == NULL && c->p.pages.rows && c->p.pages.count > 1
        && (slot == OR_K ? c->p.pages.k_stride : c->p.pages.v_stride) == 0)
        why = "is an expanded view (stride 0): its pages share memory";
    if (why == NULL && or_torch_write_refusal(c->st, c->obj[slot], &why) < 0)
        return -1;
    if (why == NULL)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s(): '%s' %s; it cannot take '%s'", c->func, name, why,
                 names[slot - OR_K]);
    return -1;
}

/* k_new or v_new as a C-contiguous (kv units..., n, D) copy, its shape checked against k's
 * or v's (dense) or the sequences' (varlen); n returned in *n, or checked against it. */
static PyArrayObject *load_rows(or_call *c, PyObject *obj, int slot, or_ssize *n)
{
    const char *name = names[slot - OR_K];
    or_dtype dt;
    int copied;
    /* (NumPy would read it as an object, in a resident call too: a DeviceArray cache is
     * refused by check_cache, after the new rows are read) */
    if (or_device_array_index(c->st, obj) >= 0) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' is a DeviceArray: new rows go into "
                     "a host cache, from a host array or tensor (.numpy() brings it back)",
                     c->func, name);
        return NULL;
    }
    PyArrayObject *given = or_operand_view(c->st, obj, c->func, name, &dt, &copied);
    PyArrayObject *a = NULL, *rows = NULL;
    if (given == NULL)
        return NULL;
    if (dt != c->dt[slot]) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' has dtype %s but '%s' has %s",
                     c->func, name, or_dtypes[dt].name, slot == OR_K ? "k" : "v",
                     or_dtypes[c->dt[slot]].name);
        goto done;
    }
    /* the new rows of kv unit w, as k's rows: (..., Hkv, n, D) */
    PyArrayObject *cache = c->arr[slot];
    const int nd = PyArray_NDIM(given), want = c->varlen ? 4 : PyArray_NDIM(cache);
    const int swap = c->varlen || c->seqlen_first;     /* (..., n, Hkv, D) given */
    int ok = nd == want && (nd >= 3 || (!swap && nd >= 2));
    a = ok && swap ? (PyArrayObject *)PyArray_SwapAxes(given, nd - 3, nd - 2)
                   : (PyArrayObject *)Py_NewRef(given);
    if (a == NULL)
        goto done;
    const npy_intp width = slot == OR_K ? c->p.d : c->p.dv;
    if (c->varlen) {
        const or_ssize hkv = c->heads / c->p.prm.group;
        ok = ok && PyArray_DIM(a, 0) == PyArray_DIM(c->cu_k, 0) - 1 && PyArray_DIM(a, 1) == hkv;
    } else {
        for (int i = 0; ok && i < nd - 2; i++)
            ok = PyArray_DIM(a, i) == PyArray_DIM(cache, i);
    }
    ok = ok && PyArray_DIM(a, nd - 1) == width && (*n < 0 || PyArray_DIM(a, nd - 2) == *n);
    if (!ok) {
        PyObject *got = or_shape_str(given);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must be %s%s, got shape %S", c->func,
                         name, layout(c), slot == OR_V ? " (n as in 'k_new', D as in v)" : "",
                         got);
        Py_XDECREF(got);
        goto done;
    }
    *n = PyArray_DIM(a, nd - 2);
    /* (not counted in stats(): copied whatever their layout, into the native byte order) */
    rows = or_staged_copy(a, PyArray_TYPE(a), 1);
done:
    Py_XDECREF(a);
    Py_DECREF(given);
    return rows;
}

int or_load_new_kv(or_call *c, const or_opts *o)
{
    if (o->k_new == Py_None && o->v_new == Py_None)
        return 0;
    if (o->k_new == Py_None || o->v_new == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): '%s' must be given with '%s'", c->func,
                     o->k_new == Py_None ? "k_new" : "v_new",
                     o->k_new == Py_None ? "v_new" : "k_new");
        return -1;
    }
    or_ssize n = -1;
    if (!(c->new_kv[0] = load_rows(c, o->k_new, OR_K, &n))
        || !(c->new_kv[1] = load_rows(c, o->v_new, OR_V, &n)))
        return -1;
    if (n == 0 || c->p.n_units == 0) {     /* nothing to write: any cache will do */
        Py_CLEAR(c->new_kv[0]);
        Py_CLEAR(c->new_kv[1]);
        return 0;
    }
    for (int s = OR_K; s <= OR_V; s++) {
        const int recorded = or_torch_recorded(c->st, s == OR_K ? o->k_new : o->v_new);
        if (recorded > 0)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' requires grad, in grad mode: autograd "
                         "would not see orchard_ops write it into '%s' (write it with torch's "
                         "indexing, or under torch.no_grad())", c->func, names[s - OR_K],
                         s == OR_K ? "k" : "v");
        if (recorded != 0)
            return -1;
    }
    const or_ssize group = c->p.prm.group, hkv = c->heads / group, rows = c->p.pages.rows;
    const int64_t *lp = c->leftpad ? PyArray_DATA(c->leftpad) : NULL;
    for (or_ssize w = 0; w < c->p.n_units / group; w += hkv) {     /* a sequence's first */
        const or_ssize b = w / hkv, end = c->p.nk[w * group] + (lp ? lp[b] : 0);
        if (end < n) {
            PyErr_Format(PyExc_ValueError, "%s(): sequence %zd ends at position %zd, so it "
                         "cannot end with the %zd new rows of 'k_new'", c->func, (Py_ssize_t)b,
                         (Py_ssize_t)end, (Py_ssize_t)n);
            return -1;
        }
        /* or_check_key_ranges checked the pages from the left padding on: new rows before it
         * go into pages of their own */
        if (rows && or_check_pages(c, b, (end - n) / rows, (end - 1) / rows + 1) < 0)
            return -1;
    }
    return check_cache(c, OR_K) < 0 || check_cache(c, OR_V) < 0 ? -1 : 0;
}

/* The address of key j of kv unit w in slot s (orchard.h: or_view, or_pages); j < 0: a row
 * before the unit's first key, its left padding. */
static char *key_row(const or_problem *p, int s, or_ssize w, or_ssize j)
{
    const or_view *v = &p->view[s];
    if (!p->pages.rows)
        return v->base + v->offs[w] + j * v->row_stride;
    const or_ssize at = p->pages.first[w] + j, page = p->pages.table[w][at / p->pages.rows];
    return v->base + page * (s == OR_K ? p->pages.k_stride : p->pages.v_stride)
           + at % p->pages.rows * v->row_stride + v->offs[w];
}

int or_write_new_kv(or_call *c)
{
    if (c->new_kv[0] == NULL)
        return 0;
    /* (before the write: a failure leaves the caches as they were) */
    if (or_torch_written(c->st, c->obj[OR_K]) < 0 || or_torch_written(c->st, c->obj[OR_V]) < 0)
        return -1;
    const or_problem *p = &c->p;
    const or_ssize group = p->prm.group, units = p->n_units / group;
    for (int s = OR_K; s <= OR_V; s++) {
        PyArrayObject *rows = c->new_kv[s - OR_K];
        const int nd = PyArray_NDIM(rows);
        const or_ssize n = PyArray_DIM(rows, nd - 2);
        const size_t row_bytes = (size_t)PyArray_DIM(rows, nd - 1) * PyArray_ITEMSIZE(rows);
        const char *src = PyArray_BYTES(rows);
        for (or_ssize w = 0; w < units; w++) {
            const or_ssize nk = p->nk[w * group];
            for (or_ssize i = 0; i < n; i++, src += row_bytes)
                memcpy(key_row(p, s, w, nk - n + i), src, row_bytes);
        }
    }
    return 0;
}
