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
#include "../_native/msgpack_read.h"

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
                       const char *usage, Py_ssize_t *cap) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
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
    if (read_common(args, nargs, 3, "drain(socket, cap, max_frames)", &cap) < 0)
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
    if (read_common(args, nargs, 5, "drain_beats(socket, cap, topic, expected, rank)", &cap) < 0)
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
 * The subset read is the prefix index's fused apply's (prefix_index/_core.c):
 * events all maps (decode_batch's typed path) or all tagged arrays (its
 * generic path), int hashes and token ids, no lora_name, extra keys, cache
 * salt or lookahead tokens, scalars in the fields nobody reads, every limit
 * of decode_batch checked. Anything else, well formed or not, is FALL and
 * answered None: the stream decodes it the general way, which accepts or
 * refuses it exactly as before. So what is accepted here only has to be a
 * part of what decode_batch accepts (tests/subscriber/test_check_batch.py
 * holds the two side by side). */

typedef struct {
    Py_ssize_t max_events, max_blocks, max_bs, max_tokens;
} Limits;

/* The bytes an int takes by its head byte c (0: not an int), as rd_int reads it. */
static inline Py_ssize_t int_width(unsigned char c) {
    if (c <= 0x7f || c >= 0xe0) return 1;
    switch (c) {
        case 0xcc: case 0xd0: return 2;
        case 0xcd: case 0xd1: return 3;
        case 0xce: case 0xd2: return 5;
        case 0xcf: case 0xd3: return 9;
        default: return 0;
    }
}

/* An array of at most max ints, skipped (their values are the sink's to read). */
static int ck_ints(Rd *r, Py_ssize_t max) {
    Py_ssize_t n;
    if (RD_ARRAY(r, &n) || n > max) return FALL;
    const unsigned char *p = r->p;
    Py_ssize_t i = r->i, end = r->n, k = 0;
    /* Four at a time while they share a width (token ids mostly do): the next
     * three heads' places are known from the first's, so their reads overlap. */
    while (n - k >= 4 && end - i >= 4 * 9) {
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
    return 0;
}

static int ck_field(const Limits *lim, Rd *r, int f) {
    uint64_t v;
    int neg, has;
    const char *s;
    Py_ssize_t n;
    switch (f) {
        case F_HASHES:
            return ck_ints(r, lim->max_blocks);
        case F_TOKENS:
            return ck_ints(r, lim->max_tokens);
        case F_BS:
            return rd_block_size(r, (uint64_t)lim->max_bs, &n);
        case F_PARENT:
        case F_GROUP:
            return rd_opt_int(r, &v, &neg, &has);
        case F_MEDIUM:
            return rd_opt_str(r, &s, &n);
        case F_LORA_ID:
        case F_WINDOW:
        case F_KIND:
            return rd_dropped(r, f);
        case F_TYPE:
            return FALL; /* a second tag */
        case F_LORA_NAME: case F_EXTRA: case F_LOOKAHEAD: case F_SALT:
            return rd_nil(r) ? 0 : FALL; /* what would key a block differently */
        default:
            return rd_skip(r); /* locality, ownership, session_id, a field not known */
    }
}

/* One event, a map (`map` 1) or a tagged array; *cleared set by an AllBlocksCleared. */
static int ck_event(const Limits *lim, Rd *r, int map, int *cleared) {
    Py_ssize_t n, len;
    const char *s;
    if (rd_event_open(r, map, &n, &s, &len)) return FALL;
    int kind = event_kind(s, len);
    if (kind < 0) return FALL;
    unsigned seen = 0;
    int f = -1;
    for (Py_ssize_t k = 1; k < n; k++)
        if (rd_field_id(r, map, kind, k, &f, &seen) || ck_field(lim, r, f)) return FALL;
    if (!event_complete(kind, seen)) return FALL;
    if (kind == EV_CLEARED) *cleared = 1;
    return 0;
}

/* The whole payload: *m events, the rank (*has_rank 0: nil or absent), *cleared. */
static int ck_batch(const Limits *lim, Rd *r, Py_ssize_t *m, uint64_t *rank, int *neg,
                    int *has_rank, int *cleared) {
    Py_ssize_t n;
    if (rd_batch_open(r, &n, m, lim->max_events)) return FALL;
    int map = rd_events_are_maps(r, *m);
    for (Py_ssize_t k = 0; k < *m; k++)
        if (ck_event(lim, r, map, cleared)) return FALL;
    *has_rank = 0;
    if (n == 3 && rd_opt_int(r, rank, neg, has_rank)) return FALL;
    return r->i != r->n ? FALL : 0;
}

/* A limit as a non-negative Py_ssize_t; *fail set otherwise (that limit is not read here). */
static Py_ssize_t limit_arg(PyObject *o, int *fail) {
    Py_ssize_t v = PyLong_Check(o) ? PyLong_AsSsize_t(o) : -1;
    if (v < 0) {
        PyErr_Clear();
        *fail = 1;
    }
    return v;
}

static PyObject *check_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "check_batch(payload, max_events, max_blocks, max_block_size, max_tokens)");
        return NULL;
    }
    int bad = 0;
    Limits lim = {limit_arg(args[1], &bad), limit_arg(args[2], &bad), limit_arg(args[3], &bad),
                  limit_arg(args[4], &bad)};
    if (bad) Py_RETURN_NONE; /* limits this check does not read: the general way */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not bytes-like: decode_batch says what it is */
        Py_RETURN_NONE;
    }
    Rd r = {view.buf, view.len, 0};
    Py_ssize_t m = 0;
    uint64_t rank = 0;
    int neg = 0, has_rank = 0, cleared = 0;
    int rc = ck_batch(&lim, &r, &m, &rank, &neg, &has_rank, &cleared);
    PyBuffer_Release(&view);
    if (rc) Py_RETURN_NONE;
    PyObject *r_obj;
    if (!has_rank)
        r_obj = Py_NewRef(Py_None);
    else if (neg)
        r_obj = PyLong_FromLongLong((long long)rank);
    else
        r_obj = PyLong_FromUnsignedLongLong(rank);
    if (r_obj == NULL)
        return NULL;
    return Py_BuildValue("(nNO)", m, r_obj, cleared ? Py_True : Py_False);
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
