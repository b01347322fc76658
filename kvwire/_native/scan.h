/* The one native reader of a batch payload, shared by every extension that
 * reads payloads (the prefix index's fused apply, the snapshot mirror, the
 * subscriber's receive check, kvwire.wire._scan for decode_batch).
 *
 * kvs_batch checks a whole payload once against the DecodeLimits and leaves
 * a flat view of its events (KvEv: kind, hashes, parent, where the token ids
 * are, block size, medium, lora name, group, and which rarer fields were
 * given). It reads a subset of what kvwire.wire.decode_batch accepts: the
 * envelope an array [ts, events, rank?] or a map {ts, events,
 * data_parallel_rank?}, events maps (the "type" key first) or tagged arrays,
 * int hashes and token ids, ASCII strings, scalars (or arrays of scalars)
 * in the fields nobody reads. Anything else, well formed or not, is FALL:
 * the caller decodes the payload the general way, which accepts or refuses
 * it. So what is accepted here is exactly a part of what decode_batch
 * accepts, read the way it reads it (tests/wire/test_scan.py and
 * benchmarks/fuzz_campaign.py hold every reader side by side).
 *
 * A consumer may still decline an event the scanner took (the index a
 * lora_name, the mirror an AllBlocksCleared): then it leaves the payload to
 * the general way too. The first pass uses no Python API (it may run
 * without the GIL) and reports out of memory as -1 without an exception.
 * Include after <Python.h>.
 */
#ifndef KVWIRE_SCAN_H
#define KVWIRE_SCAN_H

#include "msgpack_read.h"
#include "pyext.h"

/* --- the event field table ---------------------------------------------------- */
/* BlockStored's fields in declaration (positional) order, then the tag:
 * kvwire/wire/events.py's BlockStored, BlockRemoved a subset
 * (tests/wire/test_scan.py compares the two through kvwire.wire._scan). */
enum {
    F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP,
    F_KIND, F_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, F_LOOKAHEAD, F_SALT, F_TYPE, F_COUNT,
    F_UNKNOWN = -1
};
#define FIELD_NAME(s) {s, sizeof(s) - 1}
static const struct {
    const char *s;
    Py_ssize_t n;
} FIELD_NAMES[F_COUNT] = {
    FIELD_NAME("block_hashes"), FIELD_NAME("parent_block_hash"), FIELD_NAME("token_ids"),
    FIELD_NAME("block_size"), FIELD_NAME("lora_id"), FIELD_NAME("medium"),
    FIELD_NAME("lora_name"), FIELD_NAME("extra_keys"), FIELD_NAME("group_idx"),
    FIELD_NAME("kv_cache_spec_kind"), FIELD_NAME("kv_cache_spec_sliding_window"),
    FIELD_NAME("locality"), FIELD_NAME("ownership"), FIELD_NAME("session_id"),
    FIELD_NAME("lookahead_token_ids"), FIELD_NAME("cache_salt"), FIELD_NAME("type"),
};
#undef FIELD_NAME
/* BlockRemoved's fields, positional order. */
static const int REMOVED_FIELDS[] = {F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP};
#define N_REMOVED 5
#define N_STORED F_TYPE
#define REQUIRED_STORED ((1u << F_HASHES) | (1u << F_PARENT) | (1u << F_TOKENS) | (1u << F_BS))

enum { EV_STORED, EV_REMOVED, EV_CLEARED };

/* An event's kind by its tag, -1 if none of these. */
static inline int event_kind(const char *s, Py_ssize_t n) {
    if (str_is(s, n, "BlockStored")) return EV_STORED;
    if (str_is(s, n, "BlockRemoved")) return EV_REMOVED;
    if (str_is(s, n, "AllBlocksCleared")) return EV_CLEARED;
    return -1;
}

static inline int is_field(const char *s, Py_ssize_t n, int f) {
    return n == FIELD_NAMES[f].n && memcmp(s, FIELD_NAMES[f].s, (size_t)n) == 0;
}

