/* The prefix index's hot loops: block keys and the holder tables.
 *
 * Python keeps the policy (rank naming, groups, tiers by medium name,
 * counters); this module keeps the state a router touches per block:
 *
 *   KeyChain  the chained 64-bit block key (see keys.py for the formula),
 *             computed from token ids as msgpack bytes, a list or a buffer.
 *   Index     per rank: engine hash -> (our key, depth, a store count per
 *             tier); shared: our key -> its holders: one rank inline in the
 *             16-byte node, or (a key two or more ranks hold) a row of
 *             bitmasks, one bit per rank and tier. Open addressing with
 *             linear probing and backward-shift deletion, so tables shrink
 *             and free themselves as blocks leave.
 *
 * Every function runs with the GIL held: calls are atomic to other threads.
 * Nothing here trusts its input: token bytes come off the network.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>
#ifdef __linux__
#include <pthread.h>
#include <sys/mman.h>
#endif

#include "../_native/intbuf.h"
#include "../_native/msgpack_read.h"
#include "../_native/pyext.h"
/* The index reads token ids straight into block sums (rd_token_sums, below). */
struct KvScan;
struct KvEv;
static int rd_token_sums(struct KvScan *s, Rd *r, struct KvEv *ev);
#define KVS_TOKENS rd_token_sums
#include "../_native/scan.h"

typedef uint64_t u64;
typedef uint32_t u32;
typedef int32_t i32;
typedef uint16_t u16;

#define F1 0xFF51AFD7ED558CCDULL
#define F2 0xC4CEB9FE1A85EC53ULL
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define DEPTH_LIMIT ((1LL << 31) - (1LL << 20))
#define MIN_CAP 8
#define PREFETCH 12
#define STORE_PREFETCH 24
#define NODE_AHEAD 8
#define CLEAR_AHEAD 16
#define REHASH_AHEAD 32
#define WALK_PREFETCH 32 /* blocks (4 groups): more at once queue behind each other (measured) */

static inline u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= F1;
    x ^= x >> 33;
    x *= F2;
    return x ^ (x >> 33);
}

/* ------------------------------------------------------------------------ */
/* Token ids in, as u64 (two's complement for negatives).                    */

typedef struct {
    u64 *p;
    Py_ssize_t cap;
} Scratch;

static u64 *scratch_get(Scratch *s, Py_ssize_t n) {
    if (n < 1) n = 1;
    if (n > s->cap) {
        Py_ssize_t cap = s->cap ? s->cap : 256;
        while (cap < n) cap *= 2;
        u64 *p = PyMem_Realloc(s->p, (size_t)cap * sizeof(u64));
        if (!p) { PyErr_NoMemory(); return NULL; }
        s->p = p;
        s->cap = cap;
    }
    return s->p;
}

static void scratch_free(Scratch *s) {
    PyMem_Free(s->p);
    s->p = NULL;
    s->cap = 0;
}

/* One error channel: every reader below returns 0, or -1 with a Python
 * exception set: TypeError for input of the wrong kind, ValueError for bad
 * content, MemoryError. Callers that treat unusable tokens as malformed
 * clear only the first two. */
static int refuse(PyObject *type, const char *why) {
    PyErr_SetString(type, why);
    return -1;
}

/* A token id as u64 (two's complement); 0, or -1 with TypeError or
 * ValueError set. Runs no Python code (PyLong_Check'ed conversions only),
 * so a caller reading a list's items cannot see the list change. Small
 * exact ints, which every token id is, skip the general conversion. */
static inline int token_of(PyObject *o, u64 *out) {
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (u64)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 0;
        }
#else
        Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            *out = size ? (u64)((int64_t)size * (int64_t)((PyLongObject *)o)->ob_digit[0]) : 0;
            return 0;
        }
#endif
    } else if (!PyLong_Check(o)) {
        return refuse(PyExc_TypeError, "a token id is not an integer");
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) {
        *out = (u64)v;
        return (v == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    unsigned long long u = overflow > 0 ? PyLong_AsUnsignedLongLong(o) : 0;
    if (overflow < 0 || (u == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        return refuse(PyExc_ValueError, "a token id does not fit 64 bits");
    }
    *out = u;
    return 0;
}

/* A msgpack array of integers at the start of p[0..len) (what engines put
 * in token_ids); *used: the bytes it takes. */
static int tokens_packed_at(const unsigned char *p, Py_ssize_t len, Scratch *s, u64 **out,
                            Py_ssize_t *count, Py_ssize_t *used) {
    PyObject *VE = PyExc_ValueError;
    Rd r = {p, len, 0};
    Py_ssize_t n;
    if (RD_ARRAY(&r, &n)) return refuse(VE, "token_ids is not an array (or longer than its bytes)");
    Py_ssize_t i = r.i;
    u64 *t = scratch_get(s, n);
    if (!t) return -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (i >= len) return refuse(VE, "truncated array");
        unsigned char c = p[i];
        /* The common forms first: fixint and uint16 (most vocabularies). */
        if (c <= 0x7f) { t[k] = c; i++; continue; }
        if (c == 0xcd) {
            if (len - i < 3) return refuse(VE, "truncated integer");
            t[k] = ((u64)p[i + 1] << 8) | p[i + 2];
            i += 3;
            continue;
        }
        int neg, used = kvw_get_int(p + i, len - i, &t[k], &neg);
        if (used <= 0) return refuse(VE, used ? "truncated integer" : "a token id is not an integer");
        i += used;
    }
    *out = t;
    *count = n;
    *used = i;
    return 0;
}

/* The same, the array filling p[0..len) exactly. */
static int tokens_packed(const unsigned char *p, Py_ssize_t len, Scratch *s, u64 **out,
                         Py_ssize_t *count) {
    Py_ssize_t used;
    if (tokens_packed_at(p, len, s, out, count, &used) < 0) return -1;
    if (used != len) return refuse(PyExc_ValueError, "trailing bytes after token_ids");
    return 0;
}

/* A token id that is an exact int of one non-negative digit (every id of a
 * real vocabulary: < 2**30), read off the object: its value, with a word
 * or'ed into *bad that leaves it <= 1 only if the id is one (the value is
 * meaningless otherwise). Call only on exact ints: nothing else is sure to
 * have the fields read. */
static inline u64 digit_token(PyObject *o, u64 *bad) {
#if PY_VERSION_HEX >= 0x030C0000
    /* Any compact value, negative ones too (two's complement, as token_of). */
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *bad = 2;
        return 0;
    }
    return (u64)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
#else
    /* ob_size 0 or 1 (a negative one has every bit set); a zero's digit is
     * not always written. */
    Py_ssize_t size = Py_SIZE(o);
    *bad |= (u64)size;
    return (u64)((PyLongObject *)o)->ob_digit[0] & (0 - (u64)size);
#endif
}

/* A list or tuple of Python ints. Reads items only with PyLong_Check'ed
 * conversions, which run no Python code, so the sequence cannot change
 * under the loop and borrowed items stay alive. */
static int tokens_seq(PyObject *seq, Scratch *s, u64 **out, Py_ssize_t *count) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *t = scratch_get(s, n);
    if (!t) return -1;
    /* Small exact ints straight off the objects, up to the first other item;
     * from there the general way, or from the start if one of them was not
     * small (so an error is the first item's in order, as before). */
    u64 bad = 0;
    for (; k < n && PyLong_CheckExact(items[k]); k++) t[k] = digit_token(items[k], &bad);
    if (bad > 1) k = 0;
    for (; k < n; k++)
        if (token_of(items[k], &t[k]) < 0) return -1;
    *out = t;
    *count = n;
    return 0;
}

/* A 1-D C-contiguous buffer of native integers (numpy arrays, array.array). */
static int tokens_buffer(Py_buffer *v, Scratch *s, u64 **out, Py_ssize_t *count) {
    int is_signed = kvw_int_format(v, "token ids", PyExc_TypeError);
    if (is_signed < 0) return -1;
    if (v->ndim > 1) return refuse(PyExc_ValueError, "tokens must be 1-D");
    const Py_ssize_t w = v->itemsize, n = v->len / w;
    u64 *t = scratch_get(s, n);
    if (!t) return -1;
    const char *b = v->buf;
    KVW_EACH_INT(b, 0, w, is_signed, n, k, x, t[k] = x;)
    *out = t;
    *count = n;
    return 0;
}

/* tokens: bytes-like msgpack when packed, else a list/tuple or an int buffer. */
static int read_tokens(PyObject *obj, int packed, Scratch *s, u64 **out, Py_ssize_t *count) {
    if (!packed && (PyList_Check(obj) || PyTuple_Check(obj))) {
        PyObject *seq = PySequence_Fast(obj, "tokens");
        if (!seq) return -1;
        int r = tokens_seq(seq, s, out, count);
        Py_DECREF(seq);
        return r;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, packed ? PyBUF_SIMPLE : (PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError))
            return -1;
        PyErr_Clear();
        return refuse(PyExc_TypeError, packed ? "packed tokens must be bytes-like"
                                              : "tokens must be a list, a tuple or a contiguous integer array");
    }
    int r = packed ? tokens_packed(v.buf, v.len, s, out, count) : tokens_buffer(&v, s, out, count);
    PyBuffer_Release(&v);
    return r;
}

/* Whether the pending exception means "unusable input" (cleared) rather
 * than a failure to pass on (MemoryError and the like). */
static int clear_refusal(void) {
    if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* KeyChain                                                                  */

typedef struct {
    PyObject_HEAD
    Py_ssize_t bs;
    u64 *w;
    u64 q, pos_k, detached_k, malformed_k;
    Scratch tok;
} KeyChain;

/* L_b = sum_j t[b, j] * w_j, four independent sums so the multiplies overlap. */
static inline u64 block_sum(const u64 *t, const u64 *w, Py_ssize_t bs) {
    u64 a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    Py_ssize_t j = 0;
    for (; j + 4 <= bs; j += 4) {
        a0 += t[j] * w[j];
        a1 += t[j + 1] * w[j + 1];
        a2 += t[j + 2] * w[j + 2];
        a3 += t[j + 3] * w[j + 3];
    }
    for (; j < bs; j++) a0 += t[j] * w[j];
    return (a0 + a1) + (a2 + a3);
}

/* One link of the chain: block sum l at absolute position pos after state. */
static inline u64 chain_step(const KeyChain *c, u64 state, u64 l, u64 pos, u64 extra) {
    u64 x = l ^ fmix64((pos + 1) * GOLDEN ^ c->pos_k) ^ extra;
    x ^= x >> 32;
    x *= F1;
    return state * c->q + x;
}

static inline u64 block_sum_of(const KeyChain *c, const u64 *tok, Py_ssize_t b) {
    /* 16 tokens a block is what engines use: a constant lets it unroll. */
    return c->bs == 16 ? block_sum(tok + b * 16, c->w, 16) : block_sum(tok + b * c->bs, c->w, c->bs);
}

static void chain_keys(const KeyChain *c, const u64 *tok, Py_ssize_t nblocks, u64 start,
                       u64 position, const u64 *extra, u64 *out) {
    u64 state = start;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        state = chain_step(c, state, block_sum_of(c, tok, b), position + (u64)b, extra ? extra[b] : 0);
        out[b] = state;
    }
}

/* The chain from block sums computed already (the fused apply's first pass). */
static void chain_sums(const KeyChain *c, const u64 *sums, Py_ssize_t nblocks, u64 start,
                       u64 position, u64 *out) {
    u64 state = start;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        state = chain_step(c, state, sums[b], position + (u64)b, 0);
        out[b] = state;
    }
}

static int u64_arg(PyObject *o, u64 *out, const char *what) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int", what);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLongMask(o);
    return (*out == (u64)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* A read-only view of n u64s (extra keys); NULL for None. */
static int get_u64s(PyObject *o, Py_buffer *v, Py_ssize_t n, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (v->itemsize != 8 || !(f[0] == 'Q' || f[0] == 'L' || f[0] == 'q' || f[0] == 'l') || f[1]) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_TypeError, "%s must be a uint64 array", what);
        return -1;
    }
    if (v->len / 8 < n) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s has %zd entries for %zd blocks", what, v->len / 8, n);
        return -1;
    }
    return 0;
}

static int KeyChain_init(KeyChain *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"weights", "q", "pos_k", "detached_k", "malformed_k", NULL};
    PyObject *weights, *q, *pk, *dk, *mk;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO", kwlist, &weights, &q, &pk, &dk, &mk))
        return -1;
    if (u64_arg(q, &self->q, "q") || u64_arg(pk, &self->pos_k, "pos_k") ||
        u64_arg(dk, &self->detached_k, "detached_k") || u64_arg(mk, &self->malformed_k, "malformed_k"))
        return -1;
    PyObject *seq = PySequence_Fast(weights, "weights must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a block holds at least one token");
        return -1;
    }
    u64 *w = PyMem_Malloc((size_t)n * sizeof(u64));
    if (!w) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (u64_arg(PySequence_Fast_GET_ITEM(seq, i), &w[i], "a weight")) {
            PyMem_Free(w);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    PyMem_Free(self->w);
    self->w = w;
    self->bs = n;
    return 0;
}

static void KeyChain_dealloc(KeyChain *self) {
    PyMem_Free(self->w);
    scratch_free(&self->tok);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A KeyChain made without __init__ has no weights: refuse to use it. */
static int chain_ready(const KeyChain *c) {
    if (c->w && c->bs > 0) return 0;
    PyErr_SetString(PyExc_ValueError, "KeyChain used before __init__");
    return -1;
}

/* keys_into(tokens, packed, start, position, extra, out) -> blocks written */
static PyObject *KeyChain_keys_into(KeyChain *self, PyObject *const *args, Py_ssize_t nargs) {
    if (chain_ready(self) < 0) return NULL;
    if (kvw_nargs(nargs, 6, "keys_into") < 0) return NULL;
    int packed = PyObject_IsTrue(args[1]);
    u64 start, position;
    if (packed < 0 || u64_arg(args[2], &start, "start") || u64_arg(args[3], &position, "position"))
        return NULL;
    /* Every buffer before the tokens: getting one may run Python code (3.12's
     * __buffer__), which must not see our scratch pointer. */
    Py_buffer ev = {0}, ov;
    const u64 *extra = NULL;
    if (args[4] != Py_None) {
        if (get_u64s(args[4], &ev, 0, "extra") < 0) return NULL;
        extra = ev.buf;
    }
    if (PyObject_GetBuffer(args[5], &ov, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        if (extra) PyBuffer_Release(&ev);
        return NULL;
    }
    u64 *tok = NULL;
    Py_ssize_t ntok = 0, nb = 0;
    const char *why = NULL;
    if (read_tokens(args[0], packed, &self->tok, &tok, &ntok) < 0) goto fail;
    if (chain_ready(self) < 0) goto fail;
    nb = ntok / self->bs;
    if (extra && ev.len / 8 < nb) why = "extra has fewer entries than blocks";
    else if (ov.len < nb * 8) why = "out is too small";
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
        goto fail;
    }
    chain_keys(self, tok, nb, start, position, extra, ov.buf);
    PyBuffer_Release(&ov);
    if (extra) PyBuffer_Release(&ev);
    return PyLong_FromSsize_t(nb);
fail:
    PyBuffer_Release(&ov);
    if (extra) PyBuffer_Release(&ev);
    return NULL;
}

static PyObject *KeyChain_get_block_size(KeyChain *self, void *closure) {
    if (chain_ready(self) < 0) return NULL;
    return PyLong_FromSsize_t(self->bs);
}

static PyMethodDef KeyChain_methods[] = {
    {"keys_into", (PyCFunction)(void (*)(void))KeyChain_keys_into, METH_FASTCALL,
     "keys_into(tokens, packed, start, position, extra, out) -> number of keys written"},
    {NULL},
};

static PyGetSetDef KeyChain_getset[] = {
    {"block_size", (getter)KeyChain_get_block_size, NULL, "tokens per block", NULL},
    {NULL},
};

static PyTypeObject KeyChainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.prefix_index._core.KeyChain",
    .tp_basicsize = sizeof(KeyChain),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The chained block key function of one (seed, block size).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyChain_init,
    .tp_dealloc = (destructor)KeyChain_dealloc,
    .tp_methods = KeyChain_methods,
    .tp_getset = KeyChain_getset,
};

