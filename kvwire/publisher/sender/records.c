/* A collector batch's records: C records (Rec, CBatch) read on the engine thread, and the
 * same records as Python objects (CollectedBatch), both ways, with the GIL. */
#include <stdlib.h>

#include "pyread.h"

static PyObject *TAGS[3], *CLEAR_RECORD; /* 0, 1, 2 and (2,) */
static PyObject *S_ts, *S_records, *S_rank, *S_block_size, *S_signed;

/* Copy a record's hashes, token ids and parent into r->vals and drop those references,
 * when they are lists or tuples of exact ints in range (hashes and the parent within
 * [-2**63, 2**64), token ids within [0, 2**32)); otherwise (or out of memory) leave the
 * record holding its references. Hashes need only their value modulo 2**64: both wire
 * forms, and Python's _hash_int, are functions of it. */
void rec_copy(Rec *r, Pool *pool) {
    PyObject *hs = r->hashes, *tk = r->tokens;
    if (!exact_seq(hs) || (tk && !exact_seq(tk))) return;
    IntV pv = {0, 0};
    int has_parent = r->tag == T_STORE && r->parent != Py_None;
    if (has_parent && read_int(r->parent, &pv) < 0) return;
    size_t nh = (size_t)seq_len(hs), nt = tk ? (size_t)seq_len(tk) : 0;
    size_t bytes = nh * sizeof(u64) + nt * sizeof(uint32_t);
    u64 *v = ints_alloc(pool, bytes);
    if (!v) return;
    int neg, mixed; /* (a hash's wire form needs only its bits) */
    if (read_bits(hs, v, &neg, &mixed) < 0 || (tk && read_tokens(tk, (uint32_t *)(v + nh)) < 0)) {
        ints_free(v);
        return;
    }
    ints_end(v, bytes);
    r->vals = v;
    r->nh = nh;
    r->nt = nt;
    r->pv = pv.bits;
    r->has_parent = has_parent;
    Py_CLEAR(r->hashes);
    Py_CLEAR(r->tokens);
    Py_CLEAR(r->parent);
}


void rec_release(Rec *r) {
    ints_free(r->vals);
    r->vals = NULL;
    Py_XDECREF(r->hashes);
    Py_XDECREF(r->parent);
    Py_XDECREF(r->tokens);
    Py_XDECREF(r->lora);
    Py_XDECREF(r->medium);
    Py_XDECREF(r->extra);
    Py_XDECREF(r->group);
}

void cbatch_free(CBatch *b) {
    if (!b) return;
    for (size_t i = 0; i < b->n; i++) rec_release(&b->recs[i]);
    free(b);
}

CBatch *cbatch_alloc(size_t n) {
    CBatch *b = malloc(sizeof(CBatch) + (n ? n : 1) * sizeof(Rec));
    if (b) {
        b->next = NULL;
        b->n = 0;
    }
    return b;
}

/* The records in CollectedBatch.records' layout (a new list of tuples), or NULL with an
 * error set. */
/* A new list of copied hashes (tokens NULL) or token ids, or NULL with an error set. */
static PyObject *vals_list(const u64 *hashes, const uint32_t *tokens, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *x = tokens ? PyLong_FromUnsignedLong(tokens[i])
                             : PyLong_FromUnsignedLongLong(hashes[i]);
        if (!x) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, x);
    }
    return out;
}