/* A field id by its map key, for an event of this kind (F_UNKNOWN: not its
 * field); `guess` (the field after the last one) is tried first. */
static inline int field_of(int kind, const char *s, Py_ssize_t n, int guess) {
    if (kind == EV_STORED) {
        if (guess >= 0 && guess < F_COUNT && is_field(s, n, guess)) return guess;
        for (int f = 0; f < F_COUNT; f++)
            if (is_field(s, n, f)) return f;
        return F_UNKNOWN;
    }
    if (kind == EV_REMOVED)
        for (int k = 0; k < N_REMOVED; k++)
            if (is_field(s, n, REMOVED_FIELDS[k])) return REMOVED_FIELDS[k];
    return is_field(s, n, F_TYPE) ? F_TYPE : F_UNKNOWN;
}

/* --- the flat view ------------------------------------------------------------ */

/* Rarer fields given (not nil), a bit each, for consumers that do not take them. */
enum { X_EXTRA = 1, X_LOOKAHEAD = 2, X_SALT = 4, X_OTHER = 8 /* locality, ownership, session_id */,
       X_LORA = 16 /* a lora_name */ };

typedef struct KvEv {
    int kind;                 /* EV_* */
    int has_parent, has_group, group_neg;
    unsigned extras;          /* X_* */
    uint64_t parent, group;   /* two's complement; group_neg: a negative group */
    Py_ssize_t n, hoff;       /* n hashes, at the scanner's h[hoff..) when it keeps them */
    const unsigned char *tok; /* token_ids: the packed array (tok_len bytes, ntok ids) */
    Py_ssize_t tok_len, ntok, block_size;
    const char *medium, *lora; /* into the payload; *_len -1: nil (medium "GPU" unless given) */
    Py_ssize_t medium_len, lora_len;
    /* left for the consumer: what its token reader made of the ids, its own notes */
    Py_ssize_t aux;
    int tier, ok, other;
} KvEv;

typedef struct {
    Py_ssize_t max_events, max_blocks, max_bs, max_tokens;
} KvLimits;

typedef struct KvScan KvScan;

struct KvScan {
    KvLimits lim;
    int keep_hashes; /* 0: hashes checked, not kept */
    int keep_events; /* 0: events checked and counted (ev_len), not kept */
    void *ctx;       /* the consumer's, for its token reader */
    uint64_t *h;     /* the hashes of the events read (raw allocator) */
    Py_ssize_t h_len, h_cap;
    KvEv *ev; /* the events read (raw allocator) */
    Py_ssize_t ev_len, ev_cap;
    /* the last batch read: its rank (has_rank 0: nil or absent), whether it
     * clears, its events' X_* bits together, the forms its events took
     * (KVS_MAPS, KVS_ARRAYS: together, a batch of both), whether a field
     * the view does not hold (lora_id, kv_cache_spec_*) was given, its ts */
    uint64_t rank;
    int has_rank, rank_neg, cleared;
    unsigned extras, forms, unviewed;
    double ts;
};

enum { KVS_MAPS = 1, KVS_ARRAYS = 2 };

/* The bytes an int takes by its head byte (0: not an int), as rd_int reads it. */
static const unsigned char KVS_INT_WIDTH[256] = {
    [0x00 ... 0x7f] = 1, [0xcc] = 2, [0xcd] = 3, [0xce] = 5, [0xcf] = 9,
    [0xd0] = 2, [0xd1] = 3, [0xd2] = 5, [0xd3] = 9, [0xe0 ... 0xff] = 1,
};

static inline Py_ssize_t int_width(unsigned char c) { return KVS_INT_WIDTH[c]; }

