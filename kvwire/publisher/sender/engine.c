/* Engine batches: an engine's own msgspec structs (vLLM's, SGLang's).
 *
 * The plugins' publish(batch) hands over the engine's KVEventBatch of tagged event structs
 * (BlockStored, BlockRemoved, AllBlocksCleared). An EngineFormat, made once from the
 * engine's classes, says where each field lies in a struct (its slot's offset) and how
 * msgspec writes it (key, omitted when None). EnginePublish reads the slots on the
 * engine thread (a new reference to each value: the structs themselves are mutable) and
 * queues them; the sender thread writes the bytes msgspec writes for the structs
 * (writer.c), for values of the kinds value_size() takes (None, exact ints, compact ASCII
 * strs, lists of exact ints). Anything else (another class, a subclass, bytes hashes,
 * extra keys...) is left to msgspec under the GIL (the format's `wrap`, then the sender's
 * `encode`), giving the same bytes. */
#include "pyread.h"

#include <stdlib.h>
#include <structmember.h>

#include "../../_native/msgpack.h"

void ebatch_free(EBatch *b) {
    if (!b) return;
    ints_free(b->ints);
    for (size_t i = 0; i < b->nvals; i++) Py_XDECREF(b->vals[i]);
    Py_XDECREF(b->rank);
    Py_XDECREF((PyObject *)b->fmt);
    free(b);
}

static inline PyObject *slot(PyObject *o, Py_ssize_t off) { return *(PyObject **)((char *)o + off); }

/* The engine batch's fields as read on the engine thread (new references; lists of exact
 * ints copied into C memory, so that no reference to them or their ints is kept), or NULL
 * (no error set) when msgspec is to encode it. */
EBatch *ebatch_read(EngineFormat *f, PyObject *batch, Pool *pool) {
    if (f->records || Py_TYPE(batch) != f->batch_cls) return NULL;
    PyObject *ts = slot(batch, f->batch_off[0]), *events = slot(batch, f->batch_off[1]),
             *rank = slot(batch, f->batch_off[2]);
    if (!ts || !events || !rank || !PyFloat_CheckExact(ts) || !PyList_CheckExact(events))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(events);
    size_t nvals = 0, nints = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(events, i);
        int k = 0;
        while (k < f->nev && f->ev[k].cls != Py_TYPE(e)) k++;
        if (k == f->nev) return NULL; /* an unknown class or a subclass */
        const EvLayout *lay = &f->ev[k];
        nvals += (size_t)lay->nfields;
        for (int j = 0; j < lay->nfields; j++) {
            PyObject *v = slot(e, lay->off[j]);
            if (v && PyList_CheckExact(v)) nints += (size_t)PyList_GET_SIZE(v);
        }
    }
    EBatch *b = malloc(sizeof(EBatch) + (size_t)n * sizeof(EEvent) +
                       nvals * (sizeof(PyObject *) + sizeof(EList)));
    if (!b) return NULL;
    *b = (EBatch){.fmt = (EngineFormat *)Py_NewRef((PyObject *)f), .ts = PyFloat_AS_DOUBLE(ts),
                  .rank = Py_NewRef(rank), .native = value_size(rank) >= 0};
    b->ev = (EEvent *)(b + 1);
    b->vals = (PyObject **)(b->ev + n);
    b->lists = (EList *)(b->vals + nvals);
    if (!(b->ints = ints_alloc(pool, nints * sizeof(u64)))) {
        ebatch_free(b);
        return NULL;
    }
    Py_ssize_t used = 0;
    int mixed;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(events, i);
        int k = 0;
        while (f->ev[k].cls != Py_TYPE(e)) k++;
        const EvLayout *lay = &f->ev[k];
        b->ev[b->n++] = (EEvent){lay, b->vals + b->nvals, b->lists + b->nvals};
        for (int j = 0; j < lay->nfields; j++) {
            PyObject *v = slot(e, lay->off[j]);
            if (!v) { /* an unset field: msgspec says what is wrong */
                ebatch_free(b);
                return NULL;
            }
            EList *l = &b->lists[b->nvals];
            *l = (EList){-1, 0, 0, 0};
            Py_ssize_t len = PyList_CheckExact(v) ? PyList_GET_SIZE(v) : -1;
            if (len >= 0 && (read_tokens(v, (uint32_t *)(b->ints + used)) == 0
                                 ? (l->narrow = 1)
                                 : read_bits(v, (u64 *)(b->ints + used), &l->neg, &mixed) == 0 &&
                                       !mixed)) {
                l->n = len;
                l->off = used;
                used += l->narrow ? (len * 4 + 7) & ~(Py_ssize_t)7 : len * 8;
                b->vals[b->nvals++] = NULL;
                continue;
            }
            /* a list held by reference holds something else than exact ints in range */
            if (PyList_CheckExact(v) || value_size(v) < 0) b->native = 0;
            b->vals[b->nvals++] = Py_NewRef(v);
        }
    }
    ints_end(b->ints, (size_t)used);
    return b;
}

