/* The msgpack writer: every payload the sender sends, byte for byte what msgspec writes.
 *
 * One event writer (put_event) writes what a layout says (EngineFormat: tag, keys in order,
 * fields omitted when None, or a tagged array), from one of two sources: an engine batch's
 * struct slots as read on the engine thread, or a collector batch's records, coalesced (a
 * store continuing the previous one's chain joins its event, as does a removal following
 * one of the same medium and group) in kvwire's map or array dialect (batch.py derives
 * both from kvwire.wire.events). Plus the heartbeat. Nothing here reads a reference count or
 * takes the GIL: the sender thread calls it as it is (encode_collected prepares, with the
 * GIL, what it cannot read so). */
#include "pyread.h"
#include "../../_native/msgpack.h"
#include "../../_native/msgpack_read.h"

static inline size_t rec_nh(const Rec *r) { return r->vals ? r->nh : (size_t)seq_len(r->hashes); }
static inline size_t rec_nt(const Rec *r) { return r->vals ? r->nt : (size_t)seq_len(r->tokens); }
static inline int rec_has_parent(const Rec *r) {
    return r->vals ? r->has_parent : r->parent != Py_None;
}

/* A store record's parent (rec_has_parent), as read. */
static inline IntV rec_parent(const Rec *r) {
    IntV v = {r->pv, 0};
    if (r->vals) return v;
    read_int(r->parent, &v);
    return v;
}

/* A list or tuple (its items are checked as they are written); its length, or -1. */
static Py_ssize_t check_ints(PyObject *o) {
    if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) return -1;
    return seq_len(o);
}

/* A record's text field (lora_name, medium): None, a compact ASCII str or, in a batch
 * prepared with the GIL (normalized), the UTF-8 bytes of any other str. 0, or -1. */
static inline int rec_str(PyObject *o, const char **s, Py_ssize_t *n, int normalized) {
    if (normalized && PyBytes_CheckExact(o)) {
        *s = PyBytes_AS_STRING(o);
        *n = PyBytes_GET_SIZE(o);
        return 0;
    }
    return read_str(o, s, n);
}

static inline int same_text(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (Py_TYPE(a) != Py_TYPE(b) || a == Py_None || b == Py_None) return 0;
    const char *x, *y;
    Py_ssize_t n, m;
    rec_str(a, &x, &n, 1);
    rec_str(b, &y, &m, 1);
    return n == m && memcmp(x, y, (size_t)n) == 0;
}

/* A msgpack array's length and where its items start, or -1 (not an array). */
static Py_ssize_t array_body(PyObject *raw, const unsigned char **body) {
    Rd r = {(const unsigned char *)PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), 0};
    Py_ssize_t n;
    if (RD_ARRAY(&r, &n)) return -1;
    *body = r.p + r.i;
    return n;
}

/* Whether every record has the shape the native encoder takes (the ints in its
 * lists are checked while writing them); sets *size to an upper bound of the
 * payload's size. */
static int check_recs(const Rec *recs, size_t n, long bs, int normalized, const EngineFormat *fmt,
                      size_t *size) {
    size_t total = 64;
    for (size_t i = 0; i < n; i++) {
        const Rec *r = &recs[i];
        total += fmt->ev[r->tag].fixed;
        if (r->tag == T_CLEAR) continue;
        const char *s;
        Py_ssize_t slen, slen2 = 0, nt = 0, extra = 0;
        IntV v;
        int present;
        Py_ssize_t nh = r->vals ? (Py_ssize_t)r->nh : check_ints(r->hashes);
        if (nh <= 0 || rec_str(r->medium, &s, &slen, normalized) < 0 ||
            read_opt_int(r->group, &v, &present) < 0)
            return -1;
        if (r->tag == T_STORE) {
            nt = r->vals ? (Py_ssize_t)r->nt : check_ints(r->tokens);
            if (nt < 0 || nt != nh * bs) return -1;
            if (!r->vals && r->parent != Py_None && read_int(r->parent, &v) < 0) return -1;
            if (rec_str(r->lora, &s, &slen2, normalized) < 0) return -1;
            if (r->extra != Py_None) { /* extra_keys: packed (a msgpack array) with the GIL */
                const unsigned char *body;
                if (!normalized || !PyBytes_CheckExact(r->extra) || array_body(r->extra, &body) < 0)
                    return -1;
                extra = PyBytes_GET_SIZE(r->extra) + 16;
            }
        }
        total += 9 * (size_t)(nh + nt) + (size_t)(slen + slen2 + extra) + 32;
    }
    *size = total;
    return 0;
}

#define PREFETCH 8 /* ints ahead: their objects lie anywhere in memory */

