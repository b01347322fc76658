/* The publisher's sender: a native thread that never takes the GIL in steady state.
 *
 * Sender.publish(batch), on any engine thread, reserves the next seq and
 * appends the batch (a strong reference) to a queue, both under one mutex, so
 * that seq order is queue order, wire order and replay order whatever thread
 * publishes; it wakes the sender thread only when that thread waits. A full
 * queue (or a closed sender) drops the batch with its seq reserved: a visible
 * gap. With the mirror on, batches dropped on a full queue still go through the
 * queue, up to `mirror_backlog` of them, marked to be encoded for the mirror
 * only.
 *
 * The sender thread (a pthread) encodes each batch into a reference-counted
 * buffer and sends [topic, seq, payload] on the PUB socket, the payload
 * zero-copy. A collector's batch travels as C records (CBatch): the native
 * Collector below (EventCollector's hooks) queues its records as they are,
 * without a Python object, and publish() turns a CollectedBatch (`batch_type`)
 * into one. A batch whose records hold only what the checks below accept
 * (exact ints in lists or tuples, None, compact ASCII strs) is read and encoded
 * here without the GIL: the collector's contract is that the lists it was
 * handed are not changed after the call, the queued batch holds a reference to
 * every one of them, and ints, tuples and strs are immutable. The coalescing
 * and bytes are those of CollectedBatch.encode (both dialects). Anything else
 * is encoded by the Python callable `encode` with the GIL taken (a CollectedBatch
 * is made then for the Collector's batches); `stats()` counts both, and every
 * time the thread took the GIL.
 * The oldest queued batch is sent coalesce_s after its publish(), with whatever
 * was published meanwhile (a backlog is sent at once, and a nap ends when CHUNK
 * batches are queued: a burst goes out a chunk at a time, its copies few).
 * While batches keep coming (two within POLL_S of each other), the thread looks
 * at the queue every `coalesce_s` instead of being woken, so publish() makes no
 * wake-up syscall at a steady pace; POLL_S after the last batch it goes
 * back to waiting. A heartbeat, or a batch a while after the previous one (an
 * engine publishing now and then), starts no polling: a host of many such
 * ranks would otherwise wake POLL_S / coalesce_s times per batch for nothing.
 *
 * References the thread is done with cannot be released without the GIL: they
 * go on a "done" list that the next GIL holder releases (publish() on the
 * engine thread, close(), the thread itself when it holds the GIL anyway or
 * when the list passes DONE_MAX).
 *
 * Sent payloads are kept in a ring of `buffer_steps` for replay, which a
 * Python thread reads through Payload objects (buffer protocol, no copy). With
 * the mirror on, every encoded batch (sent or dropped on a full queue) is also
 * pushed, in seq order, onto a feed a Python thread takes in large batches;
 * `service_fd` (an eventfd) becomes readable when the armed feed gets an entry
 * or when wake() is called.
 */
#define _GNU_SOURCE /* pthread_timedjoin_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../_native/libzmq.h"
#include "../_native/msgpack.h"

typedef uint64_t u64;
typedef int64_t i64;

#define CHUNK 64          /* batches popped, encoded and sent per pass */
#define DONE_MAX 8192     /* references waiting for a GIL holder before the thread takes it */
#define FEED_MAX (1 << 20) /* mirror feed entries waiting; beyond, a gap the mirror sees */
#define POLL_S 0.05       /* how long the sender polls the queue after a batch (with coalesce_s) */

/* K_SKIP: a seq left empty on purpose (skip()): nothing is sent under it. */
enum { K_COLLECTED = 0, K_OTHER = 1, K_HEARTBEAT = 2, K_ENGINE = 3, K_SKIP = 4 };
enum { T_STORE = 0, T_REMOVE = 1, T_CLEAR = 2 };

/* --- payload buffers ---------------------------------------------------------------- */

/* A payload: a reference-counted buffer, malloc'd (slab NULL) or carved from a slab. */
typedef struct Buf {
    atomic_long refs;
    size_t len;
    struct Slab *slab;
    unsigned char data[];
} Buf;

/* The sender thread's payloads are carved one after the other from 1 MiB slabs (exact sizes,
 * no malloc per batch), and a slab whose payloads are all released is kept for reuse. The
 * replay ring keeps each payload for buffer_steps batches, and memory a process touches for
 * the first time costs a page fault per 4 KiB (about half the sender's time at B=256 when
 * each payload was a fresh malloc, the allocator growing and trimming its heap): a reused
 * slab costs none, and a new one is populated in one madvise call rather than page by page.
 * Payloads are released in about the order they were made (the ring is a FIFO), so slabs
 * empty in turn. A Pool outlives its Sender while slabs remain (one reference per slab). */
#define SLAB_BYTES ((size_t)1 << 20)
#define SLAB_SPARE 16 /* empty slabs kept for reuse (at most 16 MiB a pool) */

typedef struct Pool {
    atomic_long refs;  /* the sender's, and one per slab */
    pthread_mutex_t mu;
    struct Slab *spare; /* (mu) */
    size_t nspare;      /* (mu) */
    int closed;         /* (mu) the sender is gone: free emptied slabs */
    int populate;       /* fault a new slab's pages in at once (not on an engine thread: a
                         * millisecond's stall) */
    struct Slab *cur;   /* the slab being carved (the sender thread's, or its owner's) */
    atomic_long made, mapped; /* slabs mapped so far, and now (for tests) */
} Pool;

typedef struct Slab {
    atomic_long live; /* payloads carved from it, plus one while it is being carved */
    Pool *pool;
    size_t used;      /* bytes carved (with cur) */
    struct Slab *next; /* on the spare list */
    _Alignas(16) unsigned char mem[];
} Slab;

#define SLAB_CAP (SLAB_BYTES - offsetof(Slab, mem))

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL): faults then */
#endif

static void pool_unref(Pool *p) {
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&p->mu);
        free(p);
    }
}

static Pool *pool_new(int populate) {
    Pool *p = calloc(1, sizeof(Pool));
    if (p) {
        p->populate = populate;
        atomic_init(&p->refs, 1);
        atomic_init(&p->made, 0);
        atomic_init(&p->mapped, 0);
        pthread_mutex_init(&p->mu, NULL);
    }
    return p;
}

static void slab_unmap(Slab *s) {
    Pool *p = s->pool;
    atomic_fetch_sub_explicit(&p->mapped, 1, memory_order_relaxed);
    UNPOISON(s, SLAB_BYTES);
    munmap(s, SLAB_BYTES);
    pool_unref(p);
}

/* One reference less on a slab: emptied, it goes to the spare list (or away). */
static void slab_release(Slab *s) {
    if (atomic_fetch_sub_explicit(&s->live, 1, memory_order_acq_rel) != 1) return;
    Pool *p = s->pool;
    pthread_mutex_lock(&p->mu);
    int keep = !p->closed && p->nspare < SLAB_SPARE;
    if (keep) {
        s->next = p->spare;
        p->spare = s;
        p->nspare++;
    }
    pthread_mutex_unlock(&p->mu);
    if (!keep) slab_unmap(s);
}

/* The sender is done with its pool: what is spare goes, the rest when emptied. */
static void pool_close(Pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    Slab *spare = p->spare;
    p->spare = NULL;
    p->nspare = 0;
    pthread_mutex_unlock(&p->mu);
    while (spare) {
        Slab *next = spare->next;
        slab_unmap(spare);
        spare = next;
    }
    if (p->cur) slab_release(p->cur);
    p->cur = NULL;
    pool_unref(p);
}

/* A slab to carve: a spare one (its pages already in memory), or a new one. */
static Slab *slab_get(Pool *p) {
    pthread_mutex_lock(&p->mu);
    Slab *s = p->spare;
    if (s) {
        p->spare = s->next;
        p->nspare--;
    }
    pthread_mutex_unlock(&p->mu);
    if (!s) {
        void *m = mmap(NULL, SLAB_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        if (p->populate) (void)madvise(m, SLAB_BYTES, MADV_POPULATE_WRITE);
        s = m;
        s->pool = p;
        atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->made, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->mapped, 1, memory_order_relaxed);
    }
    POISON(s->mem, SLAB_CAP);
    atomic_init(&s->live, 1);
    s->used = 0;
    s->next = NULL;
    return s;
}

/* A buffer for up to cap bytes: carved from the pool's slab (pool: the caller is its only
 * user), or malloc'd (pool NULL, too large a payload, or no slab to be had). Set its length
 * with buf_end(), before the next buf_new() on the pool. */
static Buf *buf_new(Pool *pool, size_t cap) {
    size_t need = (sizeof(Buf) + cap + 15) & ~(size_t)15;
    if (pool && need <= SLAB_CAP / 4) {
        Slab *s = pool->cur;
        if (!s || s->used + need > SLAB_CAP) {
            if (s) slab_release(s);
            s = pool->cur = slab_get(pool);
        }
        if (s) {
            Buf *b = (Buf *)(s->mem + s->used);
            UNPOISON(b, need);
            atomic_fetch_add_explicit(&s->live, 1, memory_order_relaxed);
            atomic_init(&b->refs, 1);
            b->len = 0;
            b->slab = s;
            return b;
        }
    }
    Buf *b = malloc(sizeof(Buf) + cap);
    if (b) {
        atomic_init(&b->refs, 1);
        b->len = 0;
        b->slab = NULL;
    }
    return b;
}

/* The payload ends at `end`: its length, and (carved) the slab's next buffer starts after it. */
static void buf_end(Buf *b, const unsigned char *end) {
    b->len = (size_t)(end - b->data);
    Slab *s = b->slab;
    if (s) {
        size_t used = (size_t)((unsigned char *)b - s->mem);
        size_t size = (sizeof(Buf) + b->len + 15) & ~(size_t)15;
        s->used = used + size;
        POISON(b->data + b->len, size - sizeof(Buf) - b->len);
        POISON(s->mem + s->used, SLAB_CAP - s->used);
    }
}

static inline void buf_ref(Buf *b) { atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed); }

static inline void buf_unref(Buf *b) {
    if (!b || atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1) return;
    Slab *s = b->slab;
    if (!s) {
        free(b);
        return;
    }
    POISON(b, sizeof(Buf) + b->len);
    slab_release(s);
}

/* Ints copied on the engine thread (a record's vals, an engine batch's ints), until the
 * sender encodes them: carved like payloads from a pool of the GIL holders' (the sender's
 * vpool; they are released at once after encoding, so its slabs cycle without touching
 * new memory), or malloc'd (pool NULL). 8-byte aligned. End with ints_end() before the
 * next ints_alloc() on the pool, or free. */
