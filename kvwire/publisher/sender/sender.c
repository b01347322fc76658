/* The publisher's sender (the queue, the replay ring, the mirror feed, the thread): a native thread that never takes the GIL in steady state.
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
 * Collector (collector.c, EventCollector's hooks) queues its records as they are,
 * without a Python object, and publish() turns a CollectedBatch (`batch_type`)
 * into one. A batch whose records hold only what the writer takes without the
 * GIL (exact ints in lists or tuples, None, compact ASCII strs) is encoded here
 * (writer.c, in the dialect's format: `wire`): the collector's contract is that
 * the lists it was handed are not changed after the call, the queued batch holds
 * a reference to every one of them, and ints, tuples and strs are immutable; an
 * engine's batch likewise (engine.c). Anything else goes to the Python callable
 * `encode` with the GIL taken (a CollectedBatch is made then for the Collector's
 * batches: its encode() prepares the values for the same writer); `stats()`
 * counts both, and every time the thread took the GIL.
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
 * pushed, in seq order, onto a feed a Python thread takes in large batches (the
 * heartbeats too, which keep the seqs whole but leave nothing to mirror);
 * `service_fd` (an eventfd) becomes readable when the armed feed gets a batch,
 * once the chunk holding it is sent (so that the mirror does not compete with
 * the send), or when wake() is called.
 */
#define _GNU_SOURCE /* pthread_timedjoin_np */
#include "sender.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <structmember.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "../../_native/libzmq.h"
#include "../../_native/msgpack.h"
#include "../../_native/pyext.h"

#define CHUNK 64          /* batches popped, encoded and sent per pass */
#define DONE_MAX 8192     /* references waiting for a GIL holder before the thread takes it */
#define FEED_MAX (1 << 20) /* mirror feed entries waiting; beyond, a gap the mirror sees */
#define POLL_S 0.05       /* how long the sender polls the queue after a batch (with coalesce_s) */

