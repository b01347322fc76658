/* EventCollector's hooks (Collector).
 *
 * EventCollector's engine-thread hooks, creating no Python object per call for lists and
 * tuples: stored()/removed()/cleared() append C records holding the values of lists and
 * tuples of exact ints (read during the call: rec_copy), else strong references to what the
 * engine passed (the contract: those lists not changed after the call), and flush() hands
 * them to the publisher's Sender as a C batch, queued like publish() queues one. Other
 * inputs go through the Python `capture` callable (arrays copied, CUDA copies queued);
 * with any other publisher, flush() builds a CollectedBatch and calls its publish(). */
#include <stdlib.h>

#include "sender.h"

static PyObject *S_publish, *S_GPU, *S_rank, *S_block_hashes, *S_token_ids;

typedef struct {
    PyObject_HEAD
    PyObject *publisher;  /* anything with .rank and .publish(batch); unused with a sender */
    Sender *sender;       /* the publisher's native sender, or NULL */
    PyObject *batch_type; /* CollectedBatch */
    PyObject *capture;    /* capture(values, what, device) -> a private snapshot */
    PyObject *device;     /* a list: CUDA copies awaiting their event */
    PyObject *mark;       /* mark(device): record the event that ends this iteration's copies */
    long block_size;
    int hash_signed;
    Py_ssize_t cap;       /* stored blocks per iteration; -1: no cap */
    Py_ssize_t stored_blocks;
    i64 batches, dropped_blocks, dropped_calls;
    Rec *recs;            /* this iteration's records */
    size_t n, ncap;
} Collector;


static PyObject *collector_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"publisher", "block_size", "signed", "cap", "sender", "batch_type",
                            "capture", "device", "mark", NULL};
    PyObject *publisher, *sender, *batch_type, *capture, *device, *mark;
    long block_size;
    int sg;
    Py_ssize_t cap;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Olpn$OOOOO", names, &publisher, &block_size, &sg,
                                     &cap, &sender, &batch_type, &capture, &device, &mark))
        return NULL;
    const char *bad = block_size < 1 ? "block_size must be >= 1"
                      : cap < -1     ? "cap must be >= 0, or -1 for none"
                      : sender != Py_None && Py_TYPE(sender) != &SenderType
                          ? "sender must be a Sender or None"
                      : !PyType_Check(batch_type) ? "batch_type must be a type"
                      : !PyCallable_Check(capture) || !PyCallable_Check(mark)
                          ? "capture and mark must be callable"
                      : !PyList_CheckExact(device) ? "device must be a list"
                                                   : NULL;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Collector *c = (Collector *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->publisher = Py_NewRef(publisher);
    c->sender = sender == Py_None ? NULL : (Sender *)Py_NewRef(sender);
    c->batch_type = Py_NewRef(batch_type);
    c->capture = Py_NewRef(capture);
    c->device = Py_NewRef(device);
    c->mark = Py_NewRef(mark);
    c->block_size = block_size;
    c->hash_signed = sg;
    c->cap = cap;
    return (PyObject *)c;
}

static void collector_drop_records(Collector *c) {
    size_t n = c->n;
    c->n = 0;
    for (size_t i = 0; i < n; i++) rec_release(&c->recs[i]);
}

static int collector_traverse(Collector *c, visitproc visit, void *arg) {
    Py_VISIT(c->publisher);
    Py_VISIT((PyObject *)c->sender);
    Py_VISIT(c->batch_type);
    Py_VISIT(c->capture);
    Py_VISIT(c->device);
    Py_VISIT(c->mark);
    for (size_t i = 0; i < c->n; i++)
        for (int j = 0; j < REC_OBJECTS; j++) Py_VISIT(c->recs[i].obj[j]);
    return 0;
}

static int collector_clear(Collector *c) {
    collector_drop_records(c);
    Py_CLEAR(c->publisher);
    Py_CLEAR(c->sender);
    Py_CLEAR(c->batch_type);
    Py_CLEAR(c->capture);
    Py_CLEAR(c->device);
    Py_CLEAR(c->mark);
    return 0;
}

static void collector_dealloc(Collector *c) {
    PyObject_GC_UnTrack(c);
    collector_clear(c);
    free(c->recs);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* Append a record, taking over its references (released here on failure). */
static int collector_append(Collector *c, Rec r) {
    if (c->n == c->ncap) {
        size_t cap = c->ncap ? c->ncap * 2 : 16;
        Rec *recs = realloc(c->recs, cap * sizeof(Rec));
        if (!recs) {
            rec_release(&r);
            PyErr_NoMemory();
            return -1;
        }
        c->recs = recs;
        c->ncap = cap;
    }
    c->recs[c->n++] = r;
    return 0;
}

/* The arguments by position (at most npos) or name into out[0..nparams); the first
 * nrequired must be given. 0, or -1 with a TypeError. */
static int parse_args(const char *fn, const char *const *names, int nparams, int npos,
                      int nrequired, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      PyObject **out) {
    for (int i = 0; i < nparams; i++) out[i] = NULL;
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional arguments but %zd were given", fn,
                     npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nparams && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) j++;
        if (j == nparams) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
            return -1;
        }
        if (out[j]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                         names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (int i = 0; i < nrequired; i++) {
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    }
    return 0;
}