/* An array of at most max ints, skipped; *start its first byte, *count its ids. */
static inline int kvs_skip_ints(Rd *r, Py_ssize_t max, Py_ssize_t *count) {
    Py_ssize_t n;
    if (RD_ARRAY(r, &n) || n > max) return FALL;
    const unsigned char *p = r->p;
    Py_ssize_t i = r->i, end = r->n, k = 0;
    /* Four at a time while they share a width (token ids mostly do): the next
     * three heads' places are known from the first's, so their reads overlap. */
    while (n - k >= 4 && end - i >= 4 * 9) {
        if (p[i] == 0xcd && n - k >= 16 && end - i >= 48) {
            /* sixteen uint16s, most token ids of a 32k-65k vocabulary, at once */
            unsigned all = 1;
            for (int j = 3; j < 48; j += 3) all &= p[i + j] == 0xcd;
            if (all) {
                i += 48;
                k += 16;
                continue;
            }
        }
        Py_ssize_t w = int_width(p[i]);
        if (!w) return FALL;
        if (int_width(p[i + w]) == w && int_width(p[i + 2 * w]) == w &&
            int_width(p[i + 3 * w]) == w) {
            i += 4 * w;
            k += 4;
        } else {
            i += w;
            k++;
        }
    }
    for (; k < n; k++) {
        if (i >= end) return FALL;
        Py_ssize_t w = int_width(p[i]);
        if (!w) return FALL;
        i += w;
    }
    if (i > end) return FALL;
    r->i = i;
    *count = n;
    return 0;
}

/* The default token reader: the ids checked and skipped. */
static inline int kvs_tokens(KvScan *s, Rd *r, KvEv *ev) {
    Py_ssize_t start = r->i;
    if (kvs_skip_ints(r, s->lim.max_tokens, &ev->ntok)) return FALL;
    ev->tok = r->p + start;
    ev->tok_len = r->i - start;
    return 0;
}

/* n hashes into out; their usual form (uint64, 63-bit hashes) in one load. */
static inline int kvs_hashes(Rd *r, uint64_t *out, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (r->n - r->i >= 9 && r->p[r->i] == 0xcf) {
            uint64_t v;
            memcpy(&v, r->p + r->i + 1, 8);
            out[k] = __builtin_bswap64(v);
            r->i += 9;
            continue;
        }
        int neg;
        if (rd_int(r, &out[k], &neg)) return FALL;
    }
    return 0;
}

/* A value of a field nobody reads here: a scalar (rd_skip) or an array of them. */
static inline int kvs_skip_any(Rd *r) {
    Py_ssize_t n;
    if (r->i < r->n && is_array_head(r->p[r->i])) {
        if (RD_ARRAY(r, &n)) return FALL;
        for (Py_ssize_t k = 0; k < n; k++)
            if (rd_skip(r)) return FALL;
        return 0;
    }
    return rd_skip(r);
}

/* A token reader: the token_ids array at r read (its ids checked to be ints,
 * at most lim.max_tokens), ev->tok/tok_len/ntok set; 0, FALL or -1. An
 * extension with one of its own (the index makes its block sums as it
 * reads) defines KVS_TOKENS as its name before including this header, and
 * the function after it; the call is direct, so it inlines. */
#ifndef KVS_TOKENS
#define KVS_TOKENS kvs_tokens
#endif