static void *ints_alloc(Pool *pool, size_t bytes) {
    Buf *b = buf_new(pool, bytes);
    return b ? b->data : NULL;
}

static inline Buf *ints_buf(void *v) { return (Buf *)((unsigned char *)v - offsetof(Buf, data)); }

static void ints_end(void *v, size_t bytes) { buf_end(ints_buf(v), (unsigned char *)v + bytes); }

static void ints_free(void *v) {
    if (v) buf_unref(ints_buf(v));
}

static void buf_free_zmq(void *data, void *hint) { buf_unref((Buf *)hint); }

/* A payload as Python sees it: a read-only buffer over a Buf, holding a reference. */
typedef struct {
    PyObject_HEAD
    Buf *buf;
} Payload;

static PyTypeObject PayloadType;

static PyObject *payload_wrap(Buf *b) { /* takes a new reference to b */
    Payload *p = PyObject_New(Payload, &PayloadType);
    if (!p) return NULL;
    buf_ref(b);
    p->buf = b;
    return (PyObject *)p;
}

static void payload_dealloc(Payload *p) {
    buf_unref(p->buf);
    PyObject_Free(p);
}

static int payload_getbuffer(Payload *p, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)p, p->buf->data, (Py_ssize_t)p->buf->len, 1, flags);
}

static Py_ssize_t payload_len(Payload *p) { return (Py_ssize_t)p->buf->len; }

static PyBufferProcs payload_as_buffer = {(getbufferproc)payload_getbuffer, NULL};
static PySequenceMethods payload_as_seq = {.sq_length = (lenfunc)payload_len};

static PyTypeObject PayloadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Payload",
    .tp_basicsize = sizeof(Payload),
    .tp_dealloc = (destructor)payload_dealloc,
    .tp_as_buffer = &payload_as_buffer,
    .tp_as_sequence = &payload_as_seq,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A sent batch's payload (read-only buffer, shared, never copied).",
};

/* --- queue items ---------------------------------------------------------------------- */

typedef struct {
    u64 bits; /* the value modulo 2**64 */
    int neg;  /* the value is negative */
} IntV;

/* One record of a collector batch, in CollectedBatch.records' layout: a store (every
 * field), a removal (hashes, medium, group) or a clear (none). Each field is a strong
 * reference, or NULL where the tag has none. A copied record (vals set) instead holds
 * the values of its hashes, token ids and parent, read on the engine thread during the
 * hook call (hashes, tokens and parent NULL): the sender then touches none of the
 * engine's lists or ints, and frees vals itself once the batch is encoded. */
typedef struct Rec {
    long tag;
    PyObject *hashes, *parent, *tokens, *lora, *medium, *extra, *group;
    u64 *vals;  /* nh hashes (modulo 2**64: their wire form is set at encoding), then nt token
                 * ids as uint32 (rec_tokens) */
    size_t nh, nt;
    u64 pv;     /* the parent (modulo 2**64), when has_parent */
    int has_parent;
} Rec;

/* A collector batch the sender reads without the GIL: the native collector's flush()
 * hands one over, publish() makes one from a CollectedBatch. Freed with the GIL held. */
typedef struct CBatch {
    struct CBatch *next; /* on the done list */
    double ts;
    i64 rank;
    long block_size;
    int hash_signed;
    size_t n;
    Rec recs[];
} CBatch;

typedef struct Item {
    i64 seq;
    int kind;
    int mirror_only;
    PyObject *obj;  /* the batch (strong); NULL for a heartbeat or a native collector's batch */
    CBatch *batch;  /* a collector batch's records, else NULL */
    struct EBatch *engine; /* an engine batch's fields (obj: the batch), else NULL */
    double ts;      /* a heartbeat's */
    double enq; /* CLOCK_MONOTONIC time publish() queued it (0 for a heartbeat) */
    i64 rank;       /* a heartbeat's */
    Buf *payload; /* set by the sender thread */
} Item;

typedef struct FeedEntry {
    i64 seq;
    Buf *buf; /* NULL: the batch could not be encoded */
} FeedEntry;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* configuration (fixed at construction) */
    unsigned char *topic;
    size_t topic_len;
    int dialect; /* 0 map, 1 array */
    i64 rank;
    double coalesce_s;
    double poll_until; /* CLOCK_MONOTONIC: the sender polls the queue until then (under mu) */
    double heartbeat_s; /* <= 0: none */
    int mirror;
    size_t mirror_backlog;
    size_t buffer_steps;
    PyObject *batch_type;
    PyObject *encode;
    int service_fd;
    /* queue (mu) */
    Item *q;
    size_t qcap, qhead, qlen, q_send, q_mirror_only;
    size_t max_queue;
    i64 next_seq;
    int closed, stopping, waiting, started, joined, flushed;
    int napping; /* the thread naps (polling or coalescing): woken when a chunk is queued */
    double deadline;
    double last_sent;
    int last_was_batch; /* the last send was a batch, not a heartbeat */
    /* done references and batches (mu) */
    PyObject **done;
    size_t done_len, done_cap, done_batches;
    CBatch *done_batch;
    struct EBatch *done_engine;
    /* replay ring (mu) */
    FeedEntry *ring;
    size_t ring_head, ring_len;
    /* mirror feed (mu) */
    FeedEntry *feed;
    size_t feed_len, feed_cap;
    int feed_armed;
    /* counters (mu) */
    i64 published, dropped_queue_full, dropped_closed, dropped_send_error, dropped_encode_error;
    i64 skipped;
    i64 heartbeats, native_encoded, gil_encoded, gil_takes;
    /* the thread */
    void *pub;
    Pool *pool;  /* the thread's payload memory */
    Pool *vpool; /* the ints the engine threads copy (with the GIL) */
    pthread_t thread;
    PyThreadState *tstate;
} Sender;

static double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* time.time(), as Python computes it. */
static double wall_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    i64 ns = (i64)t.tv_sec * 1000000000LL + t.tv_nsec;
    return ns % 1000000000LL == 0 ? (double)(ns / 1000000000LL) : (double)ns / 1e9;
}

#define HEARTBEAT_QUIET 0.5  /* kvwire.wire.heartbeat.HEARTBEAT_QUIET */
#define AFTER_BATCH_STEP 0.5 /* kvwire.wire.heartbeat.AFTER_BATCH_STEP */

/* When the next heartbeat is due (CLOCK_MONOTONIC seconds; INFINITY without heartbeats):
 * kvwire.wire.heartbeat.heartbeat_at, the one rule publisher and subscriber share, ported
 * line for line (change both together). Heartbeats fall on the wall-clock grid of a step,
 * the interval (half of it when the last send was a batch): the first grid instant at or
 * after last_sent + step / 2, where last_sent is the monotonic time of the last batch sent
 * (heartbeats included) and wall is time.time() read at now. */
static double heartbeat_due(double last_sent, double interval, double now, double wall,
                            int after_batch) {
    if (!(interval > 0)) return INFINITY;
    double step = after_batch ? interval * AFTER_BATCH_STEP : interval;
    double earliest = last_sent + HEARTBEAT_QUIET * step;
    double earliest_wall = wall + (earliest - now);
    double grid = ceil(earliest_wall / step) * step;
    double wait = grid - earliest_wall;
    return earliest + (wait < 0 ? 0 : wait > step ? step : wait);
}

/* --- reading Python objects without the GIL -------------------------------------------
 * Only exact types whose fields never change: reading their memory needs no lock. */

/* An exact int within [-2**63, 2**64); 0, or -1 for anything else. */
static int read_int(PyObject *o, IntV *out) {
    out->bits = 0;
    out->neg = 0;
    if (!PyLong_CheckExact(o)) return -1;
    PyLongObject *l = (PyLongObject *)o;
    const digit *d;
    Py_ssize_t n;
    int neg;
#if PY_VERSION_HEX >= 0x030C0000
    uintptr_t tag = l->long_value.lv_tag;
    n = (Py_ssize_t)(tag >> 3);
    neg = (tag & 3) == 2;
    d = l->long_value.ob_digit;
#else
    Py_ssize_t size = Py_SIZE(o);
    n = size < 0 ? -size : size;
    neg = size < 0;
    d = l->ob_digit;
#endif
    if (n <= 1) { /* every token id: one digit, or zero */
        u64 mag = n ? d[0] : 0;
        out->neg = neg;
        out->bits = neg ? (u64)0 - mag : mag;
        return 0;
    }
    if (n > 3) return -1;
    unsigned __int128 m = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) m = (m << PyLong_SHIFT) | d[i];
    if (m >> 64) return -1;
    u64 mag = (u64)m;
    if (neg && mag > (1ULL << 63)) return -1;
    out->neg = neg && mag != 0;
    out->bits = neg ? (u64)0 - mag : mag;
    return 0;
}

/* A hash in the wire's form: unsigned (wrap negatives) or signed (wrap above 2**63 - 1). */
static inline IntV hash_form(IntV v, int hash_signed) {
    v.neg = hash_signed ? (i64)v.bits < 0 : 0;
    return v;
}

/* None or an exact, compact ASCII str: 0 (None: *s NULL), -1 for anything else. */
static int read_str(PyObject *o, const char **s, Py_ssize_t *n) {
    if (o == Py_None) {
        *s = NULL;
        *n = 0;
        return 0;
    }
    if (!PyUnicode_CheckExact(o) || !PyUnicode_IS_COMPACT_ASCII(o)) return -1;
    *s = (const char *)PyUnicode_DATA(o);
    *n = PyUnicode_GET_LENGTH(o);
    return 0;
}

static int same_str(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (a == Py_None || b == Py_None) return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    return n == PyUnicode_GET_LENGTH(b) && memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), n) == 0;
}

/* None or an exact int (group_idx). */
static int read_opt_int(PyObject *o, IntV *v, int *present) {
    *present = o != Py_None;
    return *present ? read_int(o, v) : 0;
}

static int same_opt_int(PyObject *a, PyObject *b) {
    if (a == Py_None || b == Py_None) return a == b;
    IntV x, y;
    read_int(a, &x);
    read_int(b, &y);
    return x.bits == y.bits && x.neg == y.neg;
}

static inline Py_ssize_t seq_len(PyObject *o) { return Py_SIZE(o); }

static inline PyObject **seq_items(PyObject *o) {
    return PyList_CheckExact(o) ? ((PyListObject *)o)->ob_item : ((PyTupleObject *)o)->ob_item;
}

