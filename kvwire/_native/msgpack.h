/* msgpack writers shared by kvwire's C extensions: every int in its smallest
 * form, byte for byte what msgspec writes for the same Python value.
 *
 * Include in each extension that needs them (the functions are static inline).
 * Writers of ints store 8 bytes after the int's head: leave that much slack
 * after the end of the buffer.
 */
#ifndef KVWIRE_MSGPACK_H
#define KVWIRE_MSGPACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline unsigned char *kvw_put_be(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)v;
        v >>= 8;
    }
    return p + n;
}

/* One int, `neg` saying whether the 64-bit pattern v is read as negative.
 * Branch-free on the width (token ids mix widths at random): the head byte,
 * then the low bytes of v big-endian, written as one 8-byte store into the
 * slack the caller leaves after the buffer. */
static inline unsigned char *kvw_put_int(unsigned char *p, uint64_t v, int neg) {
    static const unsigned char pos_head[5] = {0, 0xcc, 0xcd, 0xce, 0xcf};
    static const unsigned char neg_head[5] = {0, 0xd0, 0xd1, 0xd2, 0xd3};
    static const int body[5] = {0, 1, 2, 4, 8};
    int cls;
    unsigned char head;
    if (!neg) {
        cls = (v > 127) + (v > 255) + (v > 65535) + (v > 0xffffffffULL);
        head = cls ? pos_head[cls] : (unsigned char)v;
    } else {
        int64_t x = (int64_t)v;
        cls = (x < -32) + (x < -128) + (x < -32768) + (x < -2147483648LL);
        head = cls ? neg_head[cls] : (unsigned char)v;
    }
    int n = body[cls];
    uint64_t top = n ? v << (64 - 8 * n) : 0;
    uint64_t be = __builtin_bswap64(top);
    p[0] = head;
    memcpy(p + 1, &be, 8);
    return p + 1 + n;
}

/* An int in [0, 2**32) (a token id), as kvw_put_int writes it, in one 8-byte store:
 * (u64)v << 24 byte-swapped holds 0 then v's four bytes big-endian; shifted right by
 * 4 - n bytes, its first byte is a zero (or, for a fixint, v itself) for the head and
 * the next n bytes are v's low bytes big-endian. Head, shift and length come from
 * tables indexed by the count of leading zeros: no comparison chain, no masking (half
 * the time of kvw_put_int on random token ids; the encoder's hottest loop). Stores 8
 * bytes from p: leave that much slack after the end of the buffer. */
static inline unsigned char *kvw_put_u32(unsigned char *p, uint32_t v) {
    /* by leading zeros: 0-15 uint32, 16-23 uint16, 24 uint8, 25-31 positive fixint */
#define KVW_BY_CLZ(u32, u16, u8, fix)                                                        \
    {u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32,         \
     u16, u16, u16, u16, u16, u16, u16, u16, u8,  fix, fix, fix, fix, fix, fix, fix}
    static const unsigned char head[32] = KVW_BY_CLZ(0xce, 0xcd, 0xcc, 0);
    static const unsigned char shift[32] = KVW_BY_CLZ(0, 16, 24, 32);
    static const unsigned char len[32] = KVW_BY_CLZ(5, 3, 2, 1);
#undef KVW_BY_CLZ
    int z = __builtin_clz(v | 1);
    uint64_t w = (__builtin_bswap64((uint64_t)v << 24) >> shift[z]) | head[z];
    memcpy(p, &w, 8);
    return p + len[z];
}

/* An array header for n items. */
static inline unsigned char *kvw_put_array_header(unsigned char *p, size_t n) {
    if (n < 16) {
        *p++ = (unsigned char)(0x90 | n);
        return p;
    }
    if (n < 65536) {
        *p++ = 0xdc;
        return kvw_put_be(p, (uint64_t)n, 2);
    }
    *p++ = 0xdd;
    return kvw_put_be(p, (uint64_t)n, 4);
}

/* A str of n bytes (UTF-8 already). */
static inline unsigned char *kvw_put_str(unsigned char *p, const void *s, size_t n) {
    if (n < 32) {
        *p++ = (unsigned char)(0xa0 | n);
    } else if (n < 256) {
        *p++ = 0xd9;
        *p++ = (unsigned char)n;
    } else if (n < 65536) {
        *p++ = 0xda;
        p = kvw_put_be(p, (uint64_t)n, 2);
    } else {
        *p++ = 0xdb;
        p = kvw_put_be(p, (uint64_t)n, 4);
    }
    memcpy(p, s, n);
    return p + n;
}

/* A float as msgspec writes every Python float: float64. */
static inline unsigned char *kvw_put_float64(unsigned char *p, double d) {
    uint64_t bits;
    memcpy(&bits, &d, 8);
    *p++ = 0xcb;
    return kvw_put_be(p, bits, 8);
}

#endif /* KVWIRE_MSGPACK_H */