/* *values as the record keeps it: lists and tuples by reference, anything else through
 * capture(). Takes over *values' reference; 0, or -1 (with *values released). */
static int collector_capture(Collector *c, PyObject **values, PyObject *what) {
    if (PyList_CheckExact(*values) || PyTuple_CheckExact(*values)) return 0;
    PyObject *args[3] = {*values, what, c->device};
    PyObject *got = PyObject_Vectorcall(c->capture, args, 3, NULL);
    Py_SETREF(*values, got);
    return got ? 0 : -1;
}

static PyObject *collector_stored(Collector *c, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    static const char *const names[] = {"block_hashes", "parent_hash", "token_ids", "lora_name",
                                        "medium", "extra_keys", "group_idx"};
    PyObject *a[7];
    if (parse_args("stored", names, 7, 3, 3, args, nargs, kwnames, a) < 0) return NULL;
    Py_ssize_t n = PyObject_Length(a[0]);
    if (n < 0) return NULL;
    Py_ssize_t nt = PyObject_Length(a[2]);
    if (nt < 0) return NULL;
    Py_ssize_t bs = c->block_size, want;
    if (__builtin_mul_overflow(n, bs, &want) || nt != want) {
        PyErr_Format(PyExc_ValueError,
                     "stored() got %zd token ids for %zd blocks of %zd: only full blocks are "
                     "published",
                     nt, n, bs);
        return NULL;
    }
    if (!n) Py_RETURN_NONE;
    PyObject *keys = a[5] ? a[5] : Py_None;
    if (keys != Py_None) {
        Py_ssize_t ne = PyObject_Length(keys);
        if (ne < 0) return NULL;
        if (ne != n) {
            PyErr_Format(PyExc_ValueError, "extra_keys has %zd entries for %zd blocks", ne, n);
            return NULL;
        }
        if (!(keys = PySequence_List(keys))) return NULL;
    } else {
        Py_INCREF(keys);
    }
    PyObject *hs = Py_NewRef(a[0]), *toks = Py_NewRef(a[2]);
    if (c->cap >= 0) {
        if (c->stored_blocks + n > c->cap) {
            Py_ssize_t keep = c->cap - c->stored_blocks;
            if (keep < 0) keep = 0;
            c->dropped_blocks += n - keep;
            c->dropped_calls++;
            if (keep == 0) {
                Py_DECREF(hs);
                Py_DECREF(toks);
                Py_DECREF(keys);
                Py_RETURN_NONE;
            }
            Py_SETREF(hs, PySequence_GetSlice(hs, 0, keep));
            if (hs) Py_SETREF(toks, PySequence_GetSlice(toks, 0, keep * bs));
            if (hs && toks && keys != Py_None) Py_SETREF(keys, PyList_GetSlice(keys, 0, keep));
            if (!hs || !toks || !keys) goto fail;
            n = keep;
        }
        c->stored_blocks += n;
    }
    if (collector_capture(c, &hs, S_block_hashes) < 0 ||
        collector_capture(c, &toks, S_token_ids) < 0)
        goto fail;
    Rec r = {.tag = T_STORE, .hashes = hs, .parent = Py_NewRef(a[1]), .tokens = toks,
             .lora = Py_NewRef(a[3] ? a[3] : Py_None), .medium = Py_NewRef(a[4] ? a[4] : S_GPU),
             .extra = keys, .group = Py_NewRef(a[6] ? a[6] : Py_None)};
    /* lists and tuples of ints read now, while hot (not arrays' snapshots) */
    rec_copy(&r, c->sender ? c->sender->vpool : NULL);
    if (collector_append(c, r) < 0) return NULL;
    Py_RETURN_NONE;
fail:
    Py_XDECREF(hs);
    Py_XDECREF(toks);
    Py_XDECREF(keys);
    return NULL;
}

