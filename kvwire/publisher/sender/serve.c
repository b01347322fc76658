/* Replies on the replay ROUTER, sent in C: Replies and Account.
 *
 * The service thread (replay.py) decides what each client is sent; this file sends it,
 * without a Python object per message: a replay range goes from the sender's ring in one
 * call (its payloads zero-copy, as the live stream sends them), a snapshot chunk is a
 * Payload every client's pipe shares. The frames are the ones docs/wire.md gives; the
 * caller passes the constant ones (replay.py builds them with kvwire.wire's helpers), so
 * no wire rule is restated here but the replay item's [b"", topic, seq, payload].
 *
 * Bytes in flight: every payload is handed to libzmq with a free function that runs when
 * libzmq lets go of it (written to the kernel, or its pipe torn down), on libzmq's I/O
 * thread. It subtracts the payload's bytes from its job's Account and from the Replies'
 * total, both atomics the service thread reads (the bound is the service thread's to keep:
 * it sends only while they are under its limits), and, when the service thread waits on
 * its clients (arm()), writes its eventfd: the thread wakes when a client took something,
 * rather than looking now and then. Accounts and the total are reference counted: a
 * message still in a pipe keeps them alive after its job (or the publisher) is gone.
 *
 * One thread uses a Replies' socket (the service thread), as libzmq requires; the GIL is
 * released while sending.
 */
#include "sender.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

/* A second copy of the table in this translation unit, loaded from the same library. */
#include "../../_native/libzmq.h"
#include "../../_native/msgpack.h"

typedef long long ll;

/* The bytes in flight of all replies of one ROUTER, and whom to wake when some are taken. */
typedef struct Total {
    atomic_long refs;
    atomic_llong in_flight, taken, peak;
    atomic_int armed;
    pthread_mutex_t mu; /* fd's: a free function may write it while close() closes it */
    int fd; /* a duplicate of the service thread's eventfd; -1 once closed (close(), or the
             * last reference) */
} Total;

/* One job's bytes in flight. */
typedef struct Acct {
    atomic_long refs;
    atomic_llong in_flight, taken;
    Total *total;
} Acct;

/* What a sent payload's free function needs (one allocation per message). */
typedef struct Flight {
    Buf *buf;
    Acct *acct;
    size_t n;
} Flight;

/* Close the duplicate descriptor (the publisher is closing: messages still in pipes must not
 * keep it open, nor write to whatever later reuses its number). */
static void total_close_fd(Total *t) {
    pthread_mutex_lock(&t->mu);
    if (t->fd >= 0) close(t->fd);
    t->fd = -1;
    pthread_mutex_unlock(&t->mu);
}

static void total_unref(Total *t) {
    if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) == 1) {
        total_close_fd(t);
        pthread_mutex_destroy(&t->mu);
        free(t);
    }
}

static void acct_unref(Acct *a) {
    if (atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) == 1) {
        total_unref(a->total);
        free(a);
    }
}

/* libzmq let go of a payload (any thread, no GIL). */
static void flight_free(void *data, void *hint) {
    Flight *f = hint;
    Acct *a = f->acct;
    Total *t = a->total;
    ll n = (ll)f->n;
    atomic_fetch_sub_explicit(&a->in_flight, n, memory_order_acq_rel);
    atomic_fetch_add_explicit(&a->taken, n, memory_order_acq_rel);
    atomic_fetch_sub_explicit(&t->in_flight, n, memory_order_acq_rel);
    atomic_fetch_add_explicit(&t->taken, n, memory_order_acq_rel);
    if (atomic_exchange_explicit(&t->armed, 0, memory_order_acq_rel)) {
        u64 one = 1;
        pthread_mutex_lock(&t->mu);
        if (t->fd >= 0) {
            ssize_t r = write(t->fd, &one, sizeof one);
            (void)r; /* EAGAIN: the counter is full, it is readable anyway */
        }
        pthread_mutex_unlock(&t->mu);
    }
    buf_unref(f->buf);
    acct_unref(a);
    free(f);
}

/* --- Account ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Acct *acct; /* NULL only before tp_new completes */
} Account;

