/* Int arrays to msgpack, the publisher's per-token loop.
 *
 * pack_ints(values, mode, what) -> bytes: a msgpack array holding every value
 * in its smallest integer form, byte for byte what msgspec writes for the same
 * list of Python ints. values: a list or tuple of ints (or objects with
 * __index__), or a 1-D buffer of native integers (numpy arrays, array.array,
 * any stride). Reading a numpy array here skips the Python int per element
 * that tolist() and msgspec would make.
 *
 * mode 0: ints as given (each within [-2**63, 2**64));
 * mode 1: 64-bit hashes, unsigned (negative ones wrap by 2**64);
 * mode 2: 64-bit hashes, signed (ones above 2**63 - 1 wrap by 2**64).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_native/intbuf.h"
#include "../_native/msgpack.h"

typedef uint64_t u64;
typedef int64_t i64;

/* The 64-bit pattern and sign of value (signed `s`, or unsigned `u` when
 * is_unsigned) in a mode. */
static inline unsigned char *put_mode(unsigned char *p, u64 bits, int is_unsigned, int mode) {
    int neg;
    switch (mode) {
        case 1: neg = 0; break;                        /* as unsigned 64 */
        case 2: neg = (i64)bits < 0; break;            /* as signed 64 */
        default: neg = !is_unsigned && (i64)bits < 0;  /* as given */
    }
    return kvw_put_int(p, bits, neg);
}

/* Room for n packed ints: header, 9 bytes an int at most, 8 bytes of slack. */
static PyObject *out_for(Py_ssize_t n) {
    if (n > (PY_SSIZE_T_MAX - 13) / 9) return PyErr_NoMemory();
    return PyBytes_FromStringAndSize(NULL, 5 + 9 * n + 8);
}

static PyObject *finish(PyObject *out, unsigned char *start, unsigned char *end) {
    if (_PyBytes_Resize(&out, end - start) < 0) return NULL;
    return out;
}

/* Ints (and subclasses) convert without running Python code; anything else
 * goes through its __index__, which may change the list: hold the item
 * across the call, then re-read the items and refuse a size change. */
static PyObject *pack_seq(PyObject *seq, int mode, const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = out_for(n);
    if (!out) return NULL;
    unsigned char *start = (unsigned char *)PyBytes_AS_STRING(out), *p = kvw_put_array_header(start, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        u64 bits;
        int is_unsigned = 0, rc = 0;
        PyObject *o = items[i];
#if PY_VERSION_HEX >= 0x030C0000
        if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            bits = (u64)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            p = put_mode(p, bits, 0, mode);
            continue;
        }
#else
        if (PyLong_CheckExact(o) && Py_SIZE(o) >= -1 && Py_SIZE(o) <= 1) {
            /* A small int (every token id): its one digit, signed by its size. */
            bits = (u64)((int64_t)Py_SIZE(o) * (int64_t)((PyLongObject *)o)->ob_digit[0]);
            p = put_mode(p, bits, 0, mode);
            continue;
        }
#endif
        int foreign = !PyLong_Check(o);
        if (foreign) Py_INCREF(o);
        rc = kvw_int_bits(o, &bits, &is_unsigned, what);
        if (foreign) {
            Py_DECREF(o);
            if (rc == 0 && PySequence_Fast_GET_SIZE(seq) != n) {
                PyErr_Format(PyExc_RuntimeError, "%s values changed size while being packed", what);
                rc = -1;
            }
            items = PySequence_Fast_ITEMS(seq);
        }
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
        p = put_mode(p, bits, is_unsigned, mode);
    }
    return finish(out, start, p);
}

static PyObject *pack_buffer(Py_buffer *v, int mode, const char *what) {
    int is_signed = kvw_int_buffer(v, what, PyExc_ValueError);
    if (is_signed < 0) return NULL;
    Py_ssize_t n = v->shape[0], w = v->itemsize;
    Py_ssize_t stride = v->strides ? v->strides[0] : w;
    PyObject *out = out_for(n);
    if (!out) return NULL;
    unsigned char *start = (unsigned char *)PyBytes_AS_STRING(out), *p = kvw_put_array_header(start, (size_t)n);
    const char *b = v->buf;
    if (is_signed) KVW_EACH_INT(b, stride, w, 1, n, i, x, p = put_mode(p, x, 0, mode);)
    else KVW_EACH_INT(b, stride, w, 0, n, i, x, p = put_mode(p, x, 1, mode);)
    return finish(out, start, p);
}

