/* The one native batch reader (kvwire/_native/scan.h) as decode_batch and
 * the tests see it: whether a payload is inside the subset it reads, and
 * the flat view it gives the index, the mirror and the receive check. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_native/pyext.h"
#include "../_native/scan.h"

static KvLimitsSeen last_limits;

/* Read payload with limits into s, the payload's buffer held in *view
 * (release it after reading the view); 0, FALL (with no exception, nothing
 * held) or -1 (nothing held). */
static int scan_held(PyObject *payload, PyObject *limits, KvScan *s, Py_buffer *view) {
    int bad = kvs_limits_seen(&last_limits, limits);
    if (bad) return bad < 0 ? -1 : FALL;
    s->lim = last_limits.lim;
    if (PyObject_GetBuffer(payload, view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not bytes-like: decode_batch says what it is */
        return FALL;
    }
    Rd r = {view->buf, view->len, 0};
    int rc = kvs_batch(s, &r);
    if (rc) PyBuffer_Release(view);
    if (rc < 0) PyErr_NoMemory();
    return rc;
}

/* Read payload with limits into s; 0, FALL (with no exception) or -1. */
static int scan(PyObject *payload, PyObject *limits, KvScan *s) {
    Py_buffer view;
    int rc = scan_held(payload, limits, s, &view);
    if (rc == 0) PyBuffer_Release(&view);
    return rc;
}

/* check(payload, limits) -> (events, data_parallel_rank, cleared) | None */
static PyObject *check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "check") < 0) return NULL;
    KvScan s = {.keep_hashes = 0};
    int rc = scan(args[0], args[1], &s);
    Py_ssize_t m = s.ev_len;
    kvs_free(&s);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_None);
    return kvs_summary(&s, m);
}

/* --- decode_batch's typed path ------------------------------------------------ */

/* What bind() gave: the typed decoders (payload -> KVEventBatch) for an
 * array envelope of map events, of tagged-array events, and for a map
 * envelope; the exceptions they raise on a form only the general path reads;
 * TokenIds, msgspec.Raw; the batch and event structs. Held for the process. */
static PyObject *dec_maps, *dec_arrays, *dec_map_envelope, *dec_errors, *token_ids_type, *raw_type;
static PyObject *batch_type, *cleared_type;
static PyTypeObject *stored_type, *removed_type;
static PyObject *s_events, *s_token_ids, *s_parent, *s_hashes;
/* The medium each event struct takes when none is given (its default object:
 * msgspec's omit_defaults leaves out that object, not an equal string). */
static PyObject *stored_medium, *removed_medium;

/* A struct type's default for field f of its positional fields (by index). */
static PyObject *default_of(PyObject *type, Py_ssize_t index) {
    PyObject *fields = PyObject_GetAttrString(type, "__struct_fields__");
    PyObject *defaults = PyObject_GetAttrString(type, "__struct_defaults__");
    PyObject *out = NULL;
    if (fields && defaults && PyTuple_Check(fields) && PyTuple_Check(defaults)) {
        Py_ssize_t at = index - (PyTuple_GET_SIZE(fields) - PyTuple_GET_SIZE(defaults));
        if (at >= 0 && at < PyTuple_GET_SIZE(defaults)) out = Py_NewRef(PyTuple_GET_ITEM(defaults, at));
        else PyErr_SetString(PyExc_TypeError, "the event struct has no default medium");
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "not a msgspec struct type");
    }
    Py_XDECREF(fields);
    Py_XDECREF(defaults);
    return out;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 || !PyType_Check(args[7]) || !PyType_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "bind(maps, arrays, map_envelope, errors, TokenIds, Raw, "
                                         "KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared) "
                                         "takes 10 arguments");
        return NULL;
    }
    if (!s_events && (!(s_events = PyUnicode_InternFromString("events")) ||
                      !(s_token_ids = PyUnicode_InternFromString("token_ids")) ||
                      !(s_parent = PyUnicode_InternFromString("parent_block_hash")) ||
                      !(s_hashes = PyUnicode_InternFromString("block_hashes"))))
        return NULL;
    /* medium: BlockStored's field F_MEDIUM, BlockRemoved's REMOVED_FIELDS[1] */
    PyObject *sm = default_of(args[7], F_MEDIUM), *rm = sm ? default_of(args[8], 1) : NULL;
    if (!rm) {
        Py_XDECREF(sm);
        return NULL;
    }
    Py_XSETREF(stored_medium, sm);
    Py_XSETREF(removed_medium, rm);
    Py_XSETREF(dec_maps, Py_NewRef(args[0]));
    Py_XSETREF(dec_arrays, Py_NewRef(args[1]));
    Py_XSETREF(dec_map_envelope, Py_NewRef(args[2]));
    Py_XSETREF(dec_errors, Py_NewRef(args[3]));
    Py_XSETREF(token_ids_type, Py_NewRef(args[4]));
    Py_XSETREF(raw_type, Py_NewRef(args[5]));
    Py_XSETREF(batch_type, Py_NewRef(args[6]));
    Py_XSETREF(stored_type, (PyTypeObject *)Py_NewRef(args[7]));
    Py_XSETREF(removed_type, (PyTypeObject *)Py_NewRef(args[8]));
    Py_XSETREF(cleared_type, Py_NewRef(args[9]));
    Py_RETURN_NONE;
}

