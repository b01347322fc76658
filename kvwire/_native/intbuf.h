/* 1-D buffers of native integers (numpy arrays, array.array, typed memoryviews), for the
 * C extensions that read them: which buffer formats are ints, and one item's value; and
 * any Python int (or object with __index__) as 64 bits. Include after Python.h. */
#ifndef KVWIRE_INTBUF_H
#define KVWIRE_INTBUF_H

#include <stdint.h>
#include <string.h>

/* Whether a buffer's items are native-endian integers of 1, 2, 4 or 8 bytes: 1 signed,
 * 0 unsigned, -1 with `err` (ValueError or TypeError) set naming `what`. */
static inline int kvw_int_format(const Py_buffer *v, const char *what, PyObject *err) {
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
    return is_signed;
}

/* The same, for a 1-D buffer. */
static inline int kvw_int_buffer(const Py_buffer *v, const char *what, PyObject *err) {
    int is_signed = kvw_int_format(v, what, err);
    if (is_signed >= 0 && v->ndim != 1) {
        PyErr_Format(err, "%s must be a 1-D integer array; got %d dimensions", what, v->ndim);
        return -1;
    }
    return is_signed;
}

/* `body` for each item i < n of the `size`-byte ints kvw_int_format accepted at p, `stride`
 * bytes apart (a literal 0: contiguous, which the compiler vectorizes), with x the item's
 * 64-bit pattern (sign-extended when is_signed): a loop per width and sign, each item one
 * load (token ids and hashes go through here by the million). Pass p, stride and n as
 * locals: they are read on every item. */
#define KVW_EACH_INT(p, stride, size, is_signed, n, i, x, body)                             \
    switch ((size) * 2 + !(is_signed)) {                                                    \
        case 2: KVW_EACH_AS(int8_t, p, stride, n, i, x, body) break;                        \
        case 3: KVW_EACH_AS(uint8_t, p, stride, n, i, x, body) break;                       \
        case 4: KVW_EACH_AS(int16_t, p, stride, n, i, x, body) break;                       \
        case 5: KVW_EACH_AS(uint16_t, p, stride, n, i, x, body) break;                      \
        case 8: KVW_EACH_AS(int32_t, p, stride, n, i, x, body) break;                       \
        case 9: KVW_EACH_AS(uint32_t, p, stride, n, i, x, body) break;                      \
        case 16: KVW_EACH_AS(int64_t, p, stride, n, i, x, body) break;                      \
        default: KVW_EACH_AS(uint64_t, p, stride, n, i, x, body) break;                     \
    }
#define KVW_EACH_AS(T, p, stride, n, i, x, body)                                            \
    for (Py_ssize_t i = 0; i < (n); i++) {                                                  \
        T kvw_item;                                                                         \
        memcpy(&kvw_item, (p) + i * ((stride) ? (stride) : (Py_ssize_t)sizeof kvw_item),     \
               sizeof kvw_item);                                                            \
        uint64_t x = (uint64_t)kvw_item;                                                    \
        body                                                                                \
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