/* A list's ints, each checked as it is read; NULL at the first that is not an exact
 * int in range. */
static unsigned char *put_ints(unsigned char *p, PyObject *seq, int hashes, int hash_signed) {
    Py_ssize_t n = seq_len(seq);
    PyObject **items = seq_items(seq);
    for (Py_ssize_t i = 0; i < n && i < PREFETCH; i++) __builtin_prefetch(items[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) __builtin_prefetch(items[i + PREFETCH]);
        IntV v;
        if (read_int(items[i], &v) < 0) return NULL;
        if (hashes) v = hash_form(v, hash_signed);
        p = kvw_put_int(p, v.bits, v.neg);
    }
    return p;
}

/* Copied hashes, in the wire's form (signed: those above 2**63 - 1 written negative). */
static unsigned char *put_hash_vals(unsigned char *p, const u64 *v, size_t n, int hash_signed) {
    for (size_t i = 0; i < n; i++) p = kvw_put_int(p, v[i], hash_signed && (i64)v[i] < 0);
    return p;
}

/* Copied token ids. */
static unsigned char *put_token_vals(unsigned char *p, const uint32_t *v, size_t n) {
    for (size_t i = 0; i < n; i++) p = kvw_put_u32(p, v[i]);
    return p;
}

static inline unsigned char *put_intv(unsigned char *p, IntV v) { return kvw_put_int(p, v.bits, v.neg); }

static unsigned char *put_opt_str(unsigned char *p, PyObject *o) {
    if (o == Py_None) {
        *p++ = 0xc0;
        return p;
    }
    const char *s;
    Py_ssize_t n;
    rec_str(o, &s, &n, 1);
    return kvw_put_str(p, s, (size_t)n);
}

/* The last hash of a store record, in the wire's form. */
static IntV last_hash(const Rec *r, int hash_signed) {
    IntV v;
    if (r->vals) v = (IntV){r->vals[r->nh - 1], 0};
    else read_int(seq_items(r->hashes)[seq_len(r->hashes) - 1], &v);
    return hash_form(v, hash_signed);
}

/* Where the event starting at record i ends (a store chain or a run of removes). */
static size_t run_end(const Rec *recs, size_t i, size_t n, int hash_signed) {
    const Rec *rec = &recs[i];
    size_t j = i + 1;
    if (rec->tag == T_STORE) {
        IntV last = last_hash(rec, hash_signed);
        for (; j < n; j++) {
            const Rec *nxt = &recs[j];
            if (nxt->tag != T_STORE || !rec_has_parent(nxt)) break;
            if (!same_text(nxt->lora, rec->lora) || !same_text(nxt->medium, rec->medium) ||
                !same_opt_int(nxt->group, rec->group) ||
                (nxt->extra == Py_None) != (rec->extra == Py_None))
                break;
            IntV parent = rec_parent(nxt);
            if (parent.bits != last.bits) break; /* both in the same form: equal iff equal bits */
            last = last_hash(nxt, hash_signed);
        }
    } else if (rec->tag == T_REMOVE) {
        for (; j < n; j++) {
            const Rec *nxt = &recs[j];
            if (nxt->tag != T_REMOVE || !same_text(nxt->medium, rec->medium) ||
                !same_opt_int(nxt->group, rec->group))
                break;
        }
    }
    return j;
}

/* The hashes (or, with `tokens`, the token ids) of records i..end as one msgpack array. */
static unsigned char *put_run(unsigned char *p, const Rec *recs, size_t i, size_t end, int tokens,
                              int hash_signed) {
    size_t n = 0;
    for (size_t k = i; k < end; k++) n += tokens ? rec_nt(&recs[k]) : rec_nh(&recs[k]);
    p = kvw_put_array_header(p, n);
    for (size_t k = i; k < end && p; k++) {
        const Rec *r = &recs[k];
        if (r->vals)
            p = tokens ? put_token_vals(p, rec_tokens(r), r->nt)
                       : put_hash_vals(p, r->vals, r->nh, hash_signed);
        else
            p = tokens ? put_ints(p, r->tokens, 0, 0) : put_ints(p, r->hashes, 1, hash_signed);
    }
    return p;
}

/* The extra_keys of records i..end (packed arrays) as one msgpack array. */
static unsigned char *put_extra_run(unsigned char *p, const Rec *recs, size_t i, size_t end) {
    const unsigned char *body;
    size_t n = 0;
    for (size_t k = i; k < end; k++) n += (size_t)array_body(recs[k].extra, &body);
    p = kvw_put_array_header(p, n);
    for (size_t k = i; k < end; k++) {
        PyObject *raw = recs[k].extra;
        array_body(raw, &body);
        size_t len = (size_t)PyBytes_GET_SIZE(raw) - (size_t)(body - (const unsigned char *)PyBytes_AS_STRING(raw));
        memcpy(p, body, len);
        p += len;
    }
    return p;
}