/* A hash read as a negative int (signed int64, the TensorRT-LLM/SGLang form):
 * 1 and *masked its unsigned 64-bit id; 0: not negative; -1 with an exception. */
static int negative(PyObject *h, uint64_t *masked) {
    int over;
    long long v = PyLong_AsLongLongAndOverflow(h, &over);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (over || v >= 0) return 0;
    *masked = (uint64_t)v;
    return 1;
}

/* An event's block_hashes with the negative ones masked to unsigned (a new
 * list, set in place), or left as they are. */
static int fix_hashes(PyObject *e) {
    PyObject *hashes = PyObject_GetAttr(e, s_hashes), *fixed = NULL;
    if (!hashes) return -1;
    int rc = -1;
    if (!PyList_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "block_hashes is not a list");
        goto out;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *h = PyList_GET_ITEM(hashes, j);
        uint64_t m;
        int neg = negative(h, &m);
        if (neg < 0) goto out;
        if (!neg && !fixed) continue;
        if (!fixed) {
            if (!(fixed = PyList_GetSlice(hashes, 0, n))) goto out;
        }
        if (neg) {
            PyObject *u = PyLong_FromUnsignedLongLong(m);
            if (!u) goto out;
            PyList_SetItem(fixed, j, u); /* steals u, drops the old item */
        }
    }
    rc = fixed ? PyObject_GenericSetAttr(e, s_hashes, fixed) : 0;
out:
    Py_XDECREF(fixed);
    Py_DECREF(hashes);
    return rc;
}

/* Fix-ups in place, on events no one else has seen yet (every bound was
 * checked by the scanner): each store's packed token ids wrapped in
 * TokenIds, negative hashes masked to unsigned. The structs are frozen:
 * written as msgspec.structs.force_setattr writes (they are gc=False). */
static int fix_events(PyObject *batch) {
    PyObject *events = PyObject_GetAttr(batch, s_events);
    if (!events) return -1;
    int rc = -1;
    if (!PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "events is not a list");
        goto out;
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(events); k++) {
        PyObject *e = PyList_GET_ITEM(events, k);
        PyTypeObject *t = Py_TYPE(e);
        if (t == stored_type) {
            PyObject *raw = PyObject_GetAttr(e, s_token_ids);
            if (!raw) goto out;
            PyObject *tokens = PyObject_Vectorcall(token_ids_type, &raw, 1, NULL);
            Py_DECREF(raw);
            if (!tokens) goto out;
            int set = PyObject_GenericSetAttr(e, s_token_ids, tokens);
            Py_DECREF(tokens);
            if (set < 0) goto out;
            PyObject *parent = PyObject_GetAttr(e, s_parent);
            if (!parent) goto out;
            uint64_t m;
            int neg = parent == Py_None ? 0 : negative(parent, &m);
            Py_DECREF(parent);
            if (neg < 0) goto out;
            if (neg) {
                PyObject *u = PyLong_FromUnsignedLongLong(m);
                if (!u) goto out;
                set = PyObject_GenericSetAttr(e, s_parent, u);
                Py_DECREF(u);
                if (set < 0) goto out;
            }
        } else if (t != removed_type) {
            continue;
        }
        if (fix_hashes(e) < 0) goto out;
    }
    rc = 0;
out:
    Py_DECREF(events);
    return rc;
}

static PyObject *opt_str(const char *p, Py_ssize_t n) {
    return n < 0 ? Py_NewRef(Py_None) : PyUnicode_FromStringAndSize(p, n);
}

