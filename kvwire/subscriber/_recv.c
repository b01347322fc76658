/* The subscriber's receive drain: every message ready on a ZeroMQ socket, in one call.
 *
 * pyzmq's recv_multipart costs a Python call per frame and an exception when
 * the socket is empty; a router following a thousand ranks pays that for
 * every batch and heartbeat. drain() reads up to `cap` messages with
 * zmq_msg_recv(ZMQ_DONTWAIT) on the socket's libzmq handle (the same library
 * pyzmq loaded: libzmq.h) and returns them as tuples of bytes. It stops when
 * the socket has nothing more (EAGAIN: libzmq has then processed its
 * commands, so the socket's edge-triggered descriptor signals the next
 * arrival) or at the cap (the caller must come back without waiting for a
 * signal). The socket's own limits stay in force (ZMQ_MAXMSGSIZE: libzmq
 * drops a larger message with its connection). A message of more than
 * `max_frames` frames is read to its end and returned as an empty tuple, so
 * that the caller counts it and nothing of it is kept.
 *
 * drain_beats() is drain() for a live SUB socket whose stream is in sequence:
 * the heartbeats at its head (kvwire.wire.heartbeat: [topic, next seq, an
 * empty batch of this rank], exactly as encode_batch gives it) are counted
 * and dropped instead of returned, so that an idle fleet costs no Python
 * objects per heartbeat. It stops counting at the first other message; that
 * one and all after it are returned as drain() would, for the stream to judge.
 *
 * check_batch() reads a batch payload the way kvwire.wire.decode_batch does
 * and returns only what RankStream reads of the decoded batch (its number of
 * events, its data_parallel_rank, whether an AllBlocksCleared is among them),
 * without a Python object per event, so that a sink taking payload bytes
 * (PrefixIndex.apply_payload) gets them from a stream that vouched for them.
 *
 * Called with the GIL held, from the one thread that uses the socket.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "../_native/libzmq.h"
#include "../_native/pyext.h"
#include "../_native/scan.h"

#define MAX_FRAMES 64

static void *socket_handle(PyObject *sock) {
    PyObject *addr = PyObject_GetAttrString(sock, "underlying");
    if (addr == NULL)
        return NULL;
    void *handle = PyLong_AsVoidPtr(addr);
    Py_DECREF(addr);
    if (handle == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "the socket is closed");
    return handle;
}

static void zmq_error(int err) {
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", err, kvw_zmq.strerror(err));
    if (exc != NULL) {
        PyErr_SetObject(PyExc_OSError, exc);
        Py_DECREF(exc);
    }
}

static PyObject *load(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    char err[512];
    if (kvw_zmq_load(path, err, sizeof err) != 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The heartbeats drain_beats() drops: what they must match, and what was dropped. */
typedef struct {
    int on;             /* still at the head of the socket (nothing returned yet) */
    const char *topic;  /* the stream's topic frame */
    size_t topic_len;
    uint64_t expected;  /* the seq the next heartbeat must carry */
    long long rank;     /* the envelope's rank must be nil or this; < 0: any */
    Py_ssize_t count;
    unsigned char last[32]; /* the last dropped payload (the stream's anchor) */
    size_t last_len;
} Beats;

/* Whether [topic, seq, payload] is the next heartbeat: an envelope
 * [float64 ts, [], rank] (0x93 0xcb <8> 0x90 <rank>), with rank nil or a
 * non-negative int, and nothing after it. Anything else is the stream's to judge. */
static int is_beat(kvw_zmq_msg *parts, Py_ssize_t n, const Beats *b) {
    if (n != 3 || kvw_zmq.msg_size(&parts[0]) != b->topic_len ||
        kvw_zmq.msg_size(&parts[1]) != 8)
        return 0;
    if (b->topic_len && memcmp(kvw_zmq.msg_data(&parts[0]), b->topic, b->topic_len) != 0)
        return 0;
    if (kvw_get_be((const unsigned char *)kvw_zmq.msg_data(&parts[1]), 8) != b->expected)
        return 0;
    const unsigned char *p = (const unsigned char *)kvw_zmq.msg_data(&parts[2]);
    size_t len = kvw_zmq.msg_size(&parts[2]);
    if (len < 12 || p[0] != 0x93 || p[1] != 0xcb || p[10] != 0x90)
        return 0;
    const unsigned char *r = p + 11;
    size_t rest = len - 11;
    if (*r == 0xc0)
        return rest == 1;
    /* An unsigned form only (as msgspec writes a rank), taking all the rest. */
    uint64_t rank;
    int neg;
    if (*r >= 0xd0 || kvw_get_int(r, (Py_ssize_t)rest, &rank, &neg) != (Py_ssize_t)rest)
        return 0;
    return b->rank < 0 || rank == (uint64_t)b->rank;
}

