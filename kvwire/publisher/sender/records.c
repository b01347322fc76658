/* A collector batch's records: C records (Rec, CBatch) read on the engine thread; Record,
 * one of them as Python sees it; a CollectedBatch's records both ways; and
 * encode_collected (CollectedBatch.encode): any collector batch prepared with the GIL for
 * the one writer (writer.c). */
#include "pyread.h"

#include <stddef.h>
#include <stdlib.h>
#include <structmember.h>

#include "../../_native/intbuf.h"
#include "../../_native/pyext.h"

static PyObject *S_ts, *S_records, *S_rank, *S_block_size, *S_signed, *S_numpy;

/* A store's parent as an exact int in range (its bits in *pv: 0 for None); 0, or -1. */
static int rec_parent_bits(const Rec *r, IntV *pv) {
    *pv = (IntV){0, 0};
    return r->tag == T_STORE && r->parent != Py_None ? read_int(r->parent, pv) : 0;
}

/* The record now holds its hashes, token ids and parent as copied values (v, ended):
 * their references go. */
static void rec_hold(Rec *r, u64 *v, size_t nh, size_t nt, IntV pv) {
    r->vals = v;
    r->nh = nh;
    r->nt = nt;
    r->pv = pv.bits;
    r->has_parent = r->tag == T_STORE && r->parent != Py_None;
    Py_CLEAR(r->hashes);
    Py_CLEAR(r->tokens);
    Py_CLEAR(r->parent);
}

/* Copy a record's hashes, token ids and parent into r->vals and drop those references,
 * when they are lists or tuples of exact ints in range (hashes and the parent within
 * [-2**63, 2**64), token ids within [0, 2**32)); otherwise (or out of memory) leave the
 * record holding its references. Hashes need only their value modulo 2**64: both wire
 * forms, and Python's _hash_int, are functions of it. */
void rec_copy(Rec *r, Pool *pool) {
    PyObject *hs = r->hashes, *tk = r->tokens;
    IntV pv;
    if (!exact_seq(hs) || (tk && !exact_seq(tk)) || rec_parent_bits(r, &pv) < 0) return;
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
    rec_hold(r, v, nh, nt, pv);
}

void rec_release(Rec *r) {
    ints_free(r->vals);
    r->vals = NULL;
    for (int j = 0; j < REC_OBJECTS; j++) Py_XDECREF(r->obj[j]);
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
        b->normalized = 0;
        b->n = 0;
    }
    return b;
}

/* --- Record: one record as Python sees it ----------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Rec rec; /* references only (never vals) */
} RecordObject;

static const char *const RECORD_KINDS = "kind must be STORED (0), REMOVED (1) or CLEARED (2)";

/* Record(kind, *, block_hashes, parent_hash, token_ids, lora_name, medium, extra_keys,
 * group_idx): a stored record has every field (None where not given), a removed one its
 * block_hashes, medium and group_idx, a cleared one none. */
static PyObject *record_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"kind",   "block_hashes", "parent_hash", "token_ids", "lora_name",
                            "medium", "extra_keys",   "group_idx",   NULL};
    long kind;
    PyObject *f[REC_OBJECTS] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "l|$OOOOOOO:Record", names, &kind, &f[0], &f[1],
                                     &f[2], &f[3], &f[4], &f[5], &f[6]))
        return NULL;
    if (kind < T_STORE || kind > T_CLEAR) {
        PyErr_SetString(PyExc_ValueError, RECORD_KINDS);
        return NULL;
    }
    /* which fields each kind has: hashes parent tokens lora medium extra group */
    static const int has[3][REC_OBJECTS] = {{1, 1, 1, 1, 1, 1, 1}, {1, 0, 0, 0, 1, 0, 1}, {0}};
    for (int j = 0; j < REC_OBJECTS; j++) {
        if (f[j] && !has[kind][j]) {
            PyErr_Format(PyExc_TypeError, "a record of kind %ld has no %s", kind, names[j + 1]);
            return NULL;
        }
    }
    if (kind != T_CLEAR && (!f[0] || (kind == T_STORE && !f[2]))) {
        PyErr_SetString(PyExc_TypeError, kind == T_STORE
                                             ? "a stored record needs block_hashes and token_ids"
                                             : "a removed record needs block_hashes");
        return NULL;
    }
    RecordObject *o = (RecordObject *)type->tp_alloc(type, 0);
    if (!o) return NULL;
    o->rec.tag = kind;
    for (int j = 0; j < REC_OBJECTS; j++)
        if (has[kind][j]) o->rec.obj[j] = Py_NewRef(f[j] ? f[j] : Py_None);
    return (PyObject *)o;
}

