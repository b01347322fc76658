/* msgpack readers under the one batch payload scanner (kvwire/_native/scan.h):
 * a subset of msgpack, read the way msgspec reads it.
 *
 * One error convention: a reader returns 0, the value read and the cursor past
 * it, or FALL: the bytes are outside the subset (malformed, truncated or just
 * another form), and the caller falls back to decoding the payload the general
 * way. Every length is checked against the bytes left before it is used.
 * Include after <Python.h> (Py_ssize_t).
 */
#ifndef KVWIRE_MSGPACK_READ_H
#define KVWIRE_MSGPACK_READ_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FALL 1 /* outside the subset: the caller falls back */

/* A cursor over a payload: bytes p[0..n), the next one at p[i]. */
typedef struct {
    const unsigned char *p;
    Py_ssize_t n, i;
} Rd;

/* The n bytes at p (n <= 8) as a big-endian unsigned int. */
static inline uint64_t kvw_get_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An int of any msgpack form at p[0..len), len >= 1: the bytes it takes (0: not
 * an int, -1: truncated); *v its 64-bit two's complement, *neg a negative one. */
static inline int kvw_get_int(const unsigned char *p, Py_ssize_t len, uint64_t *v, int *neg) {
    unsigned char c = p[0];
    *neg = 0;
    if (c <= 0x7f) { *v = c; return 1; }
    if (c >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)c; *neg = 1; return 1; }
    int w;
    switch (c) {
        case 0xcc: w = 1; break;
        case 0xcd: w = 2; break;
        case 0xce: w = 4; break;
        case 0xcf: w = 8; break;
        case 0xd0: w = -1; break;
        case 0xd1: w = -2; break;
        case 0xd2: w = -4; break;
        case 0xd3: w = -8; break;
        default: return 0;
    }
    int bytes = w < 0 ? -w : w;
    if (len - 1 < bytes) return -1;
    uint64_t x = kvw_get_be(p + 1, bytes);
    if (w < 0) {
        if (bytes < 8) {
            int shift = 64 - 8 * bytes;
            x = (uint64_t)(((int64_t)(x << shift)) >> shift);
        }
        *neg = (int64_t)x < 0;
    }
    *v = x;
    return 1 + bytes;
}

/* An int of any msgpack form; the cursor stays put on FALL. */
static inline int rd_int(Rd *r, uint64_t *v, int *neg) {
    if (r->i >= r->n) return FALL;
    int used = kvw_get_int(r->p + r->i, r->n - r->i, v, neg);
    if (used <= 0) return FALL;
    r->i += used;
    return 0;
}

/* 1 (and the cursor past it) if a nil is next, else 0. */
static inline int rd_nil(Rd *r) {
    if (r->i < r->n && r->p[r->i] == 0xc0) {
        r->i++;
        return 1;
    }
    return 0;
}

/* nil (*has 0, *v untouched) or an int (*has 1). */
static inline int rd_opt_int(Rd *r, uint64_t *v, int *neg, int *has) {
    *has = !rd_nil(r);
    return *has ? rd_int(r, v, neg) : 0;
}

/* An array (fix 0x90) or map (fix 0x80) header; *n checked against the bytes
 * left, every item taking at least per_item of them. */
static inline int rd_head(Rd *r, Py_ssize_t *n, unsigned char fix, unsigned char b16,
                          unsigned char b32, Py_ssize_t per_item) {
    if (r->i >= r->n) return FALL;
    unsigned char c = r->p[r->i];
    Py_ssize_t rem = r->n - r->i - 1;
    if (c >= fix && c <= fix + 15) { *n = c & 15; r->i += 1; }
    else if (c == b16) { if (rem < 2) return FALL; *n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 2); r->i += 3; }
    else if (c == b32) { if (rem < 4) return FALL; *n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 4); r->i += 5; }
    else return FALL;
    return *n > (r->n - r->i) / per_item ? FALL : 0;
}

