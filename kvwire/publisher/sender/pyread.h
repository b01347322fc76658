/* Reading Python objects without the GIL, for the sender's files: only exact types whose
 * fields never change (int, str, and the items of lists and tuples the collector's contract
 * keeps unchanged), so reading their memory needs no lock. All static inline: these are the
 * per-int loops of the engine thread and the sender thread. */
#ifndef KVWIRE_PYREAD_H
#define KVWIRE_PYREAD_H

#include "sender.h"


/* An exact int within [-2**63, 2**64); 0, or -1 for anything else. */
static __attribute__((unused)) int read_int(PyObject *o, IntV *out) {
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
static __attribute__((unused)) int read_str(PyObject *o, const char **s, Py_ssize_t *n) {
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

/* None or an exact int (group_idx). */
static __attribute__((unused)) int read_opt_int(PyObject *o, IntV *v, int *present) {
    *present = o != Py_None;
    return *present ? read_int(o, v) : 0;
}

static __attribute__((unused)) int same_opt_int(PyObject *a, PyObject *b) {
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
static __attribute__((unused, noinline)) int read_bits(PyObject *seq, u64 *v, int *neg, int *mixed) {
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
static __attribute__((unused, noinline)) int read_tokens(PyObject *seq, uint32_t *v) {
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


static inline int exact_seq(PyObject *o) { return PyList_CheckExact(o) || PyTuple_CheckExact(o); }

#endif /* KVWIRE_PYREAD_H */