/* The chain argument of an Index method, or NULL with TypeError. */
static KeyChain *chain_arg(PyObject *o) {
    if (PyObject_TypeCheck(o, &KeyChainType)) return (KeyChain *)o;
    PyErr_SetString(PyExc_TypeError, "chain must be a KeyChain");
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Open addressing over fixed-size records whose first 8 bytes are the key. */

typedef int (*Occupied)(const char *rec, size_t rs);

typedef struct Arena Arena;

typedef struct {
    char *a;
    size_t cap;   /* 0 or a power of two >= MIN_CAP */
    size_t count;
    size_t rs;    /* record size in bytes */
    int shift;
    int homed;    /* the record's second 8 bytes are its home hash (below), bits 3-31 free */
    size_t floor; /* 0, or the capacity the table starts at and never shrinks under */
    size_t bytes; /* of memory behind a (at least cap * rs) */
    Arena *arena; /* where its mid-sized arrays come from (below), or NULL */
    int in_arena; /* a is one */
    const int *small_first; /* its index's Arena.small_first (an import running), or NULL */
    size_t *acct; /* the index's running count of table bytes (arena chunks apart), or NULL */
} Table;

/* Whether the table's fresh memory is faulted in with small pages first (its index imports). */
static inline int t_small_first(const Table *t) { return t->small_first && *t->small_first; }

/* What a table adds to its index's memory: its array, unless an arena chunk
 * (counted whole) holds it. */
static inline size_t t_own_bytes(const Table *t) { return t->in_arena ? 0 : t->bytes; }

static inline void t_account(const Table *t, size_t before) {
    if (t->acct) *t->acct += t_own_bytes(t) - before; /* wraps back when it shrinks */
}

/* A growing index allocates a table twice the size at every doubling, and
 * faulting its fresh pages in one at a time, as the inserts first touch
 * them, cost more than the inserts. So the pages of a table of POPULATE_MIN
 * bytes or more are faulted in by one call (MADV_POPULATE_WRITE; a no-op for
 * memory the allocator reuses, already mapped). From HUGE_MIN bytes a table
 * is a mapping of its own with transparent huge pages: a lookup is a cache
 * miss anyway, and with 4 KiB pages it is a TLB miss too. Under
 * AddressSanitizer every table comes from the (instrumented) allocator, so
 * that a stray access past one is caught. */
#define POPULATE_MIN ((size_t)1 << 16)
#define HUGE_MIN ((size_t)1 << 21)
#if defined(__linux__) && !defined(__SANITIZE_ADDRESS__)
#define TABLE_MMAP 1
#else
#define TABLE_MMAP 0
#endif

#if TABLE_MMAP
/* Best effort: where refused (an older kernel), pages fault in lazily. */
static void populate_range(void *p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
    const uintptr_t page = 4096, a = ((uintptr_t)p + page - 1) & ~(page - 1);
    const uintptr_t b = ((uintptr_t)p + bytes) & ~(page - 1);
    if (b > a) madvise((void *)a, b - a, MADV_POPULATE_WRITE);
#endif
}

typedef struct {
    char *p;
    size_t bytes;
} Span;

/* Where a table's fresh memory gets its huge pages. On a VM whose host
 * takes free memory back a huge page at a time, a huge page's first fault
 * cost up to 25x its 512 small pages' (0.11 against 2.8 GB/s), and a
 * doubling of a large table faulted in that way stalled its caller for
 * 1.6-2.7 s. So:
 * - an import's memory (1.5 GiB at once for a restarted router) is faulted
 *   in with small pages and only then advised for huge ones, which
 *   khugepaged collapses it into as it goes (16 MiB per 10 s at its
 *   defaults): loads of 12.6-18 s took 3.1-4.1 s (benchmarks/restart_floor.py);
 * - a table of SPLIT_MIN or more grown by stores (the shared one's
 *   doublings) is faulted in with small pages too, and once filled
 *   collapsed by a thread of its own (collapse_later);
 * - any other table gets its huge pages at once: probes into it miss the
 *   TLB less from the start (apply about 10%, matches up to 30% faster). */
static void advise_huge(void *p, size_t bytes, int huge) {
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#else
    (void)p, (void)bytes, (void)huge;
#endif
}

static void *populate_run(void *arg) {
    const Span *s = arg;
    populate_range(s->p, s->bytes);
    return NULL;
}

/* A table of SPLIT_MIN bytes or more (the shared one, growing) is faulted in
 * by two threads, half each: a VM's host faults in a fresh page per thread
 * at a time, so two take about half as long (benchmarks/restart_floor.py). */
#define SPLIT_MIN ((size_t)1 << 25)

static void populate(void *p, size_t bytes) {
    pthread_t th;
    Span upper = {(char *)p + (bytes / 2 & ~(HUGE_MIN - 1)), 0};
    upper.bytes = (size_t)((char *)p + bytes - upper.p);
    if (bytes < SPLIT_MIN || pthread_create(&th, NULL, populate_run, &upper) != 0) {
        populate_range(p, bytes);
        return;
    }
    populate_range(p, (size_t)(upper.p - (char *)p));
    pthread_join(th, NULL);
}

/* Fault in fresh memory mapped with advise_huge(p, bytes, !small_first): where
 * small_first, in small pages, then advised for huge ones. */
static void fault_in(void *p, size_t bytes, int small_first) {
    populate(p, bytes);
    if (small_first) advise_huge(p, bytes, 1);
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux >= 6.1; refused (EINVAL) by an older kernel */
#endif

/* One large table collapsed into huge pages at a time, on a thread of its
 * own: faulted in with small pages (advise_huge), it would otherwise miss
 * the TLB until khugepaged's pace reaches it. A table freed meanwhile stops
 * the thread before it is unmapped (collapse_forget). Process-wide; a
 * second table while one is collapsing is left to khugepaged. */
static pthread_mutex_t collapse_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t collapse_cv = PTHREAD_COND_INITIALIZER;
static Span collapse_span; /* the range being collapsed, while collapse_busy */
static int collapse_busy, collapse_stop;

static void *collapse_run(void *arg) {
    (void)arg;
    pthread_mutex_lock(&collapse_mu);
    const Span s = collapse_span; /* fixed while collapse_busy */
    pthread_mutex_unlock(&collapse_mu);
    for (size_t off = 0; off + HUGE_MIN <= s.bytes; off += HUGE_MIN) {
        pthread_mutex_lock(&collapse_mu);
        const int stop = collapse_stop;
        pthread_mutex_unlock(&collapse_mu);
        /* Stops where refused (a kernel without it, no huge page to be had). */
        if (stop || (madvise(s.p + off, HUGE_MIN, MADV_COLLAPSE) != 0 && errno != EAGAIN)) break;
    }
    pthread_mutex_lock(&collapse_mu);
    collapse_busy = 0;
    pthread_cond_broadcast(&collapse_cv);
    pthread_mutex_unlock(&collapse_mu);
    return NULL;
}

static void collapse_later(char *p, size_t bytes) {
    pthread_attr_t attr;
    pthread_t th;
    pthread_mutex_lock(&collapse_mu);
    const int idle = !collapse_busy;
    if (idle) {
        collapse_span = (Span){p, bytes};
        collapse_busy = 1;
        collapse_stop = 0;
    }
    pthread_mutex_unlock(&collapse_mu);
    if (!idle) return;
    int ok = pthread_attr_init(&attr) == 0;
    if (ok) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        ok = pthread_create(&th, &attr, collapse_run, NULL) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!ok) {
        pthread_mutex_lock(&collapse_mu);
        collapse_busy = 0;
        pthread_mutex_unlock(&collapse_mu);
    }
}

/* Whether a table of `bytes` is faulted in with small pages and collapsed
 * once filled: a large one grown by stores (not by an import). */
static int collapsed_later(size_t bytes, int small_first) { return !small_first && bytes >= SPLIT_MIN; }

/* Before [p, p + bytes) is unmapped: a collapse of it stopped, its current
 * step (one huge page) finished. */
static void collapse_forget(char *p, size_t bytes) {
    pthread_mutex_lock(&collapse_mu);
    if (collapse_busy && collapse_span.p < p + bytes && p < collapse_span.p + collapse_span.bytes) {
        collapse_stop = 1;
        while (collapse_busy) pthread_cond_wait(&collapse_cv, &collapse_mu);
    }
    pthread_mutex_unlock(&collapse_mu);
}
#endif

/* *bytes zeroed bytes, rounded up to whole huge pages for a presized table
 * of HUGE_MIN / 2 or more: a capacity hint asks for speed with memory up
 * front, and a random probe into it then misses the cache but, in huge
 * pages (advise_huge), not the TLB (at most 1.6x that table's memory; rank
 * tables of that size come from the arena below instead). */
static void *table_alloc(size_t *bytes_io, int presized, int small_first) {
    size_t bytes = *bytes_io;
#if TABLE_MMAP
    if (presized && bytes >= HUGE_MIN / 2) bytes = *bytes_io = (bytes + HUGE_MIN - 1) & ~(HUGE_MIN - 1);
    if (bytes >= HUGE_MIN) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        const int small = small_first || collapsed_later(bytes, small_first);
        advise_huge(p, bytes, !small);
        fault_in(p, bytes, small);
        return p;
    }
    void *p = PyMem_Calloc(1, bytes);
    if (p && bytes >= POPULATE_MIN) populate(p, bytes);
    return p;
#else
    (void)presized, (void)small_first;
    return PyMem_Calloc(1, bytes);
#endif
}

static void table_free(void *p, size_t bytes) {
#if TABLE_MMAP
    if (bytes >= HUGE_MIN) {
        if (p) {
            collapse_forget(p, bytes);
            munmap(p, bytes);
        }
        return;
    }
#endif
    PyMem_Free(p);
}

/* The rank tables' arena. A rank's table is probed at a random place per
 * block, and 64 ranks' tables of 0.5-1 MiB each are far more pages than the
 * TLB covers: from the allocator (4 KiB pages) nearly every probe of a
 * growing index was a TLB miss too, a costly one in a VM. So arrays of
 * ARENA_MIN bytes up to HUGE_MIN (a power of two: a rank table's 32-byte
 * entries) are carved from 2 MiB chunks on transparent huge pages, a chunk
 * per size, a bit a slot; a chunk is unmapped once empty. Only the two
 * largest sizes: a chunk then holds 2 or 4 tables, so one rank alone, or
 * ranks shrinking apart, waste at most 1.5 MiB a chunk; memory_bytes counts
 * whole chunks. */
#define ARENA_MIN ((size_t)1 << 19)

typedef struct {
    char *base;
    u32 used, dirty; /* slots in use; slots used since mapped (to zero again) */
    size_t size;
} Chunk;

struct Arena {
    Chunk *c;
    size_t n, cap;
    int small_first; /* set while its index imports: fresh memory, its chunks' and that of the
                      * tables pointing at it, faulted in with small pages first */
};

#if TABLE_MMAP
static int arena_fits(size_t bytes) {
    return bytes >= ARENA_MIN && bytes < HUGE_MIN && (bytes & (bytes - 1)) == 0;
}

/* Room in the chunk list for `more` chunks; -1 with MemoryError. */
static int arena_room(Arena *ar, size_t more) {
    if (ar->n + more <= ar->cap) return 0;
    size_t cap = ar->cap ? 2 * ar->cap : 16;
    while (cap < ar->n + more) cap *= 2;
    Chunk *c = PyMem_Realloc(ar->c, cap * sizeof(Chunk));
    if (!c) { PyErr_NoMemory(); return -1; }
    ar->c = c;
    ar->cap = cap;
    return 0;
}

/* `bytes` (whole huge pages) of fresh memory aligned to 2 MiB, so that the
 * kernel can back it with huge pages, and advised so unless it is to be
 * faulted in with small pages first (advise_huge); NULL if not mapped. */
static char *map_huge(size_t bytes, int small_first) {
    char *m = mmap(NULL, bytes + HUGE_MIN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    char *base = (char *)(((uintptr_t)m + HUGE_MIN - 1) & ~(uintptr_t)(HUGE_MIN - 1));
    if (base > m) munmap(m, (size_t)(base - m));
    if (base + bytes < m + bytes + HUGE_MIN) munmap(base + bytes, (size_t)(m + bytes + HUGE_MIN - base - bytes));
    advise_huge(base, bytes, !small_first);
    return base;
}

/* A zeroed array of `size` bytes (a power of two fitting the arena), or NULL. */
static void *arena_alloc(Arena *ar, size_t size) {
    const u32 full = (u32)(((u64)1 << (HUGE_MIN / size)) - 1);
    for (size_t i = 0; i < ar->n; i++) {
        Chunk *c = &ar->c[i];
        if (c->size != size || c->used == full) continue;
        int s = __builtin_ctz(~c->used);
        char *p = c->base + (size_t)s * size;
        /* A slot never used may be one an import's fault-in thread (below) has
         * not reached: faulted in for writing here, so that the table's first
         * reads do not map the zero page, whose replacement at the first
         * write then cost a TLB flush on every core the process runs on. */
        if (c->dirty & (1u << s)) memset(p, 0, size);
        else populate_range(p, size);
        c->used |= 1u << s;
        c->dirty |= 1u << s;
        return p;
    }
    if (arena_room(ar, 1) < 0) return NULL;
    char *base = map_huge(HUGE_MIN, ar->small_first);
    if (!base) return NULL;
    fault_in(base, HUGE_MIN, ar->small_first);
    ar->c[ar->n++] = (Chunk){base, 1, 1, size};
    return base;
}

static void arena_free(Arena *ar, char *p) {
    char *base = (char *)((uintptr_t)p & ~(uintptr_t)(HUGE_MIN - 1));
    for (size_t i = 0; i < ar->n; i++) {
        Chunk *c = &ar->c[i];
        if (c->base != base) continue;
        c->used &= ~(1u << ((size_t)(p - base) / c->size));
        if (!c->used) {
            munmap(base, HUGE_MIN);
            *c = ar->c[--ar->n];
        }
        return;
    }
}

/* An import's rank tables, faulted in ahead of it. A restarted router's
 * import builds every rank's table in memory new to the process, and
 * faulting those pages in (zeroing them; in a VM, a host fault too) took as
 * long as the import's own work. So before the tables are built, the arena
 * chunks they will take are mapped in one piece and a thread of their own
 * faults them in from the last, while the import fills them from the first:
 * the kernel's work runs beside the import's. Chunks left unused (a view
 * refused) are unmapped at the end. */
typedef struct {
    char *base;
    size_t bytes;
    pthread_t th;
    int running;
} Ahead;

static void *ahead_run(void *arg) {
    const Ahead *a = arg;
    for (size_t off = a->bytes; off > 0; off -= HUGE_MIN) fault_in(a->base + off - HUGE_MIN, HUGE_MIN, 1);
    return NULL;
}

/* Chunks for slots[0] tables of ARENA_MIN bytes and slots[1] of 2 *
 * ARENA_MIN, past the free slots the arena has. Best effort: where the
 * mapping or the thread cannot be had, the chunks come one at a time. */
static void ahead_start(Arena *ar, const size_t slots[2], Ahead *a) {
    size_t n[2];
    for (int k = 0; k < 2; k++) {
        const size_t size = ARENA_MIN << k, per = HUGE_MIN / size;
        size_t free = 0;
        for (size_t i = 0; i < ar->n; i++)
            if (ar->c[i].size == size) free += per - (size_t)__builtin_popcount(ar->c[i].used);
        n[k] = slots[k] > free ? (slots[k] - free + per - 1) / per : 0;
    }
    const size_t count = n[0] + n[1], bytes = count * HUGE_MIN;
    if (!count) return;
    if (arena_room(ar, count) < 0) { PyErr_Clear(); return; }
    char *base = map_huge(bytes, 1);
    if (!base) return;
    for (size_t i = 0; i < count; i++) ar->c[ar->n++] = (Chunk){base + i * HUGE_MIN, 0, 0, ARENA_MIN << (i >= n[0])};
    *a = (Ahead){base, bytes, 0, 0};
    a->running = pthread_create(&a->th, NULL, ahead_run, a) == 0;
}

/* The thread joined, and the chunks no table took unmapped. */
static void ahead_end(Arena *ar, Ahead *a) {
    if (!a->bytes) return;
    if (a->running) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(a->th, NULL);
        Py_END_ALLOW_THREADS
    }
    for (size_t i = ar->n; i-- > 0;) {
        Chunk *c = &ar->c[i];
        if (c->dirty || c->base < a->base || c->base >= a->base + a->bytes) continue;
        munmap(c->base, HUGE_MIN);
        *c = ar->c[--ar->n];
    }
    a->bytes = 0;
}
#endif

static void arena_release(Arena *ar) {
#if TABLE_MMAP
    for (size_t i = 0; i < ar->n; i++) munmap(ar->c[i].base, HUGE_MIN);
#endif
    PyMem_Free(ar->c);
    ar->c = NULL;
    ar->n = ar->cap = 0;
}

/* A table's array: from its arena where it fits, else as above. */
static void *t_alloc(Table *t, size_t *bytes, int presized, int *in_arena) {
    *in_arena = 0;
#if TABLE_MMAP
    if (t->arena && arena_fits(*bytes)) {
        void *p = arena_alloc(t->arena, *bytes);
        *in_arena = p != NULL;
        return p;
    }
#endif
    return table_alloc(bytes, presized, t_small_first(t));
}

static void t_free(Table *t) {
#if TABLE_MMAP
    if (t->in_arena) {
        arena_free(t->arena, t->a);
        return;
    }
#endif
    table_free(t->a, t->bytes);
}

/* Where a record lives: its home hash hh picks the slot, from its top
 * bits, plus its low 3 bits. A record's own key gives hh = mix(key) with
 * all but the top 32 bits clear (so an entry keeps a home hash in 4 bytes;
 * past 2**32 slots homes would crowd, still correct); the nodes' table uses
 * a home hash shared by 8 consecutive blocks of a chain with their offsets
 * in it, so a prompt's walk reads a few neighbouring cache lines (and
 * pages) per 8 blocks instead of one random line per block. */
static inline u64 mix64(u64 k) {
    k ^= k >> 31;
    return k * GOLDEN;
}

#define HOME_BITS 0xFFFFFFFF00000000ULL

static inline u64 own_home(u64 k) { return mix64(k) & HOME_BITS; }

static inline size_t home_at(u64 hh, int shift, size_t m) {
    return ((size_t)(hh >> shift) + (size_t)(hh & 7)) & m;
}

static inline u64 rec_key(const char *r) {
    u64 k;
    memcpy(&k, r, 8);
    return k;
}

/* A home hash has bits 3-31 clear: a homed record keeps its own data there. */
#define HOME_FREE 0x00000000FFFFFFF8ULL

static inline u64 rec_hh(const Table *t, const char *r) {
    if (!t->homed) return own_home(rec_key(r));
    u64 h;
    memcpy(&h, r + 8, 8);
    return h & ~HOME_FREE;
}

/* The record of (k, hh): a homed table tells records apart by both. */
static inline char *t_find_h(const Table *t, u64 k, u64 hh, Occupied occ) {
    if (!t->cap) return NULL;
    size_t m = t->cap - 1, i = home_at(hh, t->shift, m);
    for (;;) {
        char *r = t->a + i * t->rs;
        if (!occ(r, t->rs)) return NULL;
        if (rec_key(r) == k && (!t->homed || rec_hh(t, r) == hh)) return r;
        i = (i + 1) & m;
    }
}

static inline char *t_find(const Table *t, u64 k, Occupied occ) {
    return t_find_h(t, k, own_home(k), occ);
}

static inline void t_prefetch_h(const Table *t, u64 hh) {
    if (t->cap) __builtin_prefetch(t->a + home_at(hh, t->shift, t->cap - 1) * t->rs);
}

static inline void t_prefetch(const Table *t, u64 k) { t_prefetch_h(t, own_home(k)); }

/* An insert's probe: the home record's line and the next (linear probing
 * reads a few records past home when the key is new). */
static inline void t_prefetch_probe(const Table *t, u64 k) {
    if (!t->cap) return;
    const char *r = t->a + home_at(own_home(k), t->shift, t->cap - 1) * t->rs;
    __builtin_prefetch(r);
    __builtin_prefetch(r + 64);
}

static int shift_for(size_t cap) {
    int bits = 0;
    while (((size_t)1 << bits) < cap) bits++;
    return 64 - bits;
}

/* Rebuild with `cap` slots (0: free everything). The homes are the hash's
 * top bits and probing is linear, so the records of the old table come in
 * (nearly) home order and land in the new one in the same order, near twice
 * their old slot at a doubling: one sequential pass over both tables, no
 * cache or TLB miss per record. */
__attribute__((always_inline)) static inline int rehash_as(Table *t, size_t cap, Occupied occ) {
    const size_t before = t_own_bytes(t);
    if (cap == 0) {
        t_free(t);
        t->a = NULL;
        t->in_arena = 0;
        t->cap = 0;
        t->count = 0;
        t->bytes = 0;
        t_account(t, before);
        return 0;
    }
    size_t bytes = cap * t->rs;
    int in_arena;
    char *a = t_alloc(t, &bytes, cap <= t->floor, &in_arena);
    if (!a) { PyErr_NoMemory(); return -1; }
    int shift = shift_for(cap);
    size_t m = cap - 1;
    /* Where old slot j's records land, about: j scaled by cap / t->cap. */
    int up = cap >= t->cap;
    size_t scale = up ? cap / (t->cap ? t->cap : 1) : t->cap / cap;
    for (size_t j = 0; j < t->cap; j++) {
        if (j + REHASH_AHEAD < t->cap) {
            /* The new table's lines are cold (fresh pages): fetch them ahead. */
            size_t ahead = j + REHASH_AHEAD;
            __builtin_prefetch(a + ((up ? ahead * scale : ahead / scale) & m) * t->rs, 1);
        }
        const char *r = t->a + j * t->rs;
        if (!occ(r, t->rs)) continue;
        size_t i = home_at(rec_hh(t, r), shift, m);
        while (occ(a + i * t->rs, t->rs)) i = (i + 1) & m;
        memcpy(a + i * t->rs, r, t->rs);
    }
    t_free(t);
#if TABLE_MMAP
    /* Filled: a large table grown by stores goes into huge pages now (advise_huge). */
    if (collapsed_later(bytes, t_small_first(t))) collapse_later(a, bytes);
#endif
    t->a = a;
    t->cap = cap;
    t->shift = shift;
    t->bytes = bytes;
    t->in_arena = in_arena;
    t_account(t, before);
    return 0;
}

static int entry_occ(const char *r, size_t rs);
static int node_occ(const char *r, size_t rs);

/* A copy of the pass per record kind, its occupancy tests inlined (two a
 * record: an indirect call each cost a fifth of a growing index's time). */
__attribute__((noinline)) static int t_rehash(Table *t, size_t cap, Occupied occ) {
    if (occ == entry_occ) return rehash_as(t, cap, entry_occ);
    if (occ == node_occ) return rehash_as(t, cap, node_occ);
    return rehash_as(t, cap, occ);
}

/* The least capacity from `cap` up (doubling) that holds n records. */
static size_t cap_from(size_t cap, size_t n) {
    while (n * 10 > cap * 7) cap *= 2;
    return cap;
}

static size_t cap_for(size_t n) { return cap_from(MIN_CAP, n); }

/* The capacity t_reserve gives a table that must hold `need` records. */
static size_t t_cap_for(const Table *t, size_t need) {
    size_t cap = t->cap > t->floor ? t->cap : t->floor;
    return cap_from(cap < MIN_CAP ? MIN_CAP : cap, need);
}