/* An event's hashes as a new list of ints (none for a clear). */
static PyObject *hashes_of(const KvScan *s, const KvEv *ev) {
    return kvw_u64_list(ev->n ? s->h + ev->hoff : NULL, ev->n); /* (a clear's hoff is -1) */
}

/* A store's packed token ids as decode_batch hands them out: TokenIds(Raw). */
static PyObject *token_ids_of(const KvEv *ev) {
    PyObject *packed = PyBytes_FromStringAndSize((const char *)ev->tok, ev->tok_len);
    if (!packed) return NULL;
    PyObject *raw = PyObject_Vectorcall(raw_type, &packed, 1, NULL);
    Py_DECREF(packed);
    if (!raw) return NULL;
    PyObject *tokens = PyObject_Vectorcall(token_ids_type, &raw, 1, NULL);
    Py_DECREF(raw);
    return tokens;
}

/* One event of the view as its struct: its fields by the table's ids, in
 * positional order (BlockStored's up to group_idx; BlockRemoved's
 * REMOVED_FIELDS), the ones the view does not hold at their defaults. */
static PyObject *event_of(const KvScan *s, const KvEv *ev, const Py_buffer *payload) {
    if (ev->kind == EV_CLEARED) return PyObject_CallNoArgs(cleared_type);
    PyObject *v[F_GROUP + 1] = {NULL}, *e = NULL;
    int stored = ev->kind == EV_STORED;
    if (!(v[F_HASHES] = hashes_of(s, ev))) goto out;
    /* none given: the view's medium is not in the payload */
    const char *p = payload->buf;
    int given = ev->medium_len < 0 || (ev->medium >= p && ev->medium < p + payload->len);
    v[F_MEDIUM] = given ? opt_str(ev->medium, ev->medium_len)
                        : Py_NewRef(stored ? stored_medium : removed_medium);
    v[F_GROUP] = ev->has_group ? kvw_int(ev->group, ev->group_neg) : Py_NewRef(Py_None);
    if (!v[F_MEDIUM] || !v[F_GROUP]) goto out;
    if (!stored) {
        PyObject *args[3] = {v[REMOVED_FIELDS[0]], v[REMOVED_FIELDS[1]], v[REMOVED_FIELDS[2]]};
        e = PyObject_Vectorcall((PyObject *)removed_type, args, 3, NULL);
        goto out;
    }
    v[F_PARENT] = ev->has_parent ? PyLong_FromUnsignedLongLong(ev->parent) : Py_NewRef(Py_None);
    v[F_TOKENS] = token_ids_of(ev);
    v[F_BS] = PyLong_FromSsize_t(ev->block_size);
    v[F_LORA_ID] = Py_NewRef(Py_None);
    v[F_LORA_NAME] = opt_str(ev->lora, ev->lora_len);
    v[F_EXTRA] = Py_NewRef(Py_None);
    for (int f = 0; f <= F_GROUP; f++)
        if (!v[f]) goto out;
    e = PyObject_Vectorcall((PyObject *)stored_type, v, F_GROUP + 1, NULL);
out:
    for (int f = 0; f <= F_GROUP; f++) Py_XDECREF(v[f]);
    return e;
}

/* The batch a scan read, built from its flat view (no second walk). */
static PyObject *batch_of(const KvScan *s, const Py_buffer *payload) {
    PyObject *a[3] = {PyFloat_FromDouble(s->ts), PyList_New(s->ev_len),
                      s->has_rank ? kvw_int(s->rank, s->rank_neg) : Py_NewRef(Py_None)};
    PyObject *batch = NULL;
    if (!a[0] || !a[1] || !a[2]) goto out;
    for (Py_ssize_t k = 0; k < s->ev_len; k++) {
        PyObject *e = event_of(s, &s->ev[k], payload);
        if (!e) goto out;
        PyList_SET_ITEM(a[1], k, e);
    }
    batch = PyObject_Vectorcall(batch_type, a, 3, NULL);
out:
    for (int i = 0; i < 3; i++) Py_XDECREF(a[i]);
    return batch;
}

/* The typed path's scratch, kept between calls (under the GIL; a call made
 * while it is in use, which nothing does, scans into its own). */
/* What the scratch keeps after a larger batch (events, hashes): under 0.5 MB. */
#define SCRATCH_KEEP 4096
static KvScan scratch;
static int scratch_busy;