/* The hooks read lists the engine built before waiting on the GPU: by the call their ints are
 * cold (the core idled and its caches lost them), and each lies anywhere in memory. Reading
 * item i while prefetching the int of item i + READ_AHEAD keeps many misses in flight instead
 * of one at a time (it halves a cold call at B=256; 32 and 128 ahead measured worse and the
 * same). A macro: GCC 12 drops __builtin_prefetch inside an inlined function's branch. */
#define READ_AHEAD 64
#define PREFETCH_ITEM(items, i, n)                                                           \
    do {                                                                                     \
        if ((i) < (n)) __builtin_prefetch((items)[i]);                                       \
    } while (0)

/* An exact int's digits, read inline: how many (0 for zero) with *d at them, or less than 0 for a
 * negative one. Call only on an object whose type is exactly int. */
static inline Py_ssize_t pos_digits(PyObject *o, const digit **d) {
    PyLongObject *l = (PyLongObject *)o;
#if PY_VERSION_HEX >= 0x030C0000
    uintptr_t tag = l->long_value.lv_tag & ~(uintptr_t)4; /* (bit 2: 3.14's immortal flag) */
    *d = l->long_value.ob_digit;
    return (tag & 3) == 2 ? -1 : (Py_ssize_t)(tag >> 3);
#else
    *d = l->ob_digit;
    return Py_SIZE(o);
#endif
}

/* A list or tuple of exact ints in range into v as their values modulo 2**64; 0, or -1
 * (one is not such an int). *neg: one is negative; *mixed: negative ints and ints above
 * 2**63 - 1 both (their bits then do not say which is which). */
static int read_bits(PyObject *seq, u64 *v, int *neg, int *mixed) {
    Py_ssize_t n = seq_len(seq);
    PyObject **items = seq_items(seq);
    PyTypeObject *long_type = &PyLong_Type;
    int any_neg = 0, any_big = 0;
    for (Py_ssize_t i = 0; i < READ_AHEAD; i++) PREFETCH_ITEM(items, i, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PREFETCH_ITEM(items, i + READ_AHEAD, n);
        PyObject *o = items[i];
        if (Py_TYPE(o) == long_type) { /* a positive int of up to 64 bits, inline */
            const digit *d;
            Py_ssize_t nd = pos_digits(o, &d);
            if (nd == 3 && d[2] < 16) { /* (most 64-bit hashes) */
                u64 x = d[0] | (u64)d[1] << PyLong_SHIFT | (u64)d[2] << (2 * PyLong_SHIFT);
                any_big |= (i64)x < 0;
                v[i] = x;
                continue;
            }
            if (nd == 2) {
                v[i] = d[0] | (u64)d[1] << PyLong_SHIFT;
                continue;
            }
            if (nd == 1) {
                v[i] = d[0];
                continue;
            }
        }
        IntV x; /* zero, negative, too large, or not an exact int */
        if (read_int(o, &x) < 0) return -1;
        any_neg |= x.neg;
        any_big |= !x.neg && (i64)x.bits < 0;
        v[i] = x.bits;
    }
    *neg = any_neg;
    *mixed = any_neg && any_big;
    return 0;
}

/* A list or tuple of exact token ids in [0, 2**32) into v; 0, or -1 (one is not). */
static int read_tokens(PyObject *seq, uint32_t *v) {
    Py_ssize_t n = seq_len(seq);
    PyObject **items = seq_items(seq);
    PyTypeObject *long_type = &PyLong_Type;
    for (Py_ssize_t i = 0; i < READ_AHEAD; i++) PREFETCH_ITEM(items, i, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PREFETCH_ITEM(items, i + READ_AHEAD, n);
        if (Py_TYPE(items[i]) == long_type) { /* every token id below 2**30, inline */
            const digit *d;
            Py_ssize_t nd = pos_digits(items[i], &d);
            if (nd == 0 || nd == 1) {
                v[i] = nd ? (uint32_t)d[0] : 0;
                continue;
            }
        }
        IntV y;
        if (read_int(items[i], &y) < 0 || y.neg || y.bits > UINT32_MAX) return -1;
        v[i] = (uint32_t)y.bits;
    }
    return 0;
}

static inline const uint32_t *rec_tokens(const Rec *r) { return (const uint32_t *)(r->vals + r->nh); }

static inline int exact_seq(PyObject *o) { return PyList_CheckExact(o) || PyTuple_CheckExact(o); }

/* Copy a record's hashes, token ids and parent into r->vals and drop those references,
 * when they are lists or tuples of exact ints in range (hashes and the parent within
 * [-2**63, 2**64), token ids within [0, 2**32)); otherwise (or out of memory) leave the
 * record holding its references. Hashes need only their value modulo 2**64: both wire
 * forms, and Python's _hash_int, are functions of it. */
static void rec_copy(Rec *r, Pool *pool) {
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

/* Whether every record has the shape the native encoder takes (the ints in its
 * lists are checked while writing them); sets *size to an upper bound of the
 * payload's size. */
static int check_recs(const Rec *recs, size_t n, long bs, size_t *size) {
    size_t total = 64;
    for (size_t i = 0; i < n; i++) {
        const Rec *r = &recs[i];
        const char *s;
        Py_ssize_t slen, slen2;
        IntV v;
        int present;
        if (r->tag == T_STORE) {
            Py_ssize_t nh = r->vals ? (Py_ssize_t)r->nh : check_ints(r->hashes);
            Py_ssize_t nt = r->vals ? (Py_ssize_t)r->nt : check_ints(r->tokens);
            if (nh <= 0 || nt < 0 || nt != nh * bs) return -1;
            if (!r->vals && r->parent != Py_None && read_int(r->parent, &v) < 0) return -1;
            if (read_str(r->lora, &s, &slen) < 0) return -1;
            if (read_str(r->medium, &s, &slen2) < 0) return -1;
            if (r->extra != Py_None) return -1; /* extra_keys */
            if (read_opt_int(r->group, &v, &present) < 0) return -1;
            total += 9 * (size_t)(nh + nt) + (size_t)(slen + slen2) + 160;
        } else if (r->tag == T_REMOVE) {
            Py_ssize_t nh = r->vals ? (Py_ssize_t)r->nh : check_ints(r->hashes);
            if (nh <= 0) return -1;
            if (read_str(r->medium, &s, &slen) < 0) return -1;
            if (read_opt_int(r->group, &v, &present) < 0) return -1;
            total += 9 * (size_t)nh + (size_t)slen + 80;
        } else {
            total += 32;
        }
    }
    *size = total;
    return 0;
}

/* --- native encoding: CollectedBatch.encode's coalescing and bytes --------------------- */

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

/* Copied hashes, in the wire's form. */
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
    return kvw_put_str(p, PyUnicode_DATA(o), (size_t)PyUnicode_GET_LENGTH(o));
}

static unsigned char *put_opt_int(unsigned char *p, PyObject *o) {
    if (o == Py_None) {
        *p++ = 0xc0;
        return p;
    }
    IntV v;
    read_int(o, &v);
    return put_intv(p, v);
}