/* Room for `more` records without a rehash, and at least the floor. */
static int t_reserve(Table *t, Py_ssize_t more, Occupied occ) {
    size_t need = t->count + (size_t)more;
    if (need * 10 <= t->cap * 7 && t->cap >= t->floor) return 0;
    return t_rehash(t, t_cap_for(t, need), occ);
}

/* The record of (k, hh), inserted zeroed but for them (*added = 1) when
 * absent: one probe. Both forms inlined into every caller: out of line in
 * store_core's loop (once import_rank called them too), an apply of
 * one-block events took 1% more instructions. */
__attribute__((always_inline)) static inline char *t_upsert_h(Table *t, u64 k, u64 hh, Occupied occ, int *added) {
    if ((t->count + 1) * 10 > t->cap * 7 && t_reserve(t, 1, occ) < 0) return NULL;
    size_t m = t->cap - 1, i = home_at(hh, t->shift, m);
    for (;;) {
        char *r = t->a + i * t->rs;
        if (!occ(r, t->rs)) {
            memset(r, 0, t->rs);
            memcpy(r, &k, 8);
            if (t->homed) memcpy(r + 8, &hh, 8);
            t->count++;
            *added = 1;
            return r;
        }
        if (rec_key(r) == k && (!t->homed || rec_hh(t, r) == hh)) {
            *added = 0;
            return r;
        }
        i = (i + 1) & m;
    }
}

__attribute__((always_inline)) static inline char *t_upsert(Table *t, u64 k, Occupied occ, int *added) {
    return t_upsert_h(t, k, own_home(k), occ, added);
}

/* Shrink or free a table that records left (never under its floor). */
static int t_settle(Table *t, Occupied occ) {
    if (t->cap <= t->floor) return 0; /* presized: kept at its size, even empty */
    if (t->count == 0) return t_rehash(t, 0, occ);
    /* Shrinking only saves memory; on failure keep the bigger table. Not while an error
     * is pending (a rollback's): clearing the shrink's own failure would wipe it. */
    if (t->cap > MIN_CAP && t->count * 8 < t->cap && !PyErr_Occurred()) {
        size_t cap = cap_for(t->count * 2);
        if (t_rehash(t, cap > t->floor ? cap : t->floor, occ) < 0) PyErr_Clear();
    }
    return 0;
}

/* Remove the record at r: backward-shift the run after it; shrink or free. */
static int t_delete(Table *t, char *r, Occupied occ) {
    size_t m = t->cap - 1;
    size_t i = (size_t)(r - t->a) / t->rs, j = i;
    for (;;) {
        j = (j + 1) & m;
        char *rj = t->a + j * t->rs;
        if (!occ(rj, t->rs)) break;
        size_t h = home_at(rec_hh(t, rj), t->shift, m);
        /* rj may move back to i only if its home is not in (i, j]. */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        memcpy(t->a + i * t->rs, rj, t->rs);
        i = j;
    }
    memset(t->a + i * t->rs, 0, t->rs);
    t->count--;
    return t_settle(t, occ);
}

/* ------------------------------------------------------------------------ */
/* Records                                                                   */

/* One engine hash of one rank, 32 bytes: a probe reads one cache line.
 * Occupied while any count is non-zero. A count stops at COUNT_MAX stores
 * (an engine storing one hash that often without removing it is broken
 * anyway; removals then take it out after COUNT_MAX). */
typedef struct {
    u64 h;
    u16 c[3];
    i32 depth;  /* block position; ~position on a detached chain */
    u32 hh_hi;  /* the top half of the key's home hash in the nodes' table */
    u64 key;
} Entry;

#define COUNT_MAX UINT16_MAX
_Static_assert(sizeof(Entry) == 32, "an entry is half a cache line");

/* The key's home hash: a chain from a root shares its group's (top half
 * stored) with its offset in the group, its position's low bits; a detached
 * or unmatchable key has its own (offset 0). */
static inline u64 entry_hh(const Entry *e) {
    return ((u64)e->hh_hi << 32) | (e->depth >= 0 ? (u64)(e->depth & 7) : 0);
}

static int entry_occ(const char *r, size_t rs) {
    const Entry *e = (const Entry *)r;
    return (e->c[0] | e->c[1] | e->c[2]) != 0;
}

static inline int presence(const Entry *e) {
    return (e->c[0] != 0) | ((e->c[1] != 0) << 1) | ((e->c[2] != 0) << 2);
}

/* A key that several engine hashes of one rank map to: n[0] entries,
 * n[1 + t] of them present in tier t. Occupied while n[0] > 0. */
typedef struct {
    u64 key;
    u32 n[4];
} Multi;

static int multi_occ(const char *r, size_t rs) { return ((const Multi *)r)->n[0] != 0; }

/* A node, 16 bytes: its key, then its home hash with its holders in the
 * hash's free bits 3-31 (`who`, 29 bits). In the fleets nearly every key
 * is held by one rank, so that one is kept inline; only a key that two or
 * more ranks hold takes a row of the holder pool (below):
 *   who 0                 nobody (an empty slot, or a node being set);
 *   bit 0 clear           one holder: bits 1-3 its tier presence (never 0),
 *                         bits 4-28 its rank slot;
 *   bit 0 set             bits 1-28 its pool row.
 * Occupied while some rank holds it. */
#define NODE_RS 16
#define WHO_POOLED 1u
#define WHO_ROW_MAX ((1u << 28) - 1)

static inline u64 node_hw(const char *r) {
    u64 h;
    memcpy(&h, r + 8, 8);
    return h;
}

static inline u32 hw_who(u64 hw) { return (u32)((hw & HOME_FREE) >> 3); }

static inline u32 node_who(const char *r) { return hw_who(node_hw(r)); }

static inline void node_set_who(char *r, u32 who) {
    const u64 h = (node_hw(r) & ~HOME_FREE) | ((u64)who << 3);
    memcpy(r + 8, &h, 8);
}

static inline u32 who_one(size_t sid, int pa) { return (u32)(sid << 4) | ((u32)pa << 1); }

static int node_occ(const char *r, size_t rs) { return (node_hw(r) & HOME_FREE) != 0; }

/* The holder pool: rows of 1 + words * tiers u64s, a row's holder count then
 * its masks laid out [word][tier] (one tier until a non-GPU medium shows
 * up). A free row links to the next free one (row + 1; 0 ends) in its
 * count word. The array is freed once no row is in use. */
typedef struct {
    u64 *a;
    size_t rw;   /* words a row */
    size_t cap;  /* rows allocated */
    size_t top;  /* rows handed out at least once (the rest fresh) */
    size_t live; /* rows in use */
    size_t free; /* the first free row below top + 1, or 0 */
    size_t bytes;
} Pool;

typedef struct {
    Table entries;
    Table multi;
    size_t detached;
    int over_cap; /* CAP_BLOCKS | CAP_BYTES: why stores were refused since the last clear */
    size_t hint;  /* blocks reserve() said the rank will hold (0: none); kept over clears */
} Rank;

#define CAP_BLOCKS 1 /* a store would have taken the rank past max_entries */
#define CAP_BYTES 2  /* a store would have taken the index past max_bytes */


typedef struct {
    PyObject_HEAD
    Table nodes;
    Pool pool;     /* the holder masks of keys that several ranks hold */
    size_t words;  /* 64 ranks a word */
    size_t tiers;  /* 1 (GPU only so far) or 3 */
    Rank *ranks;
    size_t nranks;
    size_t max_entries; /* engine hashes a rank may hold; 0: no bound */
    size_t expected;    /* blocks a rank is expected to hold (tables presized); 0: none */
    size_t max_bytes;   /* the tables' memory budget; 0: none */
    size_t mem;         /* bytes of every table array outside the arena (Table.acct) */
    size_t hinted;      /* sum over ranks of what reserve() asked past `expected` */
    Arena arena; /* the rank tables' mid-sized arrays */
    Scratch tok, keys, hashes;
    /* apply_payload's first pass: hashes, block sums, events */
    KvScan scan;
    Scratch ps;
    Py_ssize_t ps_len;
    /* The names (and their hashes) matches report by: Names, shared by
     * every match until the names list changes. */
    PyObject *snap;
    /* What configure() gave: the per-index arguments of apply_payload and
     * match_list, so the common calls pass only what varies. */
    KeyChain *chain;
    PyObject *groups; /* NULL: apply_payload leaves every payload to the general path */
    PyObject *tier_of, *names; /* PrefixIndex._TIER_OF, the names list */
    u64 root;
    Py_ssize_t index_max_bs;
    int none_ok;
    /* the DecodeLimits last given to apply_payload (frozen) and its bounds */
    KvLimitsSeen limits;
    /* apply_payload's counters: orphans, unknown removals, ignored, malformed, refused;
     * and refusals at max_bytes (any path: the Python one adds none) */
    Py_ssize_t counts[6];
} Index;

/* Valid and empty from the start: __init__ only sets the per-rank bound, so
 * an Index that never ran it (Index.__new__(Index)) is safe to use. */
static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Index *self = (Index *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->words = 1;
    self->tiers = 1;
    self->nodes.rs = NODE_RS;
    self->nodes.homed = 1;
    self->pool.rw = 2;
    self->nodes.acct = &self->mem;
    self->nodes.small_first = &self->arena.small_first;
    return (PyObject *)self;
}

static int Index_init(Index *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"max_entries", "expected_blocks_per_rank", "max_bytes", NULL};
    Py_ssize_t max_entries = 0, expected = 0, max_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n$nn", kwlist, &max_entries, &expected, &max_bytes))
        return -1;
    if (max_entries < 0 || max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "max_entries and max_bytes must be >= 0 (0: no bound)");
        return -1;
    }
    /* Memory is taken for it up front (70-140 B a block a rank): a hint is
     * an engine's cache size, not a bound to be generous with. */
    if (expected < 0 || expected > ((Py_ssize_t)1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "expected_blocks_per_rank must be in [0, 2**24] (0: no hint)");
        return -1;
    }
    self->max_entries = (size_t)max_entries;
    self->expected = (size_t)expected;
    self->max_bytes = (size_t)max_bytes;
    return 0;
}

static void rank_free(Rank *r) {
    t_rehash(&r->entries, 0, entry_occ);
    t_rehash(&r->multi, 0, multi_occ);
    r->detached = 0;
    r->over_cap = 0;
}

/* The shared table's floor: a node for every block the ranks are expected
 * (expected_blocks_per_rank) or hinted (reserve) to hold. */
static void nodes_floor_update(Index *self) {
    size_t want = self->expected * self->nranks + self->hinted;
    self->nodes.floor = want ? cap_for(want) : 0;
}

static void Index_dealloc(Index *self) {
    Py_XDECREF(self->snap);
    Py_XDECREF(self->chain);
    Py_XDECREF(self->groups);
    Py_XDECREF(self->tier_of);
    Py_XDECREF(self->names);
    Py_XDECREF(self->limits.obj);
    for (size_t i = 0; i < self->nranks; i++) rank_free(&self->ranks[i]);
    PyMem_Free(self->ranks);
    t_rehash(&self->nodes, 0, node_occ);
    PyMem_Free(self->pool.a);
    arena_release(&self->arena);
    scratch_free(&self->tok);
    scratch_free(&self->keys);
    scratch_free(&self->hashes);
    kvs_free(&self->scan);
    scratch_free(&self->ps);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* New mask layout (more words, or per-tier masks): the pool's rows are
 * copied over; the nodes stay as they are. */
static int relayout(Index *self, size_t words, size_t tiers) {
    Pool *p = &self->pool;
    const size_t rw = 1 + words * tiers;
    if (p->cap) {
        u64 *a = PyMem_Calloc(p->cap, rw * sizeof(u64));
        if (!a) { PyErr_NoMemory(); return -1; }
        for (size_t j = 0; j < p->top; j++) {
            const u64 *o = p->a + j * p->rw;
            u64 *n = a + j * rw;
            n[0] = o[0];
            /* Going from one tier to three: every holder so far is on GPU. */
            for (size_t w = 0; w < self->words; w++)
                for (size_t k = 0; k < self->tiers; k++) n[1 + w * tiers + k] = o[1 + w * self->tiers + k];
        }
        PyMem_Free(p->a);
        self->mem += p->cap * rw * sizeof(u64) - p->bytes; /* wraps back when it shrinks */
        p->bytes = p->cap * rw * sizeof(u64);
        p->a = a;
    }
    p->rw = rw;
    self->words = words;
    self->tiers = tiers;
    return 0;
}

/* What taking `rows` more rows would add to the pool's memory (it doubles). */
static int64_t pool_growth(const Pool *p, size_t rows) {
    if (p->live + rows <= p->cap) return 0;
    size_t cap = p->cap ? p->cap : 16;
    while (cap < p->live + rows) cap *= 2;
    return (int64_t)((cap - p->cap) * p->rw * sizeof(u64));
}

/* A zeroed row, or -1 with MemoryError. */
static Py_ssize_t pool_take(Index *self) {
    Pool *p = &self->pool;
    size_t row;
    if (p->free) {
        row = p->free - 1;
        p->free = (size_t)p->a[row * p->rw];
        p->a[row * p->rw] = 0;
    } else {
        if (p->top == p->cap) {
            const size_t cap = p->cap ? 2 * p->cap : 16;
            if (cap - 1 > WHO_ROW_MAX) return refuse(PyExc_MemoryError, "the holder pool is full");
            u64 *a = PyMem_Realloc(p->a, cap * p->rw * sizeof(u64));
            if (!a) { PyErr_NoMemory(); return -1; }
            memset(a + p->cap * p->rw, 0, (cap - p->cap) * p->rw * sizeof(u64));
            self->mem += cap * p->rw * sizeof(u64) - p->bytes;
            p->bytes = cap * p->rw * sizeof(u64);
            p->a = a;
            p->cap = cap;
        }
        row = p->top++;
    }
    p->live++;
    return (Py_ssize_t)row;
}

static void pool_put(Index *self, size_t row) {
    Pool *p = &self->pool;
    u64 *r = p->a + row * p->rw;
    memset(r, 0, p->rw * sizeof(u64));
    r[0] = p->free;
    p->free = row + 1;
    if (--p->live) return;
    PyMem_Free(p->a);
    self->mem -= p->bytes;
    p->a = NULL;
    p->cap = p->top = p->free = p->bytes = 0;
}

static inline u64 *pool_masks(const Index *self, u32 who) {
    return self->pool.a + (size_t)(who >> 1) * self->pool.rw + 1;
}

/* Rank sid's tier presence in masks m, and setting it. */
static inline int mask_get(const Index *self, const u64 *m, size_t sid) {
    m += (sid >> 6) * self->tiers;
    const u64 bit = 1ULL << (sid & 63);
    if (self->tiers == 1) return (m[0] & bit) ? 1 : 0;
    return ((m[0] & bit) ? 1 : 0) | ((m[1] & bit) ? 2 : 0) | ((m[2] & bit) ? 4 : 0);
}

static inline void mask_set(const Index *self, u64 *m, size_t sid, int pa) {
    m += (sid >> 6) * self->tiers;
    const u64 bit = 1ULL << (sid & 63);
    for (size_t k = 0; k < self->tiers; k++) {
        if (pa & (1 << k)) m[k] |= bit;
        else m[k] &= ~bit;
    }
}

/* Rank sid's tier presence in a node (0: not held). */
static inline int node_bits(const Index *self, const char *r, size_t sid) {
    const u32 who = node_who(r);
    if (who & WHO_POOLED) return mask_get(self, pool_masks(self, who), sid);
    return who && (who >> 4) == sid ? (int)((who >> 1) & 7) : 0;
}

/* Set rank sid's tier presence in a node to pa (0: not held): the one
 * place a node's holders change form. A second holder moves them to a pool
 * row, and a row left with one holder goes back inline. A node nobody
 * holds is left unoccupied (node_drop deletes it). 0, or -1 with
 * MemoryError (only when a second holder comes: the node is unchanged). */
static int node_put(Index *self, char *r, size_t sid, int pa) {
    const u32 who = node_who(r);
    if (!(who & WHO_POOLED)) {
        if (!who || (who >> 4) == sid) {
            node_set_who(r, pa ? who_one(sid, pa) : 0);
            return 0;
        }
        if (!pa) return 0;
        const Py_ssize_t row = pool_take(self);
        if (row < 0) return -1;
        u64 *c = self->pool.a + (size_t)row * self->pool.rw;
        c[0] = 2;
        mask_set(self, c + 1, who >> 4, (int)((who >> 1) & 7));
        mask_set(self, c + 1, sid, pa);
        node_set_who(r, ((u32)row << 1) | WHO_POOLED);
        return 0;
    }
    u64 *m = pool_masks(self, who);
    const int pb = mask_get(self, m, sid);
    mask_set(self, m, sid, pa);
    if (!pb == !pa) return 0;
    if (pa) {
        m[-1]++;
        return 0;
    }
    if (--m[-1] > 1) return 0;
    /* One holder left: inline again. */
    for (size_t w = 0; w < self->words; w++) {
        u64 any = 0;
        for (size_t k = 0; k < self->tiers; k++) any |= m[w * self->tiers + k];
        if (!any) continue;
        const size_t s = (w << 6) + (size_t)__builtin_ctzll(any);
        node_set_who(r, who_one(s, mask_get(self, m, s)));
        break;
    }
    pool_put(self, who >> 1);
    return 0;
}

/* Drop rank sid from the node; free the node when nobody holds it. */
static int node_drop(Index *self, char *r, size_t sid) {
    if (!node_bits(self, r, sid)) return 0;
    node_put(self, r, sid, 0); /* a drop takes no row: cannot fail */
    if (!node_occ(r, NODE_RS)) return t_delete(&self->nodes, r, node_occ);
    return 0;
}

static int64_t t_growth(const Table *t, size_t more);
static int past_budget(const Index *self, int64_t g);

/* Whether setting rank sid in the nodes of n keys (key i and its home hash
 * at key[i * stride], hh[i * stride]) fits the memory budget beside `other`
 * bytes of growth; *fresh: the nodes to make room for. A node and a pool
 * row a key are assumed first (no probe); only where that does not fit are
 * the keys probed for what they add: a node where there is none, a row
 * where another rank alone holds the key. */
static int holders_fit(const Index *self, size_t sid, const u64 *key, const u64 *hh, size_t stride,
                       size_t n, int64_t other, size_t *fresh) {
    *fresh = n;
    if (!self->max_bytes) return 1;
    if (!past_budget(self, other + t_growth(&self->nodes, n) + pool_growth(&self->pool, n))) return 1;
    size_t rows = 0;
    *fresh = 0;
    for (size_t i = 0; i < n; i++) {
        const char *r = t_find_h(&self->nodes, key[i * stride], hh[i * stride], node_occ);
        if (!r) {
            (*fresh)++;
            continue;
        }
        const u32 who = node_who(r);
        rows += !(who & WHO_POOLED) && (who >> 4) != sid;
    }
    return !past_budget(self, other + t_growth(&self->nodes, *fresh) + pool_growth(&self->pool, rows));
}

/* An entry of rank sid with this key went from tier presence pb to pa. */
static int node_update(Index *self, size_t sid, u64 key, u64 hh, int pb, int pa) {
    Rank *rk = &self->ranks[sid];
    Multi *mu = (Multi *)t_find(&rk->multi, key, multi_occ);
    if (mu) {
        if (!pb && pa) mu->n[0]++;
        else if (pb && !pa) mu->n[0]--;
        int bits = 0;
        for (int k = 0; k < 3; k++) {
            mu->n[1 + k] += ((pa >> k) & 1) - ((pb >> k) & 1);
            if (mu->n[1 + k]) bits |= 1 << k;
        }
        char *r = t_find_h(&self->nodes, key, hh, node_occ);
        if (r && node_put(self, r, sid, bits) < 0) return -1; /* the rank holds it: takes no row */
        if (mu->n[0] <= 1) return t_delete(&rk->multi, (char *)mu, multi_occ);
        return 0;
    }
    if (!pb) {
        int added;
        char *r = t_upsert_h(&self->nodes, key, hh, node_occ, &added);
        if (!r) return -1;
        int held = added ? 0 : node_bits(self, r, sid);
        if (held) {
            /* Another engine hash of this rank has the same key: count both. */
            int fresh;
            Multi *m = (Multi *)t_upsert(&rk->multi, key, multi_occ, &fresh);
            if (!m) return -1;
            m->n[0] = 2;
            int bits = 0;
            for (int k = 0; k < 3; k++) {
                m->n[1 + k] = ((held >> k) & 1) + ((pa >> k) & 1);
                if (m->n[1 + k]) bits |= 1 << k;
            }
            return node_put(self, r, sid, bits);
        }
        return node_put(self, r, sid, pa);
    }
    char *r = t_find_h(&self->nodes, key, hh, node_occ);
    if (!r) return 0;
    if (!pa) return node_drop(self, r, sid);
    return node_put(self, r, sid, pa);
}

static int check_sid(Index *self, PyObject *o, size_t *sid) {
    Py_ssize_t s = PyLong_AsSsize_t(o);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s < 0 || (size_t)s >= self->nranks) {
        PyErr_Format(PyExc_IndexError, "no rank slot %zd", s);
        return -1;
    }
    *sid = (size_t)s;
    return 0;
}