/* typed(payload, limits) -> KVEventBatch | None */
static PyObject *typed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "typed") < 0) return NULL;
    if (!dec_maps) {
        PyErr_SetString(PyExc_RuntimeError, "kvwire.wire._scan.bind() was not called");
        return NULL;
    }
    KvScan own = {0}, *s = scratch_busy ? &own : &scratch;
    int busy = scratch_busy;
    scratch_busy = 1;
    s->keep_hashes = s->keep_events = 1;
    s->ev_len = s->h_len = 0;
    Py_buffer view;
    PyObject *out = NULL;
    int rc = scan_held(args[0], args[1], s, &view);
    if (rc) {
        out = rc < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    int map_envelope = view.len > 0 && is_map_head(((const unsigned char *)view.buf)[0]);
    if (!(s->extras & (X_EXTRA | X_LOOKAHEAD | X_SALT | X_OTHER)) && !s->unviewed) {
        /* Every field given is in the view: the structs straight from it. */
        out = batch_of(s, &view);
        PyBuffer_Release(&view);
        goto done;
    }
    PyBuffer_Release(&view);
    unsigned forms = s->forms;
    /* Rarer fields: msgspec reads the events, all in one form (maps, or in an
     * array envelope tagged arrays); a batch of both is the general path's. */
    if ((forms & KVS_ARRAYS) && (map_envelope || (forms & KVS_MAPS))) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *dec = map_envelope ? dec_map_envelope : forms == KVS_ARRAYS ? dec_arrays : dec_maps;
    out = PyObject_Vectorcall(dec, args, 1, NULL);
    if (!out) {
        if (PyErr_ExceptionMatches(dec_errors)) {
            PyErr_Clear(); /* a form only the general path reads (old SGLang's) */
            out = Py_NewRef(Py_None);
        }
    } else if (fix_events(out) < 0) {
        Py_CLEAR(out);
    }
done:
    if (s == &own) kvs_free(&own);
    else kvs_trim(s, SCRATCH_KEEP);
    scratch_busy = busy;
    return out;
}

/* view(payload, limits) -> [event] | None, an event (kind, hashes, parent,
 * tokens, block_size, medium, lora_name, group_idx, extras). */
static PyObject *view(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "view") < 0) return NULL;
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
        PyObject *hashes = hashes_of(&s, ev);
        PyObject *item = hashes == NULL ? NULL
            : Py_BuildValue("(sNNNnNNNI)", kinds[ev->kind], hashes,
                            ev->has_parent ? PyLong_FromUnsignedLongLong(ev->parent) : Py_NewRef(Py_None),
                            ev->tok ? PyBytes_FromStringAndSize((const char *)ev->tok, ev->tok_len)
                                    : Py_NewRef(Py_None),
                            ev->block_size, opt_str(ev->medium, ev->medium_len),
                            opt_str(ev->lora, ev->lora_len),
                            ev->has_group ? kvw_int(ev->group, ev->group_neg) : Py_NewRef(Py_None),
                            ev->extras);
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, item);
    }
    kvs_free(&s);
    return out;
}

/* The names of n fields of the table (ids; NULL: the first n), as a new tuple. */
static PyObject *names_of(const int *ids, int n) {
    PyObject *out = PyTuple_New(n);
    for (int k = 0; out && k < n; k++) {
        int f = ids ? ids[k] : k;
        PyObject *name = PyUnicode_FromStringAndSize(FIELD_NAMES[f].s, FIELD_NAMES[f].n);
        if (!name) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, k, name);
    }
    return out;
}

/* fields() -> (BlockStored's fields, BlockRemoved's): the scanner's table. */
static PyObject *fields(PyObject *self, PyObject *unused) {
    PyObject *stored = names_of(NULL, N_STORED);
    PyObject *removed = stored ? names_of(REMOVED_FIELDS, N_REMOVED) : NULL;
    if (!removed) {
        Py_XDECREF(stored);
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
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(maps, arrays, map_envelope, errors, TokenIds, Raw, KVEventBatch, BlockStored,\n"
     "BlockRemoved, AllBlocksCleared): the typed decoders typed() calls for the rarer fields\n"
     "(each payload -> KVEventBatch) and the types it builds."},
    {"typed", (PyCFunction)(void (*)(void))typed, METH_FASTCALL,
     "typed(payload, limits) -> KVEventBatch | None: decode_batch's typed path, for a payload\n"
     "the native reader vouches for (token ids wrapped, hashes unsigned); None: the general path's."},
    {"fields", fields, METH_NOARGS,
     "fields() -> (BlockStored's field names, BlockRemoved's), in positional order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.wire._scan", "The one native batch payload reader.", -1, methods,
};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
