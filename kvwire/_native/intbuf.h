/* 1-D buffers of native integers (numpy arrays, array.array, typed memoryviews), for the
 * C extensions that read them: which buffer formats are ints, and one item's value; and
 * any Python int (or object with __index__) as 64 bits. Include after Python.h. */
#ifndef KVWIRE_INTBUF_H
#define KVWIRE_INTBUF_H

#include <stdint.h>
#include <string.h>

/* Whether a buffer holds native-endian integers, 1-D: 1 signed, 0 unsigned, -1 with `err`
 * (ValueError or TypeError) set naming `what`. */
static inline int kvw_int_buffer(const Py_buffer *v, const char *what, PyObject *err) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    else if (*f == '>' || *f == '!') {
        PyErr_Format(err, "%s: big-endian arrays are not supported", what);
        return -1;
    }
    int is_signed;
    switch (f[0]) {
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': is_signed = 1; break;
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': is_signed = 0; break;
        default: is_signed = -1;
    }
    Py_ssize_t w = v->itemsize;
    if (is_signed < 0 || f[1] != 0 || (w != 1 && w != 2 && w != 4 && w != 8)) {
        PyErr_Format(err, "%s must be a 1-D integer array; got buffer format '%s'", what, v->format);
        return -1;
    }
    if (v->ndim != 1) {
        PyErr_Format(err, "%s must be a 1-D integer array; got %d dimensions", what, v->ndim);
        return -1;
    }
    return is_signed;
}

/* Item i of a buffer kvw_int_buffer accepted: its 64-bit pattern (sign-extended when
 * is_signed). */
static inline uint64_t kvw_buffer_item(const Py_buffer *v, Py_ssize_t i, int is_signed) {
    const char *p = (const char *)v->buf + i * (v->strides ? v->strides[0] : v->itemsize);
    switch (v->itemsize * 2 + !is_signed) {
        case 2: { int8_t x; memcpy(&x, p, 1); return (uint64_t)(int64_t)x; }
        case 3: { uint8_t x; memcpy(&x, p, 1); return x; }
        case 4: { int16_t x; memcpy(&x, p, 2); return (uint64_t)(int64_t)x; }
        case 5: { uint16_t x; memcpy(&x, p, 2); return x; }
        case 8: { int32_t x; memcpy(&x, p, 4); return (uint64_t)(int64_t)x; }
        case 9: { uint32_t x; memcpy(&x, p, 4); return x; }
        case 16: { int64_t x; memcpy(&x, p, 8); return (uint64_t)x; }
        default: { uint64_t x; memcpy(&x, p, 8); return x; }
    }
}

/* Any int, or object with __index__ (numpy scalars), `what` of a value: its 64-bit pattern
 * in *bits, *is_unsigned when it is above 2**63 - 1. 0, or -1 with ValueError (not an int,
 * or outside [-2**63, 2**64)) or __index__'s own error. */
static inline int kvw_int_bits(PyObject *o, uint64_t *bits, int *is_unsigned, const char *what) {
    PyObject *idx = NULL;
    if (!PyLong_Check(o)) {
        if (!Py_TYPE(o)->tp_as_number || !Py_TYPE(o)->tp_as_number->nb_index) {
            PyErr_Format(PyExc_ValueError, "%s %R is not an int", what, o);
            return -1;
        }
        idx = PyNumber_Index(o);
        if (!idx) return -1;
        o = idx;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    int rc = 0;
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) rc = -1;
        *bits = (uint64_t)v;
        *is_unsigned = 0;
    } else if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s %R does not fit in 64 bits", what, o);
            rc = -1;
        }
        *bits = u;
        *is_unsigned = 1;
    } else {
        PyErr_Format(PyExc_ValueError, "%s %R does not fit in 64 bits", what, o);
        rc = -1;
    }
    Py_XDECREF(idx);
    return rc;
}

#endif /* KVWIRE_INTBUF_H */