static unsigned char *put_envelope_head(unsigned char *p, double ts, size_t events) {
    *p++ = 0x93;
    p = kvw_put_float64(p, ts);
    return kvw_put_array_header(p, events);
}

/* The heartbeat, as encode_batch(KVEventBatch(ts, [], rank)) gives it in either dialect. */
Buf *encode_heartbeat(double ts, i64 rank, Pool *pool) {
    Buf *b = buf_new(pool, 32);
    if (!b) return NULL;
    unsigned char *p = put_envelope_head(b->data, ts, 0);
    p = kvw_put_int(p, (u64)rank, rank < 0);
    buf_end(b, p);
    return b;
}

/* --- an engine batch, as msgspec writes its structs ------------------------------------ */

/* A field value the native encoder writes as msgspec does: its size bound, or -1. */
Py_ssize_t value_size(PyObject *v) {
    const char *s;
    Py_ssize_t n;
    IntV iv;
    if (v == Py_None) return 1;
    if (PyLong_CheckExact(v)) return read_int(v, &iv) < 0 ? -1 : 9;
    if (PyUnicode_CheckExact(v)) return read_str(v, &s, &n) < 0 ? -1 : n + 5;
    if (PyList_CheckExact(v)) return 5 + 9 * seq_len(v); /* its ints checked as written */
    return -1;
}

/* A value value_size() took: None, a str, a list of ints or an int. */
static unsigned char *put_value(unsigned char *p, PyObject *v) {
    if (v == Py_None || PyUnicode_CheckExact(v)) return put_opt_str(p, v);
    if (PyList_CheckExact(v)) {
        p = kvw_put_array_header(p, (size_t)seq_len(v));
        return put_ints(p, v, 0, 0);
    }
    IntV iv;
    read_int(v, &iv);
    return put_intv(p, iv);
}

/* An engine batch's value: a copied list (v NULL) or an object. */
static unsigned char *put_field(unsigned char *p, PyObject *v, const EList *l,
                                const unsigned char *ints) {
    if (v) return put_value(p, v);
    p = kvw_put_array_header(p, (size_t)l->n);
    if (l->narrow) return put_token_vals(p, (const uint32_t *)(ints + l->off), (size_t)l->n);
    return put_hash_vals(p, (const u64 *)(ints + l->off), (size_t)l->n, l->neg);
}


/* --- one event, as its layout says ----------------------------------------------------- */

/* Where an event's field values are: an engine struct's slots as read (vals, with the
 * copied lists), or a collector's run of records i..end (a store chain, or removals). */
typedef struct EvSrc {
    PyObject *const *vals;
    const EList *lists;
    const unsigned char *ints;
    const Rec *recs;
    size_t i, end;
    long bs;
    int sg;
} EvSrc;

static inline int src_is_none(const EvLayout *lay, int j, const EvSrc *s) {
    const Rec *r = s->recs ? &s->recs[s->i] : NULL;
    switch (lay->role[j]) {
        case R_SLOT: return s->vals[j] == Py_None;
        case R_NONE: return 1;
        case R_PARENT: return !rec_has_parent(r);
        case R_LORA: return r->lora == Py_None;
        case R_MEDIUM: return r->medium == Py_None;
        case R_EXTRA: return r->extra == Py_None;
        case R_GROUP: return r->group == Py_None;
        default: return 0; /* hashes, token ids, block size */
    }
}

static unsigned char *put_src(unsigned char *p, const EvLayout *lay, int j, const EvSrc *s) {
    const Rec *r = s->recs ? &s->recs[s->i] : NULL;
    switch (lay->role[j]) {
        case R_SLOT: return put_field(p, s->vals[j], &s->lists[j], s->ints);
        case R_HASHES: return put_run(p, s->recs, s->i, s->end, 0, s->sg);
        case R_TOKENS: return put_run(p, s->recs, s->i, s->end, 1, 0);
        case R_PARENT:
            if (rec_has_parent(r)) return put_intv(p, hash_form(rec_parent(r), s->sg));
            break;
        case R_BLOCK_SIZE: return kvw_put_int(p, (u64)(i64)s->bs, s->bs < 0);
        case R_LORA: return put_opt_str(p, r->lora);
        case R_MEDIUM: return put_opt_str(p, r->medium);
        case R_EXTRA:
            if (r->extra != Py_None) return put_extra_run(p, s->recs, s->i, s->end);
            break;
        case R_GROUP: return put_value(p, r->group); /* None or an exact int */
    }
    *p++ = 0xc0; /* None */
    return p;
}