/* The floor of a rank's table: for expected_blocks_per_rank, or its hint. */
static size_t rank_floor(const Index *self, const Rank *rk) {
    size_t n = rk->hint > self->expected ? rk->hint : self->expected;
    return n ? cap_for(n) : 0;
}

/* A rank slot, as it is before any use. */
static void rank_init(Index *self, Rank *rk) {
    memset(rk, 0, sizeof *rk);
    rk->entries.rs = sizeof(Entry);
    rk->entries.arena = &self->arena;
    rk->entries.floor = rank_floor(self, rk);
    rk->entries.acct = &self->mem;
    rk->multi.rs = sizeof(Multi);
    rk->multi.acct = &self->mem;
}

/* Room for rank slot s (a valid slot number; 0, or -1 with an exception). */
static int ensure_slot(Index *self, size_t s) {
    size_t need = s + 1;
    if (need > self->nranks) {
        Rank *r = PyMem_Realloc(self->ranks, need * sizeof(Rank));
        if (!r) { PyErr_NoMemory(); return -1; }
        for (size_t i = self->nranks; i < need; i++) rank_init(self, &r[i]);
        self->ranks = r;
        self->nranks = need;
        /* A key is a node once however many ranks hold it: at most one per
         * expected block of every rank. Allocated at the next store. */
        nodes_floor_update(self);
    }
    size_t words = (need + 63) >> 6;
    if (words > self->words && relayout(self, words, self->tiers) < 0) return -1;
    return 0;
}

static int slot_arg(PyObject *arg, size_t *out) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s < 0 || s > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "rank slot %zd out of range", s);
        return -1;
    }
    *out = (size_t)s;
    return 0;
}

/* ensure_rank(sid): make room for rank slot sid. */
static PyObject *Index_ensure_rank(Index *self, PyObject *arg) {
    size_t s;
    if (slot_arg(arg, &s) < 0 || ensure_slot(self, s) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Engine hashes as u64s; TypeError when one is not an int. */
static u64 *read_hashes(Index *self, PyObject *obj, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, "block hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    u64 *h = scratch_get(&self->hashes, k);
    if (!h) { Py_DECREF(seq); return NULL; }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!PyLong_Check(items[i])) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_TypeError, "a block hash is not an int");
            return NULL;
        }
        h[i] = PyLong_AsUnsignedLongLongMask(items[i]);
        if (h[i] == (u64)-1 && PyErr_Occurred()) { Py_DECREF(seq); return NULL; }
    }
    Py_DECREF(seq);
    *n = k;
    return h;
}

#define ORPHAN 1
#define MALFORMED 2
#define OVER_CAP 4
#define OVER_BUDGET 8 /* with OVER_CAP: refused at max_bytes */

/* The tables' memory as the memory getter reports it. */
static size_t index_memory(const Index *self) { return self->mem + self->arena.n * HUGE_MIN; }

#if TABLE_MMAP
/* Whether the arena has a free slot of this size (no chunk to map for it). */
static int arena_has_room(const Arena *ar, size_t size) {
    const u32 full = (u32)(((u64)1 << (HUGE_MIN / size)) - 1);
    for (size_t i = 0; i < ar->n; i++)
        if (ar->c[i].size == size && ar->c[i].used != full) return 1;
    return 0;
}
#endif

/* What an array of `bytes` adds to the index's memory once table t takes it,
 * placed as t_alloc places it. */
static size_t placed_bytes(const Table *t, size_t bytes, int presized) {
#if TABLE_MMAP
    if (t->arena && arena_fits(bytes)) return arena_has_room(t->arena, bytes) ? 0 : HUGE_MIN;
    if (presized && bytes >= HUGE_MIN / 2) bytes = (bytes + HUGE_MIN - 1) & ~(HUGE_MIN - 1);
#else
    (void)t;
    (void)presized;
#endif
    return bytes;
}

/* What t_reserve(t, more) would add to the index's memory, the array it
 * frees taken off (an arena chunk it may free is not): 0 without a rehash. */
static int64_t t_growth(const Table *t, size_t more) {
    size_t need = t->count + more;
    if (need * 10 <= t->cap * 7 && t->cap >= t->floor) return 0;
    size_t cap = t->cap > t->floor ? t->cap : t->floor;
    if (cap < MIN_CAP) cap = MIN_CAP;
    while (need * 10 > cap * 7) cap *= 2;
    return (int64_t)placed_bytes(t, cap * t->rs, cap <= t->floor) - (int64_t)t_own_bytes(t);
}

/* Whether memory growing by g bytes would take the index past max_bytes. */
static int past_budget(const Index *self, int64_t g) {
    return self->max_bytes && g > 0 && index_memory(self) + (size_t)g > self->max_bytes;
}

/* Whether storing these hashes would take the rank past max_entries. */
static int over_cap(const Index *self, const Rank *rk, const u64 *hashes, Py_ssize_t n) {
    size_t cap = self->max_entries, have = rk->entries.count;
    if (!cap || have + (size_t)n <= cap) return 0;
    size_t fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!t_find(&rk->entries, hashes[i], entry_occ)) fresh++;
    return have + fresh > cap;
}

/* store(sid, chain, hashes, parent, tokens, packed, start, extra, tier) -> flags
 *
 * OVER_CAP: refused whole, nothing changed but the rank's over-cap mark
 * (the rank would pass max_entries; with OVER_BUDGET, the index max_bytes).
 * One BlockStored: resolve the parent in the rank's table (unknown: a
 * detached chain under it), key every block from its tokens (unusable
 * tokens: unmatchable keys from the hashes), count one more copy of every
 * block in `tier`. tokens None forces the unmatchable keys. */
/* The store itself, once every input is read: no Python code runs here.
 * Block keys come from the tokens (tok, ntok), or from their block sums
 * computed already (sums, n of them); neither, or tokens of the wrong
 * count: unmatchable keys. Returns the flags, or -1 with an exception. */
static int store_core(Index *self, size_t sid, KeyChain *chain, int tier, const u64 *hashes,
                      Py_ssize_t n, int has_parent, u64 parent, u64 start, const u64 *tok,
                      Py_ssize_t ntok, const u64 *sums, const u64 *extra) {
    int flags = 0;
    if (n == 0) return 0;
    if (tier != 0 && self->tiers == 1 && relayout(self, self->words, 3) < 0) return -1;

    Rank *rk = &self->ranks[sid];
    if (over_cap(self, rk, hashes, n)) {
        rk->over_cap |= CAP_BLOCKS;
        return OVER_CAP;
    }
    int64_t d0 = 0;
    int detached = 0;
    u64 parent_hh = 0;
    if (has_parent) {
        Entry *pe = (Entry *)t_find(&rk->entries, parent, entry_occ);
        int64_t dd;
        if (pe) {
            start = pe->key;
            dd = pe->depth;
            parent_hh = entry_hh(pe);
        } else {
            flags |= ORPHAN;
            start = fmix64(chain->detached_k ^ parent);
            dd = -1;
        }
        if (dd < 0) {
            detached = 1;
            d0 = ~dd + 1;
        } else {
            d0 = dd + 1;
        }
    }

    u64 *keys = scratch_get(&self->keys, 2 * n);
    if (!keys) return -1;
    u64 *hhs = keys + n;
    int ok = 0;
    if ((sums || (tok && ntok == n * chain->bs)) && d0 + n < DEPTH_LIMIT) {
        if (sums) chain_sums(chain, sums, n, start, (u64)d0, keys);
        else chain_keys(chain, tok, n, start, (u64)d0, extra, keys);
        ok = 1;
    }
    if (!ok) {
        /* Unmatchable keys, all at position 0 so a key keeps one depth. */
        flags |= MALFORMED;
        for (Py_ssize_t i = 0; i < n; i++) keys[i] = fmix64(hashes[i] ^ chain->malformed_k);
        detached = 1;
        d0 = 0;
    }
    /* Home hashes: a chain from a root shares one per 8 positions (that of
     * the key at the first of them: this store's, or its parent's group's);
     * a detached or unmatchable key has its own. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (detached) {
            hhs[i] = own_home(keys[i]);
            continue;
        }
        int64_t pos = d0 + i, a = pos & ~(int64_t)7;
        hhs[i] = (a >= d0 ? own_home(keys[a - d0]) : (parent_hh & HOME_BITS)) | (u64)(pos & 7);
    }
    /* The tables store_core grows below, as far as it grows them (nothing
     * has changed yet). */
    size_t fresh;
    if (!holders_fit(self, sid, keys, hhs, 1, (size_t)n, t_growth(&rk->entries, (size_t)n), &fresh)) {
        rk->over_cap |= CAP_BYTES;
        self->counts[5]++;
        return OVER_CAP | OVER_BUDGET;
    }
    /* Both tables grown for the whole store first, so that the prefetches
     * below stay in the tables the loop probes. */
    if (t_reserve(&rk->entries, n, entry_occ) < 0 || t_reserve(&self->nodes, (Py_ssize_t)fresh, node_occ) < 0)
        return -1;
    for (Py_ssize_t k = 0; k < n && k < STORE_PREFETCH; k++) {
        t_prefetch_probe(&rk->entries, hashes[k]);
        t_prefetch_h(&self->nodes, hhs[k]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + STORE_PREFETCH < n) {
            t_prefetch_probe(&rk->entries, hashes[i + STORE_PREFETCH]);
            t_prefetch_h(&self->nodes, hhs[i + STORE_PREFETCH]);
        }
        int64_t pos = ok ? d0 + i : 0;
        i32 depth = (i32)(detached ? ~pos : pos);
        int added;
        Entry *e = (Entry *)t_upsert(&rk->entries, hashes[i], entry_occ, &added);
        if (!e) return -1;
        if (added) {
            /* Occupied from here on: the count below is at least one. */
            e->key = keys[i];
            e->hh_hi = (u32)(hhs[i] >> 32);
            e->depth = depth;
            if (depth < 0) rk->detached++;
        }
        int pb = presence(e);
        if (e->c[tier] != COUNT_MAX) e->c[tier]++;
        int pa = presence(e);
        if (pb != pa && node_update(self, sid, e->key, entry_hh(e), pb, pa) < 0) return -1;
    }
    return flags;
}

static PyObject *Index_store(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 9, "store") < 0) return NULL;
    size_t sid;
    if (check_sid(self, args[0], &sid) < 0) return NULL;
    KeyChain *chain = chain_arg(args[1]);
    if (!chain) return NULL;
    long tier = PyLong_AsLong(args[8]);
    if (tier == -1 && PyErr_Occurred()) return NULL;
    if (tier < 0 || tier > 2) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0, 1 or 2");
        return NULL;
    }
    int packed = PyObject_IsTrue(args[5]);
    if (packed < 0) return NULL;
    if (!PyList_Check(args[2]) && !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "block hashes must be a list or a tuple");
        return NULL;
    }
    /* Buffers first (getting one may run Python code: 3.12's __buffer__),
     * then the tokens into the chain's scratch, then the hashes (a list's
     * ints convert without running Python code): nothing can change under
     * the pointers taken from here on. */
    Py_buffer ev = {0};
    const u64 *extra = NULL;
    PyObject *result = NULL;
    if (args[7] != Py_None) {
        if (get_u64s(args[7], &ev, 0, "extra") < 0) return NULL;
        extra = ev.buf;
    }
    u64 *tok = NULL;
    Py_ssize_t ntok = 0;
    if (args[4] != Py_None && read_tokens(args[4], packed, &chain->tok, &tok, &ntok) < 0) {
        if (!clear_refusal()) goto done; /* unusable tokens: unmatchable keys below */
        tok = NULL;
    }
    if (chain_ready(chain) < 0 || check_sid(self, args[0], &sid) < 0) goto done;
    Py_ssize_t n;
    u64 *hashes = read_hashes(self, args[2], &n);
    if (!hashes) goto done;
    if (extra && ev.len / 8 < n) {
        PyErr_Format(PyExc_ValueError, "extra has %zd entries for %zd blocks", ev.len / 8, n);
        goto done;
    }
    u64 parent = 0, start = 0;
    int has_parent = args[3] != Py_None;
    if (has_parent ? u64_arg(args[3], &parent, "parent") : u64_arg(args[6], &start, "start")) goto done;
    int flags = store_core(self, sid, chain, (int)tier, hashes, n, has_parent, parent, start, tok,
                           ntok, NULL, extra);
    if (flags >= 0) result = PyLong_FromLong(flags);
done:
    if (extra) PyBuffer_Release(&ev);
    return result;
}

/* One copy fewer of each block in `tier`; returns the removals of copies
 * the rank did not hold, or -1 with an exception. */
static Py_ssize_t remove_core(Index *self, size_t sid, const u64 *hashes, Py_ssize_t n, int tier) {
    Rank *rk = &self->ranks[sid];
    Py_ssize_t unknown = 0;
    /* Each hash is a random probe of the rank's table: keep them in flight
     * (a shrink below can move the table; a stale prefetch costs nothing). */
    for (Py_ssize_t k = 0; k < n && k < STORE_PREFETCH; k++) t_prefetch_probe(&rk->entries, hashes[k]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + STORE_PREFETCH < n) t_prefetch_probe(&rk->entries, hashes[i + STORE_PREFETCH]);
        if (i + NODE_AHEAD < n) {
            /* Its entry, prefetched a while ago, names its node: on its way too. */
            const Entry *f = (const Entry *)t_find(&rk->entries, hashes[i + NODE_AHEAD], entry_occ);
            if (f) t_prefetch_h(&self->nodes, entry_hh(f));
        }
        Entry *e = (Entry *)t_find(&rk->entries, hashes[i], entry_occ);
        if (!e || e->c[tier] == 0) {
            unknown++;
            continue;
        }
        int pb = presence(e);
        e->c[tier]--;
        int pa = presence(e);
        if (pb == pa) continue;
        if (node_update(self, sid, e->key, entry_hh(e), pb, pa) < 0) return -1;
        if (!pa) {
            if (e->depth < 0) rk->detached--;
            if (t_delete(&rk->entries, (char *)e, entry_occ) < 0) return -1;
        }
    }
    return unknown;
}

/* remove(sid, hashes, tier) -> removals of copies the rank did not hold */
static PyObject *Index_remove(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 3, "remove") < 0) return NULL;
    size_t sid;
    if (check_sid(self, args[0], &sid) < 0) return NULL;
    long tier = PyLong_AsLong(args[2]);
    if (tier == -1 && PyErr_Occurred()) return NULL;
    if (tier < 0 || tier > 2) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0, 1 or 2");
        return NULL;
    }
    Py_ssize_t n;
    u64 *hashes = read_hashes(self, args[1], &n);
    if (!hashes) return NULL;
    Py_ssize_t unknown = remove_core(self, sid, hashes, n, (int)tier);
    return unknown < 0 ? NULL : PyLong_FromSsize_t(unknown);
}

/* Forget every block of rank sid, in time linear in them. */
static int clear_core(Index *self, size_t sid) {
    Rank *rk = &self->ranks[sid];
    Table *t = &rk->entries;
    for (size_t j = 0; j < t->cap; j++) {
        if (j + CLEAR_AHEAD < t->cap) {
            /* The entries are read in order; their nodes are random probes. */
            const Entry *f = (const Entry *)(t->a + (j + CLEAR_AHEAD) * t->rs);
            if (entry_occ((const char *)f, t->rs)) t_prefetch_h(&self->nodes, entry_hh(f));
        }
        const Entry *e = (const Entry *)(t->a + j * t->rs);
        if (!entry_occ((const char *)e, t->rs)) continue;
        char *r = t_find_h(&self->nodes, e->key, entry_hh(e), node_occ);
        if (r && node_drop(self, r, sid) < 0) return -1;
    }
    rank_free(rk);
    return 0;
}

/* clear_rank(sid): forget every block of the rank. */
static PyObject *Index_clear_rank(Index *self, PyObject *arg) {
    size_t sid;
    if (check_sid(self, arg, &sid) < 0) return NULL;
    if (clear_core(self, sid) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_blocks(Index *self, PyObject *arg) {
    size_t sid;
    if (check_sid(self, arg, &sid) < 0) return NULL;
    Table *t = &self->ranks[sid].entries;
    PyObject *out = PyList_New((Py_ssize_t)t->count);
    if (!out) return NULL;
    Py_ssize_t k = 0;
    for (size_t j = 0; j < t->cap && k < (Py_ssize_t)t->count; j++) {
        const char *r = t->a + j * t->rs;
        if (!entry_occ(r, t->rs)) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(rec_key(r));
        if (!v) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, k++, v);
    }
    return out;
}

/* rank_stats(sid) -> (entries, detached entries, over-cap mark: CAP_BLOCKS | CAP_BYTES) */
static PyObject *Index_rank_stats(Index *self, PyObject *arg) {
    size_t sid;
    if (check_sid(self, arg, &sid) < 0) return NULL;
    Rank *rk = &self->ranks[sid];
    return Py_BuildValue("nni", (Py_ssize_t)rk->entries.count, (Py_ssize_t)rk->detached, rk->over_cap);
}

/* ------------------------------------------------------------------------ */
/* A rank's view as bytes (router checkpoints, peer clones), and its hints.  */
/*
 * Little-endian: a VIEW_HEAD-byte header, "KVIX", the layout version (u16),
 * the rank's over-cap mark (u16: CAP_BLOCKS | CAP_BYTES), the entry count
 * (u64), a checksum of everything else (u64); then a VIEW_REC-byte record
 * per engine hash, the layout of an Entry: hash u64, store counts per tier
 * u16 x 3, 0 u16, position i32 (~position on a detached chain), the top
 * half of the key's home hash u32, key u64. The multi-key table and the
 * holder bits follow from the entries, so an import rebuilds them.
 */
#define VIEW_MAGIC "KVIX"
#define VIEW_VERSION 1
#define VIEW_HEAD 24
#define VIEW_REC 32
_Static_assert(offsetof(Entry, c) == 8 && offsetof(Entry, depth) == 16 && offsetof(Entry, hh_hi) == 20 &&
                   offsetof(Entry, key) == 24, "a view record is an Entry");

/* Little-endian fields; on a little-endian host one load or store each. */
static inline void put_le(unsigned char *p, u64 v, int bytes) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (bytes == 8) { memcpy(p, &v, 8); return; }
    if (bytes == 4) { u32 x = (u32)v; memcpy(p, &x, 4); return; }
    if (bytes == 2) { u16 x = (u16)v; memcpy(p, &x, 2); return; }
#endif
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline u64 get_le(const unsigned char *p, int bytes) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (bytes == 8) { u64 x; memcpy(&x, p, 8); return x; }
    if (bytes == 4) { u32 x; memcpy(&x, p, 4); return x; }
    if (bytes == 2) { u16 x; memcpy(&x, p, 2); return x; }
#endif
    u64 v = 0;
    for (int i = 0; i < bytes; i++) v |= (u64)p[i] << (8 * i);
    return v;
}

