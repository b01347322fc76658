/* The snapshot mirror's tables in C (see kvwire/publisher/mirror.py).
 *
 * A Core is one state of a rank's cache: per medium, an open-addressing map
 * from block hash to the newest chain holding it (16 bytes a slot), and a
 * second map, for hashes held more than once, to an array of the older
 * holders; the live chains are on a list that holds a reference to each. A
 * Chain is one BlockStored event: its hashes inline (8 bytes each), its token
 * ids as the packed msgpack bytes they came in.
 *
 * apply_payload / apply_feed read batch payloads (through the one native
 * reader, kvwire/_native/scan.h) straight into the maps (no
 * Python object per block): a first pass reads and checks a whole payload
 * using no Python API (for a large feed it runs without the GIL), a second
 * applies it. A payload outside the subset read here changes nothing and is
 * handed back; the caller applies its decoded events through store() and
 * remove(), with the same result.
 *
 * While snapshots are served, `logs` holds their undo dicts: before a block's
 * holders change, each dict gets (medium, hash) -> the holders before the
 * change, unless it has that key already. simple_parts() builds a snapshot's
 * parts for the chains that wait for no parent (the walk's common case) in one
 * call, through the caller's StoredParts (the wire's field order stays there).
 *
 * Errors: -1 (or NULL) with a Python exception set, everywhere; the first
 * pass alone returns -1 without one (out of memory, raised by its caller once
 * it holds the GIL).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "../_native/pyext.h"
#include "../_native/scan.h"

typedef uint64_t u64;

#define GOLDEN 0x9E3779B97F4A7C15ULL

/* ------------------------------------------------------------------------ */
/* Chain                                                                     */

typedef struct Chain {
    PyObject_VAR_HEAD /* ob_size: the number of hashes */
    struct Chain *prev, *next; /* the core's live list; both NULL off it */
    Py_ssize_t live;           /* blocks this chain holds */
    Py_ssize_t block_size;
    int has_parent;
    u64 parent;
    PyObject *tokens; /* bytes: a packed msgpack array */
    PyObject *medium, *lora, *extra, *group;
    u64 hashes[1];
} Chain;

static PyTypeObject ChainType;

