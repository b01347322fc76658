/* The one native batch reader (kvwire/_native/scan.h) as decode_batch and
 * the tests see it: whether a payload is inside the subset it reads, and
 * the flat view it gives the index, the mirror and the receive check. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_native/scan.h"

/* The DecodeLimits last given (a frozen struct, held so its id is not
 * reused) and its bounds: read once, not on every small payload. */
static PyObject *last_limits;
static KvLimits last_lim;
static int last_bad;

/* Read payload with limits into s; 0, FALL (with no exception) or -1. */
static int scan(PyObject *payload, PyObject *limits, KvScan *s) {
    if (limits != last_limits) {
        int bad = kvs_limits_of(limits, &last_lim);
        if (bad < 0) return -1;
        last_bad = bad;
        Py_XSETREF(last_limits, Py_NewRef(limits));
    }
    if (last_bad) return FALL;
    s->lim = last_lim;
    int rc;
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not bytes-like: decode_batch says what it is */
        return FALL;
    }
    Rd r = {view.buf, view.len, 0};
    rc = kvs_batch(s, &r);
    PyBuffer_Release(&view);
    if (rc < 0) PyErr_NoMemory();
    return rc;
}

static PyObject *int_of(uint64_t v, int neg) {
    return neg ? PyLong_FromLongLong((long long)v) : PyLong_FromUnsignedLongLong(v);
}

/* check(payload, limits) -> (events, data_parallel_rank, cleared) | None */
static PyObject *check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check(payload, limits) takes 2 arguments");
        return NULL;
    }
    KvScan s = {.keep_hashes = 0};
    int rc = scan(args[0], args[1], &s);
    Py_ssize_t m = s.ev_len;
    kvs_free(&s);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *rank = s.has_rank ? int_of(s.rank, s.rank_neg) : Py_NewRef(Py_None);
    if (!rank) return NULL;
    return Py_BuildValue("(nNO)", m, rank, s.cleared ? Py_True : Py_False);
}

static PyObject *opt_str(const char *p, Py_ssize_t n) {
    return n < 0 ? Py_NewRef(Py_None) : PyUnicode_FromStringAndSize(p, n);
}

/* view(payload, limits) -> [event] | None, an event (kind, hashes, parent,
 * tokens, block_size, medium, lora_name, group_idx, extras). */
static PyObject *view(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "view(payload, limits) takes 2 arguments");
        return NULL;
    }
    KvScan s = {.keep_hashes = 1, .keep_events = 1};
    int rc = scan(args[0], args[1], &s);
    if (rc) {
        kvs_free(&s);
        return rc < 0 ? NULL : Py_NewRef(Py_None);
    }
    static const char *const kinds[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
    PyObject *out = PyList_New(s.ev_len);
    for (Py_ssize_t k = 0; out && k < s.ev_len; k++) {
        const KvEv *ev = &s.ev[k];
        PyObject *hashes = PyList_New(ev->kind == EV_CLEARED ? 0 : ev->n);
        for (Py_ssize_t j = 0; hashes && ev->kind != EV_CLEARED && j < ev->n; j++) {
            PyObject *h = PyLong_FromUnsignedLongLong(s.h[ev->hoff + j]);
            if (!h) Py_CLEAR(hashes);
            else PyList_SET_ITEM(hashes, j, h);
        }
        PyObject *item = hashes == NULL ? NULL
            : Py_BuildValue("(sNNNnNNNI)", kinds[ev->kind], hashes,
                            ev->has_parent ? PyLong_FromUnsignedLongLong(ev->parent) : Py_NewRef(Py_None),
                            ev->tok ? PyBytes_FromStringAndSize((const char *)ev->tok, ev->tok_len)
                                    : Py_NewRef(Py_None),
                            ev->block_size, opt_str(ev->medium, ev->medium_len),
                            opt_str(ev->lora, ev->lora_len),
                            ev->has_group ? int_of(ev->group, ev->group_neg) : Py_NewRef(Py_None),
                            ev->extras);
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, item);
    }
    kvs_free(&s);
    return out;
}

/* fields() -> (BlockStored's fields, BlockRemoved's): the scanner's table. */
static PyObject *fields(PyObject *self, PyObject *unused) {
    PyObject *stored = PyTuple_New(N_STORED), *removed = PyTuple_New(N_REMOVED);
    for (int f = 0; stored && removed && f < N_STORED; f++) {
        PyObject *name = PyUnicode_FromStringAndSize(FIELD_NAMES[f].s, FIELD_NAMES[f].n);
        if (!name) Py_CLEAR(stored);
        else PyTuple_SET_ITEM(stored, f, name);
    }
    for (int k = 0; stored && removed && k < N_REMOVED; k++) {
        int f = REMOVED_FIELDS[k];
        PyObject *name = PyUnicode_FromStringAndSize(FIELD_NAMES[f].s, FIELD_NAMES[f].n);
        if (!name) Py_CLEAR(removed);
        else PyTuple_SET_ITEM(removed, k, name);
    }
    if (!stored || !removed) {
        Py_XDECREF(stored);
        Py_XDECREF(removed);
        return NULL;
    }
    return Py_BuildValue("(NN)", stored, removed);
}

static PyMethodDef methods[] = {
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL,
     "check(payload, limits) -> (events, data_parallel_rank, cleared) | None: a payload the\n"
     "native reader vouches decode_batch(payload, limits) accepts; None: outside what it reads."},
    {"view", (PyCFunction)(void (*)(void))view, METH_FASTCALL,
     "view(payload, limits) -> [(kind, hashes, parent, tokens, block_size, medium, lora_name,\n"
     "group_idx, extras)] | None: the flat view every native consumer reads."},
    {"fields", fields, METH_NOARGS,
     "fields() -> (BlockStored's field names, BlockRemoved's), in positional order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.wire._scan", "The one native batch payload reader.", -1, methods,
};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