static void account_dealloc(Account *self) {
    if (self->acct) acct_unref(self->acct);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The counter at byte `off` of an Acct or a Total (a getter's closure). */
static PyObject *counter(const void *of, void *off) {
    const atomic_llong *c = (const atomic_llong *)((const char *)of + (size_t)off);
    return PyLong_FromLongLong(atomic_load_explicit(c, memory_order_acquire));
}

static PyObject *account_get(Account *self, void *off) { return counter(self->acct, off); }

#define ACCT_AT(field) (void *)offsetof(Acct, field)
static PyGetSetDef account_getset[] = {
    {"in_flight", (getter)account_get, NULL, "bytes sent and not taken yet", ACCT_AT(in_flight)},
    {"taken", (getter)account_get, NULL, "bytes libzmq has let go of, since the start", ACCT_AT(taken)},
    {NULL},
};

PyTypeObject AccountType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Account",
    .tp_basicsize = sizeof(Account),
    .tp_dealloc = (destructor)account_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One reply's bytes in flight (made by Replies.account()).",
    .tp_getset = account_getset,
};

/* --- Replies ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Sender *sender; /* strong: its ring */
    void *router;   /* the ROUTER socket (held open by the caller) */
    Total *total;   /* NULL only before tp_new completes */
} Replies;