static void Chain_dealloc(Chain *c) {
    Py_XDECREF(c->tokens);
    Py_XDECREF(c->medium);
    Py_XDECREF(c->lora);
    Py_XDECREF(c->extra);
    Py_XDECREF(c->group);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* A new chain of n hashes (filled by the caller); steals nothing. */
static Chain *chain_new(Py_ssize_t n, PyObject *tokens, Py_ssize_t block_size, int has_parent,
                        u64 parent, PyObject *medium, PyObject *lora, PyObject *extra,
                        PyObject *group) {
    Chain *c = PyObject_NewVar(Chain, &ChainType, n);
    if (!c) return NULL;
    c->prev = c->next = NULL;
    c->live = 0;
    c->block_size = block_size;
    c->has_parent = has_parent;
    c->parent = parent;
    c->tokens = Py_NewRef(tokens);
    c->medium = Py_NewRef(medium);
    c->lora = Py_NewRef(lora);
    c->extra = Py_NewRef(extra);
    c->group = Py_NewRef(group);
    return c;
}

static Py_ssize_t Chain_len(Chain *c) { return Py_SIZE(c); }

static int index_arg(Chain *c, PyObject *o, Py_ssize_t *out) {
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > Py_SIZE(c)) {
        PyErr_SetString(PyExc_IndexError, "chain index out of range");
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *Chain_hash_at(Chain *c, PyObject *arg) {
    Py_ssize_t i;
    if (index_arg(c, arg, &i) < 0) return NULL;
    if (i == Py_SIZE(c)) {
        PyErr_SetString(PyExc_IndexError, "chain index out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(c->hashes[i]);
}

static PyObject *Chain_hash_list(Chain *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t a, b;
    if (kvw_nargs(nargs, 2, "hash_list") < 0 || index_arg(c, args[0], &a) < 0 ||
        index_arg(c, args[1], &b) < 0)
        return NULL;
    return kvw_u64_list(c->hashes + a, b < a ? 0 : b - a);
}

static int u64_arg(PyObject *o, u64 *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a block hash must be an int");
        return -1;
    }
    u64 v = PyLong_AsUnsignedLongLong(o);
    if (v == (u64)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* index(h, start): the first position >= start holding h, -1 if none. */
static PyObject *Chain_index(Chain *c, PyObject *const *args, Py_ssize_t nargs) {
    u64 h;
    Py_ssize_t start;
    if (kvw_nargs(nargs, 2, "index") < 0 || u64_arg(args[0], &h) < 0 ||
        index_arg(c, args[1], &start) < 0)
        return NULL;
    for (Py_ssize_t i = start; i < Py_SIZE(c); i++)
        if (c->hashes[i] == h) return PyLong_FromSsize_t(i);
    return PyLong_FromLong(-1);
}

static PyObject *Chain_get_parent(Chain *c, void *unused) {
    if (!c->has_parent) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(c->parent);
}

static PyGetSetDef Chain_getset[] = {
    {"parent", (getter)Chain_get_parent, NULL, "block 0's parent hash, or None", NULL},
    {NULL},
};

#define CHAIN_FIELD(name, doc) {#name, T_OBJECT, offsetof(Chain, name), READONLY, doc}
static PyMemberDef Chain_members[] = {
    {"block_size", T_PYSSIZET, offsetof(Chain, block_size), READONLY, "tokens per block"},
    CHAIN_FIELD(tokens, "token ids, a packed msgpack array"),
    CHAIN_FIELD(medium, "the medium"),
    CHAIN_FIELD(lora, "lora_name"),
    CHAIN_FIELD(extra, "extra_keys"),
    CHAIN_FIELD(group, "group_idx"),
    {NULL},
};

static PyMethodDef Chain_methods[] = {
    {"hash_at", (PyCFunction)Chain_hash_at, METH_O, "hash_at(i): block i's hash"},
    {"hash_list", (PyCFunction)(void (*)(void))Chain_hash_list, METH_FASTCALL,
     "hash_list(start, end): the hashes of blocks start..end-1"},
    {"index", (PyCFunction)(void (*)(void))Chain_index, METH_FASTCALL,
     "index(h, start): the first block at or after start with hash h, -1 if none"},
    {NULL},
};

static PySequenceMethods Chain_as_sequence = {.sq_length = (lenfunc)Chain_len};

static PyTypeObject ChainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.publisher._mirror.Chain",
    .tp_doc = "One stored event as the mirror keeps it (made only by a Core).",
    .tp_basicsize = offsetof(Chain, hashes),
    .tp_itemsize = sizeof(u64),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)Chain_dealloc,
    .tp_as_sequence = &Chain_as_sequence,
    .tp_methods = Chain_methods,
    .tp_getset = Chain_getset,
    .tp_members = Chain_members,
};

/* ------------------------------------------------------------------------ */
/* Core: per medium, hash -> newest holder                                    */

/* An open-addressing map u64 -> pointer: linear probing, deletion by
 * backward shift (no tombstones), load at most 0.7. */
typedef struct {
    u64 key;
    void *val; /* NULL: empty */
} Slot;

typedef struct {
    Slot *slots;
    size_t cap, live;
    int shift;
} Map;

/* The older holders of a hash held more than once (newest last). */
typedef struct {
    Py_ssize_t n, cap;
    Chain *items[];
} Copies;

typedef struct {
    PyObject *name; /* str or None */
    Map held;       /* hash -> its newest holder (Chain *) */
    Map copies;     /* hash -> Copies *, for hashes held more than once */
} Medium;

typedef struct {
    PyObject_HEAD
    Medium *media;
    Py_ssize_t nmedia;
    Chain *first, *last; /* live chains, oldest first; each holds a reference */
    Py_ssize_t nchains;
    PyObject *logs; /* list of the undo dicts of snapshots in progress */
    KvScan scan;    /* the first pass's events (pointers into the payloads, which are held) */
    int busy; /* a first pass runs without the GIL on the scratch above */
} Core;

static inline size_t slot_of(const Map *m, u64 h) { return (size_t)((h * GOLDEN) >> m->shift); }

static Slot *map_find(const Map *m, u64 h) {
    if (!m->live) return NULL;
    size_t mask = m->cap - 1, at = slot_of(m, h);
    for (;;) {
        Slot *s = &m->slots[at];
        if (s->val == NULL) return NULL;
        if (s->key == h) return s;
        at = (at + 1) & mask;
    }
}

static int map_resize(Map *m, size_t extra) {
    size_t cap = m->cap ? m->cap : 1024;
    while ((m->live + extra) * 2 > cap) cap *= 2;
    Slot *fresh = PyMem_Calloc(cap, sizeof(Slot));
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    int bits = 0;
    while (((size_t)1 << bits) < cap) bits++;
    Slot *old = m->slots;
    size_t old_cap = m->cap;
    m->slots = fresh;
    m->cap = cap;
    m->shift = 64 - bits;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old[i].val) continue;
        size_t at = slot_of(m, old[i].key);
        while (fresh[at].val) at = (at + 1) & (cap - 1);
        fresh[at] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* Room for n more keys. */
static int map_reserve(Map *m, size_t n) {
    if ((m->live + n) * 10 > m->cap * 7) return map_resize(m, n);
    return 0;
}

/* Add h (known absent; room reserved) with value v. */
static void map_put(Map *m, u64 h, void *v) {
    size_t mask = m->cap - 1, at = slot_of(m, h);
    while (m->slots[at].val) at = (at + 1) & mask;
    m->slots[at].key = h;
    m->slots[at].val = v;
    m->live++;
}

/* Empty slot s, moving back the keys after it that probed past it. */
static void map_delete(Map *m, Slot *s) {
    size_t mask = m->cap - 1, i = (size_t)(s - m->slots), j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->slots[j].val) break;
        size_t home = slot_of(m, m->slots[j].key);
        /* j's key may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].val = NULL;
    m->live--;
}

/* The older holders of h in medium m, or NULL. */
static inline Copies *copies_of(const Medium *m, u64 h) {
    Slot *d = map_find(&m->copies, h);
    return d ? (Copies *)d->val : NULL;
}

static void media_free(Core *self) {
    for (Py_ssize_t i = 0; i < self->nmedia; i++) {
        Medium *m = &self->media[i];
        Py_XDECREF(m->name);
        for (size_t k = 0; k < m->copies.cap; k++) PyMem_Free(m->copies.slots[k].val);
        PyMem_Free(m->copies.slots);
        PyMem_Free(m->held.slots);
    }
    PyMem_Free(self->media);
    self->media = NULL;
    self->nmedia = 0;
}

static void chains_free(Core *self) {
    Chain *c = self->first;
    self->first = self->last = NULL;
    self->nchains = 0;
    while (c) {
        Chain *next = c->next;
        c->prev = c->next = NULL;
        Py_DECREF(c);
        c = next;
    }
}

static void link_chain(Core *self, Chain *c) {
    c->prev = self->last;
    c->next = NULL;
    if (self->last) self->last->next = c;
    else self->first = c;
    self->last = c;
    self->nchains++;
    Py_INCREF(c);
}

/* `c` no longer holds one of its blocks. */
static void lost(Core *self, Chain *c) {
    if (--c->live) return;
    if (c->prev) c->prev->next = c->next;
    else self->first = c->next;
    if (c->next) c->next->prev = c->prev;
    else self->last = c->prev;
    c->prev = c->next = NULL;
    self->nchains--;
    Py_DECREF(c);
}

/* The medium named `name` (str or None), its index; -1 with an error. */
static Py_ssize_t medium_index(Core *self, PyObject *name, int create) {
    for (Py_ssize_t i = 0; i < self->nmedia; i++) {
        PyObject *have = self->media[i].name;
        if (have == name) return i;
        if (have == Py_None || name == Py_None) continue;
        int eq = PyUnicode_Compare(have, name);
        if (eq == -1 && PyErr_Occurred()) return -1;
        if (eq == 0) return i;
    }
    if (!create) return -2;
    Medium *grown = PyMem_Realloc(self->media, (size_t)(self->nmedia + 1) * sizeof(Medium));
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    self->media = grown;
    Medium *m = &grown[self->nmedia];
    memset(m, 0, sizeof *m);
    m->name = Py_NewRef(name);
    return self->nmedia++;
}

/* The medium named by UTF-8 bytes (ASCII, checked by the reader), created if new. */
static Py_ssize_t medium_by_bytes(Core *self, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < self->nmedia; i++) {
        PyObject *have = self->media[i].name;
        if (have == Py_None) continue;
        Py_ssize_t len;
        const char *b = PyUnicode_AsUTF8AndSize(have, &len);
        if (!b) return -1;
        if (len == n && memcmp(b, s, (size_t)n) == 0) return i;
    }
    PyObject *name = PyUnicode_FromStringAndSize(s, n);
    if (!name) return -1;
    Py_ssize_t i = medium_index(self, name, 1);
    Py_DECREF(name);
    return i;
}

/* Every holder of h now, newest first, as a tuple. */
static PyObject *holders_tuple(Medium *m, u64 h) {
    Slot *s = map_find(&m->held, h);
    if (!s) return PyTuple_New(0);
    Copies *older = copies_of(m, h);
    Py_ssize_t n = 1 + (older ? older->n : 0);
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    PyTuple_SET_ITEM(out, 0, Py_NewRef((PyObject *)s->val));
    for (Py_ssize_t i = 1; i < n; i++)
        PyTuple_SET_ITEM(out, i, Py_NewRef((PyObject *)older->items[n - 1 - i]));
    return out;
}

/* Before h's holders change: each snapshot's log keeps their first value. */
static int log_change(Core *self, Medium *m, u64 h) {
    PyObject *logs = Py_NewRef(self->logs);
    PyObject *key = NULL, *hv = NULL, *holders = NULL;
    int rc = -1;
    hv = PyLong_FromUnsignedLongLong(h);
    if (!hv) goto done;
    key = PyTuple_Pack(2, m->name, hv);
    if (!key) goto done;
    holders = holders_tuple(m, h);
    if (!holders) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(logs); i++) {
        PyObject *d = Py_NewRef(PyList_GET_ITEM(logs, i));
        PyObject *got = PyDict_Check(d) ? PyDict_SetDefault(d, key, holders) : NULL;
        if (!PyDict_Check(d)) PyErr_SetString(PyExc_TypeError, "a snapshot log must be a dict");
        Py_DECREF(d);
        if (!got) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(holders);
    Py_XDECREF(key);
    Py_XDECREF(hv);
    Py_DECREF(logs);
    return rc;
}

#define LOGGING(self) ((self)->logs && PyList_GET_SIZE((self)->logs) > 0)

/* `c` becomes h's newest holder; the one before it joins h's older copies. */
static int push_copy(Medium *m, Slot *s, Chain *c) {
    Slot *d = map_find(&m->copies, s->key);
    Copies *older = d ? (Copies *)d->val : NULL;
    if (!older || older->n == older->cap) {
        Py_ssize_t cap = older ? older->cap * 2 : 2;
        if (!d && map_reserve(&m->copies, 1) < 0) return -1;
        Copies *grown = PyMem_Realloc(older, sizeof(Copies) + (size_t)cap * sizeof(Chain *));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        if (!older) grown->n = 0;
        grown->cap = cap;
        if (d) d->val = grown;
        else map_put(&m->copies, s->key, grown);
        older = grown;
    }
    older->items[older->n++] = (Chain *)s->val;
    s->val = c;
    return 0;
}

/* Chain c (new, live 0) holds its blocks in medium mi. The chains a table
 * points to are kept alive by the core's list (they are live). */
static int store_chain(Core *self, Py_ssize_t mi, Chain *c) {
    Medium *m = &self->media[mi];
    Py_ssize_t n = Py_SIZE(c);
    if (map_reserve(&m->held, (size_t)n) < 0) return -1;
    int logging = LOGGING(self);
    for (Py_ssize_t i = 0; i < n; i++) {
        u64 h = c->hashes[i];
        if (logging && log_change(self, m, h) < 0) return -1;
        Slot *s = map_find(&m->held, h);
        if (s) { /* held already: another copy */
            if (push_copy(m, s, c) < 0) return -1;
        } else {
            map_put(&m->held, h, c);
        }
        if (c->live++ == 0) link_chain(self, c);
    }
    return 0;
}

/* One copy of h leaves medium m (the newest); an absent h is ignored. */
static int remove_hash(Core *self, Medium *m, u64 h) {
    Slot *s = map_find(&m->held, h);
    if (!s) return 0;
    if (LOGGING(self) && log_change(self, m, h) < 0) return -1;
    Chain *gone = (Chain *)s->val;
    Slot *d = map_find(&m->copies, h);
    if (d) {
        Copies *older = (Copies *)d->val;
        s->val = older->items[--older->n];
        if (!older->n) {
            PyMem_Free(older);
            map_delete(&m->copies, d);
        }
    } else {
        map_delete(&m->held, s);
    }
    lost(self, gone);
    return 0;
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Core() takes no arguments");
        return NULL;
    }
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (self && !(self->logs = PyList_New(0))) Py_CLEAR(self);
    return (PyObject *)self;
}

static int Core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(self->logs);
    return 0;
}