static double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* time.time(), as Python computes it. */
double wall_now(void) {
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
 * the interval (half of it when the last send was a batch, shifted by `phase` of a step,
 * the publisher's own): the first grid instant at or after last_sent + step / 2, where
 * last_sent is the monotonic time of the last batch sent (heartbeats included) and wall is
 * time.time() read at now. */
static double heartbeat_due(double last_sent, double interval, double now, double wall,
                            int after_batch, double phase) {
    if (!(interval > 0)) return INFINITY;
    double step = after_batch ? interval * AFTER_BATCH_STEP : interval;
    double shift = after_batch ? phase * step : 0.0;
    double earliest = last_sent + HEARTBEAT_QUIET * step;
    double earliest_wall = wall + (earliest - now) - shift;
    double grid = ceil(earliest_wall / step) * step;
    double wait = grid - earliest_wall;
    return earliest + (wait < 0 ? 0 : wait > step ? step : wait);
}

/* --- the queue, done list, ring and feed (all under mu) ------------------------------- */

/* Item i of the queue, entry i of the replay ring (from the oldest). */
static inline Item *queue_at(Sender *s, size_t i) { return &s->q[(s->qhead + i) % s->qcap]; }
static inline FeedEntry *ring_at(Sender *s, size_t i) {
    return &s->ring[(s->ring_head + i) % s->buffer_steps];
}

static int queue_push(Sender *s, const Item *it) {
    if (s->qlen == s->qcap) {
        size_t cap = s->qcap ? s->qcap * 2 : 256;
        Item *q = malloc(cap * sizeof(Item));
        if (!q) return -1;
        for (size_t i = 0; i < s->qlen; i++) q[i] = *queue_at(s, i);
        free(s->q);
        s->q = q;
        s->qcap = cap;
        s->qhead = 0;
    }
    s->qlen++;
    *queue_at(s, s->qlen - 1) = *it;
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

/* The queue, taken from the sender (under mu) to be released holding the GIL, not mu. */
typedef struct Queue {
    Item *q;
    size_t len, head, cap;
} Queue;

static Queue take_queue(Sender *s) {
    Queue q = {s->q, s->qlen, s->qhead, s->qcap};
    s->q = NULL;
    s->qlen = s->qcap = s->qhead = s->q_send = s->q_mirror_only = 0;
    return q;
}

static void release_item(Item *it) {
    Py_XDECREF(it->obj);
    cbatch_free(it->batch);
    ebatch_free(it->engine);
    buf_unref(it->payload);
}

static void release_queue(Queue q) {
    for (size_t i = 0; i < q.len; i++) release_item(&q.q[(q.head + i) % q.cap]);
    free(q.q);
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
        s->ring_len++;
        *ring_at(s, s->ring_len - 1) = (FeedEntry){seq, b};
    }
}

static void wake_service(Sender *s) {
    u64 one = 1;
    ssize_t r = write(s->service_fd, &one, sizeof one);
    (void)r; /* EAGAIN: already readable */
}

/* Onto the mirror's feed, which only a batch (not a heartbeat: nothing to mirror) makes
 * pending; the caller wakes the armed mirror (feed_wake) once the batch is on the wire. */
static void feed_push(Sender *s, i64 seq, Buf *b, int batch) {
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
    s->feed_batches += batch;
}

/* Wake the mirror's thread if it asked to be (arm_feed) and a batch is pending. */
static void feed_wake(Sender *s) {
    if (s->feed_armed && s->feed_batches) {
        s->feed_armed = 0;
        wake_service(s);
    }
}

/* --- the sender thread ---------------------------------------------------------------- */

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
    if (it->kind == K_BYTES) {
        /* Immutable, and the item holds a reference: read without the GIL. */
        size_t n = (size_t)PyBytes_GET_SIZE(it->obj);
        it->payload = buf_new(s->pool, n);
        if (it->payload) {
            memcpy(it->payload->data, PyBytes_AS_STRING(it->obj), n);
            buf_end(it->payload, it->payload->data + n);
            (*native)++;
        }
        return;
    }
    if (it->kind == K_COLLECTED || it->kind == K_ENGINE) {
        it->payload = it->engine ? encode_engine(it->engine, s->pool)
                                 : encode_batch(it->batch, s->wire, s->pool);
        if (it->payload) {
            (*native)++;
            return;
        }
    }
    take_gil(s, ts, have_gil);
    (*gil)++;
    /* A native collector's batch has no Python object yet: Python encodes a CollectedBatch;
     * an engine's batch goes to Python wrapped as its format says (msgspec's encoding). */
    PyObject *wrap = it->engine ? it->engine->fmt->wrap : NULL;
    PyObject *obj = it->engine   ? (!it->obj           ? NULL /* native: out of memory */
                                    : wrap == Py_None ? Py_NewRef(it->obj)
                                                      : PyObject_CallOneArg(wrap, it->obj))
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
        if (s->mirror) feed_push(s, it->seq, it->payload, it->kind != K_HEARTBEAT);
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
    feed_wake(s); /* the mirror starts once the chunk is sent, not competing with it */
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
                                                      s->last_was_batch, s->heartbeat_phase);
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
    Queue q = take_queue(s);
    Done done = take_done(s);
    pthread_mutex_unlock(&s->mu);
    PyEval_RestoreThread(ts);
    release_queue(q);
    release_done(done);
    PyGILState_Release(g);
    return NULL;
}

/* --- the Python type ------------------------------------------------------------------- */

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
    int d = strcmp(dialect, "map") == 0 || strcmp(dialect, "array") == 0 ? 0 : -1;
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
    /* The dialect's format for collector batches: the batch type knows it. */
    PyObject *wire = PyObject_CallMethod(batch_type, "wire_format", "s", dialect);
    if (wire && (!Py_IS_TYPE(wire, &EngineFormatType) || !((EngineFormat *)wire)->records)) {
        PyErr_SetString(PyExc_TypeError, "batch_type.wire_format() must give a format for records");
        Py_CLEAR(wire);
    }
    Sender *s = wire ? (Sender *)type->tp_alloc(type, 0) : NULL;
    if (!s) {
        Py_XDECREF(wire);
        PyBuffer_Release(&topic);
        return NULL;
    }
    s->wire = (EngineFormat *)wire;
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
    Py_VISIT((PyObject *)s->wire);
    Py_VISIT(s->encode);
    return 0;
}