/* The one field switch: field f's value into ev. */
static inline __attribute__((always_inline)) int kvs_field(KvScan *s, Rd *r, int f, KvEv *ev) {
    uint64_t v;
    int neg, has;
    const char *str;
    Py_ssize_t n;
    /* The usual optional field: nil, what the event holds unless given (a
     * medium's nil is None, not the default "GPU"); a second tag never gets
     * here (kvs_event refuses it first). */
    if ((f > F_BS || f == F_UNKNOWN) && f != F_MEDIUM && r->i < r->n && r->p[r->i] == 0xc0) {
        r->i++;
        return 0;
    }
    switch (f) {
        case F_HASHES:
            if (!s->keep_hashes) return kvs_skip_ints(r, s->lim.max_blocks, &ev->n);
            if (RD_ARRAY(r, &n) || n > s->lim.max_blocks) return FALL;
            if (kvw_grow((void **)&s->h, &s->h_cap, s->h_len + n, sizeof(uint64_t)) < 0) return -1;
            if (kvs_hashes(r, s->h + s->h_len, n)) return FALL;
            ev->hoff = s->h_len;
            ev->n = n;
            s->h_len += n;
            return 0;
        case F_PARENT:
            return rd_opt_int(r, &ev->parent, &neg, &ev->has_parent);
        case F_TOKENS:
            return KVS_TOKENS(s, r, ev);
        case F_BS:
            if (rd_int(r, &v, &neg) || neg || v < 1 || v > (uint64_t)s->lim.max_bs) return FALL;
            ev->block_size = (Py_ssize_t)v;
            return 0;
        case F_LORA_ID:
        case F_WINDOW:
            if (rd_opt_int(r, &v, &neg, &has)) return FALL;
            s->unviewed |= has;
            return 0;
        case F_KIND:
            if (rd_opt_str(r, &str, &n)) return FALL;
            s->unviewed |= n >= 0;
            return 0;
        case F_MEDIUM:
            return rd_opt_str(r, &ev->medium, &ev->medium_len);
        case F_LORA_NAME:
            if (rd_opt_str(r, &ev->lora, &ev->lora_len)) return FALL;
            if (ev->lora_len >= 0) ev->extras |= X_LORA;
            return 0;
        case F_GROUP:
            return rd_opt_int(r, &ev->group, &ev->group_neg, &ev->has_group);
        case F_LOOKAHEAD:
            if (rd_nil(r)) return 0;
            ev->extras |= X_LOOKAHEAD;
            return kvs_skip_ints(r, PY_SSIZE_T_MAX, &n);
        case F_EXTRA:
            if (rd_nil(r)) return 0;
            ev->extras |= X_EXTRA;
            if (RD_ARRAY(r, &n)) return FALL; /* list[Any] | None */
            for (Py_ssize_t k = 0; k < n; k++)
                if (rd_skip(r)) return FALL;
            return 0;
        case F_SALT:
        case F_LOCALITY:
        case F_OWNERSHIP:
        case F_SESSION:
            if (rd_nil(r)) return 0;
            ev->extras |= f == F_SALT ? X_SALT : X_OTHER;
            return kvs_skip_any(r);
        case F_UNKNOWN:
            return kvs_skip_any(r); /* ignored by every decoder */
        default:
            return FALL; /* a second tag */
    }
}

/* Unknown keys an event map may have here (more: the general way). */
#define KVS_UNKNOWN 8