static int Core_clear(Core *self) {
    Py_CLEAR(self->logs);
    return 0;
}

static void Core_dealloc(Core *self) {
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    chains_free(self);
    media_free(self);
    kvs_free(&self->scan);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* --- the Python-level updates (the general path) -------------------------- */

static int opt_str(PyObject *o, const char *what) {
    if (o == Py_None || PyUnicode_Check(o)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a str or None", what);
    return -1;
}

/* store(hashes, parent, tokens, block_size, medium, lora, extra, group) */
static PyObject *Core_store(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 8, "store") < 0) return NULL;
    PyObject *hashes = PySequence_Fast(args[0], "hashes must be a sequence");
    if (!hashes) return NULL;
    PyObject *parent = args[1], *tokens = args[2], *medium = args[4], *extra = args[6], *group = args[7];
    Chain *c = NULL;
    PyObject *result = NULL;
    u64 p = 0;
    Py_ssize_t bs = PyLong_AsSsize_t(args[3]);
    if (bs == -1 && PyErr_Occurred()) goto done;
    if (parent != Py_None && u64_arg(parent, &p) < 0) goto done;
    if (!PyBytes_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be bytes (a packed msgpack array)");
        goto done;
    }
    if (opt_str(medium, "medium") < 0 || opt_str(args[5], "lora") < 0) goto done;
    if (extra != Py_None && !PyList_Check(extra)) {
        PyErr_SetString(PyExc_TypeError, "extra must be a list or None");
        goto done;
    }
    if (group != Py_None && !PyLong_Check(group)) {
        PyErr_SetString(PyExc_TypeError, "group must be an int or None");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    Py_ssize_t mi = medium_index(self, medium, 1);
    if (mi < 0) goto done;
    c = chain_new(n, tokens, bs, parent != Py_None, p, self->media[mi].name, args[5], extra, group);
    if (!c) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (u64_arg(PySequence_Fast_GET_ITEM(hashes, i), &c->hashes[i]) < 0) goto done;
    if (store_chain(self, mi, c) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(c);
    Py_DECREF(hashes);
    return result;
}

/* remove(medium, hashes) */
static PyObject *Core_remove(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "remove") < 0) return NULL;
    if (opt_str(args[0], "medium") < 0) return NULL;
    Py_ssize_t mi = medium_index(self, args[0], 0);
    if (mi == -1) return NULL;
    if (mi == -2) Py_RETURN_NONE;
    PyObject *hashes = PySequence_Fast(args[1], "hashes must be a sequence");
    if (!hashes) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(hashes); i++) {
        u64 h;
        if (u64_arg(PySequence_Fast_GET_ITEM(hashes, i), &h) < 0 ||
            remove_hash(self, &self->media[mi], h) < 0) {
            Py_DECREF(hashes);
            return NULL;
        }
    }
    Py_DECREF(hashes);
    Py_RETURN_NONE;
}