/* The checksum: four lanes, one per word of a record, each (lane ^ word) *
 * odd: a bijection of the lane, so a change confined to one lane's words
 * (any one flipped byte, any one word) always changes the sum. */
#define CK_MUL 0x9E3779B97F4A7C15ULL
typedef struct {
    u64 l[4];
} Ck;

static inline void ck_rec(Ck *c, const unsigned char *r) {
    for (int k = 0; k < 4; k++) c->l[k] = (c->l[k] ^ get_le(r + 8 * k, 8)) * CK_MUL;
}

/* Lanes seeded with the header's first 16 bytes (magic, version, mark, count). */
static void ck_begin(Ck *c, const unsigned char *head) {
    unsigned char r[VIEW_REC] = {0};
    memcpy(r, head, 16);
    c->l[0] = F1;
    c->l[1] = F2;
    c->l[2] = GOLDEN;
    c->l[3] = ~GOLDEN;
    ck_rec(c, r);
}

static u64 ck_end(const Ck *c) {
    return fmix64(c->l[0]) ^ fmix64(c->l[1] ^ 1) ^ fmix64(c->l[2] ^ 2) ^ fmix64(c->l[3] ^ 3);
}

static void entry_to_rec(const Entry *e, unsigned char *q) {
    put_le(q, e->h, 8);
    for (int k = 0; k < 3; k++) put_le(q + 8 + 2 * k, e->c[k], 2);
    put_le(q + 14, 0, 2);
    put_le(q + 16, (u32)e->depth, 4);
    put_le(q + 20, e->hh_hi, 4);
    put_le(q + 24, e->key, 8);
}

/* export_rank(sid) -> bytes: the rank's view (None: an empty one), in one
 * pass over its table. */
static PyObject *Index_export_rank(Index *self, PyObject *arg) {
    const Rank *rk = NULL;
    if (arg != Py_None) {
        size_t sid;
        if (check_sid(self, arg, &sid) < 0) return NULL;
        rk = &self->ranks[sid];
    }
    const size_t n = rk ? rk->entries.count : 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(VIEW_HEAD + n * VIEW_REC));
    if (!out) return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    memcpy(p, VIEW_MAGIC, 4);
    put_le(p + 4, VIEW_VERSION, 2);
    put_le(p + 6, rk ? (u64)rk->over_cap : 0, 2);
    put_le(p + 8, n, 8);
    Ck ck;
    ck_begin(&ck, p);
    unsigned char *q = p + VIEW_HEAD;
    if (n) {
        const Table *t = &rk->entries;
        for (size_t j = 0; j < t->cap; j++) {
            const Entry *e = (const Entry *)(t->a + j * t->rs);
            if (!entry_occ((const char *)e, t->rs)) continue;
            entry_to_rec(e, q);
            ck_rec(&ck, q);
            q += VIEW_REC;
        }
    }
    put_le(p + 16, ck_end(&ck), 8);
    return out;
}

/* The import's table of the keys that may repeat: key, full home hash,
 * entries with the key and how many are present in each tier (n[0]'s top
 * bit: its node is set). Occupied while n[0] > 0. */
typedef struct {
    u64 key;
    u64 hh;
    u32 n[4];
} KeyRec;

#define KEY_DONE 0x80000000u

static int keyrec_occ(const char *r, size_t rs) { return ((const KeyRec *)r)->n[0] != 0; }

#define IMPORT_AHEAD 16

/* What an import builds before it touches the index: the rank's entries
 * (e) and multi-key table (m); the keys that may repeat (k), found by a
 * filter of 16 bits a record (f: seen once, then seen twice; most keys
 * are met once and never enter k). */
typedef struct {
    Table e, k, m;
    u64 *f;
    int fshift;
    size_t det;
    size_t keys; /* distinct keys: a node each */
    int tiers;
} Import;

static inline size_t filter_bit(const Import *im, u64 key) { return (size_t)(mix64(key) >> im->fshift); }

static inline int filter_test(const u64 *w, size_t b) { return (int)((w[b >> 6] >> (b & 63)) & 1); }

static void import_free(Import *im) {
    if (im->e.a) t_rehash(&im->e, 0, entry_occ);
    if (im->m.a) t_rehash(&im->m, 0, multi_occ);
    if (im->k.a) t_rehash(&im->k, 0, keyrec_occ);
    PyMem_Free(im->f);
    im->f = NULL;
}

static inline void rec_entry(const unsigned char *r, Entry *v) {
    v->h = get_le(r, 8);
    for (int t = 0; t < 3; t++) v->c[t] = (u16)get_le(r + 8 + 2 * t, 2);
    v->depth = (i32)(u32)get_le(r + 16, 4);
    v->hh_hi = (u32)get_le(r + 20, 4);
    v->key = get_le(r + 24, 8);
}

static int view_refuse(const char *why) { return refuse(PyExc_ValueError, why); }

/* The records read, checked and put in tables of their own; nothing shared
 * is touched. 0, or -1 with ValueError (a bad record) or MemoryError. */
static int view_tables(const unsigned char *recs, size_t n, Import *im) {
    Table *e = &im->e, *k = &im->k, *m = &im->m;
    im->keys = n;
    if (!n) return 0;
    int fbits = 10;
    while (fbits < 40 && ((size_t)1 << fbits) < 16 * n) fbits++;
    const size_t words = ((size_t)1 << fbits) >> 6;
    if (!(im->f = PyMem_Calloc(2 * words, sizeof(u64)))) { PyErr_NoMemory(); return -1; }
    im->fshift = 64 - fbits;
    u64 *once = im->f, *twice = im->f + words;
    if (t_reserve(e, (Py_ssize_t)n, entry_occ) < 0) return -1;
    size_t maybe = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + IMPORT_AHEAD < n) t_prefetch_probe(e, get_le(recs + (i + IMPORT_AHEAD) * VIEW_REC, 8));
        const unsigned char *r = recs + i * VIEW_REC;
        Entry v;
        rec_entry(r, &v);
        if (!(v.c[0] | v.c[1] | v.c[2])) return view_refuse("a rank view entry has no store count");
        if (get_le(r + 14, 2)) return view_refuse("a rank view entry's padding is not zero");
        int64_t pos = v.depth >= 0 ? v.depth : ~(int64_t)v.depth;
        if (pos >= DEPTH_LIMIT) return view_refuse("a rank view entry's position is out of range");
        /* A detached key, and a chain's key at a multiple of 8 positions, is its own home. */
        if ((v.depth < 0 || (v.depth & 7) == 0) && v.hh_hi != (u32)(own_home(v.key) >> 32))
            return view_refuse("a rank view entry's home hash does not match its key");
        if (v.c[1] | v.c[2]) im->tiers = 1;
        if (v.depth < 0) im->det++;
        int added;
        Entry *slot = (Entry *)t_upsert(e, v.h, entry_occ, &added);
        if (!slot) return -1;
        if (!added) {
            PyErr_Format(PyExc_ValueError, "a rank view holds engine hash %llu twice", (unsigned long long)v.h);
            return -1;
        }
        *slot = v;
        const size_t b = filter_bit(im, v.key);
        const u64 bit = 1ULL << (b & 63);
        if (once[b >> 6] & bit) {
            maybe += !(twice[b >> 6] & bit);
            twice[b >> 6] |= bit;
        }
        once[b >> 6] |= bit;
    }
    if (!maybe) return 0;
    /* The keys behind the filter's repeats, counted exactly: one home hash a
     * key, and the multi-key table of those that several entries share. */
    if (t_reserve(k, (Py_ssize_t)(2 * maybe), keyrec_occ) < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const unsigned char *r = recs + i * VIEW_REC;
        const u64 key = get_le(r + 24, 8);
        if (!filter_test(twice, filter_bit(im, key))) continue;
        Entry v;
        rec_entry(r, &v);
        const u64 hh = entry_hh(&v);
        int added;
        KeyRec *kr = (KeyRec *)t_upsert(k, key, keyrec_occ, &added);
        if (!kr) return -1;
        if (added) kr->hh = hh;
        else if (kr->hh != hh) return view_refuse("a rank view gives one key two home hashes");
        kr->n[0]++;
        for (int t = 0; t < 3; t++) kr->n[1 + t] += v.c[t] != 0;
    }
    for (size_t j = 0; j < k->cap; j++) {
        const KeyRec *kr = (const KeyRec *)(k->a + j * k->rs);
        if (kr->n[0] < 2) continue;
        im->keys -= kr->n[0] - 1;
        int added;
        Multi *mu = (Multi *)t_upsert(m, kr->key, multi_occ, &added);
        if (!mu) return -1;
        memcpy(mu->n, kr->n, sizeof mu->n);
    }
    return 0;
}

/* One view of an import: its buffer (held until the import ends), its
 * checked header, and the tables built from it. */
typedef struct {
    Py_buffer v;
    int held;
    size_t sid;
    const unsigned char *recs;
    size_t n;
    u64 mark;
    Import im;
} ViewIn;

/* The view's header and checksum, and its size against max_entries: 0, or
 * -1 with ValueError. */
static int view_check(const Index *self, ViewIn *vi) {
    const unsigned char *p = vi->v.buf;
    const size_t len = (size_t)vi->v.len;
    if (len < VIEW_HEAD) {
        PyErr_Format(PyExc_ValueError, "a rank view of %zu bytes is shorter than its %d-byte header",
                     len, VIEW_HEAD);
        return -1;
    }
    if (memcmp(p, VIEW_MAGIC, 4) != 0) return view_refuse("not a prefix index rank view (bad magic)");
    const u64 version = get_le(p + 4, 2), mark = get_le(p + 6, 2), n = get_le(p + 8, 8);
    if (version != VIEW_VERSION) {
        PyErr_Format(PyExc_ValueError, "a rank view of layout version %llu; this index reads version %d",
                     (unsigned long long)version, VIEW_VERSION);
        return -1;
    }
    if (mark & ~(u64)(CAP_BLOCKS | CAP_BYTES)) return view_refuse("a rank view's over-cap mark has unknown bits");
    if (n > (len - VIEW_HEAD) / VIEW_REC || (len - VIEW_HEAD) != n * VIEW_REC) {
        PyErr_Format(PyExc_ValueError, "a rank view of %zu bytes cannot hold the %llu entries its header gives",
                     len, (unsigned long long)n);
        return -1;
    }
    Ck ck;
    ck_begin(&ck, p);
    for (size_t i = 0; i < n; i++) ck_rec(&ck, p + VIEW_HEAD + i * VIEW_REC);
    if (ck_end(&ck) != get_le(p + 16, 8))
        return view_refuse("a rank view's checksum does not match its contents (corrupt)");
    if (self->max_entries && n > self->max_entries) {
        PyErr_Format(PyExc_ValueError, "a rank view of %llu blocks is past this index's max_blocks_per_rank (%zu)",
                     (unsigned long long)n, self->max_entries);
        return -1;
    }
    vi->recs = p + VIEW_HEAD;
    vi->n = (size_t)n;
    vi->mark = mark;
    return 0;
}

/* One node insert of an import: the key's home hash, the key, the rank and
 * its tier presence. */
typedef struct {
    u64 hh;
    u64 key;
    u32 sid;
    u32 pa;
} Ins;
_Static_assert(sizeof(Ins) % 8 == 0, "inserts read as u64s at a stride (holders_fit)");

/* Drop rank sid's bits from the nodes (the shared table held at its size)
 * and free its tables: what a rank held before a view replaces it. */
static void drop_rank_bits(Index *self, size_t sid) {
    Rank *rk = &self->ranks[sid];
    Table *nodes = &self->nodes;
    const Table *old = &rk->entries;
    for (size_t j = 0; j < old->cap; j++) {
        if (j + CLEAR_AHEAD < old->cap) {
            const Entry *f = (const Entry *)(old->a + (j + CLEAR_AHEAD) * old->rs);
            if (entry_occ((const char *)f, old->rs)) t_prefetch_h(nodes, entry_hh(f));
        }
        const Entry *x = (const Entry *)(old->a + j * old->rs);
        if (!entry_occ((const char *)x, old->rs)) continue;
        char *r = t_find_h(nodes, x->key, entry_hh(x), node_occ);
        if (r) node_drop(self, r, sid);
    }
    rank_free(rk);
}

/* The node inserts of one view, in record order: a key several of its
 * entries share is inserted once, with their presence together. */
static size_t gather_inserts(ViewIn *vi, Ins *out) {
    Import *im = &vi->im;
    const u64 *twice = im->f ? im->f + (((size_t)1 << (64 - im->fshift)) >> 6) : NULL;
    size_t k = 0;
    for (size_t j = 0; j < vi->n; j++) {
        Entry x;
        rec_entry(vi->recs + j * VIEW_REC, &x);
        int pa = presence(&x);
        if (im->k.count && filter_test(twice, filter_bit(im, x.key))) {
            KeyRec *kr = (KeyRec *)t_find(&im->k, x.key, keyrec_occ);
            if (kr->n[0] & KEY_DONE) continue; /* a shared key: its node is set */
            kr->n[0] |= KEY_DONE;
            pa = (kr->n[1] != 0) | ((kr->n[2] != 0) << 1) | ((kr->n[3] != 0) << 2);
        }
        out[k++] = (Ins){entry_hh(&x), x.key, (u32)vi->sid, (u32)pa};
    }
    return k;
}

/* Set the nodes of `n` inserts, taken in the order of their homes (a
 * counting sort on the top bits of the home hash, which pick the slot):
 * the shared table is then walked nearly in order, a region of a few
 * thousand slots at a time, not a cache and TLB miss a block. The table
 * has room for them all; only a pool row can fail (MemoryError: the
 * inserts set so far are dropped again, -1). */
static int insert_sorted(Index *self, const Ins *in, Ins *sorted, size_t n, size_t *start, int bits) {
    Table *nodes = &self->nodes;
    const size_t nb = (size_t)1 << bits;
    memset(start, 0, (nb + 1) * sizeof(size_t));
    for (size_t i = 0; i < n; i++) start[1 + (in[i].hh >> (64 - bits))]++;
    for (size_t b = 0; b < nb; b++) start[b + 1] += start[b];
    for (size_t i = 0; i < n; i++) sorted[start[in[i].hh >> (64 - bits)]++] = in[i];
    for (size_t j = 0; j < n; j++) {
        if (j + STORE_PREFETCH < n) t_prefetch_h(nodes, sorted[j + STORE_PREFETCH].hh);
        const Ins *x = &sorted[j];
        int added;
        char *r = t_upsert_h(nodes, x->key, x->hh, node_occ, &added);
        if (node_put(self, r, x->sid, (int)x->pa) < 0) { /* never a node just added */
            for (size_t u = 0; u < j; u++) {
                char *q = t_find_h(nodes, sorted[u].key, sorted[u].hh, node_occ);
                if (q) node_drop(self, q, sorted[u].sid);
            }
            return -1;
        }
    }
    return 0;
}

/* The rank takes its view's tables and over-cap mark. */
static void install_view(Index *self, ViewIn *vi) {
    Rank *rk = &self->ranks[vi->sid];
    rk->entries = vi->im.e;
    rk->multi = vi->im.m;
    vi->im.e.a = vi->im.m.a = NULL; /* the rank's now */
    vi->im.e.cap = vi->im.m.cap = 0;
    rk->detached = vi->im.det;
    rk->over_cap = (int)vi->mark;
}

/* Sort bits for the inserts into a table of `cap` slots: a bucket covers
 * about 4,096 slots (a region the caches hold), 8 to 14 bits. */
static int insert_bits(size_t cap) {
    int bits = 0;
    while (((size_t)1 << bits) < cap) bits++;
    bits -= 12;
    return bits < 8 ? 8 : bits > 14 ? 14 : bits;
}

/* The import of `nv` views (distinct slots): every view is read, checked and
 * built into tables of its own before the index changes, so a bad one
 * refuses them all with nothing changed (ValueError; its position in
 * *bad). Then: one relayout for the highest slot, and view by view its
 * rank's old bits dropped and its nodes set in the order of their homes.
 * With max_bytes a view past the budget is refused like a store (flags[i]:
 * OVER_CAP | OVER_BUDGET; its rank left empty and over cap). A MemoryError
 * while the shared table grows may leave the views before it imported (the
 * caller clears them). 0, or -1 with an exception. */
static int import_views(Index *self, ViewIn *vs, size_t nv, int *flags, Py_ssize_t *bad) {
    Ins *ins = NULL;
    size_t *start = NULL;
    int rc = -1;
    size_t top = 0, most = 0;
    int tiers = 0;
#if TABLE_MMAP
    Ahead ahead = {0};
    size_t slots[2] = {0, 0}; /* rank tables to come of ARENA_MIN, 2 * ARENA_MIN bytes */
#endif
    for (size_t i = 0; i < nv; i++) {
        *bad = (Py_ssize_t)i;
        if (view_check(self, &vs[i]) < 0) goto done;
        Rank fresh;
        rank_init(self, &fresh);
        vs[i].im.e.floor = rank_floor(self, vs[i].sid < self->nranks ? &self->ranks[vs[i].sid] : &fresh);
#if TABLE_MMAP
        const size_t bytes = vs[i].n ? t_cap_for(&vs[i].im.e, vs[i].n) * sizeof(Entry) : 0;
        if (arena_fits(bytes)) slots[bytes > ARENA_MIN]++;
#endif
    }
#if TABLE_MMAP
    /* Not under a memory budget: there the chunks come one at a time, as it checks them. */
    if (!self->max_bytes) ahead_start(&self->arena, slots, &ahead);
#endif
    /* Until the end, the fresh memory this import grows into (its rank tables, and the
     * shared table) is faulted in with small pages first (advise_huge). */
    self->arena.small_first = 1;
    for (size_t i = 0; i < nv; i++) {
        *bad = (Py_ssize_t)i;
        if (view_tables(vs[i].recs, vs[i].n, &vs[i].im) < 0) goto done;
        if (vs[i].sid > top) top = vs[i].sid;
        if (vs[i].n > most) most = vs[i].n;
        tiers |= vs[i].im.tiers;
        flags[i] = 0;
    }
    *bad = -1;
    if (!nv) {
        rc = 0;
        goto done;
    }
    /* Nothing below refuses a view; only memory can fail (before the first view
     * goes in, but for the shared table's growth further on). */
    const size_t group = most;
    const int bits = 14;
    if (group) {
        ins = PyMem_Malloc(2 * group * sizeof(Ins));
        start = PyMem_Malloc((((size_t)1 << bits) + 1) * sizeof(size_t));
        if (!ins || !start) { PyErr_NoMemory(); goto done; }
    }
    if (ensure_slot(self, top) < 0) goto done;
    if (tiers && self->tiers == 1 && relayout(self, self->words, 3) < 0) goto done;
    Table *nodes = &self->nodes;
    /* View by view, the shared table grown for its keys as it comes (many
     * ranks' keys are often the same nodes: a room for the sum of them could
     * be many times what the table needs), each checked against the budget
     * as a store would be; its floor held at its size while a rank's old
     * bits go, so that drops do not shrink it. */
    const size_t floor = nodes->floor;
    for (size_t i = 0; i < nv; i++) {
        Rank *rk = &self->ranks[vs[i].sid];
        const size_t n = gather_inserts(&vs[i], ins); /* a node each (im.keys of them) */
        size_t fresh;
        /* As a store (the rows the rank's old view frees are not counted on). */
        const int64_t old = -(int64_t)(t_own_bytes(&rk->entries) + t_own_bytes(&rk->multi));
        if (!holders_fit(self, vs[i].sid, ins ? &ins[0].key : NULL, ins ? &ins[0].hh : NULL, sizeof(Ins) / 8, n,
                         old, &fresh)) {
            clear_core(self, vs[i].sid); /* frees only: cannot fail */
            rk->over_cap = CAP_BYTES;
            self->counts[4]++;
            self->counts[5]++;
            flags[i] = OVER_CAP | OVER_BUDGET;
            continue;
        }
        if (fresh && t_reserve(nodes, (Py_ssize_t)fresh, node_occ) < 0) goto restore;
        nodes->floor = nodes->cap;
        drop_rank_bits(self, vs[i].sid);
        if (n) {
            const int b = insert_bits(nodes->cap);
            if (insert_sorted(self, ins, ins + group, n, start, b < bits ? b : bits) < 0) goto restore;
        }
        install_view(self, &vs[i]);
        nodes->floor = floor;
    }
    rc = 0;
restore:
    nodes->floor = floor;
    t_settle(nodes, node_occ); /* as the drops would have left it */
done:
    self->arena.small_first = 0;
#if TABLE_MMAP
    ahead_end(&self->arena, &ahead);
#endif
    PyMem_Free(ins);
    PyMem_Free(start);
    return rc;
}