/* One event, a map (its "type" key first) or a tagged array, into ev. */
static inline __attribute__((always_inline)) int kvs_event(KvScan *s, Rd *r, KvEv *ev) {
    Py_ssize_t n, len;
    const char *tag, *key;
    if (r->i >= r->n) return FALL;
    int map = is_map_head(r->p[r->i]);
    if (map ? RD_MAP(r, &n) : RD_ARRAY(r, &n)) return FALL;
    if (n < 1) return FALL;
    s->forms |= map ? KVS_MAPS : KVS_ARRAYS;
    if (map && (rd_str(r, &key, &len) || !str_is(key, len, "type"))) return FALL;
    if (rd_str(r, &tag, &len)) return FALL;
    int kind = event_kind(tag, len);
    if (kind < 0) return FALL;
    /* field by field: a memset of the struct is a slow `rep stos` here */
    ev->kind = kind;
    ev->has_parent = ev->has_group = ev->group_neg = 0;
    ev->extras = 0;
    ev->parent = ev->group = 0;
    ev->n = ev->block_size = ev->tok_len = ev->ntok = 0;
    ev->tok = NULL;
    ev->lora = NULL;
    ev->medium = "GPU";
    ev->medium_len = 3;
    ev->lora_len = -1;
    ev->hoff = ev->aux = -1;
    ev->tier = ev->ok = ev->other = 0;
    unsigned seen = 1u << F_TYPE;
    int f = -1, nu = 0;
    /* keys that are none of the kind's fields, kept to see one given twice */
    const char *unknown[KVS_UNKNOWN];
    Py_ssize_t unknown_len[KVS_UNKNOWN];
    for (Py_ssize_t k = 1; k < n; k++) {
        if (map) {
            int g = f + 1;
            /* The usual case first: a store's next field in declaration order,
             * its name a fixstr (what field_of would find, in one compare). */
            if (kind == EV_STORED && g < F_COUNT && FIELD_NAMES[g].n < 32 &&
                r->n - r->i > FIELD_NAMES[g].n && r->p[r->i] == (0xa0 | FIELD_NAMES[g].n) &&
                memcmp(r->p + r->i + 1, FIELD_NAMES[g].s, (size_t)FIELD_NAMES[g].n) == 0) {
                r->i += 1 + FIELD_NAMES[g].n;
                f = g;
            } else {
                if (rd_str(r, &key, &len)) return FALL;
                f = field_of(kind, key, len, g);
                if (f == F_UNKNOWN) {
                    if (nu == KVS_UNKNOWN) return FALL;
                    for (int u = 0; u < nu; u++)
                        if (unknown_len[u] == len && memcmp(unknown[u], key, (size_t)len) == 0)
                            return FALL; /* a key given twice */
                    unknown[nu] = key;
                    unknown_len[nu++] = len;
                }
            }
        } else {
            Py_ssize_t at = k - 1;
            if (kind == EV_STORED) f = at < N_STORED ? (int)at : F_UNKNOWN;
            else if (kind == EV_REMOVED) f = at < N_REMOVED ? REMOVED_FIELDS[at] : F_UNKNOWN;
            else f = F_UNKNOWN;
        }
        if (f >= 0) {
            if (seen & (1u << f)) return FALL; /* a key given twice */
            seen |= 1u << f;
        }
        int rc = kvs_field(s, r, f, ev);
        if (rc) return rc;
    }
    if (kind == EV_CLEARED) return 0;
    if (!(seen & (1u << F_HASHES))) return FALL;
    return kind != EV_STORED || (seen & REQUIRED_STORED) == REQUIRED_STORED ? 0 : FALL;
}

/* The events array: appended to s->ev. */
static inline int kvs_events(KvScan *s, Rd *r) {
    Py_ssize_t m;
    KvEv one;
    if (RD_ARRAY(r, &m) || m > s->lim.max_events) return FALL;
    if (s->keep_events && kvw_grow((void **)&s->ev, &s->ev_cap, s->ev_len + m, sizeof(KvEv)) < 0)
        return -1;
    for (Py_ssize_t k = 0; k < m; k++) {
        KvEv *ev = s->keep_events ? &s->ev[s->ev_len] : &one;
        int rc = kvs_event(s, r, ev);
        if (rc) return rc;
        if (ev->kind == EV_CLEARED) s->cleared = 1;
        s->extras |= ev->extras;
        s->ev_len++;
    }
    return 0;
}

/* The timestamp: a float (float32 or float64), into *ts. */
static inline int kvs_ts(Rd *r, double *ts) {
    if (r->i >= r->n) return FALL;
    unsigned char c = r->p[r->i];
    Py_ssize_t w = c == 0xca ? 5 : c == 0xcb ? 9 : 0;
    if (!w || r->n - r->i < w) return FALL;
    uint64_t bits = kvw_get_be(r->p + r->i + 1, (int)w - 1);
    if (w == 5) {
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, 4);
        *ts = f;
    } else {
        memcpy(ts, &bits, 8);
    }
    r->i += w;
    return 0;
}

/* One whole payload: its events appended to s->ev (their hashes to s->h),
 * its rank and whether it clears in s. 0; FALL or -1 (no memory) with
 * nothing appended. */