#define RD_ARRAY(r, n) rd_head((r), (n), 0x90, 0xdc, 0xdd, 1)
#define RD_MAP(r, n) rd_head((r), (n), 0x80, 0xde, 0xdf, 2)

/* Whether head byte c starts an array, a map. */
static inline int is_array_head(unsigned char c) { return (c >= 0x90 && c <= 0x9f) || c == 0xdc || c == 0xdd; }
static inline int is_map_head(unsigned char c) { return (c >= 0x80 && c <= 0x8f) || c == 0xde || c == 0xdf; }

/* An ASCII string (the same str for every decoder), *s pointing into the
 * payload; the cursor stays put on FALL. */
static inline int rd_str(Rd *r, const char **s, Py_ssize_t *len) {
    if (r->i >= r->n) return FALL;
    unsigned char c = r->p[r->i];
    Py_ssize_t rem = r->n - r->i - 1, n, h;
    if (c >= 0xa0 && c <= 0xbf) { n = c & 31; h = 1; }
    else if (c == 0xd9) { if (rem < 1) return FALL; n = r->p[r->i + 1]; h = 2; }
    else if (c == 0xda) { if (rem < 2) return FALL; n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 2); h = 3; }
    else if (c == 0xdb) { if (rem < 4) return FALL; n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 4); h = 5; }
    else return FALL;
    if (n > r->n - r->i - h) return FALL;
    const unsigned char *b = r->p + r->i + h;
    for (Py_ssize_t k = 0; k < n; k++)
        if (b[k] & 0x80) return FALL;
    *s = (const char *)b;
    *len = n;
    r->i += h + n;
    return 0;
}

/* nil (*len -1, *s untouched) or an ASCII string. */
static inline int rd_opt_str(Rd *r, const char **s, Py_ssize_t *len) {
    if (!rd_nil(r)) return rd_str(r, s, len);
    *len = -1;
    return 0;
}

/* A value nobody reads: nil, a bool, a number, an ASCII string or bytes. */
static inline int rd_skip(Rd *r) {
    if (r->i >= r->n) return FALL;
    unsigned char c = r->p[r->i];
    Py_ssize_t rem = r->n - r->i - 1, n;
    uint64_t v;
    int neg;
    const char *s;
    switch (c) {
        case 0xc0: case 0xc2: case 0xc3: r->i++; return 0;
        case 0xca: if (rem < 4) return FALL; r->i += 5; return 0;
        case 0xcb: if (rem < 8) return FALL; r->i += 9; return 0;
        case 0xc4: if (rem < 1) return FALL; n = r->p[r->i + 1]; r->i += 2; break;
        case 0xc5: if (rem < 2) return FALL; n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 2); r->i += 3; break;
        case 0xc6: if (rem < 4) return FALL; n = (Py_ssize_t)kvw_get_be(r->p + r->i + 1, 4); r->i += 5; break;
        default:
            if (rd_int(r, &v, &neg) == 0) return 0;
            return rd_str(r, &s, &n);
    }
    if (n > r->n - r->i) return FALL;
    r->i += n;
    return 0;
}

/* Whether the n bytes at s are the C string lit. */
static inline int str_is(const char *s, Py_ssize_t n, const char *lit) {
    return (size_t)n == strlen(lit) && memcmp(s, lit, (size_t)n) == 0;
}

/* Room for `need` items of `item` bytes in *a (capacity *cap, doubled as
 * needed): scratch a first pass fills, which may run without the GIL, so the
 * raw allocator (free it with PyMem_RawFree) and -1 without an exception (the
 * caller raises MemoryError). */
static inline int kvw_grow(void **a, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = PyMem_RawRealloc(*a, (size_t)c * item);
    if (!p) return -1;
    *a = p;
    *cap = c;
    return 0;
}

#endif /* KVWIRE_MSGPACK_READ_H */