static PyObject *records_list(const Rec *recs, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        const Rec *r = &recs[i];
        PyObject *hs = NULL, *tk = NULL, *parent = NULL, *t = NULL;
        if (r->vals) { /* a copied record: lists of new ints with the values read */
            hs = vals_list(r->vals, NULL, r->nh);
            tk = r->tag == T_STORE ? vals_list(NULL, rec_tokens(r), r->nt) : Py_NewRef(Py_None);
            parent = r->has_parent ? PyLong_FromUnsignedLongLong(r->pv) : Py_NewRef(Py_None);
        } else {
            hs = Py_XNewRef(r->hashes);
            tk = Py_XNewRef(r->tokens);
            parent = Py_XNewRef(r->parent);
        }
        if (r->tag == T_STORE)
            t = hs && tk && parent ? PyTuple_Pack(8, TAGS[0], hs, parent, tk, r->lora, r->medium,
                                                  r->extra, r->group)
                                   : NULL;
        else if (r->tag == T_REMOVE)
            t = hs ? PyTuple_Pack(4, TAGS[1], hs, r->medium, r->group) : NULL;
        else
            t = Py_NewRef(CLEAR_RECORD);
        Py_XDECREF(hs);
        Py_XDECREF(tk);
        Py_XDECREF(parent);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

/* A CollectedBatch's records as C records (new references), or NULL (no error set) when
 * one is not in the collector's layout: Python then encodes the batch. */
static CBatch *cbatch_from_list(PyObject *records) {
    Py_ssize_t n = PyList_GET_SIZE(records);
    CBatch *b = cbatch_alloc((size_t)n);
    if (!b) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        IntV tag;
        if (!PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) < 1 ||
            read_int(PyTuple_GET_ITEM(rec, 0), &tag) < 0 || tag.neg || tag.bits > T_CLEAR)
            goto fail;
        Py_ssize_t len = PyTuple_GET_SIZE(rec);
        PyObject **f = ((PyTupleObject *)rec)->ob_item;
        Rec r = {.tag = (long)tag.bits};
        if (tag.bits == T_STORE) {
            if (len != 8) goto fail;
            r = (Rec){T_STORE, f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
        } else if (tag.bits == T_REMOVE) {
            if (len != 4) goto fail;
            r.hashes = f[1], r.medium = f[2], r.group = f[3];
        }
        Py_XINCREF(r.hashes);
        Py_XINCREF(r.parent);
        Py_XINCREF(r.tokens);
        Py_XINCREF(r.lora);
        Py_XINCREF(r.medium);
        Py_XINCREF(r.extra);
        Py_XINCREF(r.group);
        b->recs[b->n++] = r;
    }
    return b;
fail:
    cbatch_free(b);
    return NULL;
}

/* The CollectedBatch for a C batch (for Python to encode) with `rank` (NULL: b->rank), or
 * NULL with an error set. */
PyObject *cbatch_to_collected(PyObject *batch_type, const CBatch *b, PyObject *rank) {
    PyObject *records = records_list(b->recs, b->n);
    PyObject *r = rank ? Py_NewRef(rank) : PyLong_FromLongLong(b->rank);
    PyObject *out = records && r ? PyObject_CallFunction(batch_type, "(dOOlO)", b->ts, records, r,
                                                         b->block_size,
                                                         b->hash_signed ? Py_True : Py_False)
                                 : NULL;
    Py_XDECREF(records);
    Py_XDECREF(r);
    return out;
}

/* A CollectedBatch's fields and records as a C batch, read on the engine thread; NULL
 * (no error set) when Python is to encode it. */
CBatch *read_collected(PyObject *batch) {
    PyObject *ts = PyObject_GetAttr(batch, S_ts);
    PyObject *records = PyObject_GetAttr(batch, S_records);
    PyObject *rank = PyObject_GetAttr(batch, S_rank);
    PyObject *bs = PyObject_GetAttr(batch, S_block_size);
    PyObject *sg = PyObject_GetAttr(batch, S_signed);
    CBatch *b = NULL;
    if (ts && records && rank && bs && sg && PyFloat_CheckExact(ts) && PyList_CheckExact(records) &&
        PyLong_CheckExact(rank) && PyLong_CheckExact(bs) && PyBool_Check(sg)) {
        long long r = PyLong_AsLongLong(rank);
        long size = PyLong_AsLong(bs);
        if (!PyErr_Occurred() && (b = cbatch_from_list(records))) {
            b->ts = PyFloat_AS_DOUBLE(ts);
            b->rank = r;
            b->block_size = size;
            b->hash_signed = sg == Py_True;
        }
    }
    PyErr_Clear();
    Py_XDECREF(ts);
    Py_XDECREF(records);
    Py_XDECREF(rank);
    Py_XDECREF(bs);
    Py_XDECREF(sg);
    return b;
}

int records_init(void) {
    for (int i = 0; i < 3; i++)
        if (!(TAGS[i] = PyLong_FromLong(i))) return -1;
    if (!(CLEAR_RECORD = PyTuple_Pack(1, TAGS[T_CLEAR])) ||
        !(S_ts = PyUnicode_InternFromString("ts")) ||
        !(S_records = PyUnicode_InternFromString("records")) ||
        !(S_rank = PyUnicode_InternFromString("rank")) ||
        !(S_block_size = PyUnicode_InternFromString("block_size")) ||
        !(S_signed = PyUnicode_InternFromString("signed")))
        return -1;
    return 0;
}