/* --- the payload reader ------------------------------------------------------ */
/* The one native reader (kvwire/_native/scan.h) with decode_batch's default
 * limits (kvwire.wire.codec.DEFAULT_LIMITS, read when the module loads). */

static KvLimits LIMITS;

/* The first pass, no Python API (it may run without the GIL): the whole
 * payload read and checked, its events appended to the scanner's. An event
 * the mirror keeps more of than it reads here (extra keys, lookahead tokens,
 * a salt, locality, ownership, a session) or an AllBlocksCleared (the caller
 * resets) is FALL. */
static int rd_batch(Core *self, Rd *r) {
    KvScan *s = &self->scan;
    s->lim = LIMITS;
    s->keep_hashes = s->keep_events = 1;
    Py_ssize_t before = s->ev_len, h_before = s->h_len;
    int rc = kvs_batch(s, r);
    if (rc) return rc;
    for (Py_ssize_t k = before; k < s->ev_len; k++)
        if (s->ev[k].kind == EV_CLEARED || (s->ev[k].extras & ~X_LORA)) {
            s->ev_len = before;
            s->h_len = h_before;
            return FALL;
        }
    return 0;
}

/* The second pass (with the GIL): one event applied. */
static int apply_event(Core *self, const KvEv *ev) {
    Py_ssize_t mi = ev->medium_len < 0 ? medium_index(self, Py_None, 1)
                                       : medium_by_bytes(self, ev->medium, ev->medium_len);
    if (mi < 0) return -1;
    Medium *m = &self->media[mi];
    const u64 *hs = self->scan.h + ev->hoff;
    if (ev->kind == EV_REMOVED) {
        for (Py_ssize_t k = 0; k < ev->n; k++)
            if (remove_hash(self, m, hs[k]) < 0) return -1;
        return 0;
    }
    PyObject *tokens = PyBytes_FromStringAndSize((const char *)ev->tok, ev->tok_len);
    PyObject *lora = ev->lora_len < 0 ? Py_NewRef(Py_None)
                                      : PyUnicode_FromStringAndSize(ev->lora, ev->lora_len);
    PyObject *group = ev->has_group ? kvw_int(ev->group, ev->group_neg) : Py_NewRef(Py_None);
    Chain *c = NULL;
    int rc = -1;
    if (tokens && lora && group)
        c = chain_new(ev->n, tokens, ev->block_size, ev->has_parent, ev->parent, m->name, lora,
                      Py_None, group);
    if (c) {
        if (ev->n) memcpy(c->hashes, hs, (size_t)ev->n * sizeof(u64)); /* hs is NULL on none */
        rc = store_chain(self, mi, c);
    }
    Py_XDECREF(c);
    Py_XDECREF(tokens);
    Py_XDECREF(lora);
    Py_XDECREF(group);
    return rc;
}