#define LIT(p, s) (memcpy((p), (s), sizeof(s) - 1), (p) + sizeof(s) - 1)

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
            if (!same_str(nxt->lora, rec->lora) || !same_str(nxt->medium, rec->medium) ||
                !same_opt_int(nxt->group, rec->group))
                break;
            IntV parent = rec_parent(nxt);
            if (parent.bits != last.bits) break; /* both in the same form: equal iff equal bits */
            last = last_hash(nxt, hash_signed);
        }
    } else if (rec->tag == T_REMOVE) {
        for (; j < n; j++) {
            const Rec *nxt = &recs[j];
            if (nxt->tag != T_REMOVE || !same_str(nxt->medium, rec->medium) ||
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

static unsigned char *put_store(unsigned char *p, const Rec *recs, size_t i, size_t end, long bs,
                                int hash_signed, int dialect) {
    const Rec *rec = &recs[i];
    PyObject *group = rec->group;
    if (dialect == 0) {
        *p++ = 0xde;
        *p++ = 0;
        *p++ = (unsigned char)(8 + (group != Py_None));
        p = LIT(p, "\xa4type\xab" "BlockStored\xac" "block_hashes");
    } else {
        p = LIT(p, "\x9c\xab" "BlockStored");
    }
    if (!(p = put_run(p, recs, i, end, 0, hash_signed))) return NULL;
    if (dialect == 0) p = LIT(p, "\xb1parent_block_hash");
    if (!rec_has_parent(rec)) *p++ = 0xc0;
    else p = put_intv(p, hash_form(rec_parent(rec), hash_signed));
    if (dialect == 0) p = LIT(p, "\xa9token_ids");
    if (!(p = put_run(p, recs, i, end, 1, 0))) return NULL;
    if (dialect == 0) p = LIT(p, "\xaa" "block_size");
    p = kvw_put_int(p, (u64)(i64)bs, bs < 0);
    if (dialect == 0) p = LIT(p, "\xa7lora_id\xc0\xa6medium");
    else *p++ = 0xc0;
    p = put_opt_str(p, rec->medium);
    if (dialect == 0) p = LIT(p, "\xa9lora_name");
    p = put_opt_str(p, rec->lora);
    if (dialect == 0) {
        if (group != Py_None) {
            p = LIT(p, "\xa9group_idx");
            p = put_opt_int(p, group);
        }
    } else {
        *p++ = 0xc0; /* extra_keys */
        p = put_opt_int(p, group);
        *p++ = 0xc0; /* kv_cache_spec_kind */
        *p++ = 0xc0; /* kv_cache_spec_sliding_window */
    }
    return p;
}

static unsigned char *put_remove(unsigned char *p, const Rec *recs, size_t i, size_t end,
                                 int hash_signed, int dialect) {
    PyObject *medium = recs[i].medium, *group = recs[i].group;
    if (dialect == 0) {
        *p++ = (unsigned char)(0x83 + (group != Py_None));
        p = LIT(p, "\xa4type\xac" "BlockRemoved\xac" "block_hashes");
    } else {
        p = LIT(p, "\x93\xac" "BlockRemoved");
    }
    if (!(p = put_run(p, recs, i, end, 0, hash_signed))) return NULL;
    if (dialect == 0) p = LIT(p, "\xa6medium");
    p = put_opt_str(p, medium);
    if (dialect == 0 && group != Py_None) {
        p = LIT(p, "\xa9group_idx");
        p = put_opt_int(p, group);
    }
    return p;
}

static unsigned char *put_envelope_head(unsigned char *p, double ts, size_t events) {
    *p++ = 0x93;
    p = kvw_put_float64(p, ts);
    return kvw_put_array_header(p, events);
}

/* A collector batch's payload, or NULL when a record is one only Python encodes
 * (or memory ran out: Python then fails too, visibly). Reads no reference counts. */
static Buf *encode_batch(const CBatch *batch, int dialect, Pool *pool) {
    const Rec *recs = batch->recs;
    size_t n = batch->n, size;
    long bs = batch->block_size;
    int sg = batch->hash_signed;
    if (bs < 1 || check_recs(recs, n, bs, &size) < 0) return NULL;
    size_t events = 0;
    for (size_t i = 0; i < n; i = run_end(recs, i, n, sg)) events++;
    Buf *b = buf_new(pool, size + 16);
    if (!b) return NULL;
    unsigned char *p = put_envelope_head(b->data, batch->ts, events);
    for (size_t i = 0; i < n;) {
        size_t end = run_end(recs, i, n, sg);
        if (recs[i].tag == T_STORE) p = put_store(p, recs, i, end, bs, sg, dialect);
        else if (recs[i].tag == T_REMOVE) p = put_remove(p, recs, i, end, sg, dialect);
        else if (dialect == 0) p = LIT(p, "\x81\xa4type\xb0" "AllBlocksCleared");
        else p = LIT(p, "\x91\xb0" "AllBlocksCleared");
        if (!p) { /* an int only Python encodes (or refuses) */
            buf_unref(b);
            return NULL;
        }
        i = end;
    }
    p = kvw_put_int(p, (u64)batch->rank, batch->rank < 0);
    buf_end(b, p);
    return b;
}

/* --- collector batches as C records and as Python objects (with the GIL) --------------- */

static void rec_release(Rec *r) {
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

static void cbatch_free(CBatch *b) {
    if (!b) return;
    for (size_t i = 0; i < b->n; i++) rec_release(&b->recs[i]);
    free(b);
}

static CBatch *cbatch_alloc(size_t n) {
    CBatch *b = malloc(sizeof(CBatch) + (n ? n : 1) * sizeof(Rec));
    if (b) {
        b->next = NULL;
        b->n = 0;
    }
    return b;
}

static PyObject *TAGS[3], *CLEAR_RECORD; /* 0, 1, 2 and (2,) */

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
static PyObject *cbatch_to_collected(PyObject *batch_type, const CBatch *b, PyObject *rank) {
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

/* The heartbeat, as encode_batch(KVEventBatch(ts, [], rank)) gives it in either dialect. */
static Buf *encode_heartbeat(double ts, i64 rank, Pool *pool) {
    Buf *b = buf_new(pool, 32);
    if (!b) return NULL;
    unsigned char *p = put_envelope_head(b->data, ts, 0);
    p = kvw_put_int(p, (u64)rank, rank < 0);
    buf_end(b, p);
    return b;
}

/* --- engine batches: an engine's own msgspec structs (vLLM's, SGLang's) ----------------
 *
 * The plugins' publish(batch) hands over the engine's KVEventBatch of tagged event structs
 * (BlockStored, BlockRemoved, AllBlocksCleared). An EngineFormat, made once from the
 * engine's classes, says where each field lies in a struct (its slot's offset) and how
 * msgspec writes it (key, omitted when None). publish_engine() reads the slots on the
 * engine thread (a new reference to each value: the structs themselves are mutable) and
 * queues them; the sender thread writes the bytes msgspec writes for the structs, for
 * values of the kinds read_value() takes (None, exact ints, compact ASCII strs, lists of
 * exact ints). Anything else (another class, a subclass, bytes hashes, extra keys...) is
 * left to msgspec under the GIL (the format's `wrap`, then the sender's `encode`), giving
 * the same bytes. */

#define EV_MAX 64 /* fields of one event class */

typedef struct EvLayout {
    PyTypeObject *cls; /* strong */
    PyObject *tag_field, *tag; /* compact ASCII strs (strong) */
    int nfields;
    int wide; /* msgspec sizes the map header for every field: map16 from 16 on */
    Py_ssize_t off[EV_MAX];
    PyObject *key[EV_MAX]; /* compact ASCII strs (strong) */
    unsigned char omit_none[EV_MAX];
} EvLayout;

typedef struct {
    PyObject_HEAD
    PyTypeObject *batch_cls; /* strong; NULL only before tp_new completes */
    PyObject *wrap;          /* wrap(batch): what the publisher's encode takes (strong) */
    Py_ssize_t batch_off[3]; /* ts, events, rank */
    int nev;
    EvLayout ev[4];
} EngineFormat;

static PyTypeObject EngineFormatType;

/* A field value that was a list of exact ints: n copied ints from byte `off` of the
 * batch's ints, as uint32 (`narrow`: all within [0, 2**32), token ids) or as their 64 bits;
 * `neg`: the list has negative ints (then none above 2**63 - 1), written as such (n -1:
 * the value is held by reference). */
typedef struct EList {
    Py_ssize_t n, off;
    int neg, narrow;
} EList;

/* One queued engine batch: each event's layout and its field values (strong; NULL where
 * the value is a copied list). */
typedef struct EEvent {
    const EvLayout *lay;
    PyObject **vals;
    const EList *lists;
} EEvent;

typedef struct EBatch {
    struct EBatch *next; /* on the done list */
    EngineFormat *fmt;   /* strong: the layouts the events point into */
    double ts;
    PyObject *rank;      /* strong */
    size_t n, nvals;
    EEvent *ev;          /* n events, then */
    PyObject **vals;     /* every field value, in event order (one allocation with the batch) */
    EList *lists;        /* per value, the same */
    unsigned char *ints; /* the copied lists' ints (freed by the sender once encoded) */
    int native;          /* every value is one the native encoder writes: Python never needs
                          * the batch object */
} EBatch;

static void ebatch_free(EBatch *b) {
    if (!b) return;
    ints_free(b->ints);
    for (size_t i = 0; i < b->nvals; i++) Py_XDECREF(b->vals[i]);
    Py_XDECREF(b->rank);
    Py_XDECREF((PyObject *)b->fmt);
    free(b);
}

static inline PyObject *slot(PyObject *o, Py_ssize_t off) { return *(PyObject **)((char *)o + off); }

static Py_ssize_t value_size(PyObject *v);

/* The engine batch's fields as read on the engine thread (new references; lists of exact
 * ints copied into C memory, so that no reference to them or their ints is kept), or NULL
 * (no error set) when msgspec is to encode it. */
static EBatch *ebatch_read(EngineFormat *f, PyObject *batch, Pool *pool) {
    if (Py_TYPE(batch) != f->batch_cls) return NULL;
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

/* A field value the native encoder writes as msgspec does: its size bound, or -1. */
static Py_ssize_t value_size(PyObject *v) {
    const char *s;
    Py_ssize_t n;
    IntV iv;
    if (v == Py_None) return 1;
    if (PyLong_CheckExact(v)) return read_int(v, &iv) < 0 ? -1 : 9;
    if (PyUnicode_CheckExact(v)) return read_str(v, &s, &n) < 0 ? -1 : n + 5;
    if (PyList_CheckExact(v)) return 5 + 9 * seq_len(v); /* its ints checked as written */
    return -1;
}

static unsigned char *put_value(unsigned char *p, PyObject *v);

/* An engine batch's value: a copied list (v NULL) or an object. */
static unsigned char *put_field(unsigned char *p, PyObject *v, const EList *l,
                                const unsigned char *ints) {
    if (v) return put_value(p, v);
    p = kvw_put_array_header(p, (size_t)l->n);
    if (l->narrow) return put_token_vals(p, (const uint32_t *)(ints + l->off), (size_t)l->n);
    const u64 *x = (const u64 *)(ints + l->off);
    for (Py_ssize_t i = 0; i < l->n; i++) p = kvw_put_int(p, x[i], l->neg && (i64)x[i] < 0);
    return p;
}

static unsigned char *put_value(unsigned char *p, PyObject *v) {
    if (v == Py_None) {
        *p++ = 0xc0;
        return p;
    }
    if (PyUnicode_CheckExact(v)) return put_opt_str(p, v);
    if (PyList_CheckExact(v)) {
        p = kvw_put_array_header(p, (size_t)seq_len(v));
        return put_ints(p, v, 0, 0);
    }
    IntV iv;
    read_int(v, &iv);
    return put_intv(p, iv);
}

static unsigned char *put_key(unsigned char *p, PyObject *s) {
    return kvw_put_str(p, PyUnicode_DATA(s), (size_t)PyUnicode_GET_LENGTH(s));
}

/* The engine batch's payload, msgspec's bytes, or NULL when a value is one only msgspec
 * encodes. Reads no reference counts. */
static Buf *encode_engine(const EBatch *b, Pool *pool) {
    size_t size = 48;
    for (size_t i = 0; i < b->n; i++) {
        const EvLayout *lay = b->ev[i].lay;
        size += 16 + (size_t)PyUnicode_GET_LENGTH(lay->tag_field) + (size_t)PyUnicode_GET_LENGTH(lay->tag);
        for (int j = 0; j < lay->nfields; j++) {
            PyObject *v = b->ev[i].vals[j];
            Py_ssize_t vs = v ? value_size(v) : 5 + 9 * b->ev[i].lists[j].n;
            if (vs < 0) return NULL;
            size += (size_t)vs + 5 + (size_t)PyUnicode_GET_LENGTH(lay->key[j]);
        }
    }
    Py_ssize_t rank_size = value_size(b->rank);
    if (rank_size < 0) return NULL;
    Buf *buf = buf_new(pool, size + (size_t)rank_size + 16);
    if (!buf) return NULL;
    unsigned char *p = put_envelope_head(buf->data, b->ts, b->n);
    for (size_t i = 0; i < b->n && p; i++) {
        const EvLayout *lay = b->ev[i].lay;
        PyObject **vals = b->ev[i].vals;
        size_t count = 1;
        for (int j = 0; j < lay->nfields; j++) count += !(lay->omit_none[j] && vals[j] == Py_None);
        if (lay->wide) {
            *p++ = 0xde;
            p = kvw_put_be(p, (u64)count, 2);
        } else {
            *p++ = (unsigned char)(0x80 | count);
        }
        p = put_key(p, lay->tag_field);
        p = put_key(p, lay->tag);
        for (int j = 0; j < lay->nfields && p; j++) {
            if (lay->omit_none[j] && vals[j] == Py_None) continue;
            p = put_key(p, lay->key[j]);
            p = put_field(p, vals[j], &b->ev[i].lists[j], b->ints);
        }
    }
    if (!p) { /* an int only msgspec encodes (or refuses) */
        buf_unref(buf);
        return NULL;
    }
    p = put_value(p, b->rank);
    buf_end(buf, p);
    return buf;
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
        for (int j = 0; j < lay->nfields; j++) Py_XDECREF(lay->key[j]);
    }
    Py_TYPE(f)->tp_free((PyObject *)f);
}

/* EngineFormat(batch_type, (ts, events, rank), events, *, wrap): events is a tuple of
 * (cls, tag_field, tag, ((attr, key, omit_none), ...)), as msgspec encodes them; wrap(batch)
 * makes what the sender's Python `encode` takes, for the batches the thread leaves to it
 * (msgspec's encoding, errors reported as for any batch). */
static PyObject *engine_format_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"batch_type", "batch_fields", "events", "wrap", NULL};
    PyObject *batch_type, *bfields, *events, *wrap;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!$O", names, &PyType_Type, &batch_type,
                                     &PyTuple_Type, &bfields, &PyTuple_Type, &events, &wrap))
        return NULL;
    if (!PyCallable_Check(wrap)) {
        PyErr_SetString(PyExc_TypeError, "wrap must be callable");
        return NULL;
    }
    if (PyTuple_GET_SIZE(bfields) != 3 || PyTuple_GET_SIZE(events) > 4) {
        PyErr_SetString(PyExc_ValueError, "batch_fields: (ts, events, rank); at most 4 event classes");
        return NULL;
    }
    EngineFormat *f = (EngineFormat *)type->tp_alloc(type, 0);
    if (!f) return NULL;
    f->batch_cls = (PyTypeObject *)Py_NewRef(batch_type);
    f->wrap = Py_NewRef(wrap);
    for (int i = 0; i < 3; i++) {
        PyObject *name = PyTuple_GET_ITEM(bfields, i);
        if (!PyUnicode_Check(name) || (f->batch_off[i] = field_offset(f->batch_cls, name)) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "field names are strs");
            goto fail;
        }
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(events); k++) {
        PyObject *cls, *tag_field, *tag, *fields;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(events, k), "O!UUO!", &PyType_Type, &cls, &tag_field,
                              &tag, &PyTuple_Type, &fields))
            goto fail;
        EvLayout *lay = &f->ev[f->nev++];
        lay->cls = (PyTypeObject *)Py_NewRef(cls);
        lay->tag_field = Py_NewRef(tag_field);
        lay->tag = Py_NewRef(tag);
        if (!ascii_str(tag_field) || !ascii_str(tag) || PyTuple_GET_SIZE(fields) > EV_MAX) {
            PyErr_SetString(PyExc_ValueError, "tags are ASCII strs; at most 64 fields");
            goto fail;
        }
        lay->wide = PyTuple_GET_SIZE(fields) + 1 >= 16;
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
            lay->nfields++;
        }
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
    if (!b) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize((const char *)b->data, (Py_ssize_t)b->len);
    buf_unref(b);
    return out;
}