/* import_ranks(sids, views) -> [0, or OVER_CAP | OVER_BUDGET per view]
 *
 * Rank slot sids[i] (a new one too) holds exactly what views[i]
 * (export_rank's bytes) says, as if the events behind it had been applied
 * here; the slots must be distinct. A view that is not one, or that this
 * index cannot hold (past max_entries), raises ValueError((why, i)) with
 * nothing changed; MemoryError also changes nothing (but see max_bytes in
 * import_views). A view that would take the index past max_bytes leaves
 * its rank cleared and marked over cap (what a refused store does). */
static PyObject *Index_import_ranks(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "import_ranks") < 0) return NULL;
    PyObject *sids = PySequence_Fast(args[0], "import_ranks: sids must be a sequence");
    if (!sids) return NULL;
    PyObject *views = PySequence_Fast(args[1], "import_ranks: views must be a sequence");
    if (!views) {
        Py_DECREF(sids);
        return NULL;
    }
    PyObject *result = NULL;
    ViewIn *vs = NULL;
    int *flags = NULL;
    u64 *seen = NULL;
    const Py_ssize_t nv = PySequence_Fast_GET_SIZE(sids);
    if (PySequence_Fast_GET_SIZE(views) != nv) {
        PyErr_SetString(PyExc_ValueError, "import_ranks: as many views as sids");
        goto out;
    }
    vs = PyMem_Calloc((size_t)nv + 1, sizeof(ViewIn));
    flags = PyMem_Calloc((size_t)nv + 1, sizeof(int));
    if (!vs || !flags) {
        PyErr_NoMemory();
        goto out;
    }
    size_t top = 0;
    for (Py_ssize_t i = 0; i < nv; i++) {
        ViewIn *vi = &vs[i];
        vi->im = (Import){
            .e = {.rs = sizeof(Entry), .arena = &self->arena, .acct = &self->mem,
                  .small_first = &self->arena.small_first},
            .k = {.rs = sizeof(KeyRec)},
            .m = {.rs = sizeof(Multi), .acct = &self->mem},
        };
        if (slot_arg(PySequence_Fast_GET_ITEM(sids, i), &vi->sid) < 0) goto out;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(views, i), &vi->v, PyBUF_SIMPLE) < 0) goto out;
        vi->held = 1;
        if (vi->sid > top) top = vi->sid;
    }
    if (nv) {
        const size_t words = (top >> 6) + 1;
        if (!(seen = PyMem_Calloc(words, sizeof(u64)))) {
            PyErr_NoMemory();
            goto out;
        }
        for (Py_ssize_t i = 0; i < nv; i++) {
            const size_t s = vs[i].sid;
            if (seen[s >> 6] >> (s & 63) & 1) {
                PyErr_Format(PyExc_ValueError, "import_ranks: rank slot %zu given twice", s);
                goto out;
            }
            seen[s >> 6] |= 1ULL << (s & 63);
        }
    }
    Py_ssize_t bad = -1;
    if (import_views(self, vs, (size_t)nv, flags, &bad) < 0) {
        if (bad >= 0 && PyErr_ExceptionMatches(PyExc_ValueError)) {
            /* Which view: ValueError((why, i)). */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *exc_args = Py_BuildValue("(Nn)", PyObject_Str(value), bad);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (exc_args) PyErr_SetObject(PyExc_ValueError, exc_args);
            Py_XDECREF(exc_args);
        }
        goto out;
    }
    result = PyList_New(nv);
    if (!result) goto out;
    for (Py_ssize_t i = 0; i < nv; i++) {
        PyObject *f = PyLong_FromLong(flags[i]);
        if (!f) {
            Py_CLEAR(result);
            goto out;
        }
        PyList_SET_ITEM(result, i, f);
    }
out:
    if (vs) {
        for (Py_ssize_t i = 0; i < nv; i++) {
            import_free(&vs[i].im);
            if (vs[i].held) PyBuffer_Release(&vs[i].v);
        }
    }
    PyMem_Free(vs);
    PyMem_Free(flags);
    PyMem_Free(seen);
    Py_DECREF(sids);
    Py_DECREF(views);
    return result;
}

/* reserve(sid, blocks) -> whether taken: the rank will hold about `blocks`
 * (at most max_entries and 2**24). Its table, and the shared table's share,
 * are sized for it at its next store, and its table stays at least that
 * size (over clears too) until the next hint or forget_rank. Not taken where
 * the index could not make that room within max_bytes. */
static PyObject *Index_reserve(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "reserve") < 0) return NULL;
    size_t sid;
    if (check_sid(self, args[0], &sid) < 0) return NULL;
    Py_ssize_t blocks = PyLong_AsSsize_t(args[1]);
    if (blocks == -1 && PyErr_Occurred()) return NULL;
    if (blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "blocks must be >= 0");
        return NULL;
    }
    size_t hint = (size_t)blocks;
    if (hint > ((size_t)1 << 24)) hint = (size_t)1 << 24;
    if (self->max_entries && hint > self->max_entries) hint = self->max_entries;
    Rank *rk = &self->ranks[sid];
    const size_t x = self->expected;
    const size_t hinted = self->hinted - (rk->hint > x ? rk->hint - x : 0) + (hint > x ? hint - x : 0);
    if (self->max_bytes) {
        Table te = rk->entries, tn = self->nodes;
        te.floor = cap_for(hint > x ? hint : x);
        size_t want = x * self->nranks + hinted;
        tn.floor = want ? cap_for(want) : 0;
        if (past_budget(self, t_growth(&te, 0) + t_growth(&tn, 0))) Py_RETURN_FALSE;
    }
    rk->hint = hint;
    self->hinted = hinted;
    rk->entries.floor = rank_floor(self, rk);
    nodes_floor_update(self);
    Py_RETURN_TRUE;
}

/* forget_rank(sid): clear_rank, and the slot's hint dropped (it is free). */
static PyObject *Index_forget_rank(Index *self, PyObject *arg) {
    size_t sid;
    if (check_sid(self, arg, &sid) < 0) return NULL;
    Rank *rk = &self->ranks[sid];
    /* The floors first, so that the clear frees what they no longer keep. */
    if (rk->hint > self->expected) self->hinted -= rk->hint - self->expected;
    rk->hint = 0;
    rk->entries.floor = rank_floor(self, rk);
    nodes_floor_update(self);
    if (clear_core(self, sid) < 0) return NULL;
    Py_RETURN_NONE;
}

static void record_lost(u64 lost, size_t base, i32 *depth, i32 at) {
    while (lost) {
        depth[base + (size_t)__builtin_ctzll(lost)] = at;
        lost &= lost - 1;
    }
}

/* The walk of a match: the prompt's keys in order, ANDing each node's
 * holder masks into acc until no rank holds the prefix. depth[sid] records
 * where each rank dropped out (tiers split: three such arrays). */
typedef struct {
    size_t W, T;
    int split, dead;
    Py_ssize_t at; /* keys walked so far */
    u64 *acc;      /* [3][W]: held anywhere, on GPU, on GPU or CPU */
    i32 *depth;    /* [3][64W] */
    u64 one[3 + 3 * 64 / 2]; /* acc and depth for up to 64 ranks: no allocation */
} Walk;

static int walk_begin(Walk *wk, const Index *self, int tiers) {
    wk->W = self->words;
    wk->T = self->tiers;
    wk->split = tiers && wk->T == 3;
    wk->dead = self->nodes.count == 0 || self->nranks == 0;
    wk->at = 0;
    size_t W = wk->W;
    if (W == 1) wk->acc = wk->one;
    else if (!(wk->acc = PyMem_Malloc(3 * W * sizeof(u64) + 3 * (W << 6) * sizeof(i32)))) {
        PyErr_NoMemory();
        return -1;
    }
    wk->depth = (i32 *)(wk->acc + 3 * W);
    /* The per-tier depths are read only when split. */
    memset(wk->depth, 0, (wk->split ? 3 : 1) * (W << 6) * sizeof(i32));
    for (size_t w = 0; w < 3 * W; w++) wk->acc[w] = ~0ULL;
    return 0;
}

static void walk_end(Walk *wk) {
    if (wk->acc != wk->one) PyMem_Free(wk->acc);
    wk->acc = NULL;
}

/* The home hash of a prompt's key i, keys[0] at a multiple of 8 positions. */
static inline u64 walk_hh(const u64 *keys, Py_ssize_t i) {
    return own_home(keys[i & ~(Py_ssize_t)7]) | (u64)(i & 7);
}

/* Every line of the 8 slots from group g's home, and the line after them. */
static inline void walk_prefetch_group(const char *a, size_t rs, size_t m, int shift, const u64 *keys,
                                       Py_ssize_t g) {
    const char *r = a + home_at(own_home(keys[g]), shift, m) * rs;
    for (size_t off = 0; off < 8 * rs + 64; off += 64) __builtin_prefetch(r + off);
}

/* Walk n more keys, the first at a multiple of 8 positions (stops early
 * once nobody holds the prefix). */
/* walk_keys for at most 64 ranks, all on GPU: one mask word a node (its
 * one holder's bit, or its pool row's word), and a slot is empty exactly
 * when its `who` is 0. */
static void walk_keys_one(Walk *wk, const Index *self, const u64 *keys, Py_ssize_t n) {
    const Table *t = &self->nodes;
    if (wk->dead) return;
    if (!t->cap) {
        wk->dead = 1;
        return;
    }
    const char *a = t->a;
    const size_t rs = t->rs, m = t->cap - 1;
    const int shift = t->shift;
    u64 acc = wk->acc[0];
    const u64 *pool = self->pool.a + 1;
    const size_t rw = self->pool.rw;
    size_t next = 0; /* the slot after the previous block's */
    for (Py_ssize_t g = 0; g < n && g < WALK_PREFETCH; g += 8) walk_prefetch_group(a, rs, m, shift, keys, g);
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i & 7) == 0 && i + WALK_PREFETCH < n) walk_prefetch_group(a, rs, m, shift, keys, i + WALK_PREFETCH);
        const u64 k = keys[i], hh = walk_hh(keys, i);
        u64 rk, hw;
        /* A group's blocks sit in consecutive slots, displaced alike when
         * displaced: look right after the previous block's slot first, and
         * probe from home only when it is not there (an occupied slot whose
         * key and home are this block's is its record, wherever it is). */
        const char *r = a + next * rs;
        size_t s = next;
        int there = 0;
        if (i & 7) {
            memcpy(&rk, r, 8);
            memcpy(&hw, r + 8, 8);
            there = rk == k && (hw & ~HOME_FREE) == hh;
        }
        if (!there) {
            s = home_at(hh, shift, m);
            for (;;) {
                r = a + s * rs;
                memcpy(&rk, r, 8);
                memcpy(&hw, r + 8, 8);
                if (rk == k && (hw & ~HOME_FREE) == hh) break;
                if (!(hw & HOME_FREE)) break; /* an empty slot: not held by anyone */
                s = (s + 1) & m;
            }
        }
        next = (s + 1) & m;
        /* who << 3: bit 3 pooled; else its rank at bits 7-12 (bits 1-3 of who: GPU) */
        const u64 wb = hw & HOME_FREE;
        u64 mask = 1ULL << ((wb >> 7) & 63);
        if (__builtin_expect(wb & 8, 0)) mask = pool[(size_t)(wb >> 4) * rw];
        else if (!wb) mask = 0;
        u64 na = acc & mask;
        if (na != acc) record_lost(acc & ~na, 0, wk->depth, (i32)wk->at);
        acc = na;
        if (!acc) {
            wk->dead = 1;
            break;
        }
        wk->at++;
    }
    wk->acc[0] = acc;
}

static void walk_keys(Walk *wk, const Index *self, const u64 *keys, Py_ssize_t n) {
    if (wk->W == 1 && wk->T == 1) {
        walk_keys_one(wk, self, keys, n);
        return;
    }
    const size_t W = wk->W, T = wk->T;
    u64 *acc = wk->acc;
    i32 *depth = wk->depth;
    /* A prompt's probes are independent: have them all in flight at once
     * (a window of WALK_PREFETCH), not one cache miss after another. */
    for (Py_ssize_t k = 0; k < n && k < WALK_PREFETCH; k++) t_prefetch_h(&self->nodes, walk_hh(keys, k));
    const Table *t = &self->nodes;
    char *next = NULL; /* the slot after the previous block's (as walk_keys_one) */
    for (Py_ssize_t i = 0; i < n && !wk->dead; i++) {
        if (i + WALK_PREFETCH < n) t_prefetch_h(t, walk_hh(keys, i + WALK_PREFETCH));
        const u64 k = keys[i], hh = walk_hh(keys, i);
        char *r = (i & 7) ? next : NULL;
        if (!r || rec_key(r) != k || rec_hh(t, r) != hh || !node_occ(r, t->rs))
            r = t_find_h(t, k, hh, node_occ);
        if (!r) { wk->dead = 1; break; }
        next = r + t->rs == t->a + t->cap * t->rs ? t->a : r + t->rs;
        i32 pos = (i32)wk->at;
        u64 alive = 0;
        /* Its holders: a pool row's masks, or one rank's bit (word ow, tiers op). */
        const u32 who = node_who(r);
        const u64 *m = (who & WHO_POOLED) ? pool_masks(self, who) : NULL;
        const size_t ow = m ? W : (size_t)(who >> 10);
        const int op = (int)((who >> 1) & 7);
        const u64 obit = 1ULL << ((who >> 4) & 63);
        if (T == 1) {
            /* One tier (never split): the loop of one mask word each. */
            for (size_t w = 0; w < W; w++) {
                const u64 na = acc[w] & (m ? m[w] : w == ow ? obit : 0);
                if (acc[w] != na) record_lost(acc[w] & ~na, w << 6, depth, pos);
                acc[w] = na;
                alive |= na;
            }
            if (!alive) { wk->dead = 1; break; }
            wk->at++;
            continue;
        }
        for (size_t w = 0; w < W; w++) {
            u64 a, g = 0, f = 0;
            if (m) {
                const u64 *mw = m + w * T;
                if (T == 1) a = mw[0];
                else { g = mw[0]; f = g | mw[1]; a = f | mw[2]; }
            } else if (w == ow) {
                a = obit;
                g = (op & 1) ? obit : 0;
                f = (op & 3) ? obit : 0;
            } else {
                a = 0;
            }
            u64 na = acc[w] & a;
            if (acc[w] != na) record_lost(acc[w] & ~na, w << 6, depth, pos);
            acc[w] = na;
            alive |= na;
            if (wk->split) {
                u64 ng = acc[W + w] & g, nf = acc[2 * W + w] & f;
                if (acc[W + w] != ng) record_lost(acc[W + w] & ~ng, (W + w) << 6, depth, pos);
                if (acc[2 * W + w] != nf) record_lost(acc[2 * W + w] & ~nf, (2 * W + w) << 6, depth, pos);
                acc[W + w] = ng;
                acc[2 * W + w] = nf;
            }
        }
        if (!alive) { wk->dead = 1; break; }
        wk->at++;
    }
}

static int plain_name(PyObject *o) {
    return PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) == 2 &&
           PyUnicode_CheckExact(PyTuple_GET_ITEM(o, 0)) && PyLong_CheckExact(PyTuple_GET_ITEM(o, 1));
}

static int set_known(PyObject *d, PyObject *k, PyObject *v, Py_hash_t h) {
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_SetItem_KnownHash(d, k, v, h);
#else
    (void)h;
    return PyDict_SetItem(d, k, v);
#endif
}

/* ------------------------------------------------------------------------ */
/* Names: the rank slots' names with their hashes, a snapshot of the names   */
/* list that every match shares until the list changes.                      */

typedef struct {
    PyObject *name;
    Py_hash_t hash; /* -1: unhashable (raised if a holder has that name) */
} Name;

typedef struct {
    PyObject_VAR_HEAD
    Name e[1];
} Names;

static int Names_traverse(Names *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++) Py_VISIT(self->e[i].name);
    return 0;
}

/* No tp_clear: immutable like a tuple (a cycle through it is broken at the
 * names), so a Matches never reads a cleared one. */
static void Names_dealloc(Names *self) {
    PyObject_GC_UnTrack(self);
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++) Py_XDECREF(self->e[i].name);
    PyObject_GC_Del(self);
}

static PyTypeObject NamesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.prefix_index._core.Names",
    .tp_basicsize = sizeof(Names) - sizeof(Name), /* e[] from there */
    .tp_itemsize = sizeof(Name),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "Rank names of a match (internal).",
    .tp_dealloc = (destructor)Names_dealloc,
    .tp_traverse = (traverseproc)Names_traverse,
};

/* The names list as Names (new reference): the index's cached one while the
 * list holds the same objects. Cached only when every name is a (str, int)
 * or None: the index then holds nothing that could reference it back. */
static Names *names_snapshot(Index *self, PyObject *names) {
    const Py_ssize_t n = PyList_GET_SIZE(names);
    Names *s = (Names *)self->snap;
    if (s && Py_SIZE(s) == n) {
        Py_ssize_t i = 0;
        while (i < n && s->e[i].name == PyList_GET_ITEM(names, i)) i++;
        if (i == n) {
            Py_INCREF(s);
            return s;
        }
    }
    if (!(s = PyObject_GC_NewVar(Names, &NamesType, n))) return NULL;
    Py_SET_SIZE(s, 0);
    int plain = 1;
    /* A hash may run Python code that changes the list: re-read its size. */
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(names); i++) {
        PyObject *o = PyList_GET_ITEM(names, i);
        Py_INCREF(o);
        Py_hash_t h = 0;
        if (o != Py_None) {
            plain &= plain_name(o);
            if ((h = PyObject_Hash(o)) == -1) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                    Py_DECREF(o);
                    Py_DECREF(s);
                    return NULL;
                }
                PyErr_Clear();
            }
        }
        s->e[i].name = o;
        s->e[i].hash = h;
        Py_SET_SIZE(s, i + 1);
    }
    PyObject_GC_Track(s);
    if (plain && Py_SIZE(s) == n) {
        Py_INCREF(s);
        Py_XSETREF(self->snap, (PyObject *)s);
    }
    return s;
}

/* ------------------------------------------------------------------------ */
/* Matches: a match's result, read-only, built as far as it is read.        */
/*
 * A router usually reads a few holders (its candidates, the deepest), so
 * the walk's result keeps each holder's rank slot and depths, and the names
 * (with their hashes) it was made with, and makes a value object only when
 * one is asked for. The dict of every holder is built on the first
 * operation that needs it all (equality, keys/values/items views, many
 * lookups) and then kept. Made only by a match: it cannot be created from
 * Python. */

typedef struct {
    i32 a, b; /* (rank slot, depth held anywhere); with tiers, at cap + i: (on GPU, on GPU or CPU) */
} Holder;

typedef struct {
    PyObject_VAR_HEAD
    Names *names;
    PyObject *tt;   /* tiers_type, or NULL: depths are ints */
    PyObject *dict; /* every holder, once built */
    Py_ssize_t lookups, cap;
    i32 max;
    Holder h[1];
} Matches;

/* Key lookups by a scan of the hashes, up to this many; then the dict. */
#define MATCHES_SCANS 8