/* Scratch that one large feed grew is given back afterwards. */
static void scratch_trim(Core *self) {
    self->scan.ev_len = self->scan.h_len = 0;
    kvs_trim(&self->scan, KVS_KEEP);
}

static int not_busy(Core *self) {
    if (!self->busy) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the mirror is applying a feed in another thread");
    return -1;
}

static PyObject *Core_apply_payload(Core *self, PyObject *payload) {
    if (not_busy(self) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) return NULL;
    Rd r = {(const unsigned char *)view.buf, view.len, 0};
    self->scan.ev_len = self->scan.h_len = 0;
    int rc = rd_batch(self, &r);
    if (rc < 0) PyErr_NoMemory();
    for (Py_ssize_t k = 0; rc == 0 && k < self->scan.ev_len; k++) rc = apply_event(self, &self->scan.ev[k]);
    PyBuffer_Release(&view);
    scratch_trim(self);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

/* Feeds this large (payload bytes) are read without the GIL. */
#define NOGIL_BYTES ((Py_ssize_t)1 << 16)

/* apply_feed(feed, start, next_seq) -> int
 *
 * feed: [(seq, payload | None)]. Applies entries start, start+1, ... while
 * each has seq next_seq, next_seq + 1, ..., a payload, and is inside the
 * subset read here; returns the index of the first entry it did not apply
 * (len(feed): all). The first pass over all of them runs without the GIL
 * when they are large. */
static PyObject *Core_apply_feed(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 3, "apply_feed") < 0) return NULL;
    if (not_busy(self) < 0) return NULL;
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "feed must be a list");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    long long next_seq = PyLong_AsLongLong(args[2]);
    if (next_seq == -1 && PyErr_Occurred()) return NULL;
    PyObject *feed = Py_NewRef(args[0]);
    Py_ssize_t n = PyList_GET_SIZE(feed);
    if (start < 0 || start > n) start = n;
    Py_buffer *views = PyMem_Calloc((size_t)(n - start) + 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    Py_ssize_t held = 0, total = 0;
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    /* The entries to read: in seq order, each with a payload (the views hold them). */
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(feed, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) break;
        PyObject *seq = PyTuple_GET_ITEM(item, 0), *payload = PyTuple_GET_ITEM(item, 1);
        if (!PyLong_Check(seq) || payload == Py_None) break;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(seq, &overflow);
        if (overflow || v != next_seq + (i - start)) {
            PyErr_Clear();
            break;
        }
        if (PyObject_GetBuffer(payload, &views[held], PyBUF_SIMPLE) < 0) goto done;
        total += views[held].len;
        held++;
    }
    /* First pass over all of them; it stops at the first outside the subset. */
    Py_ssize_t read = 0;
    int rc = 0;
    self->scan.ev_len = self->scan.h_len = 0;
    PyThreadState *ts = NULL;
    self->busy = 1;
    if (total >= NOGIL_BYTES) ts = PyEval_SaveThread();
    for (; read < held; read++) {
        Rd r = {(const unsigned char *)views[read].buf, views[read].len, 0};
        rc = rd_batch(self, &r); /* on FALL nothing of it kept: left to the caller */
        if (rc) break;
    }
    if (ts) PyEval_RestoreThread(ts);
    self->busy = 0;
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    /* Second pass, in order. */
    for (Py_ssize_t k = 0; k < self->scan.ev_len; k++)
        if (apply_event(self, &self->scan.ev[k]) < 0) goto done;
    result = PyLong_FromSsize_t(start + read);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    scratch_trim(self);
    Py_DECREF(feed);
    return result;
}