/* The slot offset of `cls.name` (a struct field), or -1 with an error set. */
static Py_ssize_t field_offset(PyTypeObject *cls, PyObject *name) {
    PyObject *d = _PyType_Lookup(cls, name); /* borrowed, along the MRO */
    if (!d) {
        PyErr_Format(PyExc_ValueError, "%R has no field %R", cls, name);
        return -1;
    }
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_ValueError, "%R.%U is not a slot", cls, name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || m->offset < (Py_ssize_t)sizeof(PyObject) ||
        m->offset + (Py_ssize_t)sizeof(PyObject *) > cls->tp_basicsize) {
        PyErr_Format(PyExc_ValueError, "%R.%U is not an object slot", cls, name);
        return -1;
    }
    return m->offset;
}

static int ascii_str(PyObject *o) { return PyUnicode_CheckExact(o) && PyUnicode_IS_COMPACT_ASCII(o); }

static int engine_format_traverse(EngineFormat *f, visitproc visit, void *arg) {
    Py_VISIT((PyObject *)f->batch_cls);
    Py_VISIT(f->wrap);
    for (int k = 0; k < f->nev; k++) {
        Py_VISIT((PyObject *)f->ev[k].cls);
    }
    return 0;
}

static void engine_format_dealloc(EngineFormat *f) {
    PyObject_GC_UnTrack(f);
    Py_XDECREF((PyObject *)f->batch_cls);
    Py_XDECREF(f->wrap);
    for (int k = 0; k < f->nev; k++) {
        EvLayout *lay = &f->ev[k];
        Py_XDECREF((PyObject *)lay->cls);
        Py_XDECREF(lay->tag_field);
        Py_XDECREF(lay->tag);
        free(lay->enc);
        for (int j = 0; j < lay->nfields; j++) Py_XDECREF(lay->key[j]);
    }
    Py_TYPE(f)->tp_free((PyObject *)f);
}

/* The layout's bytes and steps (EvLayout): everything about an event that does not depend
 * on its values, encoded once. 0, or -1 with an error set. */