static void record_dealloc(RecordObject *o) {
    rec_release(&o->rec);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *record_repr(RecordObject *o) {
    const Rec *r = &o->rec;
    if (r->tag == T_STORE)
        return PyUnicode_FromFormat(
            "Record(STORED, block_hashes=%R, parent_hash=%R, token_ids=%R, lora_name=%R, "
            "medium=%R, extra_keys=%R, group_idx=%R)",
            r->hashes, r->parent, r->tokens, r->lora, r->medium, r->extra, r->group);
    if (r->tag == T_REMOVE)
        return PyUnicode_FromFormat("Record(REMOVED, block_hashes=%R, medium=%R, group_idx=%R)",
                                    r->hashes, r->medium, r->group);
    return PyUnicode_FromString("Record(CLEARED)");
}

#define RECORD_FIELD(name, field, doc) \
    {name, T_OBJECT, offsetof(RecordObject, rec.field), READONLY, doc}

static PyMemberDef record_members[] = {
    {"kind", T_LONG, offsetof(RecordObject, rec.tag), READONLY,
     "STORED (0), REMOVED (1) or CLEARED (2)."},
    RECORD_FIELD("block_hashes", hashes, "The blocks' hashes (as the engine gave them)."),
    RECORD_FIELD("parent_hash", parent, "A store's parent hash, or None."),
    RECORD_FIELD("token_ids", tokens, "A store's token ids, block_size per block."),
    RECORD_FIELD("lora_name", lora, "A store's LoRA name, or None."),
    RECORD_FIELD("medium", medium, "Where the blocks live, or None."),
    RECORD_FIELD("extra_keys", extra, "A store's extra keys (one per block), or None."),
    RECORD_FIELD("group_idx", group, "The KV cache group, or None."),
    {NULL},
};

PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Record",
    .tp_basicsize = sizeof(RecordObject),
    .tp_dealloc = (destructor)record_dealloc,
    .tp_repr = (reprfunc)record_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One hook call as the collector recorded it (a store, a removal or a clear).",
    .tp_members = record_members,
    .tp_new = record_new,
};

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

/* A Record for a C record (a copied one's values as lists of new ints), or NULL with an
 * error set. */
static PyObject *record_from(const Rec *r) {
    RecordObject *o = (RecordObject *)RecordType.tp_alloc(&RecordType, 0);
    if (!o) return NULL;
    Rec *c = &o->rec;
    c->tag = r->tag;
    for (int j = 0; j < REC_OBJECTS; j++) c->obj[j] = Py_XNewRef(r->obj[j]);
    if (r->vals) { /* (copied: hashes, tokens and parent NULL until made here) */
        c->hashes = vals_list(r->vals, NULL, r->nh);
        if (r->tag == T_STORE) {
            c->tokens = vals_list(NULL, rec_tokens(r), r->nt);
            c->parent = r->has_parent ? PyLong_FromUnsignedLongLong(r->pv) : Py_NewRef(Py_None);
        }
        if (!c->hashes || (r->tag == T_STORE && (!c->tokens || !c->parent))) {
            Py_DECREF(o);
            return NULL;
        }
    }
    return (PyObject *)o;
}

/* The records as a new list of Records, or NULL with an error set. */
static PyObject *records_list(const Rec *recs, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *r = record_from(&recs[i]);
        if (!r) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, r);
    }
    return out;
}

/* A list of Records as C records (new references), or NULL: with TypeError when strict,
 * else without an error (Python then encodes the batch). */