static PyMethodDef engine_format_methods[] = {
    {"encode", (PyCFunction)engine_format_encode, METH_O,
     "The native encoding of an engine batch, or None when msgspec encodes it."},
    {NULL},
};

static PyTypeObject EngineFormatType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.EngineFormat",
    .tp_basicsize = sizeof(EngineFormat),
    .tp_dealloc = (destructor)engine_format_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Where an engine's event structs keep their fields, and how msgspec writes them.",
    .tp_traverse = (traverseproc)engine_format_traverse,
    .tp_new = engine_format_new,
    .tp_methods = engine_format_methods,
};

/* --- the queue, done list, ring and feed (all under mu) ------------------------------- */

static int queue_push(Sender *s, const Item *it) {
    if (s->qlen == s->qcap) {
        size_t cap = s->qcap ? s->qcap * 2 : 256;
        Item *q = malloc(cap * sizeof(Item));
        if (!q) return -1;
        for (size_t i = 0; i < s->qlen; i++) q[i] = s->q[(s->qhead + i) % s->qcap];
        free(s->q);
        s->q = q;
        s->qcap = cap;
        s->qhead = 0;
    }
    s->q[(s->qhead + s->qlen) % s->qcap] = *it;
    s->qlen++;
    if (it->mirror_only) s->q_mirror_only++;
    else s->q_send++;
    return 0;
}

static Item queue_pop(Sender *s) {
    Item it = s->q[s->qhead];
    s->qhead = (s->qhead + 1) % s->qcap;
    s->qlen--;
    if (it.mirror_only) s->q_mirror_only--;
    else s->q_send--;
    return it;
}

static int done_push(Sender *s, PyObject *o) {
    if (!o) return 0;
    if (s->done_len == s->done_cap) {
        size_t cap = s->done_cap ? s->done_cap * 2 : 64;
        PyObject **d = realloc(s->done, cap * sizeof(PyObject *));
        if (!d) return -1; /* the reference leaks rather than being released without the GIL */
        s->done = d;
        s->done_cap = cap;
    }
    s->done[s->done_len++] = o;
    return 0;
}

static void done_push_batch(Sender *s, CBatch *b) {
    if (!b) return;
    b->next = s->done_batch;
    s->done_batch = b;
    s->done_batches++;
}

static void done_push_engine(Sender *s, EBatch *b) {
    if (!b) return;
    b->next = s->done_engine;
    s->done_engine = b;
    s->done_batches++;
}

/* What the thread is done with, taken from the sender to be released holding the GIL. */
typedef struct Done {
    PyObject **objs;
    size_t n;
    CBatch *batches;
    EBatch *engines;
} Done;

/* Take the done list (under mu); release it with release_done() holding the GIL, not mu. */
static Done take_done(Sender *s) {
    Done d = {s->done, s->done_len, s->done_batch, s->done_engine};
    s->done = NULL;
    s->done_len = s->done_cap = s->done_batches = 0;
    s->done_batch = NULL;
    s->done_engine = NULL;
    return d;
}

static void release_done(Done d) {
    for (size_t i = 0; i < d.n; i++) Py_DECREF(d.objs[i]);
    free(d.objs);
    while (d.batches) {
        CBatch *next = d.batches->next;
        cbatch_free(d.batches);
        d.batches = next;
    }
    while (d.engines) {
        EBatch *next = d.engines->next;
        ebatch_free(d.engines);
        d.engines = next;
    }
}

static void ring_push(Sender *s, i64 seq, Buf *b) {
    buf_ref(b);
    if (s->ring_len == s->buffer_steps) {
        buf_unref(s->ring[s->ring_head].buf);
        s->ring[s->ring_head] = (FeedEntry){seq, b};
        s->ring_head = (s->ring_head + 1) % s->buffer_steps;
    } else {
        s->ring[(s->ring_head + s->ring_len) % s->buffer_steps] = (FeedEntry){seq, b};
        s->ring_len++;
    }
}

static void wake_service(Sender *s) {
    u64 one = 1;
    ssize_t r = write(s->service_fd, &one, sizeof one);
    (void)r; /* EAGAIN: already readable */
}

static void feed_push(Sender *s, i64 seq, Buf *b) {
    if (s->feed_len >= FEED_MAX) return; /* the mirror sees the gap and stops vouching for itself */
    if (s->feed_len == s->feed_cap) {
        size_t cap = s->feed_cap ? s->feed_cap * 2 : 256;
        FeedEntry *f = realloc(s->feed, cap * sizeof(FeedEntry));
        if (!f) return; /* a gap, as above */
        s->feed = f;
        s->feed_cap = cap;
    }
    if (b) buf_ref(b);
    s->feed[s->feed_len++] = (FeedEntry){seq, b};
    if (s->feed_armed) {
        s->feed_armed = 0;
        wake_service(s);
    }
}

/* --- the sender thread ---------------------------------------------------------------- */

static void release_item(Item *it) {
    Py_XDECREF(it->obj);
    cbatch_free(it->batch);
    ebatch_free(it->engine);
    buf_unref(it->payload);
}


static void take_gil(Sender *s, PyThreadState *ts, int *have) {
    if (*have) return;
    PyEval_RestoreThread(ts);
    *have = 1;
    pthread_mutex_lock(&s->mu);
    s->gil_takes++;
    pthread_mutex_unlock(&s->mu);
}

/* Encode one item into it->payload (NULL: could not be encoded). */
static void encode_item(Sender *s, Item *it, PyThreadState *ts, int *have_gil, i64 *native,
                        i64 *gil) {
    if (it->kind == K_HEARTBEAT) {
        it->payload = encode_heartbeat(it->ts, it->rank, s->pool);
        return;
    }
    if (it->kind == K_SKIP) return;
    if (it->kind == K_COLLECTED || it->kind == K_ENGINE) {
        it->payload = it->engine ? encode_engine(it->engine, s->pool)
                                 : encode_batch(it->batch, s->dialect, s->pool);
        if (it->payload) {
            (*native)++;
            return;
        }
    }
    take_gil(s, ts, have_gil);
    (*gil)++;
    /* A native collector's batch has no Python object yet: Python encodes a CollectedBatch;
     * an engine's batch goes to Python wrapped as its format says (msgspec's encoding). */
    PyObject *obj = it->engine   ? (it->obj ? PyObject_CallOneArg(it->engine->fmt->wrap, it->obj)
                                            : NULL) /* native: out of memory */
                    : it->obj    ? Py_NewRef(it->obj)
                    : s->batch_type ? cbatch_to_collected(s->batch_type, it->batch, NULL)
                                    : NULL;
    PyObject *r = !obj ? NULL : s->encode ? PyObject_CallOneArg(s->encode, obj) : Py_NewRef(Py_None);
    Py_XDECREF(obj);
    if (r && PyBytes_Check(r)) {
        Py_ssize_t n = PyBytes_GET_SIZE(r);
        it->payload = buf_new(s->pool, (size_t)n);
        if (it->payload) {
            memcpy(it->payload->data, PyBytes_AS_STRING(r), (size_t)n);
            buf_end(it->payload, it->payload->data + n);
        }
    } else if (!r) {
        PyErr_WriteUnraisable(s->encode); /* the callable reports its own errors: a bug */
    }
    Py_XDECREF(r);
}