static int layout_steps(EvLayout *lay) {
    int map = lay->tag_field != NULL;
    if (!(lay->enc = calloc(1, lay->fixed + 32))) { /* (32: put_bytes' slack) */
        PyErr_NoMemory();
        return -1;
    }
    unsigned char *e = lay->enc, *p = e;
    if (map) p = kvw_put_str(p, PyUnicode_DATA(lay->tag_field), (size_t)PyUnicode_GET_LENGTH(lay->tag_field));
    p = kvw_put_str(p, PyUnicode_DATA(lay->tag), (size_t)PyUnicode_GET_LENGTH(lay->tag));
    lay->head_len = (size_t)(p - e);
    lay->base_count = 1;
    size_t from = (size_t)(p - e); /* constant bytes not yet in a step start here */
    for (int j = 0; j < lay->nfields; j++) {
        PyObject *key = lay->key[j];
        int omittable = map && lay->omit_none[j];
        if (lay->role[j] == R_NONE) { /* always None: left out, or constant */
            if (omittable) continue;
            if (map) p = kvw_put_str(p, PyUnicode_DATA(key), (size_t)PyUnicode_GET_LENGTH(key));
            *p++ = 0xc0;
            lay->base_count++;
            continue;
        }
        if (omittable && (size_t)(p - e) > from) { /* the constants before stay */
            lay->step[lay->nsteps++] = (struct EvStep){from, (size_t)(p - e) - from, -1, 0};
            from = (size_t)(p - e);
        }
        if (map) p = kvw_put_str(p, PyUnicode_DATA(key), (size_t)PyUnicode_GET_LENGTH(key));
        lay->base_count += !omittable;
        lay->step[lay->nsteps++] =
            (struct EvStep){from, (size_t)(p - e) - from, (short)j, (unsigned char)omittable};
        from = (size_t)(p - e);
    }
    lay->tail_at = from;
    lay->tail_len = (size_t)(p - e) - from;
    return 0;
}

/* A collector record's value for an event field, by the field's name (events.py's). */
static int record_role(PyObject *attr) {
    static const struct {
        const char *name;
        int role;
    } roles[] = {{"block_hashes", R_HASHES}, {"parent_block_hash", R_PARENT},
                 {"token_ids", R_TOKENS},    {"block_size", R_BLOCK_SIZE},
                 {"lora_name", R_LORA},      {"medium", R_MEDIUM},
                 {"extra_keys", R_EXTRA},    {"group_idx", R_GROUP}};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (PyUnicode_CompareWithASCIIString(attr, roles[i].name) == 0) return roles[i].role;
    return R_NONE; /* a field the records have no value for: always None */
}

/* EngineFormat(batch_type, (ts, events, rank), events, *, wrap=None, records=False): events
 * is a tuple of (cls, tag_field, tag, ((attr, key, omit_none), ...)), as msgspec encodes
 * them (tag_field None: a tagged array [tag, value...]); wrap(batch) makes what the sender's
 * Python `encode` takes, for the batches the thread leaves to it (msgspec's encoding, errors
 * reported as for any batch). records: a format for collector batches (kvwire's dialects),
 * its events the store, removal and clear layouts, their fields' values the records' of
 * the same names. */