/* Up to `cap` messages; with `beats`, the heartbeats at the head are counted, not returned. */
static PyObject *read_messages(void *handle, Py_ssize_t cap, Py_ssize_t max_frames, Beats *beats) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    /* One part per frame kept, and one more that takes the rest of a message too long. */
    kvw_zmq_msg parts[MAX_FRAMES + 1];
    for (Py_ssize_t i = 0; i <= max_frames; i++)
        kvw_zmq.msg_init(&parts[i]);
    Py_ssize_t read = 0;
    while (read < cap) {
        Py_ssize_t n = 0;
        int too_many = 0; /* more than max_frames: read to its end, keep nothing */
        for (;;) {
            kvw_zmq_msg *part = &parts[too_many ? max_frames : n];
            if (kvw_zmq.msg_recv(part, handle, KVW_ZMQ_DONTWAIT) < 0) {
                int err = kvw_zmq.errno_();
                if (err == KVW_EINTR)
                    continue;
                if (n == 0 && !too_many && err == KVW_EAGAIN)
                    goto done; /* nothing more ready */
                /* A message is delivered whole or not at all, so an error after its
                 * first part is the socket or the context going away. */
                zmq_error(err);
                goto fail;
            }
            int more = kvw_zmq.msg_more(part);
            if (!too_many && ++n == max_frames && more)
                too_many = 1;
            if (!more)
                break;
        }
        read++;
        if (beats != NULL && beats->on) {
            if (!too_many && is_beat(parts, n, beats)) {
                size_t len = kvw_zmq.msg_size(&parts[2]);
                if (len <= sizeof beats->last) { /* always: an envelope is at most 21 bytes */
                    memcpy(beats->last, kvw_zmq.msg_data(&parts[2]), len);
                    beats->last_len = len;
                    beats->count++;
                    beats->expected++;
                    continue;
                }
            }
            beats->on = 0; /* the stream judges this one and all after it */
        }
        PyObject *message = PyTuple_New(too_many ? 0 : n);
        if (message == NULL)
            goto fail;
        for (Py_ssize_t i = 0; !too_many && i < n; i++) {
            PyObject *frame = PyBytes_FromStringAndSize((const char *)kvw_zmq.msg_data(&parts[i]),
                                                        (Py_ssize_t)kvw_zmq.msg_size(&parts[i]));
            if (frame == NULL) {
                Py_DECREF(message);
                goto fail;
            }
            PyTuple_SET_ITEM(message, i, frame); /* steals the reference */
        }
        int rc = PyList_Append(out, message);
        Py_DECREF(message);
        if (rc < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; i <= max_frames; i++)
        kvw_zmq.msg_close(&parts[i]);
    return out;
}

/* What drain() and drain_beats() check alike: the number of arguments, that
 * libzmq is loaded, and cap (the second argument). */
static int read_common(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                       const char *name, Py_ssize_t *cap) {
    if (kvw_nargs(nargs, want, name) < 0) return -1;
    if (!kvw_zmq_loaded) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq not loaded: call load(path) first");
        return -1;
    }
    *cap = PyLong_AsSsize_t(args[1]);
    if (*cap == -1 && PyErr_Occurred())
        return -1;
    if (*cap < 0) {
        PyErr_SetString(PyExc_ValueError, "cap must be >= 0");
        return -1;
    }
    return 0;
}

static PyObject *drain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t cap;
    if (read_common(args, nargs, 3, "drain", &cap) < 0)
        return NULL;
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    if (max_frames == -1 && PyErr_Occurred())
        return NULL;
    if (max_frames < 1 || max_frames > MAX_FRAMES) {
        PyErr_SetString(PyExc_ValueError, "max_frames must be in 1..64");
        return NULL;
    }
    void *handle = socket_handle(args[0]);
    if (handle == NULL)
        return NULL;
    return read_messages(handle, cap, max_frames, NULL);
}