/* Send [topic, seq, payload]; 0, or -1 when libzmq refused it. */
static int send_item(Sender *s, const Item *it) {
    unsigned char seq[8];
    kvw_put_be(seq, (u64)it->seq, 8);
    if (kvw_zmq.send(s->pub, s->topic, s->topic_len, KVW_ZMQ_SNDMORE | KVW_ZMQ_DONTWAIT) < 0)
        return -1;
    if (kvw_zmq.send(s->pub, seq, 8, KVW_ZMQ_SNDMORE | KVW_ZMQ_DONTWAIT) < 0) return -1;
    kvw_zmq_msg msg;
    buf_ref(it->payload);
    if (kvw_zmq.msg_init_data(&msg, it->payload->data, it->payload->len, buf_free_zmq, it->payload) <
        0) {
        buf_unref(it->payload);
        return -1;
    }
    if (kvw_zmq.msg_send(&msg, s->pub, KVW_ZMQ_DONTWAIT) < 0) {
        kvw_zmq.msg_close(&msg); /* drops the reference */
        return -1;
    }
    return 0;
}

static void process(Sender *s, Item *items, int n, PyThreadState *ts) {
    int have_gil = 0;
    i64 native = 0, gil = 0, sent = 0, failed = 0, bad = 0, skipped = 0, beats = 0;
    int last_kind = -1; /* the kind of the last item put on the wire or left as a gap */
    int bad_or_skip = 0;
    for (int i = 0; i < n; i++) {
        encode_item(s, &items[i], ts, &have_gil, &native, &gil);
        /* Copied values are freed here, by the thread that read them last. */
        CBatch *b = items[i].batch;
        for (size_t k = 0; b && k < b->n; k++) {
            ints_free(b->recs[k].vals);
            b->recs[k].vals = NULL;
        }
        if (items[i].engine) {
            ints_free(items[i].engine->ints);
            items[i].engine->ints = NULL;
        }
    }
    if (have_gil) {
        /* Release what is done while holding it anyway. */
        pthread_mutex_lock(&s->mu);
        Done d = take_done(s);
        pthread_mutex_unlock(&s->mu);
        release_done(d);
        PyEval_SaveThread();
        have_gil = 0;
    }
    /* Into the replay ring and the mirror's feed, with the encode errors counted, before
     * anything goes on the wire: whoever has received a batch can replay it, gets a
     * snapshot as of it at least, and sees the drops before it in stats(). */
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n; i++) {
        Item *it = &items[i];
        if (it->payload && !it->mirror_only) ring_push(s, it->seq, it->payload);
        if (s->mirror) feed_push(s, it->seq, it->payload);
        skipped += it->kind == K_SKIP;
        bad += !it->mirror_only && !it->payload && it->kind != K_SKIP;
    }
    s->dropped_encode_error += bad;
    s->skipped += skipped;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) {
        Item *it = &items[i];
        if (it->mirror_only) continue;
        /* A gap counts as a batch for the heartbeat after it, which must come on the
         * after-batch grid to reveal it (docs/wire.md section 5). */
        last_kind = it->kind;
        if (!it->payload) {
            bad_or_skip = 1;
            continue;
        }
        if (send_item(s, it) < 0) failed++;
        else sent++;
        if (it->kind == K_HEARTBEAT) beats++;
    }
    double now = mono_now();
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n; i++) {
        Item *it = &items[i];
        buf_unref(it->payload);
        it->payload = NULL;
        done_push(s, it->obj);
        done_push_batch(s, it->batch);
        done_push_engine(s, it->engine);
        it->obj = NULL;
        it->batch = NULL;
        it->engine = NULL;
    }
    s->published += sent;
    s->dropped_send_error += failed;
    s->heartbeats += beats;
    s->native_encoded += native;
    s->gil_encoded += gil;
    if (sent + failed + bad_or_skip) {
        s->last_sent = now;
        s->last_was_batch = last_kind != K_HEARTBEAT;
    }
    pthread_mutex_unlock(&s->mu);
}

static int timed_wait(Sender *s, double until) {
    if (!isfinite(until)) return pthread_cond_wait(&s->cv, &s->mu);
    struct timespec t;
    t.tv_sec = (time_t)until;
    t.tv_nsec = (long)((until - (double)t.tv_sec) * 1e9);
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return pthread_cond_timedwait(&s->cv, &s->mu, &t);
}

/* Nap until `until` (CLOCK_MONOTONIC s), or until publish() has queued a chunk: a burst
 * is sent a chunk at a time as it comes, not after the nap, so that the batches queued (their
 * copied ints) stay few; publish() makes a wake-up syscall only then (once per CHUNK batches
 * of a burst), never while an engine publishes at a steady pace. With mu held. */
static void nap(Sender *s, double until) {
    s->napping = 1;
    timed_wait(s, until);
    s->napping = 0;
}

static void *run(void *arg) {
    Sender *s = arg;
    PyGILState_STATE g = PyGILState_Ensure(); /* this thread's state, kept until the end */
    PyThreadState *ts = PyEval_SaveThread();
    Item items[CHUNK];
    double last_batch = -INFINITY; /* CLOCK_MONOTONIC time the last batch was taken */
    pthread_mutex_lock(&s->mu);
    s->gil_takes++;
    for (;;) {
        if (s->qlen == 0) {
            if (s->stopping) break;
            double now = mono_now();
            double due =
                s->closed ? INFINITY : heartbeat_due(s->last_sent, s->heartbeat_s, now, wall_now(),
                                                      s->last_was_batch);
            if (due <= now) {
                Item hb = {.seq = s->next_seq, .kind = K_HEARTBEAT, .ts = wall_now(), .rank = s->rank};
                s->last_sent = now;
                s->last_was_batch = 0;
                if (s->q_send < s->max_queue && queue_push(s, &hb) == 0) s->next_seq++;
                continue;
            }
            if (now < s->poll_until && s->coalesce_s > 0 && !s->closed) {
                /* Recently busy: look again in coalesce_s rather than be woken, so that a
                 * steadily publishing engine thread never makes a wake-up syscall. */
                nap(s, now + s->coalesce_s);
                continue;
            }
            s->waiting = 1;
            timed_wait(s, due);
            s->waiting = 0;
            continue;
        }
        /* Coalescing: the oldest queued batch waits coalesce_s from its publish(), so that
         * batches published meanwhile share its wake-up (none waits longer; a backlog
         * does not wait at all). */
        double now = mono_now();
        double until = s->stopping || s->q_send >= CHUNK ? 0 : s->q[s->qhead].enq + s->coalesce_s;
        if (until > now) { /* a heartbeat (enq 0) never waits */
            nap(s, until);
            continue;
        }
        int n = 0;
        int batches = 0;
        while (n < CHUNK && s->qlen) {
            items[n] = queue_pop(s);
            batches += items[n++].kind != K_HEARTBEAT;
        }
        pthread_mutex_unlock(&s->mu);
        process(s, items, n, ts);
        pthread_mutex_lock(&s->mu);
        if (batches) {
            double now = mono_now();
            if (now - last_batch < POLL_S) s->poll_until = now + POLL_S;
            last_batch = now;
        }
        if (s->done_len + s->done_batches >= DONE_MAX) {
            Done d = take_done(s);
            s->gil_takes++;
            pthread_mutex_unlock(&s->mu);
            PyEval_RestoreThread(ts);
            release_done(d);
            PyEval_SaveThread();
            pthread_mutex_lock(&s->mu);
        }
        if (s->stopping && mono_now() >= s->deadline) break;
    }
    /* What is left after the deadline is dropped and counted, then released here. */
    s->flushed = s->q_send == 0;
    s->dropped_closed += (i64)s->q_send;
    Item *q = s->q;
    size_t qlen = s->qlen, qhead = s->qhead, qcap = s->qcap;
    s->q = NULL;
    s->qlen = s->qcap = s->qhead = s->q_send = s->q_mirror_only = 0;
    Done done = take_done(s);
    pthread_mutex_unlock(&s->mu);
    PyEval_RestoreThread(ts);
    for (size_t i = 0; i < qlen; i++) release_item(&q[(qhead + i) % qcap]);
    free(q);
    release_done(done);
    PyGILState_Release(g);
    return NULL;
}

/* --- the Python type ------------------------------------------------------------------- */

static PyObject *S_ts, *S_records, *S_rank, *S_block_size, *S_signed;

static PyObject *sender_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"topic", "dialect", "rank", "max_queue", "buffer_steps", "coalesce_s",
                            "heartbeat_s", "mirror", "mirror_backlog", "batch_type", "encode",
                            NULL};
    Py_buffer topic;
    const char *dialect;
    long long rank;
    Py_ssize_t max_queue, buffer_steps, mirror_backlog;
    double coalesce_s, heartbeat_s;
    int mirror;
    PyObject *batch_type, *encode;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*$sLnnddpnOO", names, &topic, &dialect, &rank,
                                     &max_queue, &buffer_steps, &coalesce_s, &heartbeat_s, &mirror,
                                     &mirror_backlog, &batch_type, &encode))
        return NULL;
    int d = strcmp(dialect, "map") == 0 ? 0 : strcmp(dialect, "array") == 0 ? 1 : -1;
    const char *bad = d < 0 ? "dialect must be 'map' or 'array'"
                      : max_queue < 1 || buffer_steps < 1 || mirror_backlog < 1
                          ? "max_queue, buffer_steps and mirror_backlog must be >= 1"
                      : !PyType_Check(batch_type) ? "batch_type must be a type"
                      : !PyCallable_Check(encode) ? "encode must be callable"
                                                  : NULL;
    if (bad) {
        PyBuffer_Release(&topic);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Sender *s = (Sender *)type->tp_alloc(type, 0);
    if (!s) {
        PyBuffer_Release(&topic);
        return NULL;
    }
    s->service_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    s->topic = malloc(topic.len ? (size_t)topic.len : 1);
    s->ring = calloc((size_t)buffer_steps, sizeof(FeedEntry));
    s->pool = pool_new(1);
    s->vpool = pool_new(0);
    s->service_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!s->topic || !s->ring || !s->pool || !s->vpool || s->service_fd < 0) {
        if (s->service_fd < 0) PyErr_SetFromErrno(PyExc_OSError);
        else PyErr_NoMemory();
        PyBuffer_Release(&topic);
        Py_DECREF(s);
        return NULL;
    }
    memcpy(s->topic, topic.buf, (size_t)topic.len);
    s->topic_len = (size_t)topic.len;
    PyBuffer_Release(&topic);
    s->dialect = d;
    s->rank = rank;
    s->max_queue = (size_t)max_queue;
    s->buffer_steps = (size_t)buffer_steps;
    s->coalesce_s = coalesce_s > 0 ? coalesce_s : 0;
    s->heartbeat_s = heartbeat_s;
    s->mirror = mirror;
    s->mirror_backlog = (size_t)mirror_backlog;
    s->batch_type = Py_NewRef(batch_type);
    s->encode = Py_NewRef(encode);
    s->flushed = 1;
    return (PyObject *)s;
}