static inline int kvs_batch(KvScan *s, Rd *r) {
    Py_ssize_t ev_len = s->ev_len, h_len = s->h_len, n;
    int rc = FALL;
    s->has_rank = s->rank_neg = s->cleared = 0;
    s->extras = s->forms = s->unviewed = 0;
    s->rank = 0;
    if (r->i < r->n && is_map_head(r->p[r->i])) {
        /* {"ts", "events", "data_parallel_rank"?}, in any order */
        unsigned seen = 0;
        if (RD_MAP(r, &n)) goto out;
        for (Py_ssize_t k = 0; k < n; k++) {
            const char *key;
            Py_ssize_t len;
            int f;
            if (rd_str(r, &key, &len)) goto out;
            if (str_is(key, len, "ts")) f = 0;
            else if (str_is(key, len, "events")) f = 1;
            else if (str_is(key, len, "data_parallel_rank")) f = 2;
            else goto out;
            if (seen & (1u << f)) goto out;
            seen |= 1u << f;
            rc = f == 0 ? kvs_ts(r, &s->ts)
               : f == 1 ? kvs_events(s, r)
                        : rd_opt_int(r, &s->rank, &s->rank_neg, &s->has_rank);
            if (rc) goto out;
            rc = FALL;
        }
        if ((seen & 3) != 3) goto out;
    } else {
        if (RD_ARRAY(r, &n) || n < 2 || n > 3 || kvs_ts(r, &s->ts)) goto out;
        if ((rc = kvs_events(s, r))) goto out;
        rc = FALL;
        if (n == 3 && rd_opt_int(r, &s->rank, &s->rank_neg, &s->has_rank)) goto out;
    }
    if (r->i == r->n) return 0;
out:
    s->ev_len = ev_len;
    s->h_len = h_len;
    return rc;
}

/* Scratch that one large payload grew is given back afterwards. */
#define KVS_KEEP ((Py_ssize_t)1 << 16)

static inline void kvs_trim(KvScan *s, Py_ssize_t keep) {
    if (s->h_cap > keep) {
        PyMem_RawFree(s->h);
        s->h = NULL;
        s->h_cap = 0;
    }
    if (s->ev_cap > keep) {
        PyMem_RawFree(s->ev);
        s->ev = NULL;
        s->ev_cap = 0;
    }
}

static inline void kvs_free(KvScan *s) { kvs_trim(s, -1); }

/* A limit as a non-negative Py_ssize_t; *fail set otherwise. */
static inline Py_ssize_t kvs_limit(PyObject *o, int *fail) {
    Py_ssize_t v = PyLong_Check(o) ? PyLong_AsSsize_t(o) : -1;
    if (v < 0) {
        PyErr_Clear();
        *fail = 1;
    }
    return v;
}

/* A DecodeLimits' bounds into *lim: 0; 1 when one is not a non-negative
 * Py_ssize_t (the general way reads it); -1 with an exception. */
static inline int kvs_limits_of(PyObject *limits, KvLimits *lim) {
    static const char *const names[4] = {"max_events", "max_blocks", "max_block_size", "max_tokens"};
    Py_ssize_t v[4];
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        PyObject *o = PyObject_GetAttrString(limits, names[i]);
        if (!o) return -1;
        v[i] = kvs_limit(o, &bad);
        Py_DECREF(o);
    }
    *lim = (KvLimits){v[0], v[1], v[2], v[3]};
    return bad;
}

/* The DecodeLimits a reader was given last (frozen, held so that its id is not reused) and
 * its bounds: read once, not on every small payload. */
typedef struct {
    PyObject *obj;
    KvLimits lim;
    int bad;
} KvLimitsSeen;

/* kvs_limits_of(limits) through *seen. */
static inline int kvs_limits_seen(KvLimitsSeen *seen, PyObject *limits) {
    if (limits != seen->obj) {
        int bad = kvs_limits_of(limits, &seen->lim);
        if (bad < 0) return -1;
        seen->bad = bad;
        Py_XSETREF(seen->obj, Py_NewRef(limits)); /* last: the old one's release may run code */
    }
    return seen->bad;
}

/* What a check of a payload says: (events, data_parallel_rank | None, cleared). */
static inline PyObject *kvs_summary(const KvScan *s, Py_ssize_t events) {
    PyObject *rank = s->has_rank ? kvw_int(s->rank, s->rank_neg) : Py_NewRef(Py_None);
    return rank ? Py_BuildValue("(nNO)", events, rank, s->cleared ? Py_True : Py_False) : NULL;
}

#endif /* KVWIRE_SCAN_H */