static PyObject *collector_removed(Collector *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    static const char *const names[] = {"block_hashes", "medium", "group_idx"};
    PyObject *a[3];
    if (parse_args("removed", names, 3, 1, 1, args, nargs, kwnames, a) < 0) return NULL;
    Py_ssize_t n = PyObject_Length(a[0]);
    if (n < 0) return NULL;
    if (!n) Py_RETURN_NONE;
    PyObject *hs = Py_NewRef(a[0]);
    if (collector_capture(c, &hs, S_block_hashes) < 0) return NULL;
    Rec r = {.tag = T_REMOVE, .hashes = hs, .medium = Py_NewRef(a[1] ? a[1] : S_GPU),
             .group = Py_NewRef(a[2] ? a[2] : Py_None)};
    rec_copy(&r, c->sender ? c->sender->vpool : NULL);
    if (collector_append(c, r) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *collector_cleared(Collector *c, PyObject *unused) {
    if (collector_append(c, (Rec){.tag = T_CLEAR}) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *collector_flush(Collector *c, PyObject *unused) {
    if (!c->n) Py_RETURN_FALSE;
    if (PyList_GET_SIZE(c->device)) {
        PyObject *r = PyObject_CallOneArg(c->mark, c->device);
        if (!r) return NULL;
        Py_DECREF(r);
        if (!c->n) Py_RETURN_FALSE; /* (flushed meanwhile by another thread) */
    }
    /* The records leave the collector first, as the Python collector's list did. */
    CBatch *b = cbatch_alloc(c->n);
    if (!b) return PyErr_NoMemory();
    memcpy(b->recs, c->recs, c->n * sizeof(Rec));
    b->n = c->n;
    c->n = 0;
    c->stored_blocks = 0;
    c->batches++;
    b->ts = wall_now();
    b->block_size = c->block_size;
    b->hash_signed = c->hash_signed;
    if (c->sender) {
        /* The publisher's native sender: the records go over as they are, with its rank. */
        b->rank = c->sender->rank;
        Item it = {.kind = K_COLLECTED, .batch = b};
        return PyBool_FromLong(sender_enqueue(c->sender, &it));
    }
    PyObject *rank = PyObject_GetAttr(c->publisher, S_rank);
    PyObject *batch = rank ? cbatch_to_collected(c->batch_type, b, rank) : NULL;
    cbatch_free(b);
    Py_XDECREF(rank);
    if (!batch) return NULL;
    PyObject *out = PyObject_CallMethodOneArg(c->publisher, S_publish, batch);
    Py_DECREF(batch);
    int queued = out ? PyObject_IsTrue(out) : -1;
    Py_XDECREF(out);
    return queued < 0 ? NULL : PyBool_FromLong(queued);
}

static PyObject *collector_stats(Collector *c, PyObject *unused) {
    return Py_BuildValue("(LLL)", (long long)c->batches, (long long)c->dropped_blocks,
                         (long long)c->dropped_calls);
}

static PyMethodDef collector_methods[] = {
    {"stored", (PyCFunction)(void (*)(void))collector_stored, METH_FASTCALL | METH_KEYWORDS,
     "stored($self, block_hashes, parent_hash, token_ids, *, lora_name=None, medium='GPU', "
     "extra_keys=None, group_idx=None)\n--\n\n"
     "Blocks block_hashes (a chain under parent_hash) entered the cache. token_ids holds "
     "block_size tokens per block, in order; anything else raises ValueError (partial blocks "
     "are never published). extra_keys, when given, has one entry per block. A list or tuple "
     "argument is kept by reference until the batch is encoded: do not change it afterwards."},
    {"removed", (PyCFunction)(void (*)(void))collector_removed, METH_FASTCALL | METH_KEYWORDS,
     "removed($self, block_hashes, *, medium='GPU', group_idx=None)\n--\n\n"
     "Blocks left the cache (never dropped by the cap)."},
    {"cleared", (PyCFunction)collector_cleared, METH_NOARGS,
     "cleared($self, /)\n--\n\nThe whole prefix cache was dropped (a reset)."},
    {"flush", (PyCFunction)collector_flush, METH_NOARGS,
     "flush($self, /)\n--\n\n"
     "Publish what this iteration collected as one batch. True when a batch was queued, False "
     "when there was nothing to send (an idle engine sends nothing) or the publisher dropped it "
     "(its counters say why)."},
    {"_counters", (PyCFunction)collector_stats, METH_NOARGS,
     "_counters() -> (batches, dropped_stored_blocks, dropped_store_calls)"},
    {NULL},
};

PyTypeObject CollectorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Collector",
    .tp_basicsize = sizeof(Collector),
    .tp_dealloc = (destructor)collector_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EventCollector's base: its hooks, one iteration's records in C memory.",
    .tp_traverse = (traverseproc)collector_traverse,
    .tp_clear = (inquiry)collector_clear,
    .tp_new = collector_new,
    .tp_methods = collector_methods,
};

int collector_init(void) {
    if (!(S_publish = PyUnicode_InternFromString("publish")) ||
        !(S_GPU = PyUnicode_InternFromString("GPU")) ||
        !(S_rank = PyUnicode_InternFromString("rank")) ||
        !(S_block_hashes = PyUnicode_InternFromString("block_hashes")) ||
        !(S_token_ids = PyUnicode_InternFromString("token_ids")))
        return -1;
    return 0;
}