static int sender_clear(Sender *s) {
    /* Only reachable once the thread is joined (it holds a reference until then). */
    Py_CLEAR(s->batch_type);
    Py_CLEAR(s->encode);
    Py_CLEAR(s->wire);
    return 0;
}

static void sender_dealloc(Sender *s) {
    /* A started thread holds a reference until close() joined it: never running here. */
    PyObject_GC_UnTrack(s);
    release_queue(take_queue(s));
    release_done(take_done(s));
    for (size_t i = 0; s->ring && i < s->ring_len; i++) buf_unref(ring_at(s, i)->buf);
    free(s->ring);
    for (size_t i = 0; i < s->feed_len; i++) buf_unref(s->feed[i].buf);
    free(s->feed);
    free(s->topic);
    pool_close(s->pool); /* (payloads still held elsewhere keep their slabs) */
    pool_close(s->vpool);
    if (s->service_fd >= 0) close(s->service_fd);
    Py_XDECREF(s->batch_type);
    Py_XDECREF(s->encode);
    Py_XDECREF(s->wire);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Reserve the next seq for *it and queue it; never blocks. 1: queued; 0: dropped (a
 * gap; *it is released here), though with the mirror on it may be queued for the mirror
 * only. Also releases what the thread is done with (the caller holds the GIL). */
int sender_enqueue(Sender *s, Item *it) {
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
    if (PyBytes_CheckExact(batch))
        it.kind = K_BYTES;
    else if (s->batch_type && Py_TYPE(batch) == (PyTypeObject *)s->batch_type &&
             (it.batch = read_collected(batch)))
        it.kind = K_COLLECTED;
    return PyBool_FromLong(sender_enqueue(s, &it));
}

/* skip() -> bool: reserve the next seq and send nothing under it (a visible gap). */
static PyObject *sender_skip(Sender *s, PyObject *unused) {
    Item it = {.kind = K_SKIP};
    return PyBool_FromLong(sender_enqueue(s, &it));
}

static PyObject *sender_start(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "start") < 0) return NULL;
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
    Queue q = {NULL, 0, 0, 0};
    if (!s->started) { /* never started: what was queued is discarded */
        s->flushed = s->q_send == 0;
        q = take_queue(s);
    }
    pthread_mutex_unlock(&s->mu);
    release_queue(q);
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
                       (i64)s->feed_batches, s->skipped};
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

/* *field = arg under mu, once arg is in [0, max] ([0, max) when open); else ValueError `bad`. */
static PyObject *set_setting(Sender *s, double *field, PyObject *arg, double max, int open,
                             const char *bad) {
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    if (!(v >= 0 && (open ? v < max : v <= max))) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    *field = v;
    pthread_mutex_unlock(&s->mu);
    Py_RETURN_NONE;
}

static PyObject *sender_set_coalesce(Sender *s, PyObject *arg) {
    return set_setting(s, &s->coalesce_s, arg, 60, 0, "coalesce_s must be in [0, 60]");
}

/* set_heartbeat_phase(phase): where the after-batch heartbeat grid falls in its step, in [0, 1)
 * (kvwire.wire.heartbeat.heartbeat_phase; 0 until set). */
static PyObject *sender_set_heartbeat_phase(Sender *s, PyObject *arg) {
    return set_setting(s, &s->heartbeat_phase, arg, 1, 1, "the heartbeat phase must be in [0, 1)");
}