static PyObject *drain_beats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t cap;
    if (read_common(args, nargs, 5, "drain_beats", &cap) < 0)
        return NULL;
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "topic must be bytes");
        return NULL;
    }
    Beats beats = {.on = 1, .count = 0, .last_len = 0};
    beats.topic = PyBytes_AS_STRING(args[2]);
    beats.topic_len = (size_t)PyBytes_GET_SIZE(args[2]);
    if (!PyLong_Check(args[3]) || !PyLong_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "expected and rank must be ints");
        return NULL;
    }
    beats.expected = PyLong_AsUnsignedLongLong(args[3]);
    if (beats.expected == (uint64_t)-1 && PyErr_Occurred()) {
        /* Past any seq frame (or negative): no heartbeat can be next. */
        PyErr_Clear();
        beats.on = 0;
    }
    beats.rank = PyLong_AsLongLong(args[4]);
    if (beats.rank == -1 && PyErr_Occurred())
        return NULL;
    void *handle = socket_handle(args[0]);
    if (handle == NULL)
        return NULL;
    /* args[2] is borrowed from the caller's frame and outlives this call. */
    PyObject *messages = read_messages(handle, cap, 3, &beats);
    if (messages == NULL)
        return NULL;
    if (beats.count == 0)
        return Py_BuildValue("(nON)", (Py_ssize_t)0, Py_None, messages);
    return Py_BuildValue("(ny#N)", beats.count, (const char *)beats.last,
                         (Py_ssize_t)beats.last_len, messages);
}

/* --- check_batch: what the stream reads of a batch ------------------------- */
/*
 * The one native reader (kvwire/_native/scan.h) over the payload, hashes
 * checked, not kept: a payload it reads is one decode_batch accepts. One
 * with what would key a block differently (a lora name, extra keys,
 * lookahead tokens, a salt: no sink's native apply reads those) or that it
 * does not read is answered None, and the stream decodes it the general way,
 * which accepts or refuses it. */

static PyObject *check_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (kvw_nargs(nargs, 5, "check_batch") < 0) return NULL;
    int bad = 0;
    KvScan s = {.lim = {kvs_limit(args[1], &bad), kvs_limit(args[2], &bad), kvs_limit(args[3], &bad),
                        kvs_limit(args[4], &bad)}};
    if (bad) Py_RETURN_NONE; /* limits this check does not read: the general way */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not bytes-like: decode_batch says what it is */
        Py_RETURN_NONE;
    }
    Rd r = {view.buf, view.len, 0};
    int rc = kvs_batch(&s, &r);
    PyBuffer_Release(&view);
    Py_ssize_t m = s.ev_len;
    if (rc == 0 && (s.extras & (X_LORA | X_EXTRA | X_LOOKAHEAD | X_SALT))) rc = FALL;
    kvs_free(&s);
    if (rc < 0) return PyErr_NoMemory();
    if (rc) Py_RETURN_NONE;
    return kvs_summary(&s, m);
}

static PyMethodDef methods[] = {
    {"load", (PyCFunction)load, METH_O,
     "load(path): resolve libzmq's calls from the library at path (already loaded by pyzmq)."},
    {"drain", (PyCFunction)(void (*)(void))drain, METH_FASTCALL,
     "drain(socket, cap, max_frames) -> list of tuples of bytes: the messages ready on the\n"
     "socket, at most cap; one of more than max_frames frames is read and returned as ()."},
    {"drain_beats", (PyCFunction)(void (*)(void))drain_beats, METH_FASTCALL,
     "drain_beats(socket, cap, topic, expected, rank) -> (count, last, messages): drain() of a\n"
     "live socket (3 frames at most) whose heartbeats at the head, on seqs expected,\n"
     "expected + 1, ..., are counted (count, the last one's payload) instead of returned."},
    {"check_batch", (PyCFunction)(void (*)(void))check_batch, METH_FASTCALL,
     "check_batch(payload, max_events, max_blocks, max_block_size, max_tokens)\n"
     "-> (events, data_parallel_rank, cleared) | None: what RankStream reads of\n"
     "decode_batch(payload, limits), for a payload it vouches decode_batch accepts;\n"
     "None: decode it the general way (which accepts or refuses it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.subscriber._recv", "The subscriber's native receive drain.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__recv(void) { return PyModule_Create(&module); }