/* --- what snapshots read ------------------------------------------------------ */

static Medium *medium_of_chain(Core *self, Chain *c) {
    for (Py_ssize_t i = 0; i < self->nmedia; i++)
        if (self->media[i].name == c->medium) return &self->media[i];
    return NULL;
}

/* Whether chain c held h when the snapshot whose log is `undo` began. */
static int held_at_start(Medium *m, Chain *c, u64 h, PyObject *undo) {
    if (PyDict_GET_SIZE(undo)) {
        PyObject *hv = PyLong_FromUnsignedLongLong(h);
        if (!hv) return -1;
        PyObject *key = PyTuple_Pack(2, c->medium, hv);
        Py_DECREF(hv);
        if (!key) return -1;
        PyObject *before = PyDict_GetItemWithError(undo, key);
        Py_DECREF(key);
        if (before) {
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(before); i++)
                if (PyTuple_GET_ITEM(before, i) == (PyObject *)c) return 1;
            return 0;
        }
        if (PyErr_Occurred()) return -1;
    }
    if (!m) return 0;
    Slot *s = map_find(&m->held, h);
    if (!s) return 0;
    if (s->val == c) return 1;
    Copies *older = copies_of(m, h);
    for (Py_ssize_t i = 0; older && i < older->n; i++)
        if (older->items[i] == c) return 1;
    return 0;
}

static int undo_arg(PyObject *o) {
    if (PyDict_Check(o)) return 0;
    PyErr_SetString(PyExc_TypeError, "undo must be a dict");
    return -1;
}

static int chain_arg(PyObject *o) {
    if (Py_TYPE(o) == &ChainType) return 0;
    PyErr_SetString(PyExc_TypeError, "expected a Chain");
    return -1;
}