static PyTypeObject MatchesType;

static inline const Name *holder_name(const Matches *self, Py_ssize_t i) {
    return &self->names->e[self->h[i].a];
}

static PyObject *holder_value(const Matches *self, Py_ssize_t i) {
    const i32 d = self->h[i].b;
    if (!self->tt) return PyLong_FromLong(d);
    const Holder *gf = &self->h[self->cap + i];
    return PyObject_CallFunction(self->tt, "iii", gf->a, gf->b - gf->a, d - gf->b);
}

/* The dict of every holder (borrowed), built on first use. */
static PyObject *matches_dict(Matches *self) {
    if (self->dict) return self->dict;
    const Py_ssize_t n = Py_SIZE(self);
#if PY_VERSION_HEX < 0x030D0000
    PyObject *d = n > 5 ? _PyDict_NewPresized(n) : PyDict_New();
#else
    PyObject *d = PyDict_New();
#endif
    if (!d) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = holder_value(self, i);
        const Name *nm = holder_name(self, i);
        int rc = v ? set_known(d, nm->name, v, nm->hash) : -1;
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    /* holder_value may have run Python code that built it meanwhile. */
    if (self->dict) Py_DECREF(d);
    else self->dict = d;
    return self->dict;
}

/* The holder of key: its position, -1 when none, -2 on error. */
static Py_ssize_t matches_find(Matches *self, PyObject *key) {
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -2;
    const Py_ssize_t n = Py_SIZE(self);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Name *nm = holder_name(self, i);
        if (nm->hash != hash) continue;
        int eq = nm->name == key ? 1 : PyObject_RichCompareBool(nm->name, key, Py_EQ);
        if (eq < 0) return -2;
        if (eq) return i;
    }
    return -1;
}

/* The value of key (new reference), NULL with no error set when absent. */
static PyObject *matches_lookup(Matches *self, PyObject *key) {
    if (!self->dict && ++self->lookups > MATCHES_SCANS && !matches_dict(self)) return NULL;
    if (self->dict) {
        PyObject *v = PyDict_GetItemWithError(self->dict, key);
        Py_XINCREF(v);
        return v;
    }
    Py_ssize_t i = matches_find(self, key);
    return i >= 0 ? holder_value(self, i) : NULL;
}

static PyObject *Matches_subscript(Matches *self, PyObject *key) {
    PyObject *v = matches_lookup(self, key);
    if (!v && !PyErr_Occurred()) {
        PyObject *args = PyTuple_Pack(1, key); /* a tuple key is one argument */
        if (args) PyErr_SetObject(PyExc_KeyError, args);
        Py_XDECREF(args);
    }
    return v;
}

static int Matches_contains(Matches *self, PyObject *key) {
    if (self->dict) return PyDict_Contains(self->dict, key);
    Py_ssize_t i = matches_find(self, key);
    return i == -2 ? -1 : i >= 0;
}

static Py_ssize_t Matches_length(Matches *self) { return Py_SIZE(self); }

static PyObject *Matches_get(Matches *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *v = matches_lookup(self, args[0]);
    if (v || PyErr_Occurred()) return v;
    v = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(v);
    return v;
}

/* Iteration is over the names, in rank slot order, without building a value. */
static PyObject *Matches_iter(Matches *self) {
    const Py_ssize_t n = Py_SIZE(self);
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = holder_name(self, i)->name;
        Py_INCREF(name);
        PyTuple_SET_ITEM(t, i, name);
    }
    PyObject *it = PyObject_GetIter(t);
    Py_DECREF(t);
    return it;
}

static PyObject *matches_view(Matches *self, const char *which) {
    PyObject *d = matches_dict(self);
    return d ? PyObject_CallMethod(d, which, NULL) : NULL;
}

static PyObject *Matches_keys(Matches *self, PyObject *unused) { return matches_view(self, "keys"); }
static PyObject *Matches_values(Matches *self, PyObject *unused) { return matches_view(self, "values"); }
static PyObject *Matches_items(Matches *self, PyObject *unused) { return matches_view(self, "items"); }

/* Pickled and copied as the dict it equals. */
static PyObject *Matches_reduce(Matches *self, PyObject *unused) {
    PyObject *d = matches_dict(self);
    return d ? Py_BuildValue("(O(O))", (PyObject *)&PyDict_Type, d) : NULL;
}

/* best(n=1) -> the n deepest holders as (name, value), deepest first, ties in
 * rank slot order. Picks by insertion into a sorted window of n: no value
 * is built for the others. */
static PyObject *Matches_best(Matches *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t want = 1;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "best(n=1)");
        return NULL;
    }
    if (nargs == 1 && (want = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred()) return NULL;
    if (want < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    const Py_ssize_t n = Py_SIZE(self);
    if (want > n) want = n;
    Py_ssize_t small[16], *top = small, k = 0;
    if (want > 16 && !(top = PyMem_Malloc((size_t)want * sizeof *top))) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n && want > 0; i++) {
        const i32 d = self->h[i].b;
        if (k == want && d <= self->h[top[k - 1]].b) continue;
        Py_ssize_t j = k < want ? k++ : k - 1;
        for (; j > 0 && d > self->h[top[j - 1]].b; j--) top[j] = top[j - 1];
        top[j] = i;
    }
    PyObject *out = PyList_New(k);
    for (Py_ssize_t i = 0; out && i < k; i++) {
        PyObject *v = holder_value(self, top[i]);
        PyObject *pair = v ? PyTuple_Pack(2, holder_name(self, top[i])->name, v) : NULL;
        Py_XDECREF(v);
        if (!pair) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, pair);
    }
    if (top != small) PyMem_Free(top);
    return out;
}

static PyObject *Matches_get_max_depth(Matches *self, void *c) { return PyLong_FromLong(self->max); }

static PyObject *Matches_richcompare(PyObject *a, PyObject *b, int op) {
    const int other = PyObject_TypeCheck(b, &MatchesType);
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(a, &MatchesType) || !(other || PyDict_Check(b)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *da = matches_dict((Matches *)a);
    PyObject *db = da && other ? matches_dict((Matches *)b) : b;
    return da && db ? PyObject_RichCompare(da, db, op) : NULL;
}

/* Printed as the dict it equals (what a match printed before it was lazy). */
static PyObject *Matches_repr(Matches *self) {
    PyObject *d = matches_dict(self);
    return d ? PyObject_Repr(d) : NULL;
}

static int Matches_traverse(Matches *self, visitproc visit, void *arg) {
    Py_VISIT(self->names);
    Py_VISIT(self->tt);
    Py_VISIT(self->dict);
    return 0;
}

/* Holders read their names: once the names are gone, there are none. */
static int Matches_clear(Matches *self) {
    Py_SET_SIZE(self, 0);
    Py_CLEAR(self->names);
    Py_CLEAR(self->tt);
    Py_CLEAR(self->dict);
    return 0;
}

static void Matches_dealloc(Matches *self) {
    PyObject_GC_UnTrack(self);
    Matches_clear(self);
    PyObject_GC_Del(self);
}

static PyMappingMethods Matches_as_mapping = {
    .mp_length = (lenfunc)Matches_length,
    .mp_subscript = (binaryfunc)Matches_subscript,
};

static PySequenceMethods Matches_as_sequence = {
    .sq_contains = (objobjproc)Matches_contains,
};

static PyMethodDef Matches_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Matches_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)Matches_keys, METH_NOARGS, "the holders"},
    {"values", (PyCFunction)Matches_values, METH_NOARGS, "their matched depths"},
    {"items", (PyCFunction)Matches_items, METH_NOARGS, "(holder, depth) pairs"},
    {"best", (PyCFunction)(void (*)(void))Matches_best, METH_FASTCALL,
     "best(n=1) -> the n deepest (holder, depth) pairs, deepest first"},
    {"__class_getitem__", Py_GenericAlias, METH_O | METH_CLASS, "Matches[K, V] in annotations"},
    {"__reduce__", (PyCFunction)Matches_reduce, METH_NOARGS, "pickled as a dict"},
    {NULL},
};

static PyGetSetDef Matches_getset[] = {
    {"max_depth", (getter)Matches_get_max_depth, NULL, "the deepest holder's matched blocks (0: none)", NULL},
    {NULL},
};

static PyTypeObject MatchesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.prefix_index._core.Matches",
    .tp_basicsize = sizeof(Matches) - sizeof(Holder), /* h[] from there */
    .tp_itemsize = sizeof(Holder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "A match's holders and their matched blocks: a read-only mapping, built as read.",
    .tp_dealloc = (destructor)Matches_dealloc,
    .tp_traverse = (traverseproc)Matches_traverse,
    .tp_clear = (inquiry)Matches_clear,
    .tp_repr = (reprfunc)Matches_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_as_mapping = &Matches_as_mapping,
    .tp_as_sequence = &Matches_as_sequence,
    .tp_richcompare = Matches_richcompare,
    .tp_iter = (getiterfunc)Matches_iter,
    .tp_methods = Matches_methods,
    .tp_getset = Matches_getset,
};

/* The walk's Matches: names[sid] and depths (or tiers_type(gpu, cpu,
 * storage) when read) of every holder; frees the walk. */
static PyObject *walk_result(Index *self, Walk *wk, PyObject *names, PyObject *tt) {
    const size_t W = wk->W, S = W << 6;
    u64 *acc = wk->acc;
    i32 *depth = wk->depth, at = (i32)wk->at;
    for (size_t w = 0; w < W; w++) {
        record_lost(acc[w], w << 6, depth, at);
        if (wk->split) {
            record_lost(acc[W + w], (W + w) << 6, depth, at);
            record_lost(acc[2 * W + w], (2 * W + w) << 6, depth, at);
        }
    }
    Matches *out = NULL;
    Names *nm = names_snapshot(self, names);
    if (!nm) goto done;
    const size_t ns = S < (size_t)Py_SIZE(nm) ? S : (size_t)Py_SIZE(nm);
    Py_ssize_t held = 0;
    for (size_t sid = 0; sid < ns; sid++) {
        if (depth[sid] <= 0 || nm->e[sid].name == Py_None) continue;
        if (nm->e[sid].hash == -1 && PyObject_Hash(nm->e[sid].name) == -1) { /* raises */
            Py_DECREF(nm);
            goto done;
        }
        held++;
    }
    out = PyObject_GC_NewVar(Matches, &MatchesType, tt == Py_None ? held : 2 * held);
    if (!out) {
        Py_DECREF(nm);
        goto done;
    }
    out->names = nm;
    out->tt = NULL;
    if (tt != Py_None) {
        Py_INCREF(tt);
        out->tt = tt;
    }
    out->dict = NULL;
    out->lookups = 0;
    out->cap = held;
    i32 max = 0;
    Py_ssize_t k = 0;
    for (size_t sid = 0; sid < ns; sid++) {
        const i32 d = depth[sid];
        if (d <= 0 || nm->e[sid].name == Py_None) continue;
        out->h[k].a = (i32)sid;
        out->h[k].b = d;
        if (out->tt) {
            Holder *gf = &out->h[held + k];
            gf->a = gf->b = d;
            if (wk->split) {
                gf->a = depth[S + sid];
                gf->b = depth[2 * S + sid];
            }
        }
        if (d > max) max = d;
        k++;
    }
    out->max = max;
    Py_SET_SIZE(out, k);
    PyObject_GC_Track(out);
done:
    walk_end(wk);
    return (PyObject *)out;
}

static int names_arg(PyObject *names) {
    if (PyList_Check(names)) return 0;
    PyErr_SetString(PyExc_TypeError, "names must be a list");
    return -1;
}

/* match(keys, names, tiers_type) -> Matches {names[sid]: depth}
 *
 * The longest run of the prompt's keys from the first that each rank holds.
 * tiers_type None: depths as ints; else tiers_type(gpu, cpu, storage) from
 * the runs held on GPU, on GPU or CPU, and anywhere. */
static PyObject *Index_match(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 3, "match") < 0) return NULL;
    if (names_arg(args[1]) < 0) return NULL;
    Py_buffer kv;
    if (get_u64s(args[0], &kv, 0, "keys") < 0) return NULL;
    Walk wk;
    if (walk_begin(&wk, self, args[2] != Py_None) < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    walk_keys(&wk, self, kv.buf, kv.len / 8);
    PyBuffer_Release(&kv);
    return walk_result(self, &wk, args[1], args[2]);
}

/* Blocks keyed and walked at a time: a prompt whose match ends early is
 * hashed only a chunk past it. */
#define MATCH_CHUNK 16

/* The block sum of bs list items read straight off the int objects: 1, or 0
 * when an item is anything but a small exact int (no error set; the caller
 * converts that block with token_of). One test a pair for the types and one
 * a block for the values, so the loads of a cold prompt's ints overlap. */
static inline int items_sum(PyObject *const *p, const u64 *w, Py_ssize_t bs, u64 *sum) {
    PyTypeObject *const lt = &PyLong_Type;
    u64 a0 = 0, a1 = 0, bad = 0;
    Py_ssize_t j = 0;
    for (; j + 2 <= bs; j += 2) {
        PyObject *o0 = p[j], *o1 = p[j + 1];
        if ((Py_TYPE(o0) != lt) | (Py_TYPE(o1) != lt)) return 0;
        a0 += digit_token(o0, &bad) * w[j];
        a1 += digit_token(o1, &bad) * w[j + 1];
    }
    if (j < bs) {
        if (Py_TYPE(p[j]) != lt) return 0;
        a0 += digit_token(p[j], &bad) * w[j];
    }
    *sum = a0 + a1;
    return bad <= 1;
}

/* A prompt's keys a chunk at a time: from a list's items (read as far as
 * that) or from tokens read up front. */
typedef struct {
    KeyChain *chain;
    PyObject *seq;
    const u64 *all;
    u64 *tok; /* a block's tokens, for items the general way */
    const u64 *extra;
    Py_ssize_t nb;
    u64 state;
} MatchChunks;

/* Block b's sum from the list's items; -1 with TypeError or ValueError for
 * an unusable item. PyLong_Check'ed conversions run no Python code: the list
 * cannot change under us. */
static inline int item_block_sum(MatchChunks *mc, Py_ssize_t b, u64 *sum) {
    const KeyChain *c = mc->chain;
    PyObject **p = PySequence_Fast_ITEMS(mc->seq) + b * c->bs;
    if (items_sum(p, c->w, c->bs, sum)) return 0;
    for (Py_ssize_t j = 0; j < c->bs; j++)
        if (token_of(p[j], &mc->tok[j]) < 0) return -1;
    *sum = block_sum_of(c, mc->tok, 0);
    return 0;
}

/* Keys of the chunk at block b into out (*m of them), their nodes
 * prefetched; -1 with TypeError or ValueError for an unusable item. */
static int chunk_keys(MatchChunks *mc, const Index *self, Py_ssize_t b, u64 *out, Py_ssize_t *m) {
    const KeyChain *c = mc->chain;
    Py_ssize_t n = mc->nb - b < MATCH_CHUNK ? mc->nb - b : MATCH_CHUNK;
    if (mc->seq) {
        u64 state = mc->state;
        for (Py_ssize_t k = 0; k < n; k++) {
            u64 l;
            if (item_block_sum(mc, b + k, &l) < 0) return -1;
            state = chain_step(c, state, l, (u64)(b + k), mc->extra ? mc->extra[b + k] : 0);
            out[k] = state;
        }
    } else {
        chain_keys(c, mc->all + b * c->bs, n, mc->state, (u64)b, mc->extra ? mc->extra + b : NULL, out);
    }
    mc->state = out[n - 1];
    for (Py_ssize_t k = 0; k < n; k++) t_prefetch_h(&self->nodes, walk_hh(out, k));
    *m = n;
    return 0;
}

/* match() from token ids in one call: keys are computed a chunk at a time
 * as the walk goes, and list items are read only as far as that. */
static PyObject *match_tokens_core(Index *self, KeyChain *chain, PyObject *obj, int packed, u64 state,
                                   PyObject *extra_obj, PyObject *names, PyObject *tt) {
    if (chain_ready(chain) < 0 || names_arg(names) < 0) return NULL;
    PyObject *seq = NULL;
    const u64 *all = NULL; /* tokens read up front (buffers, packed) */
    Py_ssize_t ntok;
    if (!packed && (PyList_Check(obj) || PyTuple_Check(obj))) {
        seq = PySequence_Fast(obj, "tokens");
        if (!seq) return NULL;
        ntok = PySequence_Fast_GET_SIZE(seq);
    } else {
        u64 *t;
        if (read_tokens(obj, packed, &chain->tok, &t, &ntok) < 0) return NULL;
        all = t;
    }
    const Py_ssize_t bs = chain->bs, nb = ntok / bs;
    Py_buffer ev = {0};
    const u64 *extra = NULL;
    Walk wk = {0};
    PyObject *result = NULL;
    if (extra_obj != Py_None) {
        if (get_u64s(extra_obj, &ev, nb, "extra") < 0) goto done;
        extra = ev.buf;
    }
    if (walk_begin(&wk, self, tt != Py_None) < 0) goto done;
    u64 keys[2][MATCH_CHUNK];
    u64 *tok = NULL;
    if (seq && !(tok = scratch_get(&chain->tok, bs))) {
        walk_end(&wk);
        goto done;
    }
    /* Chunk c + 1's keys are computed (its list items read) while chunk c's
     * probes, prefetched, are on their way. An unusable item there is
     * raised only if the walk gets that far, as when chunks go one by one. */
    MatchChunks mc = {chain, seq, all, tok, extra, nb, state};
    Py_ssize_t b = 0, m = 0;
    if (nb > 0 && chunk_keys(&mc, self, 0, keys[0], &m) < 0) {
        walk_end(&wk);
        goto done;
    }
    for (int c = 0; b < nb && !wk.dead; c ^= 1) {
        Py_ssize_t next = b + m, m2 = 0;
        PyObject *et = NULL, *ev2 = NULL, *etb = NULL;
        if (next < nb && chunk_keys(&mc, self, next, keys[c ^ 1], &m2) < 0) PyErr_Fetch(&et, &ev2, &etb);
        walk_keys(&wk, self, keys[c], m);
        if (et) {
            if (!wk.dead) {
                PyErr_Restore(et, ev2, etb);
                walk_end(&wk);
                goto done;
            }
            Py_XDECREF(et);
            Py_XDECREF(ev2);
            Py_XDECREF(etb);
        }
        b = next;
        m = m2;
    }
    result = walk_result(self, &wk, names, tt);
done:
    if (extra) PyBuffer_Release(&ev);
    Py_XDECREF(seq);
    return result;
}

/* match_tokens(chain, tokens, packed, start, extra, names, tiers_type) */
static PyObject *Index_match_tokens(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 7, "match_tokens") < 0) return NULL;
    KeyChain *chain = chain_arg(args[0]);
    if (!chain) return NULL;
    int packed = PyObject_IsTrue(args[2]);
    u64 state;
    if (packed < 0 || u64_arg(args[3], &state, "start") < 0) return NULL;
    return match_tokens_core(self, chain, args[1], packed, state, args[4], args[5], args[6]);
}

static int configured(Index *self) {
    if (self->chain) return 0;
    PyErr_SetString(PyExc_ValueError, "Index used before configure()");
    return -1;
}

/* match_list(tokens): match_tokens(chain, tokens, False, root, None, names,
 * None) with configure()'s chain, root and names: PrefixIndex.match's
 * common call, a tokenizer's list, in one argument. */
static PyObject *Index_match_list(Index *self, PyObject *tokens) {
    if (configured(self) < 0) return NULL;
    return match_tokens_core(self, self->chain, tokens, 0, self->root, Py_None, self->names, Py_None);
}

/* configure(chain, root, index_max_block_size, groups, tiers, names): the
 * per-index arguments of apply_payload and match_list. groups None:
 * apply_payload takes no payload (groups it cannot compare natively). */