static int sender_traverse(Sender *s, visitproc visit, void *arg) {
    Py_VISIT(s->batch_type);
    Py_VISIT(s->encode);
    return 0;
}

static int sender_clear(Sender *s) {
    /* Only reachable once the thread is joined (it holds a reference until then). */
    Py_CLEAR(s->batch_type);
    Py_CLEAR(s->encode);
    return 0;
}

static void sender_dealloc(Sender *s) {
    /* A started thread holds a reference until close() joined it: never running here. */
    PyObject_GC_UnTrack(s);
    for (size_t i = 0; i < s->qlen; i++) release_item(&s->q[(s->qhead + i) % s->qcap]);
    free(s->q);
    release_done(take_done(s));
    if (s->ring)
        for (size_t i = 0; i < s->ring_len; i++)
            buf_unref(s->ring[(s->ring_head + i) % s->buffer_steps].buf);
    free(s->ring);
    for (size_t i = 0; i < s->feed_len; i++) buf_unref(s->feed[i].buf);
    free(s->feed);
    free(s->topic);
    pool_close(s->pool); /* (payloads still held elsewhere keep their slabs) */
    pool_close(s->vpool);
    if (s->service_fd >= 0) close(s->service_fd);
    Py_XDECREF(s->batch_type);
    Py_XDECREF(s->encode);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* A CollectedBatch's fields and records as a C batch, read on the engine thread; NULL
 * (no error set) when Python is to encode it. */
static CBatch *read_collected(PyObject *batch) {
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

/* Reserve the next seq for *it and queue it; never blocks. 1: queued; 0: dropped (a
 * gap; *it is released here), though with the mirror on it may be queued for the mirror
 * only. Also releases what the thread is done with (the caller holds the GIL). */
static int sender_enqueue(Sender *s, Item *it) {
    int queued = 0;
    it->enq = mono_now();
    pthread_mutex_lock(&s->mu);
    Done done = take_done(s);
    it->seq = s->next_seq++;
    if (s->closed) {
        s->dropped_closed++;
    } else if (s->q_send >= s->max_queue) {
        s->dropped_queue_full++;
        if (s->mirror && s->q_mirror_only < s->mirror_backlog) {
            it->mirror_only = 1; /* never sent, but the mirror learns it */
            queued = queue_push(s, it) == 0 ? -1 : 0;
        }
    } else if (queue_push(s, it) == 0) {
        queued = 1;
        if (s->waiting || (s->napping && s->q_send >= CHUNK)) {
            s->waiting = s->napping = 0;
            pthread_cond_signal(&s->cv);
        }
    } else {
        s->dropped_queue_full++; /* out of memory: a gap like any drop */
    }
    pthread_mutex_unlock(&s->mu);
    if (!queued) release_item(it);
    release_done(done);
    return queued == 1;
}

static PyObject *sender_publish(Sender *s, PyObject *batch) {
    Item it = {.kind = K_OTHER, .obj = Py_NewRef(batch)};
    if (s->batch_type && Py_TYPE(batch) == (PyTypeObject *)s->batch_type &&
        (it.batch = read_collected(batch)))
        it.kind = K_COLLECTED;
    return PyBool_FromLong(sender_enqueue(s, &it));
}

/* skip() -> bool: reserve the next seq and send nothing under it (a visible gap). */
static PyObject *sender_skip(Sender *s, PyObject *unused) {
    Item it = {.kind = K_SKIP};
    return PyBool_FromLong(sender_enqueue(s, &it));
}

/* publish_engine(batch, format) -> bool | None: publish() for an engine's batch struct,
 * its fields read here and encoded by the thread; None (nothing queued, no seq taken)
 * when the batch is not one `format` describes, for the caller to publish otherwise. */
static PyObject *sender_publish_engine(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !Py_IS_TYPE(args[1], &EngineFormatType)) {
        PyErr_SetString(PyExc_TypeError, "publish_engine(batch, format: EngineFormat)");
        return NULL;
    }
    EBatch *eb = ebatch_read((EngineFormat *)args[1], args[0], s->vpool);
    if (!eb) Py_RETURN_NONE;
    Item it = {.kind = K_ENGINE, .obj = eb->native ? NULL : Py_NewRef(args[0]), .engine = eb};
    return PyBool_FromLong(sender_enqueue(s, &it));
}

static PyObject *sender_start(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "start(socket_address, libzmq_path)");
        return NULL;
    }
    void *pub = PyLong_AsVoidPtr(args[0]);
    if (!pub && PyErr_Occurred()) return NULL;
    const char *path = PyUnicode_AsUTF8(args[1]);
    if (!path) return NULL;
    char err[512];
    if (kvw_zmq_load(path, err, sizeof err) < 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    int bad = s->started || s->closed;
    s->started = 1;
    s->pub = pub;
    s->last_sent = mono_now();
    pthread_mutex_unlock(&s->mu);
    if (bad) {
        PyErr_SetString(PyExc_RuntimeError, "sender already started or closed");
        return NULL;
    }
    Py_INCREF(s); /* the thread's, dropped by close() after joining it */
    int rc = pthread_create(&s->thread, NULL, run, s);
    if (rc != 0) {
        pthread_mutex_lock(&s->mu);
        s->started = 0;
        pthread_mutex_unlock(&s->mu);
        Py_DECREF(s);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* Join the thread without the GIL, until `until` (CLOCK_REALTIME s; INFINITY: for good). */
static int join_thread(Sender *s, double until) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (isfinite(until)) {
        struct timespec t = {(time_t)until, (long)((until - (double)(time_t)until) * 1e9)};
        rc = pthread_timedjoin_np(s->thread, NULL, &t);
    } else {
        rc = pthread_join(s->thread, NULL);
    }
    Py_END_ALLOW_THREADS
    if (rc == 0) {
        s->joined = 1;
        Py_DECREF(s); /* the thread's reference */
    }
    return rc == 0;
}

/* close(timeout) -> (flushed, joined): stop accepting batches and send what is queued
 * within `timeout` s; wait for the thread up to a second longer. When it did not end
 * (a Python encoder stuck), it drops what is left at its next step and join() waits. */
static PyObject *sender_close(Sender *s, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    pthread_mutex_lock(&s->mu);
    int running = s->started && !s->joined && !s->stopping;
    s->closed = 1;
    s->stopping = 1;
    s->deadline = mono_now() + timeout;
    if (s->waiting || s->napping) {
        s->waiting = s->napping = 0;
        pthread_cond_signal(&s->cv);
    }
    Item *q = NULL;
    size_t qlen = 0, qhead = 0, qcap = 0;
    if (!s->started) { /* never started: what was queued is discarded */
        s->flushed = s->q_send == 0;
        q = s->q;
        qlen = s->qlen, qhead = s->qhead, qcap = s->qcap;
        s->q = NULL;
        s->qlen = s->qcap = s->qhead = s->q_send = s->q_mirror_only = 0;
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < qlen; i++) release_item(&q[(qhead + i) % qcap]);
    free(q);
    int joined = !s->started || s->joined;
    if (running) joined = join_thread(s, wall_now() + timeout + 1.0);
    pthread_mutex_lock(&s->mu);
    int flushed = s->flushed && joined;
    Done done = take_done(s);
    pthread_mutex_unlock(&s->mu);
    release_done(done);
    return Py_BuildValue("(OO)", flushed ? Py_True : Py_False, joined ? Py_True : Py_False);
}

/* join(): wait for the thread to end (after close()), without the GIL. */
static PyObject *sender_join(Sender *s, PyObject *unused) {
    if (s->started && !s->joined && s->stopping) join_thread(s, INFINITY);
    Py_RETURN_NONE;
}

static PyObject *sender_stats(Sender *s, PyObject *unused) {
    pthread_mutex_lock(&s->mu);
    long long v[13] = {s->next_seq - 1, (i64)s->q_send, s->published, s->dropped_queue_full,
                       s->dropped_closed, s->dropped_send_error, s->dropped_encode_error,
                       s->heartbeats, s->native_encoded, s->gil_encoded, s->gil_takes,
                       (i64)s->feed_len, s->skipped};
    pthread_mutex_unlock(&s->mu);
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsLsLsLsL}", "last_seq", v[0], "queue_depth", v[1], "published", v[2],
        "dropped_queue_full", v[3], "dropped_closed", v[4], "dropped_send_error", v[5],
        "dropped_encode_error", v[6], "heartbeats", v[7], "native_encoded", v[8], "gil_encoded",
        v[9], "sender_gil_takes", v[10], "mirror_feed", v[11], "skipped", v[12]);
}

static PyObject *sender_set_max_queue(Sender *s, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "max_queue must be >= 1");
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    s->max_queue = (size_t)n;
    pthread_mutex_unlock(&s->mu);
    Py_RETURN_NONE;
}

static PyObject *sender_set_coalesce(Sender *s, PyObject *arg) {
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    if (!(v >= 0 && v <= 60)) {
        PyErr_SetString(PyExc_ValueError, "coalesce_s must be in [0, 60]");
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    s->coalesce_s = v;
    pthread_mutex_unlock(&s->mu);
    Py_RETURN_NONE;
}

/* replay_range(start_seq, n) -> [(seq, Payload)]: up to n buffered batches from the
 * first whose seq is >= start_seq. */
static PyObject *sender_replay_range(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "replay_range(start_seq, n)");
        return NULL;
    }
    long long start = PyLong_AsLongLong(args[0]);
    Py_ssize_t want = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (want < 0) want = 0;
    FeedEntry got[64];
    if (want > 64) want = 64;
    Py_ssize_t n = 0;
    pthread_mutex_lock(&s->mu);
    size_t lo = 0, hi = s->ring_len; /* seqs ascend along the ring */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (s->ring[(s->ring_head + mid) % s->buffer_steps].seq < start) lo = mid + 1;
        else hi = mid;
    }
    for (size_t i = lo; i < s->ring_len && n < want; i++, n++) {
        got[n] = s->ring[(s->ring_head + i) % s->buffer_steps];
        buf_ref(got[n].buf);
    }
    pthread_mutex_unlock(&s->mu);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = out ? payload_wrap(got[i].buf) : NULL;
        PyObject *t = p ? Py_BuildValue("(LN)", (long long)got[i].seq, p) : NULL;
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
        buf_unref(got[i].buf);
    }
    return out;
}

