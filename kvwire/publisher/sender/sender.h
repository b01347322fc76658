/* kvwire.publisher._sender, the publisher's native side: its internal header.
 *
 * One extension built from the files of this folder, each one concern:
 *
 *   buffers.c    payloads: reference-counted buffers carved from reused slabs; Payload
 *   writer.c     the msgpack writer: a collector batch, an engine batch, a heartbeat
 *   records.c    a collector batch's records (Rec) in C, and as Python objects
 *   collector.c  EventCollector's engine-thread hooks (Collector)
 *   engine.c     an engine's own structs: EngineFormat (where their fields lie) and
 *                EnginePublish (an engine plugin's publish() in C)
 *   sender.c     the queue, the replay ring, the mirror feed and the thread (Sender);
 *                the module
 *   serve.c      replies on the replay ROUTER sent in C (Replies): a replay range straight
 *                from the ring, shared snapshot chunks, their bytes in flight (Account)
 *
 * pyread.h reads Python ints, strs and lists without the GIL (exact types only).
 */
#ifndef KVWIRE_SENDER_H
#define KVWIRE_SENDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef int64_t i64;

/* What a queued item holds. K_SKIP: a seq left empty on purpose (skip()); K_BYTES: an
 * encoded payload (exact bytes), sent as it is. */
enum { K_COLLECTED = 0, K_OTHER = 1, K_HEARTBEAT = 2, K_ENGINE = 3, K_SKIP = 4, K_BYTES = 5 };
/* A collector record's kind. */
enum { T_STORE = 0, T_REMOVE = 1, T_CLEAR = 2 };

/* --- payload buffers (buffers.c) ------------------------------------------------------ */

/* A payload: a reference-counted buffer, malloc'd (slab NULL) or carved from a slab. */
typedef struct Buf {
    atomic_long refs;
    size_t len;
    struct Slab *slab;
    unsigned char data[];
} Buf;

/* Slabs to carve buffers from, kept for reuse (see buffers.c). */
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

Pool *pool_new(int populate);
void pool_close(Pool *p);
Buf *buf_new(Pool *pool, size_t cap);
void buf_end(Buf *b, const unsigned char *end);
void buf_unref(Buf *b);
static inline void buf_ref(Buf *b) { atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed); }
void buf_free_zmq(void *data, void *hint);
void *ints_alloc(Pool *pool, size_t bytes);
void ints_end(void *v, size_t bytes);
void ints_free(void *v);

extern PyTypeObject PayloadType;
PyObject *payload_wrap(Buf *b);
Buf *payload_buf(PyObject *payload); /* a Payload's buffer (borrowed) */
PyObject *buf_bytes(Buf *b);

/* --- a collector batch's records (records.c) ------------------------------------------- */

typedef struct {
    u64 bits; /* the value modulo 2**64 */
    int neg;  /* the value is negative */
} IntV;

/* One record of a collector batch: a store (every field), a removal (hashes, medium,
 * group) or a clear (none). Each field is a strong reference, or NULL where the kind has
 * none. A copied record (vals set) instead holds the values of its hashes, token ids and
 * parent, read on the engine thread during the hook call (hashes, tokens and parent NULL):
 * the sender then touches none of the engine's lists or ints, and frees vals itself once
 * the batch is encoded. */
#define REC_OBJECTS 7
typedef struct Rec {
    long tag;
    union {
        struct {
            PyObject *hashes, *parent, *tokens, *lora, *medium, *extra, *group;
        };
        PyObject *obj[REC_OBJECTS]; /* the same fields, for what is done to each of them */
    };
    u64 *vals;  /* nh hashes (modulo 2**64: their wire form is set at encoding), then nt token
                 * ids as uint32 (rec_tokens) */
    size_t nh, nt;
    u64 pv;     /* the parent (modulo 2**64), when has_parent */
    int has_parent;
} Rec;

/* A collector batch the sender reads without the GIL: the native collector's flush()
 * hands one over, publish() makes one from a CollectedBatch. Freed with the GIL held.
 * normalized: prepared with the GIL (encode_collected) for the writer, which then also
 * takes what only that step makes: text fields as UTF-8 bytes, extra_keys packed. */
typedef struct CBatch {
    struct CBatch *next; /* on the done list */
    double ts;
    i64 rank;
    long block_size;
    int hash_signed;
    int normalized;
    size_t n;
    Rec recs[];
} CBatch;

static inline const uint32_t *rec_tokens(const Rec *r) { return (const uint32_t *)(r->vals + r->nh); }