/* [(seq, Payload | None)] for n entries, each entry's reference to its buffer released. */
static PyObject *entries_list(FeedEntry *e, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; i < n; i++) {
        PyObject *t = NULL;
        if (out) {
            PyObject *p = e[i].buf ? payload_wrap(e[i].buf) : Py_NewRef(Py_None);
            t = p ? Py_BuildValue("(LN)", (long long)e[i].seq, p) : NULL;
        }
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, t);
        buf_unref(e[i].buf);
    }
    return out;
}

/* Up to `want` buffered batches from the first whose seq is >= start, each with a reference
 * taken (the caller releases them): the one search of the ring, for replay_range() and the
 * native replies (serve.c). Takes mu. */
size_t ring_take(Sender *s, i64 start, size_t want, FeedEntry *out) {
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    size_t lo = 0, hi = s->ring_len; /* seqs ascend along the ring */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (ring_at(s, mid)->seq < start) lo = mid + 1;
        else hi = mid;
    }
    for (size_t i = lo; i < s->ring_len && n < want; i++, n++) {
        out[n] = *ring_at(s, i);
        buf_ref(out[n].buf);
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* replay_range(start_seq, n) -> [(seq, Payload)]: up to n buffered batches from the
 * first whose seq is >= start_seq. */
static PyObject *sender_replay_range(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 2, "replay_range") < 0) return NULL;
    long long start = PyLong_AsLongLong(args[0]);
    Py_ssize_t want = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (want < 0) want = 0;
    FeedEntry got[RING_TAKE_MAX];
    if (want > RING_TAKE_MAX) want = RING_TAKE_MAX;
    size_t n = ring_take(s, (i64)start, (size_t)want, got);
    return entries_list(got, n);
}

/* take_feed() -> [(seq, Payload | None)]: the mirror feed so far, in seq order. */
static PyObject *sender_take_feed(Sender *s, PyObject *unused) {
    pthread_mutex_lock(&s->mu);
    FeedEntry *f = s->feed;
    size_t n = s->feed_len;
    s->feed = NULL;
    s->feed_len = s->feed_cap = s->feed_batches = 0;
    pthread_mutex_unlock(&s->mu);
    PyObject *out = entries_list(f, n);
    free(f);
    return out;
}

/* arm_feed(): make service_fd readable once the feed has a batch sent (now, if it has one). */
static PyObject *sender_arm_feed(Sender *s, PyObject *unused) {
    pthread_mutex_lock(&s->mu);
    if (s->feed_batches) wake_service(s);
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
        seqs[i] = ring ? ring_at(s, i)->seq : queue_at(s, i)->seq;
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
    Buf *b = cb && s->wire ? encode_batch(cb, s->wire, NULL) : NULL;
    cbatch_free(cb);
    return buf_bytes(b);
}

/* slabs() -> ((made, mapped), (made, mapped)): the payload and copied-int pools' slabs mapped
 * so far and now (for tests). */
static PyObject *sender_slabs(Sender *s, PyObject *unused) {
    return Py_BuildValue("((ll)(ll))", atomic_load(&s->pool->made), atomic_load(&s->pool->mapped),
                         atomic_load(&s->vpool->made), atomic_load(&s->vpool->mapped));
}

static PyMemberDef sender_members[] = {
    {"service_fd", T_INT, offsetof(Sender, service_fd), READONLY,
     "An eventfd readable when the armed mirror feed gets a batch, or after wake()."},
    {NULL},
};