static PyObject *engine_format_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"batch_type", "batch_fields", "events", "wrap", "records", NULL};
    PyObject *batch_type, *bfields, *events, *wrap = Py_None;
    int records = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!|$Op", names, &PyType_Type, &batch_type,
                                     &PyTuple_Type, &bfields, &PyTuple_Type, &events, &wrap,
                                     &records))
        return NULL;
    if (wrap != Py_None && !PyCallable_Check(wrap)) {
        PyErr_SetString(PyExc_TypeError, "wrap must be callable or None");
        return NULL;
    }
    if (PyTuple_GET_SIZE(bfields) != 3 || PyTuple_GET_SIZE(events) > 4 ||
        (records && PyTuple_GET_SIZE(events) != 3)) {
        PyErr_SetString(PyExc_ValueError, "batch_fields: (ts, events, rank); at most 4 event "
                                          "classes (for records: store, removal, clear)");
        return NULL;
    }
    EngineFormat *f = (EngineFormat *)type->tp_alloc(type, 0);
    if (!f) return NULL;
    f->batch_cls = (PyTypeObject *)Py_NewRef(batch_type);
    f->wrap = Py_NewRef(wrap);
    f->records = records;
    for (int i = 0; i < 3; i++) {
        PyObject *name = PyTuple_GET_ITEM(bfields, i);
        if (!PyUnicode_Check(name) || (f->batch_off[i] = field_offset(f->batch_cls, name)) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "field names are strs");
            goto fail;
        }
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(events); k++) {
        PyObject *cls, *tag_field, *tag, *fields;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(events, k), "O!OUO!", &PyType_Type, &cls, &tag_field,
                              &tag, &PyTuple_Type, &fields))
            goto fail;
        EvLayout *lay = &f->ev[f->nev++];
        lay->cls = (PyTypeObject *)Py_NewRef(cls);
        lay->tag_field = tag_field == Py_None ? NULL : Py_NewRef(tag_field);
        lay->tag = Py_NewRef(tag);
        if ((lay->tag_field && !ascii_str(tag_field)) || !ascii_str(tag) ||
            PyTuple_GET_SIZE(fields) > EV_MAX) {
            PyErr_SetString(PyExc_ValueError, "tags are ASCII strs; at most 64 fields");
            goto fail;
        }
        lay->wide = PyTuple_GET_SIZE(fields) + 1 >= 16;
        /* headers, the tag (and its key), then per field its key and (None, an int) value */
        lay->fixed = 8 + (lay->tag_field ? 5 + (size_t)PyUnicode_GET_LENGTH(tag_field) : 0) + 5 +
                     (size_t)PyUnicode_GET_LENGTH(tag);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(fields); j++) {
            PyObject *attr, *key;
            int omit;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, j), "UUp", &attr, &key, &omit))
                goto fail;
            if (!ascii_str(key)) {
                PyErr_SetString(PyExc_ValueError, "keys are ASCII strs");
                goto fail;
            }
            Py_ssize_t off = field_offset(lay->cls, attr);
            if (off < 0) goto fail;
            lay->off[j] = off;
            lay->key[j] = Py_NewRef(key);
            lay->omit_none[j] = (unsigned char)omit;
            lay->role[j] = (unsigned char)(records ? record_role(attr) : R_SLOT);
            lay->fixed += 5 + (size_t)PyUnicode_GET_LENGTH(key) + 9;
            lay->nfields++;
        }
        if (layout_steps(lay) < 0) goto fail;
    }
    return (PyObject *)f;
fail:
    Py_DECREF(f);
    return NULL;
}

/* encode(batch) -> bytes | None: what the sender writes for an engine batch, or None
 * when msgspec encodes it (for tests). */
static PyObject *engine_format_encode(EngineFormat *f, PyObject *batch) {
    EBatch *eb = ebatch_read(f, batch, NULL);
    Buf *b = eb ? encode_engine(eb, NULL) : NULL;
    ebatch_free(eb);
    return buf_bytes(b);
}

static PyMethodDef engine_format_methods[] = {
    {"encode", (PyCFunction)engine_format_encode, METH_O,
     "The native encoding of an engine batch, or None when msgspec encodes it."},
    {NULL},
};

PyTypeObject EngineFormatType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.EngineFormat",
    .tp_basicsize = sizeof(EngineFormat),
    .tp_dealloc = (destructor)engine_format_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Where an engine's event structs keep their fields, and how msgspec writes them.",
    .tp_traverse = (traverseproc)engine_format_traverse,
    .tp_new = engine_format_new,
    .tp_methods = engine_format_methods,
};


/* --- an engine plugin's publish(), in C --------------------------------------------------
 *
 * The engine's scheduler calls its publisher's publish(batch) once per iteration. As a
 * Python method it costs the engine thread a frame and a few attribute lookups, cold after
 * the scheduler's own work (about 1 us measured, more than the native path it leads to);
 * this callable does the same without a frame: stamp the rank where the batch leaves it
 * None, read the batch natively and queue it, or hand it to `fallback`. */

typedef struct {
    PyObject_HEAD
    Sender *sender;      /* strong */
    EngineFormat *fmt;   /* strong */
    PyObject *rank_field; /* str (strong) */
    PyObject *rank;      /* strong */
    PyObject *fallback;  /* fallback(batch): publishes what the native path leaves (strong) */
    vectorcallfunc vectorcall;
} EnginePublish;