/* runs(chain, undo): the runs (start, end) of blocks the chain held at the snapshot's start. */
static PyObject *Core_runs(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "runs") < 0) return NULL;
    if (chain_arg(args[0]) < 0 || undo_arg(args[1]) < 0) return NULL;
    Chain *c = (Chain *)Py_NewRef(args[0]);
    PyObject *undo = Py_NewRef(args[1]);
    PyObject *out = PyList_New(0);
    Medium *m = medium_of_chain(self, c);
    Py_ssize_t start = -1, n = Py_SIZE(c);
    for (Py_ssize_t i = 0; out && i <= n; i++) {
        int live = i < n ? held_at_start(m, c, c->hashes[i], undo) : 0;
        if (live < 0) Py_CLEAR(out);
        else if (live && start < 0) start = i;
        else if (!live && start >= 0) {
            PyObject *run = Py_BuildValue("(nn)", start, i);
            if (!run || PyList_Append(out, run) < 0) Py_CLEAR(out);
            Py_XDECREF(run);
            start = -1;
        }
    }
    Py_DECREF(undo);
    Py_DECREF(c);
    return out;
}

/* simple_parts(chains, i, room, undo, done, make, raw) -> (parts, i, blocks)
 *
 * The snapshot walk's common case, a chain at a time without the interpreter: from
 * chains[i] on, a chain with no parent that held every one of its blocks when the snapshot
 * began (its runs: one, the whole chain) waits for nothing and goes out whole, as
 * make(hashes, None, raw(tokens), block_size, None, medium, lora, extra, group) (the
 * caller's StoredParts and msgspec.Raw: the wire's field order is theirs), with (chain, 0)
 * added to done; a chain already in done is passed over. Stops at the first other chain
 * (the caller's walk takes it) or before one longer than the room left; returns the parts,
 * the index it stopped at and their blocks. */
static PyObject *Core_simple_parts(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_Check(args[0]) || !PyDict_Check(args[3]) || !PySet_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "simple_parts(chains: list, i, room, undo: dict, done: set, make, raw)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    Py_ssize_t room = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    PyObject *chains = args[0], *undo = args[3], *done = args[4], *make = args[5], *raw = args[6];
    PyObject *parts = PyList_New(0);
    PyObject *zero = PyLong_FromLong(0);
    if (!parts || !zero) goto fail;
    Py_ssize_t blocks = 0;
    if (i < 0) i = 0;
    for (; i < PyList_GET_SIZE(chains); i++) {
        PyObject *item = PyList_GET_ITEM(chains, i);
        if (chain_arg(item) < 0) goto fail;
        Chain *c = (Chain *)item;
        Py_ssize_t n = Py_SIZE(c);
        if (c->has_parent || n > room) break;
        PyObject *key = PyTuple_Pack(2, item, zero);
        if (!key) goto fail;
        int seen = PySet_Contains(done, key);
        if (seen) { /* passed over (taken already), or an error */
            Py_DECREF(key);
            if (seen < 0) goto fail;
            continue;
        }
        Py_INCREF(item); /* held while its blocks are looked up (undo's __eq__ may run code) */
        Medium *m = medium_of_chain(self, c);
        int all = n > 0;
        for (Py_ssize_t k = 0; all > 0 && k < n; k++) all = held_at_start(m, c, c->hashes[k], undo);
        if (all <= 0) {
            Py_DECREF(item);
            Py_DECREF(key);
            if (all < 0) goto fail;
            break;
        }
        PyObject *hashes = kvw_u64_list(c->hashes, n);
        PyObject *tokens = hashes ? PyObject_CallOneArg(raw, c->tokens) : NULL;
        PyObject *block_size = tokens ? PyLong_FromSsize_t(c->block_size) : NULL;
        PyObject *part = NULL;
        if (block_size) {
            PyObject *argv[9] = {hashes, Py_None, tokens, block_size, Py_None,
                                 c->medium, c->lora, c->extra, c->group};
            part = PyObject_Vectorcall(make, argv, 9, NULL);
        }
        Py_XDECREF(hashes);
        Py_XDECREF(tokens);
        Py_XDECREF(block_size);
        int rc = part ? PyList_Append(parts, part) : -1;
        Py_XDECREF(part);
        if (rc == 0) rc = PySet_Add(done, key);
        Py_DECREF(key);
        Py_DECREF(item);
        if (rc < 0) goto fail;
        room -= n;
        blocks += n;
    }
    Py_DECREF(zero);
    PyObject *out = Py_BuildValue("(Nnn)", parts, i, blocks);
    return out;
fail:
    Py_XDECREF(parts);
    Py_XDECREF(zero);
    return NULL;
}