static CBatch *cbatch_from_list(PyObject *records, int strict) {
    Py_ssize_t n = PyList_GET_SIZE(records);
    CBatch *b = cbatch_alloc((size_t)n);
    if (!b) {
        if (strict) PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        if (!Py_IS_TYPE(rec, &RecordType)) {
            if (strict)
                PyErr_Format(PyExc_TypeError, "records must be Records, not %.100s",
                             Py_TYPE(rec)->tp_name);
            cbatch_free(b);
            return NULL;
        }
        Rec r = ((RecordObject *)rec)->rec;
        for (int j = 0; j < REC_OBJECTS; j++) Py_XINCREF(r.obj[j]);
        b->recs[b->n++] = r;
    }
    return b;
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

/* A CollectedBatch's fields and records as a C batch, or NULL: with an error when strict,
 * else without one (the engine thread's read: Python then encodes the batch). */
static CBatch *collected_read(PyObject *batch, int strict) {
    PyObject *ts = PyObject_GetAttr(batch, S_ts);
    PyObject *records = ts ? PyObject_GetAttr(batch, S_records) : NULL;
    PyObject *rank = records ? PyObject_GetAttr(batch, S_rank) : NULL;
    PyObject *bs = rank ? PyObject_GetAttr(batch, S_block_size) : NULL;
    PyObject *sg = bs ? PyObject_GetAttr(batch, S_signed) : NULL;
    CBatch *b = NULL;
    if (sg && PyFloat_CheckExact(ts) && PyList_CheckExact(records) && PyLong_CheckExact(rank) &&
        PyLong_CheckExact(bs) && PyBool_Check(sg)) {
        long long r = PyLong_AsLongLong(rank);
        long size = PyLong_AsLong(bs);
        if (!PyErr_Occurred() && (b = cbatch_from_list(records, strict))) {
            b->ts = PyFloat_AS_DOUBLE(ts);
            b->rank = r;
            b->block_size = size;
            b->hash_signed = sg == Py_True;
        }
    } else if (sg && strict) {
        PyErr_SetString(PyExc_TypeError, "a CollectedBatch holds a float ts, a list of Records, "
                                         "an int rank and block_size, and a bool signed");
    }
    if (!strict) PyErr_Clear();
    Py_XDECREF(ts);
    Py_XDECREF(records);
    Py_XDECREF(rank);
    Py_XDECREF(bs);
    Py_XDECREF(sg);
    return b;
}

CBatch *read_collected(PyObject *batch) { return collected_read(batch, 0); }

/* --- encode_collected: any collector batch, prepared with the GIL for the writer ---------
 *
 * The sender thread writes a batch of exact ints and ASCII strs without the GIL. Anything
 * else the hooks accept (arrays and tensors, int subclasses, extra_keys, other strs) is
 * turned here, with the GIL, into what the same writer takes: ints exact (through
 * __index__), arrays copied as the hooks copy lists (or made lists), strs UTF-8, extra_keys
 * packed by msgspec. A value that is no 64-bit int, or a store whose token ids no longer
 * match its hashes, raises ValueError naming it. */

static const char CHANGED[] =
    "the token ids or hashes passed to stored() changed before the batch was encoded; pass "
    "lists that are not modified afterwards";

/* An int of `what` as an exact int within [-2**63, 2**64): a new reference (o itself when
 * it is one), or NULL with ValueError. */
static PyObject *exact_int(PyObject *o, const char *what) {
    IntV v;
    u64 bits;
    int is_unsigned;
    if (PyLong_CheckExact(o) && read_int(o, &v) == 0) return Py_NewRef(o);
    if (kvw_int_bits(o, &bits, &is_unsigned, what) < 0) return NULL;
    return is_unsigned ? PyLong_FromUnsignedLongLong(bits) : PyLong_FromLongLong((long long)bits);
}

/* An array's values: a new reference to an object with an integer buffer (values, or what
 * its numpy() gives: torch tensors, CUDA copies once done), or NULL with TypeError. */
static PyObject *as_array(PyObject *values, const char *what) {
    PyObject *arr = NULL;
    if (!PyUnicode_Check(values) && !PyBytes_Check(values) && !PyByteArray_Check(values)) {
        arr = PyObject_CheckBuffer(values) ? Py_NewRef(values)
                                           : PyObject_CallMethodNoArgs(values, S_numpy);
        if (!arr && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
        else if (!arr) return NULL;
    }
    if (arr && PyObject_CheckBuffer(arr)) return arr;
    Py_XDECREF(arr);
    PyErr_Format(PyExc_TypeError, "%s values must be a list, a tuple or an integer array, not %.100s",
                 what, Py_TYPE(values)->tp_name);
    return NULL;
}

/* values as a list or tuple of exact ints within 64 bits: a new reference (values itself
 * when it is one), or NULL with an error naming `what`. */
static PyObject *exact_ints(PyObject *values, const char *what) {
    IntV v;
    if (exact_seq(values)) {
        Py_ssize_t n = seq_len(values), i = 0;
        while (i < n && read_int(seq_items(values)[i], &v) == 0) i++;
        if (i == n) return Py_NewRef(values);
        PyObject *out = PyList_New(n);
        for (i = 0; out && i < n; i++) {
            if (seq_len(values) != n) { /* (an __index__ changed the list) */
                PyErr_Format(PyExc_RuntimeError, "%s values changed size while being read", what);
                Py_CLEAR(out);
                break;
            }
            PyObject *o = Py_NewRef(seq_items(values)[i]);
            PyObject *x = exact_int(o, what);
            Py_DECREF(o);
            if (!x) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, x);
        }
        return out;
    }
    PyObject *arr = as_array(values, what);
    if (!arr) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    int is_signed = kvw_int_buffer(&view, what, PyExc_ValueError);
    PyObject *out = is_signed < 0 ? NULL : PyList_New(view.shape[0]);
    const char *b = view.buf;
    Py_ssize_t n = out ? view.shape[0] : 0, stride = out ? view.strides[0] : 0;
    KVW_EACH_INT(b, stride, view.itemsize, is_signed, n, i, x, {
        PyObject *o = out ? kvw_int(x, is_signed) : NULL;
        if (!o) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, o);
    })
    PyBuffer_Release(&view);
    Py_DECREF(arr);
    return out;
}