static PyMethodDef sender_methods[] = {
    {"publish", (PyCFunction)sender_publish, METH_O, "Reserve a seq and queue a batch; never blocks."},
    {"skip", (PyCFunction)sender_skip, METH_NOARGS,
     "Reserve a seq and send nothing under it (a visible gap); never blocks."},
    {"start", (PyCFunction)(void (*)(void))sender_start, METH_FASTCALL,
     "start(socket_address, libzmq_path): start the thread, sole user of the PUB socket."},
    {"close", (PyCFunction)sender_close, METH_O,
     "close(timeout) -> (flushed, joined): flush within timeout s and join the thread."},
    {"join", (PyCFunction)sender_join, METH_NOARGS, "Wait for the thread to end (after close)."},
    {"stats", (PyCFunction)sender_stats, METH_NOARGS, "The counters by name."},
    {"set_max_queue", (PyCFunction)sender_set_max_queue, METH_O, "Change the queue's bound."},
    {"set_coalesce", (PyCFunction)sender_set_coalesce, METH_O, "Change coalesce_s."},
    {"set_heartbeat_phase", (PyCFunction)sender_set_heartbeat_phase, METH_O,
     "Set where the after-batch heartbeat grid falls in its step, in [0, 1)."},
    {"replay_range", (PyCFunction)(void (*)(void))sender_replay_range, METH_FASTCALL,
     "replay_range(start_seq, n) -> [(seq, payload)] from the replay ring."},
    {"take_feed", (PyCFunction)sender_take_feed, METH_NOARGS, "The mirror feed so far."},
    {"arm_feed", (PyCFunction)sender_arm_feed, METH_NOARGS,
     "Make service_fd readable once the feed has a batch."},
    {"wake", (PyCFunction)sender_wake, METH_NOARGS, "Make service_fd readable."},
    {"clear_wake", (PyCFunction)sender_clear_wake, METH_NOARGS, "Reset service_fd."},
    {"seqs", (PyCFunction)sender_seqs, METH_O, "seqs(ring): queued (False) or buffered (True) seqs."},
    {"slabs", (PyCFunction)sender_slabs, METH_NOARGS,
     "((made, mapped), (made, mapped)): the payload and copied-int pools' slabs (for tests)."},
    {"encode_native", (PyCFunction)sender_encode, METH_O,
     "The native encoding of a collector batch, or None when Python encodes it."},
    {NULL},
};

PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The publisher's queue and native sender thread.",
    .tp_traverse = (traverseproc)sender_traverse,
    .tp_clear = (inquiry)sender_clear,
    .tp_new = sender_new,
    .tp_methods = sender_methods,
    .tp_members = sender_members,
};


/* heartbeat_due(last_sent, interval, now, wall, after_batch, phase=0.0): the sender's rule,
 * for tests to hold it equal to kvwire.wire.heartbeat.heartbeat_at. */
static PyObject *module_heartbeat_due(PyObject *module, PyObject *args) {
    double last_sent, interval, now, wall, phase = 0.0;
    int after_batch;
    if (!PyArg_ParseTuple(args, "ddddp|d", &last_sent, &interval, &now, &wall, &after_batch,
                          &phase))
        return NULL;
    return PyFloat_FromDouble(heartbeat_due(last_sent, interval, now, wall, after_batch, phase));
}

static PyMethodDef module_methods[] = {
    {"heartbeat_due", module_heartbeat_due, METH_VARARGS,
     "heartbeat_due(last_sent, interval, now, wall, after_batch, phase=0.0) -> when the next "
     "heartbeat is due"},
    {"encode_collected", (PyCFunction)(void (*)(void))encode_collected, METH_FASTCALL,
     "encode_collected(batch, format, pack) -> bytes: a CollectedBatch's payload"},
    {"payload_of", module_payload_of, METH_O, "payload_of(data) -> a Payload holding a copy"},
    {"holders", module_holders, METH_O, "holders(payload) -> references to its buffer"},
    {NULL},
};

static struct PyModuleDef sendermodule = {
    PyModuleDef_HEAD_INIT, "_sender", "The publisher's native sender thread.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__sender(void) {
    static PyTypeObject *const types[] = {&SenderType,        &PayloadType,       &CollectorType,
                                          &EngineFormatType,  &EnginePublishType, &RecordType,
                                          &RepliesType,       &AccountType,       NULL};
    static const KvwConst consts[] = {{"STORED", T_STORE}, {"REMOVED", T_REMOVE}, {"CLEARED", T_CLEAR},
                                      {"RING_TAKE_MAX", RING_TAKE_MAX}, {NULL}};
    if (records_init() < 0 || collector_init() < 0) return NULL;
    return kvw_module(&sendermodule, types, consts);
}