/* take_feed() -> [(seq, Payload | None)]: the mirror feed so far, in seq order. */
static PyObject *sender_take_feed(Sender *s, PyObject *unused) {
    pthread_mutex_lock(&s->mu);
    FeedEntry *f = s->feed;
    size_t n = s->feed_len;
    s->feed = NULL;
    s->feed_len = s->feed_cap = 0;
    pthread_mutex_unlock(&s->mu);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; i < n; i++) {
        PyObject *t = NULL;
        if (out) {
            PyObject *p = f[i].buf ? payload_wrap(f[i].buf) : Py_NewRef(Py_None);
            t = p ? Py_BuildValue("(LN)", (long long)f[i].seq, p) : NULL;
        }
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, t);
        buf_unref(f[i].buf);
    }
    free(f);
    return out;
}

/* arm_feed(): make service_fd readable at the feed's next entry (now, if it has one). */
static PyObject *sender_arm_feed(Sender *s, PyObject *unused) {
    pthread_mutex_lock(&s->mu);
    if (s->feed_len) wake_service(s);
    else s->feed_armed = 1;
    pthread_mutex_unlock(&s->mu);
    Py_RETURN_NONE;
}

static PyObject *sender_wake(Sender *s, PyObject *unused) {
    wake_service(s);
    Py_RETURN_NONE;
}

static PyObject *sender_clear_wake(Sender *s, PyObject *unused) {
    u64 v;
    ssize_t r = read(s->service_fd, &v, sizeof v);
    (void)r;
    Py_RETURN_NONE;
}

/* Seqs waiting in the queue, and in the replay ring (for tests). */
static PyObject *sender_seqs(Sender *s, PyObject *which) {
    int ring = PyObject_IsTrue(which);
    if (ring < 0) return NULL;
    pthread_mutex_lock(&s->mu);
    size_t n = ring ? s->ring_len : s->qlen;
    i64 *seqs = malloc((n ? n : 1) * sizeof(i64));
    for (size_t i = 0; seqs && i < n; i++)
        seqs[i] = ring ? s->ring[(s->ring_head + i) % s->buffer_steps].seq
                       : s->q[(s->qhead + i) % s->qcap].seq;
    pthread_mutex_unlock(&s->mu);
    if (!seqs) return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(seqs[i]);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    free(seqs);
    return out;
}

static PyObject *sender_encode(Sender *s, PyObject *batch) {
    /* encode_native(batch) -> bytes | None: what the thread would send for a collector
     * batch, or None when it leaves the batch to Python (for tests). */
    if (!s->batch_type || Py_TYPE(batch) != (PyTypeObject *)s->batch_type) Py_RETURN_NONE;
    CBatch *cb = read_collected(batch);
    Buf *b = cb ? encode_batch(cb, s->dialect, NULL) : NULL;
    cbatch_free(cb);
    if (!b) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize((const char *)b->data, (Py_ssize_t)b->len);
    buf_unref(b);
    return out;
}

/* slabs() -> ((made, mapped), (made, mapped)): the payload and copied-int pools' slabs mapped
 * so far and now (for tests). */
static PyObject *sender_slabs(Sender *s, PyObject *unused) {
    return Py_BuildValue("((ll)(ll))", atomic_load(&s->pool->made), atomic_load(&s->pool->mapped),
                         atomic_load(&s->vpool->made), atomic_load(&s->vpool->mapped));
}

static PyObject *sender_get_fd(Sender *s, void *unused) { return PyLong_FromLong(s->service_fd); }

static PyGetSetDef sender_getset[] = {
    {"service_fd", (getter)sender_get_fd, NULL,
     "An eventfd readable when the armed mirror feed gets an entry, or after wake().", NULL},
    {NULL},
};

static PyMethodDef sender_methods[] = {
    {"publish", (PyCFunction)sender_publish, METH_O, "Reserve a seq and queue a batch; never blocks."},
    {"skip", (PyCFunction)sender_skip, METH_NOARGS,
     "Reserve a seq and send nothing under it (a visible gap); never blocks."},
    {"publish_engine", (PyCFunction)(void (*)(void))sender_publish_engine, METH_FASTCALL,
     "publish_engine(batch, format) -> bool | None: queue an engine's batch struct."},
    {"start", (PyCFunction)(void (*)(void))sender_start, METH_FASTCALL,
     "start(socket_address, libzmq_path): start the thread, sole user of the PUB socket."},
    {"close", (PyCFunction)sender_close, METH_O,
     "close(timeout) -> (flushed, joined): flush within timeout s and join the thread."},
    {"join", (PyCFunction)sender_join, METH_NOARGS, "Wait for the thread to end (after close)."},
    {"stats", (PyCFunction)sender_stats, METH_NOARGS, "The counters by name."},
    {"set_max_queue", (PyCFunction)sender_set_max_queue, METH_O, "Change the queue's bound."},
    {"set_coalesce", (PyCFunction)sender_set_coalesce, METH_O, "Change coalesce_s."},
    {"replay_range", (PyCFunction)(void (*)(void))sender_replay_range, METH_FASTCALL,
     "replay_range(start_seq, n) -> [(seq, payload)] from the replay ring."},
    {"take_feed", (PyCFunction)sender_take_feed, METH_NOARGS, "The mirror feed so far."},
    {"arm_feed", (PyCFunction)sender_arm_feed, METH_NOARGS,
     "Make service_fd readable at the feed's next entry."},
    {"wake", (PyCFunction)sender_wake, METH_NOARGS, "Make service_fd readable."},
    {"clear_wake", (PyCFunction)sender_clear_wake, METH_NOARGS, "Reset service_fd."},
    {"seqs", (PyCFunction)sender_seqs, METH_O, "seqs(ring): queued (False) or buffered (True) seqs."},
    {"slabs", (PyCFunction)sender_slabs, METH_NOARGS,
     "((made, mapped), (made, mapped)): the payload and copied-int pools' slabs (for tests)."},
    {"encode_native", (PyCFunction)sender_encode, METH_O,
     "The native encoding of a collector batch, or None when Python encodes it."},
    {NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The publisher's queue and native sender thread.",
    .tp_traverse = (traverseproc)sender_traverse,
    .tp_clear = (inquiry)sender_clear,
    .tp_new = sender_new,
    .tp_methods = sender_methods,
    .tp_getset = sender_getset,
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

static PyTypeObject EnginePublishType = {
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

/* --- the collector's hooks -------------------------------------------------------------
 *
 * EventCollector's engine-thread hooks, creating no Python object per call for lists and
 * tuples: stored()/removed()/cleared() append C records holding the values of lists and
 * tuples of exact ints (read during the call: rec_copy), else strong references to what the
 * engine passed (the contract: those lists not changed after the call), and flush() hands
 * them to the publisher's Sender as a C batch, queued like publish() queues one. Other
 * inputs go through the Python `capture` callable (arrays copied, CUDA copies queued);
 * with any other publisher, flush() builds a CollectedBatch and calls its publish(). */

static PyObject *S_publish, *S_GPU, *S_block_hashes, *S_token_ids;

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

static PyTypeObject CollectorType;

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
    for (size_t i = 0; i < c->n; i++) {
        Rec *r = &c->recs[i];
        Py_VISIT(r->hashes);
        Py_VISIT(r->parent);
        Py_VISIT(r->tokens);
        Py_VISIT(r->lora);
        Py_VISIT(r->medium);
        Py_VISIT(r->extra);
        Py_VISIT(r->group);
    }
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
    Rec r = {T_STORE,          hs, Py_NewRef(a[1]), toks, Py_NewRef(a[3] ? a[3] : Py_None),
             Py_NewRef(a[4] ? a[4] : S_GPU), keys, Py_NewRef(a[6] ? a[6] : Py_None)};
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

static PyTypeObject CollectorType = {
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

/* heartbeat_due(last_sent, interval, now, wall, after_batch): the sender's rule, for tests to hold it
 * equal to kvwire.wire.heartbeat.heartbeat_at. */
static PyObject *module_heartbeat_due(PyObject *module, PyObject *args) {
    double last_sent, interval, now, wall;
    int after_batch;
    if (!PyArg_ParseTuple(args, "ddddp", &last_sent, &interval, &now, &wall, &after_batch))
        return NULL;
    return PyFloat_FromDouble(heartbeat_due(last_sent, interval, now, wall, after_batch));
}

static PyMethodDef module_methods[] = {
    {"heartbeat_due", module_heartbeat_due, METH_VARARGS,
     "heartbeat_due(last_sent, interval, now, wall, after_batch) -> when the next heartbeat is due"},
    {NULL},
};

static struct PyModuleDef sendermodule = {
    PyModuleDef_HEAD_INIT, "_sender", "The publisher's native sender thread.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__sender(void) {
    if (PyType_Ready(&SenderType) < 0 || PyType_Ready(&PayloadType) < 0 ||
        PyType_Ready(&CollectorType) < 0 || PyType_Ready(&EngineFormatType) < 0 ||
        PyType_Ready(&EnginePublishType) < 0)
        return NULL;
    for (int i = 0; i < 3; i++)
        if (!(TAGS[i] = PyLong_FromLong(i))) return NULL;
    if (!(CLEAR_RECORD = PyTuple_Pack(1, TAGS[T_CLEAR])) ||
        !(S_publish = PyUnicode_InternFromString("publish")) ||
        !(S_GPU = PyUnicode_InternFromString("GPU")) ||
        !(S_block_hashes = PyUnicode_InternFromString("block_hashes")) ||
        !(S_token_ids = PyUnicode_InternFromString("token_ids")))
        return NULL;
    if (!(S_ts = PyUnicode_InternFromString("ts")) ||
        !(S_records = PyUnicode_InternFromString("records")) ||
        !(S_rank = PyUnicode_InternFromString("rank")) ||
        !(S_block_size = PyUnicode_InternFromString("block_size")) ||
        !(S_signed = PyUnicode_InternFromString("signed")))
        return NULL;
    PyObject *m = PyModule_Create(&sendermodule);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType) < 0 ||
        PyModule_AddObjectRef(m, "Payload", (PyObject *)&PayloadType) < 0 ||
        PyModule_AddObjectRef(m, "Collector", (PyObject *)&CollectorType) < 0 ||
        PyModule_AddObjectRef(m, "EngineFormat", (PyObject *)&EngineFormatType) < 0 ||
        PyModule_AddObjectRef(m, "EnginePublish", (PyObject *)&EnginePublishType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