/* Copy a record whose hashes or token ids are arrays into r->vals, as rec_copy copies
 * lists, without a Python int per value: 1 copied, 0 not (a list of other than exact
 * ints, or a token id beyond [0, 2**32): exact_ints then), -1 with an error set. */
static int rec_copy_arrays(Rec *r) {
    PyObject *src[2] = {r->hashes, r->tokens}, *arr[2] = {NULL, NULL};
    Py_buffer view[2];
    int is_signed[2] = {0, 0}, viewed[2] = {0, 0}, rc = -1;
    Py_ssize_t len[2] = {0, 0};
    const char *what[2] = {"block hash", "token id"};
    u64 *v = NULL;
    IntV pv;
    if (rec_parent_bits(r, &pv) < 0) return 0;
    for (int k = 0; k < 2; k++) {
        if (!src[k]) continue;
        if (exact_seq(src[k])) {
            len[k] = seq_len(src[k]);
            continue;
        }
        if (!(arr[k] = as_array(src[k], what[k]))) goto done;
        if (PyObject_GetBuffer(arr[k], &view[k], PyBUF_FORMAT | PyBUF_STRIDES) < 0) goto done;
        viewed[k] = 1;
        if ((is_signed[k] = kvw_int_buffer(&view[k], what[k], PyExc_ValueError)) < 0) goto done;
        len[k] = view[k].shape[0];
    }
    size_t bytes = (size_t)len[0] * sizeof(u64) + (size_t)len[1] * sizeof(uint32_t);
    if (!(v = ints_alloc(NULL, bytes))) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t *tokens = (uint32_t *)(v + len[0]);
    rc = 0;
    int neg, mixed;
    const char *b[2] = {viewed[0] ? view[0].buf : NULL, viewed[1] ? view[1].buf : NULL};
    Py_ssize_t stride[2] = {viewed[0] ? view[0].strides[0] : 0, viewed[1] ? view[1].strides[0] : 0};
    if (viewed[0]) {
        KVW_EACH_INT(b[0], stride[0], view[0].itemsize, is_signed[0], len[0], i, x, v[i] = x;)
    } else if (read_bits(src[0], v, &neg, &mixed) < 0) {
        goto done;
    }
    if (viewed[1]) {
        KVW_EACH_INT(b[1], stride[1], view[1].itemsize, is_signed[1], len[1], i, x, {
            if (x > UINT32_MAX) goto done; /* (negative ones included) */
            tokens[i] = (uint32_t)x;
        })
    } else if (src[1] && read_tokens(src[1], tokens) < 0) {
        goto done;
    }
    ints_end(v, bytes);
    rec_hold(r, v, (size_t)len[0], (size_t)len[1], pv);
    v = NULL;
    rc = 1;
done:
    ints_free(v);
    for (int k = 0; k < 2; k++) {
        if (viewed[k]) PyBuffer_Release(&view[k]);
        Py_XDECREF(arr[k]);
    }
    return rc;
}

/* A text field (lora_name, medium): None and ASCII strs as they are, any other str as its
 * UTF-8 bytes (the writer takes them in a normalized batch). 0, or -1 with an error. */