static PyObject *engine_publish_call(EnginePublish *p, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "publish(events) takes one positional argument");
        return NULL;
    }
    if (!p->sender) { /* cleared by the cycle collector (a finalizer calling it) */
        PyErr_SetString(PyExc_RuntimeError, "publish() after the publisher was collected");
        return NULL;
    }
    PyObject *batch = args[0];
    /* getattr(batch, rank_field), read from its slot where the format knows the class;
     * only compared with None */
    PyObject *cur = Py_TYPE(batch) == p->fmt->batch_cls ? slot(batch, p->fmt->batch_off[2]) : NULL;
    if (!cur) {
        if (!(cur = PyObject_GetAttr(batch, p->rank_field))) return NULL;
        Py_DECREF(cur);
    }
    if (cur == Py_None && PyObject_SetAttr(batch, p->rank_field, p->rank) < 0) return NULL;
    EBatch *eb = ebatch_read(p->fmt, batch, p->sender->vpool);
    if (eb) {
        /* A batch of native values is not kept: the engine frees it, its lists and ints. */
        Item it = {.kind = K_ENGINE, .obj = eb->native ? NULL : Py_NewRef(batch), .engine = eb};
        sender_enqueue(p->sender, &it);
        Py_RETURN_NONE;
    }
    PyObject *r = PyObject_CallOneArg(p->fallback, batch);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *engine_publish_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"sender", "format", "rank_field", "rank", "fallback", NULL};
    PyObject *sender, *fmt, *field, *rank, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!UOO:EnginePublish", names, &SenderType,
                                     &sender, &EngineFormatType, &fmt, &field, &rank, &fallback))
        return NULL;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return NULL;
    }
    EngineFormat *f = (EngineFormat *)fmt;
    Py_ssize_t off = field_offset(f->batch_cls, field);
    if (off < 0) return NULL;
    if (off != f->batch_off[2]) {
        PyErr_Format(PyExc_ValueError, "%R is not the format's rank field", field);
        return NULL;
    }
    EnginePublish *p = (EnginePublish *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    p->sender = (Sender *)Py_NewRef(sender);
    p->fmt = (EngineFormat *)Py_NewRef(fmt);
    p->rank_field = Py_NewRef(field);
    p->rank = Py_NewRef(rank);
    p->fallback = Py_NewRef(fallback);
    p->vectorcall = (vectorcallfunc)engine_publish_call;
    return (PyObject *)p;
}

static int engine_publish_traverse(EnginePublish *p, visitproc visit, void *arg) {
    Py_VISIT((PyObject *)p->sender);
    Py_VISIT((PyObject *)p->fmt);
    Py_VISIT(p->rank_field);
    Py_VISIT(p->rank);
    Py_VISIT(p->fallback);
    return 0;
}

static int engine_publish_clear(EnginePublish *p) {
    Py_CLEAR(p->sender);
    Py_CLEAR(p->fmt);
    Py_CLEAR(p->rank_field);
    Py_CLEAR(p->rank);
    Py_CLEAR(p->fallback);
    return 0;
}

static void engine_publish_dealloc(EnginePublish *p) {
    PyObject_GC_UnTrack(p);
    engine_publish_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

PyTypeObject EnginePublishType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.EnginePublish",
    .tp_basicsize = sizeof(EnginePublish),
    .tp_dealloc = (destructor)engine_publish_dealloc,
    .tp_vectorcall_offset = offsetof(EnginePublish, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "An engine plugin's publish(events), in C: stamp the rank, queue the batch "
              "natively, or hand it to fallback.",
    .tp_traverse = (traverseproc)engine_publish_traverse,
    .tp_clear = (inquiry)engine_publish_clear,
    .tp_new = engine_publish_new,
};