/* owner(medium, h, undo): a chain that held h when the snapshot began, or None. */
static PyObject *Core_owner(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 3, "owner") < 0) return NULL;
    if (undo_arg(args[2]) < 0) return NULL;
    u64 h;
    if (u64_arg(args[1], &h) < 0) return NULL;
    PyObject *key = PyTuple_Pack(2, args[0], args[1]);
    if (!key) return NULL;
    PyObject *before = PyDict_GetItemWithError(args[2], key);
    Py_DECREF(key);
    if (before) {
        if (!PyTuple_Check(before)) {
            PyErr_SetString(PyExc_TypeError, "a snapshot log's values must be tuples");
            return NULL;
        }
        return Py_NewRef(PyTuple_GET_SIZE(before) ? PyTuple_GET_ITEM(before, 0) : Py_None);
    }
    if (PyErr_Occurred()) return NULL;
    if (opt_str(args[0], "medium") < 0) return NULL;
    Py_ssize_t mi = medium_index(self, args[0], 0);
    if (mi == -1) return NULL;
    if (mi == -2) Py_RETURN_NONE;
    Slot *s = map_find(&self->media[mi].held, h);
    return Py_NewRef(s ? (PyObject *)s->val : Py_None);
}

static PyObject *Core_chains(Core *self, PyObject *unused) {
    PyObject *out = PyList_New(self->nchains);
    if (!out) return NULL;
    Py_ssize_t i = 0;
    for (Chain *c = self->first; c; c = c->next) PyList_SET_ITEM(out, i++, Py_NewRef((PyObject *)c));
    return out;
}

static PyObject *Core_count(Core *self, PyObject *unused) {
    size_t n = 0;
    for (Py_ssize_t i = 0; i < self->nmedia; i++) n += self->media[i].held.live;
    return PyLong_FromSize_t(n);
}

static PyObject *Core_get_logs(Core *self, void *unused) {
    if (!self->logs) {
        PyErr_SetString(PyExc_RuntimeError, "this Core was cleared");
        return NULL;
    }
    return Py_NewRef(self->logs);
}

static PyGetSetDef Core_getset[] = {
    {"logs", (getter)Core_get_logs, NULL, "the undo dicts of the snapshots in progress", NULL},
    {NULL},
};

static PyMethodDef Core_methods[] = {
    {"apply_payload", (PyCFunction)Core_apply_payload, METH_O,
     "apply_payload(payload) -> bool: applied, or False (outside the subset read here; nothing changed)"},
    {"apply_feed", (PyCFunction)(void (*)(void))Core_apply_feed, METH_FASTCALL,
     "apply_feed(feed, start, next_seq) -> int: the index of the first entry not applied"},
    {"store", (PyCFunction)(void (*)(void))Core_store, METH_FASTCALL,
     "store(hashes, parent, tokens, block_size, medium, lora, extra, group)"},
    {"remove", (PyCFunction)(void (*)(void))Core_remove, METH_FASTCALL, "remove(medium, hashes)"},
    {"runs", (PyCFunction)(void (*)(void))Core_runs, METH_FASTCALL,
     "runs(chain, undo): runs of blocks the chain held when the snapshot began"},
    {"owner", (PyCFunction)(void (*)(void))Core_owner, METH_FASTCALL,
     "owner(medium, h, undo): a chain holding h when the snapshot began, or None"},
    {"chains", (PyCFunction)Core_chains, METH_NOARGS, "the live chains, oldest first"},
    {"simple_parts", (PyCFunction)(void (*)(void))Core_simple_parts, METH_FASTCALL,
     "simple_parts(chains, i, room, undo, done, make, raw) -> (parts, i, blocks): whole "
     "chains that wait for no parent, as make() builds them"},
    {"count", (PyCFunction)Core_count, METH_NOARGS, "distinct (medium, hash) blocks held"},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.publisher._mirror.Core",
    .tp_doc = "One state of a rank's cache: hash -> chains, per medium.",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef mirror_module = {
    PyModuleDef_HEAD_INIT, "_mirror", "The snapshot mirror's tables (see mirror.py).", -1, NULL,
};

/* decode_batch's default limits, the ones the mirror's general path decodes with. */
static int limits_init(void) {
    PyObject *codec = PyImport_ImportModule("kvwire.wire.codec");
    if (!codec) return -1;
    PyObject *limits = PyObject_GetAttrString(codec, "DEFAULT_LIMITS");
    Py_DECREF(codec);
    if (!limits) return -1;
    int rc = kvs_limits_of(limits, &LIMITS);
    Py_DECREF(limits);
    if (rc > 0) PyErr_SetString(PyExc_ValueError, "DEFAULT_LIMITS must be non-negative ints");
    return rc ? -1 : 0;
}

PyMODINIT_FUNC PyInit__mirror(void) {
    static PyTypeObject *const types[] = {&ChainType, &CoreType, NULL};
    return limits_init() < 0 ? NULL : kvw_module(&mirror_module, types, NULL);
}