static int rec_text(PyObject **field, const char *what) {
    PyObject *o = *field;
    if (o == Py_None || (PyUnicode_CheckExact(o) && PyUnicode_IS_COMPACT_ASCII(o))) return 0;
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str or None, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    PyObject *b = s ? PyBytes_FromStringAndSize(s, n) : NULL;
    if (!b) return -1;
    Py_SETREF(*field, b);
    return 0;
}

/* Prepare one record for the writer (see above); pack(list) -> msgpack bytes. 0, or -1. */
static int rec_normalize(Rec *r, long bs, PyObject *pack) {
    if (r->tag == T_CLEAR) return 0;
    if (!r->vals) rec_copy(r, NULL); /* lists of exact ints, as the hooks copy them */
    if (!r->vals && (!exact_seq(r->hashes) || (r->tokens && !exact_seq(r->tokens))) &&
        rec_copy_arrays(r) < 0)
        return -1;
    if (!r->vals) {
        PyObject *x = exact_ints(r->hashes, "block hash");
        if (!x) return -1;
        Py_SETREF(r->hashes, x);
        if (r->tokens) {
            if (!(x = exact_ints(r->tokens, "token id"))) return -1;
            Py_SETREF(r->tokens, x);
        }
        if (r->parent && r->parent != Py_None) {
            if (!(x = exact_int(r->parent, "block hash"))) return -1;
            Py_SETREF(r->parent, x);
        }
    }
    size_t nh = r->vals ? r->nh : (size_t)seq_len(r->hashes);
    if (nh == 0) {
        PyErr_SetString(PyExc_ValueError, "a record lists no block hashes");
        return -1;
    }
    if (r->tag == T_STORE && (r->vals ? r->nt : (size_t)seq_len(r->tokens)) != nh * (size_t)bs) {
        PyErr_SetString(PyExc_ValueError, CHANGED);
        return -1;
    }
    if (rec_text(&r->medium, "medium") < 0) return -1;
    if (r->group != Py_None) {
        PyObject *g = exact_int(r->group, "group_idx");
        if (!g) return -1;
        Py_SETREF(r->group, g);
    }
    if (r->tag != T_STORE) return 0;
    if (rec_text(&r->lora, "lora_name") < 0) return -1;
    if (r->extra != Py_None) {
        if (!PyList_Check(r->extra) && !PyTuple_Check(r->extra)) {
            PyErr_Format(PyExc_TypeError, "extra_keys must be a list or None, not %.100s",
                         Py_TYPE(r->extra)->tp_name);
            return -1;
        }
        PyObject *raw = PyObject_CallOneArg(pack, r->extra);
        if (!raw) return -1;
        if (!PyBytes_CheckExact(raw)) {
            Py_DECREF(raw);
            PyErr_SetString(PyExc_TypeError, "pack() must return bytes");
            return -1;
        }
        Py_SETREF(r->extra, raw);
    }
    return 0;
}

/* encode_collected(batch, format, pack) -> bytes: CollectedBatch.encode (format: the
 * dialect's, for records). */
PyObject *encode_collected(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !Py_IS_TYPE(args[1], &EngineFormatType) ||
        !((EngineFormat *)args[1])->records) {
        PyErr_SetString(PyExc_TypeError, "encode_collected(batch, format: a format for records, pack)");
        return NULL;
    }
    CBatch *b = collected_read(args[0], 1);
    if (!b) return NULL;
    PyObject *out = NULL;
    if (b->block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %ld", b->block_size);
        goto done;
    }
    for (size_t i = 0; i < b->n; i++)
        if (rec_normalize(&b->recs[i], b->block_size, args[2]) < 0) goto done;
    b->normalized = 1;
    Buf *payload = encode_batch(b, (EngineFormat *)args[1], NULL);
    out = payload ? buf_bytes(payload) : PyErr_NoMemory();
done:
    cbatch_free(b);
    return out;
}

int records_init(void) {
    if (!(S_ts = PyUnicode_InternFromString("ts")) ||
        !(S_records = PyUnicode_InternFromString("records")) ||
        !(S_rank = PyUnicode_InternFromString("rank")) ||
        !(S_block_size = PyUnicode_InternFromString("block_size")) ||
        !(S_signed = PyUnicode_InternFromString("signed")) ||
        !(S_numpy = PyUnicode_InternFromString("numpy")))
        return -1;
    return 0;
}