static PyObject *Index_configure(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 6, "configure") < 0) return NULL;
    KeyChain *chain = chain_arg(args[0]);
    if (!chain || chain_ready(chain) < 0 || names_arg(args[5]) < 0) return NULL;
    PyObject *groups = args[3] == Py_None ? NULL : args[3];
    if ((groups && !PyAnySet_Check(groups)) || !PyDict_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "groups must be a set or None, tiers a dict");
        return NULL;
    }
    u64 root;
    if (u64_arg(args[1], &root, "root") < 0) return NULL;
    int bad = 0;
    Py_ssize_t index_max_bs = kvs_limit(args[2], &bad);
    if (bad) groups = NULL; /* a bound this path does not read: the general way */
    int none_ok = groups ? PySet_Contains(groups, Py_None) : 0;
    if (none_ok < 0) return NULL;
    Py_XSETREF(self->chain, (KeyChain *)Py_NewRef(args[0]));
    Py_XSETREF(self->groups, Py_XNewRef(groups));
    Py_XSETREF(self->tier_of, Py_NewRef(args[4]));
    Py_XSETREF(self->names, Py_NewRef(args[5]));
    self->root = root;
    self->index_max_bs = index_max_bs;
    self->none_ok = none_ok;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* The fused apply: one batch payload's msgpack straight into the tables.    */
/*
 * What kvwire.wire.decode_batch followed by PrefixIndex.apply does, without
 * a Python object per event or block, for the batches engines send. A first
 * pass is the one native reader (kvwire/_native/scan.h: the payload checked
 * against the DecodeLimits, its events' flat view, hashes into its scratch),
 * its token reader making the block sums as it goes; then each event's tier
 * and group are resolved, and a store with a lora_name, extra keys, a salt or
 * lookahead tokens (keyed differently) declined. A second pass applies it.
 * Anything the reader does not take, well formed or not, changes nothing and
 * is answered False: the caller decodes it the general way, which applies it
 * or raises WireError (tests/wire/differential.py holds the paths side by
 * side). */

/* The scanner's event (kvwire/_native/scan.h), with the index's notes:
 * tier, ok (its group counts), other (a store of another, valid block size),
 * aux (its block sums in ps, -1: tokens unusable). */
typedef KvEv PEv;

typedef struct {
    Index *self;
    KeyChain *chain;
    PyObject *groups, *tiers;
    int none_ok;
    Py_ssize_t index_max_bs;
    /* the medium last looked up */
    const char *med;
    Py_ssize_t med_len;
    int med_tier;
} PCtx;

/* tier_of(medium) from PrefixIndex's cache of it; a name not cached yet: FALL. */
static int medium_tier(PCtx *cx, const char *s, Py_ssize_t n, int *tier) {
    if (cx->med && cx->med_len == n && memcmp(cx->med, s, (size_t)n) == 0) {
        *tier = cx->med_tier;
        return 0;
    }
    PyObject *key = PyUnicode_FromStringAndSize(s, n);
    if (!key) return -1;
    PyObject *v = PyDict_GetItemWithError(cx->tiers, key);
    Py_DECREF(key);
    if (!v) return PyErr_Occurred() ? -1 : FALL;
    long t = PyLong_Check(v) ? PyLong_AsLong(v) : -1;
    if (t < 0 || t > 2) {
        PyErr_Clear();
        return FALL;
    }
    cx->med = s;
    cx->med_len = n;
    cx->med_tier = *tier = (int)t;
    return 0;
}

/* The token_ids array at r, read straight into the block sums of the
 * chain's block size, appended to the index's sums scratch (at ev->aux, one
 * a whole block): the fused apply needs the tokens only for those; the
 * scanner's token reader (-1: out of memory, raised). Accepts and refuses
 * (FALL) exactly the arrays the scanner's default reader does. A block of 16 uint16 ids, most of a 32k-65k vocabulary's, is read
 * without a branch per id. */
static int rd_token_sums(KvScan *s, Rd *r, KvEv *ev) {
    PCtx *cx = s->ctx;
    const unsigned char *p = r->p + r->i;
    Py_ssize_t len = r->n - r->i, n, i;
    if (len < 1) return FALL;
    unsigned char h = p[0];
    if (h >= 0x90 && h <= 0x9f) { n = h & 0x0f; i = 1; }
    else if (h == 0xdc && len >= 3) { n = (Py_ssize_t)kvw_get_be(p + 1, 2); i = 3; }
    else if (h == 0xdd && len >= 5) { n = (Py_ssize_t)kvw_get_be(p + 1, 4); i = 5; }
    else return FALL;
    if (n > len - i || n > s->lim.max_tokens) return FALL;
    const KeyChain *c = cx->chain;
    Py_ssize_t bs = c->bs, nb = n / bs;
    Index *self = cx->self;
    Py_ssize_t off = self->ps_len;
    if (!scratch_get(&self->ps, off + nb)) return -1;
    u64 *sums = self->ps.p + off;
    const u64 *w = c->w;
    for (Py_ssize_t b = 0; b <= nb; b++) {
        /* b == nb: the ids past the last whole block, read for their checks only */
        Py_ssize_t m = b < nb ? bs : n - nb * bs;
        if (bs == 16 && b < nb && len - i >= 48) {
            const unsigned char *q = p + i;
            unsigned all = 1;
            for (int k = 0; k < 16; k++) all &= q[3 * k] == 0xcd;
            if (all) {
                u64 a0 = 0, a1 = 0;
                for (int k = 0; k < 16; k += 2) {
                    a0 += (((u64)q[3 * k + 1] << 8) | q[3 * k + 2]) * w[k];
                    a1 += (((u64)q[3 * k + 4] << 8) | q[3 * k + 5]) * w[k + 1];
                }
                sums[b] = a0 + a1;
                i += 48;
                continue;
            }
        }
        u64 a = 0;
        for (Py_ssize_t k = 0; k < m; k++) {
            if (i >= len) return FALL;
            u64 t;
            int neg, used = kvw_get_int(p + i, len - i, &t, &neg);
            if (used <= 0) return FALL;
            i += used;
            a += t * w[k];
        }
        if (b < nb) sums[b] = a;
    }
    self->ps_len = off + nb;
    ev->aux = off;
    ev->tok = p;
    ev->tok_len = i;
    ev->ntok = n;
    r->i += i;
    return 0;
}

/* An event the scanner read, as the index takes it: its tier and group, its
 * sums usable or not; FALL for what would key a block differently (a lora
 * name, extra keys, lookahead tokens, a salt: the general way keys those). */
static int index_event(PCtx *cx, PEv *ev) {
    if (ev->kind == EV_CLEARED) return 0;
    if (ev->extras & (X_LORA | X_EXTRA | X_LOOKAHEAD | X_SALT)) return FALL;
    ev->tier = 0; /* tier_of(None): GPU */
    if (ev->medium_len >= 0) {
        int rc = medium_tier(cx, ev->medium, ev->medium_len, &ev->tier);
        if (rc) return rc;
    }
    if (!ev->has_group) ev->ok = cx->none_ok;
    else {
        PyObject *g = ev->group_neg ? PyLong_FromLongLong((long long)ev->group)
                                    : PyLong_FromUnsignedLongLong(ev->group);
        if (!g) return -1;
        int rc = PySet_Contains(cx->groups, g);
        Py_DECREF(g);
        if (rc < 0) return -1;
        ev->ok = rc;
    }
    if (ev->kind != EV_STORED) return 0;
    /* PrefixIndex._store: tokens count only at the index's block size. */
    Py_ssize_t bs = ev->block_size;
    int usable = bs == cx->chain->bs;
    ev->other = !usable && bs <= cx->index_max_bs;
    if (!(usable && ev->n && ev->ntok == ev->n * bs)) ev->aux = -1;
    return 0;
}

/* The first pass: the whole payload read and checked (the one reader, its
 * token reader making the block sums as it goes); *count events. */
static int rd_batch(PCtx *cx, Rd *r, Py_ssize_t *count) {
    KvScan *s = &cx->self->scan;
    s->ev_len = s->h_len = 0;
    int rc = kvs_batch(s, r);
    if (rc < 0 && !PyErr_Occurred()) PyErr_NoMemory();
    if (rc) return rc;
    for (Py_ssize_t k = 0; k < s->ev_len; k++)
        if ((rc = index_event(cx, &s->ev[k]))) return rc;
    *count = s->ev_len;
    return 0;
}

/* Engines send many small events a batch (vLLM: a one-block BlockStored per
 * request per step), and each event's first probes are misses that
 * store_core and remove_core can only prefetch within the event. So the
 * second pass runs a window over the payload's events: EVENT_AHEAD events
 * ahead, their parents' entries and first hashes' entries are prefetched;
 * EVENT_AHEAD / 2 ahead, the parent (now near) gives the first block's key
 * and its node's home is prefetched too. Hints only, computed the way
 * store_core does: a stale one (the event before it changed the tables)
 * costs nothing and changes nothing. */
#define EVENT_AHEAD 8
#define EVENT_HASHES 4

static void event_prefetch(Index *self, Rank *rk, const PEv *ev, int stage, KeyChain *chain,
                           u64 root) {
    if (ev->kind == EV_CLEARED || !ev->ok || !ev->n) return;
    Table *t = &rk->entries;
    const u64 *h = self->scan.h + ev->hoff;
    if (stage == 0) {
        if (ev->kind == EV_STORED && ev->has_parent) t_prefetch(t, ev->parent);
        for (Py_ssize_t b = 0; b < ev->n && b < EVENT_HASHES; b++) t_prefetch_probe(t, h[b]);
        return;
    }
    if (ev->kind != EV_STORED || ev->aux < 0) return;
    u64 start = root, hh_group = 0;
    int64_t d0 = 0;
    if (ev->has_parent) {
        const Entry *pe = (const Entry *)t_find(t, ev->parent, entry_occ);
        if (!pe || pe->depth < 0) return;
        start = pe->key;
        d0 = (int64_t)pe->depth + 1;
        hh_group = entry_hh(pe) & HOME_BITS;
    }
    u64 key = chain_step(chain, start, self->ps.p[ev->aux], (u64)d0, 0);
    t_prefetch_h(&self->nodes, (d0 & 7) ? hh_group | (u64)(d0 & 7) : own_home(key));
}

/* Scratch that one hostile payload grew is given back afterwards. */
#define SCRATCH_KEEP ((Py_ssize_t)1 << 16)

static void scratch_trim(Scratch *s) {
    if (s->cap > SCRATCH_KEEP) scratch_free(s);
}

/* apply_payload(sid, payload, limits) -> True | False
 *
 * decode_batch(payload, limits) applied to rank sid with configure()'s
 * arguments, counted in counters and each rank's over_cap. False: the
 * payload is outside the subset read here (or groups are not native);
 * nothing changed, the caller decodes it the general way. */
static PyObject *Index_apply_payload(Index *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 3, "apply_payload") < 0) return NULL;
    if (configured(self) < 0) return NULL;
    if (!self->groups) Py_RETURN_FALSE;
    int lim = kvs_limits_seen(&self->limits, args[2]); /* 1: a bound not read here */
    if (lim) return lim < 0 ? NULL : Py_NewRef(Py_False);
    PCtx cx = {.self = self, .chain = self->chain, .groups = self->groups, .tiers = self->tier_of,
               .none_ok = self->none_ok, .index_max_bs = self->index_max_bs};
    self->scan.lim = self->limits.lim;
    self->scan.keep_hashes = self->scan.keep_events = 1;
    self->scan.ctx = &cx;
    const u64 root = self->root;
    Py_buffer pv;
    if (PyObject_GetBuffer(args[1], &pv, PyBUF_SIMPLE) < 0) {
        if (!clear_refusal() && !PyErr_ExceptionMatches(PyExc_BufferError)) return NULL;
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    PyObject *result = NULL;
    size_t sid;
    if (chain_ready(cx.chain) < 0 || check_sid(self, args[0], &sid) < 0) goto done;
    self->ps_len = 0;
    Rd r = {pv.buf, pv.len, 0};
    Py_ssize_t m = 0;
    int rc = rd_batch(&cx, &r, &m);
    if (rc) {
        if (rc == FALL) result = Py_NewRef(Py_False);
        goto done;
    }
    /* The second pass: nothing below can refuse the batch. */
    Py_ssize_t orphans = 0, unknown = 0, ignored = 0, malformed = 0, refused = 0;
    Rank *rk = &self->ranks[sid];
    for (Py_ssize_t k = 0; k < m && k < EVENT_AHEAD; k++) event_prefetch(self, rk, &self->scan.ev[k], 0, cx.chain, root);
    for (Py_ssize_t k = 0; k < m; k++) {
        if (k + EVENT_AHEAD < m) event_prefetch(self, rk, &self->scan.ev[k + EVENT_AHEAD], 0, cx.chain, root);
        if (k + EVENT_AHEAD / 2 < m) event_prefetch(self, rk, &self->scan.ev[k + EVENT_AHEAD / 2], 1, cx.chain, root);
        const PEv *ev = &self->scan.ev[k];
        if (ev->kind == EV_CLEARED) {
            if (clear_core(self, sid) < 0) goto done;
            continue;
        }
        if (!ev->ok) {
            ignored++;
            continue;
        }
        if (!ev->n) continue;
        const u64 *h = self->scan.h + ev->hoff;
        if (ev->kind == EV_REMOVED) {
            Py_ssize_t u = remove_core(self, sid, h, ev->n, ev->tier);
            if (u < 0) goto done;
            unknown += u;
            continue;
        }
        const u64 *sums = ev->aux < 0 ? NULL : self->ps.p + ev->aux;
        int flags = store_core(self, sid, cx.chain, ev->tier, h, ev->n, ev->has_parent, ev->parent,
                               root, NULL, 0, sums, NULL);
        if (flags < 0) goto done;
        if (flags & OVER_CAP) { /* store_core marked the rank */
            refused++;
            continue;
        }
        if (flags & ORPHAN) orphans++;
        if ((flags & MALFORMED) && !ev->other) malformed++;
    }
    self->counts[0] += orphans;
    self->counts[1] += unknown;
    self->counts[2] += ignored;
    self->counts[3] += malformed;
    self->counts[4] += refused;
    result = Py_NewRef(Py_True);
done:
    PyBuffer_Release(&pv);
    self->scan.ctx = NULL;
    kvs_trim(&self->scan, SCRATCH_KEEP);
    scratch_trim(&self->ps);
    return result;
}

static size_t rank_bytes(const Rank *r) {
    return (r->entries.in_arena ? 0 : r->entries.bytes) + r->multi.bytes;
}

static PyObject *Index_get_counters(Index *self, void *c) {
    const Py_ssize_t *n = self->counts;
    return Py_BuildValue("nnnnnn", n[0], n[1], n[2], n[3], n[4], n[5]);
}

/* The running count (O(1): the budget reads it per growing store). */
static PyObject *Index_get_memory(Index *self, void *c) {
    return PyLong_FromSize_t(index_memory(self));
}

/* The same, summed table by table: what the running count must equal (tests). */
static PyObject *Index_get_memory_summed(Index *self, void *c) {
    size_t total = self->nodes.bytes + self->pool.bytes;
    for (size_t i = 0; i < self->nranks; i++) total += rank_bytes(&self->ranks[i]);
    total += self->arena.n * HUGE_MIN; /* its chunks, in use or not */
    return PyLong_FromSize_t(total);
}

static PyMethodDef Index_methods[] = {
    {"ensure_rank", (PyCFunction)Index_ensure_rank, METH_O, "ensure_rank(sid): room for rank slot sid"},
    {"store", (PyCFunction)(void (*)(void))Index_store, METH_FASTCALL,
     "store(sid, chain, hashes, parent, tokens, packed, start, extra, tier) -> flags"},
    {"remove", (PyCFunction)(void (*)(void))Index_remove, METH_FASTCALL,
     "remove(sid, hashes, tier) -> unknown removals"},
    {"clear_rank", (PyCFunction)Index_clear_rank, METH_O, "clear_rank(sid)"},
    {"forget_rank", (PyCFunction)Index_forget_rank, METH_O, "forget_rank(sid): clear_rank, and its hint dropped"},
    {"reserve", (PyCFunction)(void (*)(void))Index_reserve, METH_FASTCALL,
     "reserve(sid, blocks) -> whether taken: the rank's tables sized for that many blocks"},
    {"export_rank", (PyCFunction)Index_export_rank, METH_O, "export_rank(sid | None) -> the rank's view as bytes"},
    {"import_ranks", (PyCFunction)(void (*)(void))Index_import_ranks, METH_FASTCALL,
     "import_ranks(sids, views) -> [0, or OVER_CAP | OVER_BUDGET]: each rank holds what its view says"},
    {"blocks", (PyCFunction)Index_blocks, METH_O, "blocks(sid) -> engine hashes held"},
    {"rank_stats", (PyCFunction)Index_rank_stats, METH_O, "rank_stats(sid) -> (entries, detached, over_cap)"},
    {"configure", (PyCFunction)(void (*)(void))Index_configure, METH_FASTCALL,
     "configure(chain, root, index_max_block_size, groups, tiers, names): apply_payload's and "
     "match_list's per-index arguments"},
    {"apply_payload", (PyCFunction)(void (*)(void))Index_apply_payload, METH_FASTCALL,
     "apply_payload(sid, payload, limits) -> True, or False (decode it the general way)"},
    {"match", (PyCFunction)(void (*)(void))Index_match, METH_FASTCALL,
     "match(keys, names, tiers_type) -> Matches {name: depth}"},
    {"match_tokens", (PyCFunction)(void (*)(void))Index_match_tokens, METH_FASTCALL,
     "match_tokens(chain, tokens, packed, start, extra, names, tiers_type) -> Matches {name: depth}"},
    {"match_list", (PyCFunction)Index_match_list, METH_O,
     "match_list(tokens) -> Matches {name: depth}, with configure()'s chain, root and names"},
    {NULL},
};

/* (size_t members read as T_ULONG: the same type on the LP64 systems this builds on) */
_Static_assert(sizeof(size_t) == sizeof(unsigned long), "size_t is unsigned long");
#define INDEX_SIZE(name, field, doc) {name, T_ULONG, offsetof(Index, field), READONLY, doc}
static PyMemberDef Index_members[] = {
    INDEX_SIZE("nodes", nodes.count, "distinct keys held"),
    INDEX_SIZE("pooled", pool.live, "keys two or more ranks hold (a pool row each)"),
    INDEX_SIZE("max_entries", max_entries, "engine hashes a rank may hold (0: no bound)"),
    INDEX_SIZE("expected_blocks_per_rank", expected, "blocks a rank's tables are presized for (0: none)"),
    INDEX_SIZE("max_bytes", max_bytes, "the tables' memory budget (0: none)"),
    {NULL},
};

static PyGetSetDef Index_getset[] = {
    {"memory", (getter)Index_get_memory, NULL, "bytes held by the tables", NULL},
    {"memory_summed", (getter)Index_get_memory_summed, NULL, "memory, summed table by table (tests)", NULL},
    {"counters", (getter)Index_get_counters, NULL,
     "apply_payload's (orphans, unknown removals, ignored, malformed, refused), and refusals at max_bytes",
     NULL},
    {NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.prefix_index._core.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Holder tables of the prefix index.",
    .tp_new = Index_new,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
    .tp_members = Index_members,
};

static struct PyModuleDef coremodule = {
    PyModuleDef_HEAD_INIT, "_core", "The prefix index's native tables and key chain.", -1, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&NamesType) < 0) return NULL;
    static PyTypeObject *const types[] = {&KeyChainType, &IndexType, &MatchesType, NULL};
    static const KvwConst consts[] = {
        {"ORPHAN", ORPHAN}, {"OVER_CAP", OVER_CAP}, {"MALFORMED", MALFORMED},
        {"OVER_BUDGET", OVER_BUDGET}, {"CAP_BLOCKS", CAP_BLOCKS}, {"CAP_BYTES", CAP_BYTES},
        {"VIEW_VERSION", VIEW_VERSION}, {NULL},
    };
    return kvw_module(&coremodule, types, consts);
}
