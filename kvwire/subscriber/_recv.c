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
 * Called with the GIL held, from the one thread that uses the socket.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_native/libzmq.h"

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

static void release(PyObject **frames, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(frames[i]);
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

static PyObject *drain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "drain(socket, cap, max_frames)");
        return NULL;
    }
    if (!kvw_zmq_loaded) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq not loaded: call load(path) first");
        return NULL;
    }
    Py_ssize_t cap = PyLong_AsSsize_t(args[1]);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    if (max_frames == -1 && PyErr_Occurred())
        return NULL;
    if (cap < 0 || max_frames < 1 || max_frames > 64) {
        PyErr_SetString(PyExc_ValueError, "cap must be >= 0, max_frames in 1..64");
        return NULL;
    }
    void *handle = socket_handle(args[0]);
    if (handle == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    PyObject *frames[64];
    kvw_zmq_msg msg;
    kvw_zmq.msg_init(&msg);
    while (PyList_GET_SIZE(out) < cap) {
        Py_ssize_t n = 0;
        int too_many = 0; /* more than max_frames: read to its end, keep nothing */
        int first = 1;
        for (;;) {
            if (kvw_zmq.msg_recv(&msg, handle, KVW_ZMQ_DONTWAIT) < 0) {
                int err = kvw_zmq.errno_();
                if (err == KVW_EINTR)
                    continue;
                if (first && err == KVW_EAGAIN)
                    goto done; /* nothing more ready */
                /* A message is delivered whole or not at all, so an error after its
                 * first part is the socket or the context going away. */
                release(frames, n);
                zmq_error(err);
                goto fail;
            }
            first = 0;
            if (n < max_frames && !too_many) {
                PyObject *frame = PyBytes_FromStringAndSize((const char *)kvw_zmq.msg_data(&msg),
                                                            (Py_ssize_t)kvw_zmq.msg_size(&msg));
                if (frame == NULL) {
                    release(frames, n);
                    /* Its other parts would read as the next message: drop them. */
                    while (kvw_zmq.msg_more(&msg) &&
                           kvw_zmq.msg_recv(&msg, handle, KVW_ZMQ_DONTWAIT) >= 0) {
                    }
                    goto fail;
                }
                frames[n++] = frame;
            } else if (!too_many) {
                release(frames, n);
                n = 0;
                too_many = 1;
            }
            if (!kvw_zmq.msg_more(&msg))
                break;
        }
        PyObject *message = PyTuple_New(n);
        if (message == NULL) {
            release(frames, n);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            PyTuple_SET_ITEM(message, i, frames[i]); /* steals the reference */
        int rc = PyList_Append(out, message);
        Py_DECREF(message);
        if (rc < 0)
            goto fail;
    }
done:
    kvw_zmq.msg_close(&msg);
    return out;
fail:
    kvw_zmq.msg_close(&msg);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"load", (PyCFunction)load, METH_O,
     "load(path): resolve libzmq's calls from the library at path (already loaded by pyzmq)."},
    {"drain", (PyCFunction)(void (*)(void))drain, METH_FASTCALL,
     "drain(socket, cap, max_frames) -> list of tuples of bytes: the messages ready on the\n"
     "socket, at most cap; one of more than max_frames frames is read and returned as ()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.subscriber._recv", "The subscriber's native receive drain.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__recv(void) { return PyModule_Create(&module); }