/* A layout's pre-encoded tag or key: up to 32 bytes in one fixed-size copy (the layouts'
 * bytes and the payload buffers leave 32 bytes of slack), longer ones as they are. */
static inline unsigned char *put_bytes(unsigned char *p, const unsigned char *b, size_t n) {
    if (n <= 32) memcpy(p, b, 32);
    else memcpy(p, b, n);
    return p + n;
}

/* One event: a map as msgspec writes a tagged struct (fields omitted when None where the
 * layout says so), or a tagged array. NULL at a value only Python encodes. */
static unsigned char *put_event(unsigned char *p, const EvLayout *lay, const EvSrc *s) {
    unsigned char omit[2 * EV_MAX];
    if (lay->tag_field) {
        size_t count = lay->base_count;
        for (int k = 0; k < lay->nsteps; k++) {
            const struct EvStep *st = &lay->step[k];
            omit[k] = st->omittable && src_is_none(lay, st->field, s);
            count += st->omittable && !omit[k];
        }
        if (lay->wide) {
            *p++ = 0xde;
            p = kvw_put_be(p, (u64)count, 2);
        } else {
            *p++ = (unsigned char)(0x80 | count);
        }
    } else {
        p = kvw_put_array_header(p, (size_t)lay->nfields + 1);
        memset(omit, 0, (size_t)lay->nsteps);
    }
    p = put_bytes(p, lay->enc, lay->head_len);
    for (int k = 0; k < lay->nsteps && p; k++) {
        const struct EvStep *st = &lay->step[k];
        if (omit[k]) continue;
        p = put_bytes(p, lay->enc + st->at, st->len);
        if (st->field >= 0) p = put_src(p, lay, st->field, s);
    }
    return p ? put_bytes(p, lay->enc + lay->tail_at, lay->tail_len) : NULL;
}

/* A collector batch's payload in a format for records (kvwire's dialects), or NULL when a
 * record is one only the GIL prepares (or memory ran out). Reads no reference counts. */
Buf *encode_batch(const CBatch *batch, const EngineFormat *fmt, Pool *pool) {
    const Rec *recs = batch->recs;
    size_t n = batch->n, size;
    long bs = batch->block_size;
    int sg = batch->hash_signed;
    if (bs < 1 || check_recs(recs, n, bs, batch->normalized, fmt, &size) < 0) return NULL;
    size_t events = 0;
    for (size_t i = 0; i < n; i = run_end(recs, i, n, sg)) events++;
    Buf *b = buf_new(pool, size + 48);
    if (!b) return NULL;
    unsigned char *p = put_envelope_head(b->data, batch->ts, events);
    EvSrc src = {.recs = recs, .bs = bs, .sg = sg};
    for (size_t i = 0; i < n && p; i = src.end) {
        src.i = i;
        src.end = run_end(recs, i, n, sg);
        p = put_event(p, &fmt->ev[recs[i].tag], &src);
    }
    if (!p) { /* an int only the GIL prepares (or refuses) */
        buf_unref(b);
        return NULL;
    }
    p = kvw_put_int(p, (u64)batch->rank, batch->rank < 0);
    buf_end(b, p);
    return b;
}

/* The engine batch's payload, msgspec's bytes, or NULL when a value is one only msgspec
 * encodes. Reads no reference counts. */
Buf *encode_engine(const EBatch *b, Pool *pool) {
    size_t size = 48;
    for (size_t i = 0; i < b->n; i++) {
        const EvLayout *lay = b->ev[i].lay;
        size += lay->fixed;
        for (int j = 0; j < lay->nfields; j++) {
            PyObject *v = b->ev[i].vals[j];
            Py_ssize_t vs = v ? value_size(v) : 5 + 9 * b->ev[i].lists[j].n;
            if (vs < 0) return NULL;
            size += (size_t)vs;
        }
    }
    Py_ssize_t rank_size = value_size(b->rank);
    if (rank_size < 0) return NULL;
    Buf *buf = buf_new(pool, size + (size_t)rank_size + 48);
    if (!buf) return NULL;
    unsigned char *p = put_envelope_head(buf->data, b->ts, b->n);
    for (size_t i = 0; i < b->n && p; i++) {
        EvSrc src = {.vals = b->ev[i].vals, .lists = b->ev[i].lists, .ints = b->ints};
        p = put_event(p, b->ev[i].lay, &src);
    }
    if (!p) { /* an int only msgspec encodes (or refuses) */
        buf_unref(buf);
        return NULL;
    }
    p = put_value(p, b->rank);
    buf_end(buf, p);
    return buf;
}