static PyObject *replies_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sender", "router_address", "libzmq_path", NULL};
    PyObject *sender, *address;
    const char *path;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!Os", kwlist, &SenderType, &sender, &address,
                                     &path))
        return NULL;
    void *router = PyLong_AsVoidPtr(address);
    if (!router) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "router_address is NULL");
        return NULL;
    }
    char err[512];
    if (kvw_zmq_load(path, err, sizeof err) < 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Total *t = calloc(1, sizeof(Total));
    if (!t) return PyErr_NoMemory();
    atomic_init(&t->refs, 1);
    atomic_init(&t->in_flight, 0);
    atomic_init(&t->taken, 0);
    atomic_init(&t->peak, 0);
    atomic_init(&t->armed, 0);
    t->fd = dup(((Sender *)sender)->service_fd);
    if (t->fd < 0) {
        free(t);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_init(&t->mu, NULL);
    Replies *self = (Replies *)type->tp_alloc(type, 0);
    if (!self) {
        total_unref(t);
        return NULL;
    }
    self->sender = (Sender *)Py_NewRef(sender);
    self->router = router;
    self->total = t;
    return (PyObject *)self;
}

static void replies_dealloc(Replies *self) {
    Py_XDECREF(self->sender);
    if (self->total) total_unref(self->total);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *replies_account(Replies *self, PyObject *unused) {
    Acct *a = calloc(1, sizeof(Acct));
    if (!a) return PyErr_NoMemory();
    Account *out = PyObject_New(Account, &AccountType);
    if (!out) {
        free(a);
        return NULL;
    }
    atomic_init(&a->refs, 1);
    atomic_init(&a->in_flight, 0);
    atomic_init(&a->taken, 0);
    atomic_fetch_add_explicit(&self->total->refs, 1, memory_order_relaxed);
    a->total = self->total;
    out->acct = a;
    return (PyObject *)out;
}

/* Whether n more bytes may go to a: one message always may, alone (replay.py's rule). */
static int fits(const Acct *a, ll n, ll job_cap, ll total_cap) {
    ll mine = atomic_load_explicit(&a->in_flight, memory_order_acquire);
    ll all = atomic_load_explicit(&a->total->in_flight, memory_order_acquire);
    if (mine && mine + n > job_cap) return 0;
    return !(all && all + n > total_cap);
}

typedef struct {
    const void *p;
    size_t n;
} Part;

/* Send [identity, *head, payload] to the client, the payload zero-copy and counted on a.
 * Takes a reference to b while libzmq holds it. 0, or libzmq's errno: EAGAIN on the
 * identity frame only (a full pipe), before anything was sent. No GIL needed. */
static int send_one(void *router, Part identity, const Part *head, int nhead, Buf *b, Acct *a) {
    if (kvw_zmq.send(router, identity.p, identity.n, KVW_ZMQ_SNDMORE | KVW_ZMQ_DONTWAIT) < 0)
        return kvw_zmq.errno_();
    for (int i = 0; i < nhead; i++)
        if (kvw_zmq.send(router, head[i].p, head[i].n, KVW_ZMQ_SNDMORE | KVW_ZMQ_DONTWAIT) < 0)
            return kvw_zmq.errno_();
    Flight *f = malloc(sizeof(Flight));
    if (!f) return ENOMEM;
    kvw_zmq_msg msg;
    buf_ref(b);
    atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    *f = (Flight){b, a, b->len};
    /* counted before libzmq may free it (at once, on another thread) */
    Total *t = a->total;
    atomic_fetch_add_explicit(&a->in_flight, (ll)b->len, memory_order_acq_rel);
    ll now = atomic_fetch_add_explicit(&t->in_flight, (ll)b->len, memory_order_acq_rel) +
             (ll)b->len;
    ll peak = atomic_load_explicit(&t->peak, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak(&t->peak, &peak, now)) {
    }
    if (kvw_zmq.msg_init_data(&msg, b->data, b->len, flight_free, f) < 0) {
        int e = kvw_zmq.errno_();
        flight_free(b->data, f); /* uncounts it */
        atomic_fetch_sub_explicit(&a->taken, (ll)b->len, memory_order_acq_rel);
        atomic_fetch_sub_explicit(&a->total->taken, (ll)b->len, memory_order_acq_rel);
        return e;
    }
    if (kvw_zmq.msg_send(&msg, router, KVW_ZMQ_DONTWAIT) < 0) {
        int e = kvw_zmq.errno_();
        kvw_zmq.msg_close(&msg); /* frees it: counted as taken, which it was not; undo that */
        atomic_fetch_sub_explicit(&a->taken, (ll)b->len, memory_order_acq_rel);
        atomic_fetch_sub_explicit(&a->total->taken, (ll)b->len, memory_order_acq_rel);
        return e;
    }
    return 0;
}

static int get_part(PyObject *o, Part *out) {
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a frame must be bytes, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    out->p = PyBytes_AS_STRING(o);
    out->n = (size_t)PyBytes_GET_SIZE(o);
    return 0;
}

#define MAX_HEAD 8

/* send(account, identity, head, payload, job_cap, total_cap) -> errno
 * [identity, *head, payload] when it fits (as send_range's items): 0, sent; -1, it does
 * not fit now, nothing was sent; else libzmq's errno (EAGAIN: the client's pipe is full,
 * nothing was sent). head: a tuple of bytes frames; payload: a Payload. */
static PyObject *replies_send(Replies *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyObject_TypeCheck(args[0], &AccountType) || !PyTuple_Check(args[2]) ||
        !PyObject_TypeCheck(args[3], &PayloadType)) {
        PyErr_SetString(PyExc_TypeError, "send(account: Account, identity: bytes, head: tuple, "
                                         "payload: Payload, job_cap: int, total_cap: int)");
        return NULL;
    }
    long long job_cap = PyLong_AsLongLong(args[4]);
    long long total_cap = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    Part identity, head[MAX_HEAD];
    Py_ssize_t nhead = PyTuple_GET_SIZE(args[2]);
    if (nhead > MAX_HEAD) {
        PyErr_SetString(PyExc_ValueError, "too many head frames");
        return NULL;
    }
    if (get_part(args[1], &identity) < 0) return NULL;
    for (Py_ssize_t i = 0; i < nhead; i++)
        if (get_part(PyTuple_GET_ITEM(args[2], i), &head[i]) < 0) return NULL;
    Buf *b = payload_buf(args[3]);
    Acct *a = ((Account *)args[0])->acct;
    if (!fits(a, (ll)b->len, job_cap, total_cap)) return PyLong_FromLong(-1);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = send_one(self->router, identity, head, (int)nhead, b, a);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* send_range(account, identity, topic, start_seq, n, job_cap, total_cap)
 *   -> (errno, sent, bytes, found, next_seq)
 * Up to n buffered batches from the first whose seq is >= start_seq, each sent as a replay
 * item [identity, b"", topic, seq, payload] while it fits (job_cap: the account's bytes in
 * flight, total_cap: every reply's; one message always may, alone). found: the batches the
 * ring had (at most n); sent of them went, bytes in all; next_seq: after the last sent
 * (start_seq if none). Stops at the first error (errno; EAGAIN: the pipe is full). */
static PyObject *replies_send_range(Replies *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyObject_TypeCheck(args[0], &AccountType)) {
        PyErr_SetString(PyExc_TypeError, "send_range(account, identity, topic, start_seq, n, "
                                         "job_cap, total_cap)");
        return NULL;
    }
    Part identity, head[3];
    if (get_part(args[1], &identity) < 0 || get_part(args[2], &head[1]) < 0) return NULL;
    long long start = PyLong_AsLongLong(args[3]);
    Py_ssize_t want = PyLong_AsSsize_t(args[4]);
    long long job_cap = PyLong_AsLongLong(args[5]);
    long long total_cap = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (want < 0) want = 0;
    if (want > RING_TAKE_MAX) want = RING_TAKE_MAX;
    Acct *a = ((Account *)args[0])->acct;
    FeedEntry got[RING_TAKE_MAX];
    unsigned char seq[8];
    head[0] = (Part){"", 0};
    head[2] = (Part){seq, 8};
    int rc = 0;
    size_t found, sent = 0;
    ll bytes = 0;
    i64 next = (i64)start;
    Py_BEGIN_ALLOW_THREADS
    found = ring_take(self->sender, (i64)start, (size_t)want, got);
    for (; sent < found; sent++) {
        Buf *b = got[sent].buf;
        if (!fits(a, (ll)b->len, job_cap, total_cap)) break;
        kvw_put_be(seq, (u64)got[sent].seq, 8);
        rc = send_one(self->router, identity, head, 3, b, a);
        if (rc) break;
        bytes += (ll)b->len;
        next = got[sent].seq + 1;
    }
    for (size_t i = 0; i < found; i++) buf_unref(got[i].buf);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(innnL)", rc, (Py_ssize_t)sent, (Py_ssize_t)bytes, (Py_ssize_t)found,
                         (long long)next);
}

/* close(): no more wake-ups; the duplicate descriptor is closed now (idempotent). The counts
 * go on as libzmq releases what is still in pipes. */
static PyObject *replies_close(Replies *self, PyObject *unused) {
    total_close_fd(self->total);
    Py_RETURN_NONE;
}

/* arm(): write the service eventfd when a client next takes something. */
static PyObject *replies_arm(Replies *self, PyObject *unused) {
    atomic_store_explicit(&self->total->armed, 1, memory_order_release);
    Py_RETURN_NONE;
}

static PyMethodDef replies_methods[] = {
    {"account", (PyCFunction)replies_account, METH_NOARGS, "account() -> a new reply's Account"},
    {"send", (PyCFunction)(void (*)(void))replies_send, METH_FASTCALL,
     "send(account, identity, head, payload, job_cap, total_cap) -> errno (-1: does not fit)"},
    {"send_range", (PyCFunction)(void (*)(void))replies_send_range, METH_FASTCALL,
     "send_range(account, identity, topic, start_seq, n, job_cap, total_cap) -> "
     "(errno, sent, bytes, found, next_seq)"},
    {"arm", (PyCFunction)replies_arm, METH_NOARGS,
     "arm(): wake the service thread when a client next takes something"},
    {"close", (PyCFunction)replies_close, METH_NOARGS,
     "close(): release the wake-up descriptor (the publisher is closing)"},
    {NULL},
};

static PyObject *replies_get(Replies *self, void *off) { return counter(self->total, off); }

#define TOTAL_AT(field) (void *)offsetof(Total, field)
static PyGetSetDef replies_getset[] = {
    {"peak", (getter)replies_get, NULL, "the most bytes ever in flight at once", TOTAL_AT(peak)},
    {"in_flight", (getter)replies_get, NULL, "bytes sent to every client, not taken yet",
     TOTAL_AT(in_flight)},
    {"taken", (getter)replies_get, NULL, "bytes libzmq has let go of, since the start", TOTAL_AT(taken)},
    {NULL},
};

PyTypeObject RepliesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Replies",
    .tp_basicsize = sizeof(Replies),
    .tp_dealloc = (destructor)replies_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The replay ROUTER's replies, sent in C, and their bytes in flight.",
    .tp_new = replies_new,
    .tp_methods = replies_methods,
    .tp_getset = replies_getset,
};

/* --- module functions ------------------------------------------------------------------- */

/* payload_of(data) -> Payload: a copy of any buffer, to be shared by every client's pipe. */
PyObject *module_payload_of(PyObject *module, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    Buf *b = buf_new(NULL, (size_t)view.len);
    if (!b) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(b->data, view.buf, (size_t)view.len);
    buf_end(b, b->data + view.len);
    PyBuffer_Release(&view);
    PyObject *out = payload_wrap(b);
    buf_unref(b);
    return out;
}

/* holders(payload) -> int: the references to its buffer (its Payloads, the ring, the pipes
 * that hold it): for tests, that one buffer is shared, never copied. */
PyObject *module_holders(PyObject *module, PyObject *payload) {
    if (!PyObject_TypeCheck(payload, &PayloadType)) {
        PyErr_SetString(PyExc_TypeError, "holders(payload: Payload)");
        return NULL;
    }
    return PyLong_FromLong(atomic_load(&payload_buf(payload)->refs));
}