void rec_copy(Rec *r, Pool *pool);
void rec_release(Rec *r);
CBatch *cbatch_alloc(size_t n);
void cbatch_free(CBatch *b);
CBatch *read_collected(PyObject *batch);
PyObject *cbatch_to_collected(PyObject *batch_type, const CBatch *b, PyObject *rank);
extern PyTypeObject RecordType;
PyObject *encode_collected(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int records_init(void);

/* --- engine batches (engine.c) --------------------------------------------------------- */

#define EV_MAX 64 /* fields of one event class */

/* Where a collector record's value for an event field comes from (a format for records);
 * R_SLOT: the struct's own slot (an engine's batch). */
enum { R_SLOT, R_NONE, R_HASHES, R_PARENT, R_TOKENS, R_BLOCK_SIZE, R_LORA, R_MEDIUM, R_EXTRA,
       R_GROUP };

/* How msgspec writes one tagged event struct, and where its fields lie: as a map
 * {tag_field: tag, key: value...}, or (tag_field NULL) positionally, [tag, value...]. */
typedef struct EvLayout {
    PyTypeObject *cls; /* strong */
    PyObject *tag_field, *tag; /* compact ASCII strs (strong) */
    int nfields;
    int wide; /* msgspec sizes the map header for every field: map16 from 16 on */
    Py_ssize_t off[EV_MAX];
    PyObject *key[EV_MAX]; /* compact ASCII strs (strong) */
    unsigned char omit_none[EV_MAX];
    unsigned char role[EV_MAX]; /* R_* */
    size_t fixed; /* bytes of the event besides its values' (headers, tag, keys), at most */
    /* The event as the writer writes it, made once: the tag (after its key, in a map), then
     * steps, each constant bytes (keys, and fields always None with their nil) and then a
     * field's value (field -1: none), then the tail's constant bytes; a step `omittable`
     * is left out whole when its value is None. All the bytes lie in enc (malloc'd). */
    unsigned char *enc;
    size_t head_len, tail_at, tail_len;
    size_t base_count; /* a map's entries always written, the tag's included */
    int nsteps;
    struct EvStep {
        size_t at, len;
        short field;
        unsigned char omittable;
    } step[2 * EV_MAX];
} EvLayout;

/* An engine's batch format, or kvwire's own (records: its three layouts, for T_STORE,
 * T_REMOVE and T_CLEAR, say how a collector batch's records are written). */
typedef struct {
    PyObject_HEAD
    PyTypeObject *batch_cls; /* strong; NULL only before tp_new completes */
    PyObject *wrap;          /* wrap(batch): what the publisher's encode takes (strong), or None */
    Py_ssize_t batch_off[3]; /* ts, events, rank */
    int records;
    int nev;
    EvLayout ev[4];
} EngineFormat;

/* A field value that was a list of exact ints: n copied ints from byte `off` of the
 * batch's ints, as uint32 (`narrow`: all within [0, 2**32), token ids) or as their 64 bits;
 * `neg`: the list has negative ints (then none above 2**63 - 1), written as such (n -1:
 * the value is held by reference). */
typedef struct EList {
    Py_ssize_t n, off;
    int neg, narrow;
} EList;

/* One queued engine batch's event: its layout and its field values (strong; NULL where
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

extern PyTypeObject EngineFormatType, EnginePublishType;
EBatch *ebatch_read(EngineFormat *f, PyObject *batch, Pool *pool);
void ebatch_free(EBatch *b);

/* --- the msgpack writer (writer.c) ----------------------------------------------------- */

/* A field value the engine writer takes as msgspec writes it: its size bound, or -1. */
Py_ssize_t value_size(PyObject *v);
/* The payloads, or NULL when a value is one only Python encodes (or memory ran out).
 * None reads a reference count: safe without the GIL. */
Buf *encode_batch(const CBatch *batch, const EngineFormat *fmt, Pool *pool);
Buf *encode_engine(const EBatch *b, Pool *pool);
Buf *encode_heartbeat(double ts, i64 rank, Pool *pool);

/* --- the sender (sender.c) ------------------------------------------------------------- */

typedef struct Item {
    i64 seq;
    int kind;
    int mirror_only;
    PyObject *obj;  /* the batch (strong); NULL for a heartbeat or a native collector's batch */
    CBatch *batch;  /* a collector batch's records, else NULL */
    EBatch *engine; /* an engine batch's fields (obj: the batch), else NULL */
    double ts;      /* a heartbeat's */
    double enq;     /* CLOCK_MONOTONIC time publish() queued it (0 for a heartbeat) */
    i64 rank;       /* a heartbeat's */
    Buf *payload;   /* set by the sender thread */
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
    EngineFormat *wire; /* the dialect's format for collector batches (strong) */
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
    double heartbeat_phase; /* of the after-batch grid's step, in [0, 1) */
    /* done references and batches (mu) */
    PyObject **done;
    size_t done_len, done_cap, done_batches;
    CBatch *done_batch;
    EBatch *done_engine;
    /* replay ring (mu) */
    FeedEntry *ring;
    size_t ring_head, ring_len;
    /* mirror feed (mu) */
    FeedEntry *feed;
    size_t feed_len, feed_cap;
    size_t feed_batches; /* entries that are not heartbeats (stats: mirror_feed) */
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

extern PyTypeObject SenderType, CollectorType;
/* Reserve the next seq for *it and queue it; never blocks. 1: queued; 0: dropped (a gap;
 * *it is released). The caller holds the GIL. */
int sender_enqueue(Sender *s, Item *it);
#define RING_TAKE_MAX 64 /* batches one look at the replay ring returns, at most */
size_t ring_take(Sender *s, i64 start, size_t want, FeedEntry *out);
double wall_now(void);
int collector_init(void);

/* --- replies on the replay ROUTER (serve.c) --------------------------------------------- */

extern PyTypeObject RepliesType, AccountType;
PyObject *module_payload_of(PyObject *module, PyObject *data);
PyObject *module_holders(PyObject *module, PyObject *payload);

#endif /* KVWIRE_SENDER_H */