static PyObject *pack_ints(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack_ints(values, mode, what)");
        return NULL;
    }
    PyObject *values = args[0];
    long mode = PyLong_AsLong(args[1]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    if (mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "mode must be 0, 1 or 2");
        return NULL;
    }
    const char *what = PyUnicode_AsUTF8(args[2]);
    if (!what) return NULL;
    if (PyList_Check(values) || PyTuple_Check(values)) {
        PyObject *seq = PySequence_Fast(values, "values");
        if (!seq) return NULL;
        PyObject *r = pack_seq(seq, (int)mode, what);
        Py_DECREF(seq);
        return r;
    }
    if (PyObject_CheckBuffer(values)) {
        Py_buffer v;
        if (PyObject_GetBuffer(values, &v, PyBUF_FORMAT | PyBUF_STRIDES) < 0) return NULL;
        PyObject *r = pack_buffer(&v, (int)mode, what);
        PyBuffer_Release(&v);
        return r;
    }
    PyErr_Format(PyExc_TypeError, "%s must be a list, a tuple or an integer array, not %s", what,
                 Py_TYPE(values)->tp_name);
    return NULL;
}

static PyObject *FORMATS[8];
static PyObject *CAST;

/* snapshot(values, what) -> memoryview: a private copy of a 1-D integer
 * array, for the engine thread: one call instead of numpy's checks and copy.
 * TypeError when values is not one. */
static PyObject *snapshot(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "snapshot(values, what)");
        return NULL;
    }
    const char *what = PyUnicode_AsUTF8(args[1]);
    if (!what) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D integer array, not %s", what,
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    int is_signed = kvw_int_buffer(&v, what, PyExc_TypeError);
    if (is_signed < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    Py_ssize_t n = v.shape[0], w = v.itemsize, stride = v.strides ? v.strides[0] : w;
    /* memoryview.cast's format for this width and sign: b h i q, upper case unsigned. */
    int slot = (w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3) + (is_signed ? 0 : 4);
    if (!FORMATS[slot]) {
        static const char *names[8] = {"b", "h", "i", "q", "B", "H", "I", "Q"};
        FORMATS[slot] = PyUnicode_InternFromString(names[slot]);
        if (!FORMATS[slot]) {
            PyBuffer_Release(&v);
            return NULL;
        }
    }
    PyObject *copy = n > PY_SSIZE_T_MAX / 8 ? PyErr_NoMemory() : PyBytes_FromStringAndSize(NULL, n * w);
    if (!copy) {
        PyBuffer_Release(&v);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(copy);
    if (stride == w) memcpy(dst, v.buf, (size_t)(n * w));
    else
        for (Py_ssize_t i = 0; i < n; i++) memcpy(dst + i * w, (const char *)v.buf + i * stride, (size_t)w);
    PyBuffer_Release(&v);
    PyObject *raw = PyMemoryView_FromObject(copy);
    Py_DECREF(copy);
    if (!raw) return NULL;
    if (!CAST && !(CAST = PyUnicode_InternFromString("cast"))) {
        Py_DECREF(raw);
        return NULL;
    }
    PyObject *call[2] = {raw, FORMATS[slot]};
    PyObject *typed = PyObject_VectorcallMethod(CAST, call, 2, NULL);
    Py_DECREF(raw);
    return typed;
}

static PyMethodDef methods[] = {
    {"snapshot", (PyCFunction)(void (*)(void))snapshot, METH_FASTCALL,
     "snapshot(values, what) -> memoryview: a private copy of a 1-D integer array"},
    {"pack_ints", (PyCFunction)(void (*)(void))pack_ints, METH_FASTCALL,
     "pack_ints(values, mode, what) -> msgpack array bytes, every int in its smallest form"},
    {NULL},
};

static struct PyModuleDef packmodule = {
    PyModuleDef_HEAD_INIT, "_pack", "Int arrays to msgpack.", -1, methods,
};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&packmodule); }
