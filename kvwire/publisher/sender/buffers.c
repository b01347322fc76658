/* Payload buffers: reference-counted, carved from reused slabs; Payload, their Python view. */
#include <stddef.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "sender.h"

/* The sender thread's payloads are carved one after the other from 1 MiB slabs (exact sizes,
 * no malloc per batch), and a slab whose payloads are all released is kept for reuse. The
 * replay ring keeps each payload for buffer_steps batches, and memory a process touches for
 * the first time costs a page fault per 4 KiB (about half the sender's time at B=256 when
 * each payload was a fresh malloc, the allocator growing and trimming its heap): a reused
 * slab costs none, and a new one is populated in one madvise call rather than page by page.
 * Payloads are released in about the order they were made (the ring is a FIFO), so slabs
 * empty in turn. A Pool outlives its Sender while slabs remain (one reference per slab). */
#define SLAB_BYTES ((size_t)1 << 20)
#define SLAB_SPARE 16 /* empty slabs kept for reuse (at most 16 MiB a pool) */

typedef struct Slab {
    atomic_long live; /* payloads carved from it, plus one while it is being carved */
    Pool *pool;
    size_t used;      /* bytes carved (with cur) */
    struct Slab *next; /* on the spare list */
    _Alignas(16) unsigned char mem[];
} Slab;

#define SLAB_CAP (SLAB_BYTES - offsetof(Slab, mem))

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL): faults then */
#endif

static void pool_unref(Pool *p) {
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&p->mu);
        free(p);
    }
}

Pool *pool_new(int populate) {
    Pool *p = calloc(1, sizeof(Pool));
    if (p) {
        p->populate = populate;
        atomic_init(&p->refs, 1);
        atomic_init(&p->made, 0);
        atomic_init(&p->mapped, 0);
        pthread_mutex_init(&p->mu, NULL);
    }
    return p;
}

static void slab_unmap(Slab *s) {
    Pool *p = s->pool;
    atomic_fetch_sub_explicit(&p->mapped, 1, memory_order_relaxed);
    UNPOISON(s, SLAB_BYTES);
    munmap(s, SLAB_BYTES);
    pool_unref(p);
}

/* One reference less on a slab: emptied, it goes to the spare list (or away). */
static void slab_release(Slab *s) {
    if (atomic_fetch_sub_explicit(&s->live, 1, memory_order_acq_rel) != 1) return;
    Pool *p = s->pool;
    pthread_mutex_lock(&p->mu);
    int keep = !p->closed && p->nspare < SLAB_SPARE;
    if (keep) {
        s->next = p->spare;
        p->spare = s;
        p->nspare++;
    }
    pthread_mutex_unlock(&p->mu);
    if (!keep) slab_unmap(s);
}

/* The sender is done with its pool: what is spare goes, the rest when emptied. */
void pool_close(Pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    Slab *spare = p->spare;
    p->spare = NULL;
    p->nspare = 0;
    pthread_mutex_unlock(&p->mu);
    while (spare) {
        Slab *next = spare->next;
        slab_unmap(spare);
        spare = next;
    }
    if (p->cur) slab_release(p->cur);
    p->cur = NULL;
    pool_unref(p);
}

/* A slab to carve: a spare one (its pages already in memory), or a new one. */
static Slab *slab_get(Pool *p) {
    pthread_mutex_lock(&p->mu);
    Slab *s = p->spare;
    if (s) {
        p->spare = s->next;
        p->nspare--;
    }
    pthread_mutex_unlock(&p->mu);
    if (!s) {
        void *m = mmap(NULL, SLAB_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        if (p->populate) (void)madvise(m, SLAB_BYTES, MADV_POPULATE_WRITE);
        s = m;
        s->pool = p;
        atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->made, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->mapped, 1, memory_order_relaxed);
    }
    POISON(s->mem, SLAB_CAP);
    atomic_init(&s->live, 1);
    s->used = 0;
    s->next = NULL;
    return s;
}

/* A buffer for up to cap bytes: carved from the pool's slab (pool: the caller is its only
 * user), or malloc'd (pool NULL, too large a payload, or no slab to be had). Set its length
 * with buf_end(), before the next buf_new() on the pool. */
Buf *buf_new(Pool *pool, size_t cap) {
    size_t need = (sizeof(Buf) + cap + 15) & ~(size_t)15;
    Slab *s = NULL;
    Buf *b;
    if (pool && need <= SLAB_CAP / 4) {
        s = pool->cur;
        if (!s || s->used + need > SLAB_CAP) {
            if (s) slab_release(s);
            s = pool->cur = slab_get(pool);
        }
    }
    if (s) {
        b = (Buf *)(s->mem + s->used);
        UNPOISON(b, need);
        atomic_fetch_add_explicit(&s->live, 1, memory_order_relaxed);
    } else if (!(b = malloc(sizeof(Buf) + cap))) {
        return NULL;
    }
    atomic_init(&b->refs, 1);
    b->len = 0;
    b->slab = s;
    return b;
}

/* The payload ends at `end`: its length, and (carved) the slab's next buffer starts after it. */
void buf_end(Buf *b, const unsigned char *end) {
    b->len = (size_t)(end - b->data);
    Slab *s = b->slab;
    if (s) {
        size_t used = (size_t)((unsigned char *)b - s->mem);
        size_t size = (sizeof(Buf) + b->len + 15) & ~(size_t)15;
        s->used = used + size;
        POISON(b->data + b->len, size - sizeof(Buf) - b->len);
        POISON(s->mem + s->used, SLAB_CAP - s->used);
    }
}

void buf_unref(Buf *b) {
    if (!b || atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1) return;
    Slab *s = b->slab;
    if (!s) {
        free(b);
        return;
    }
    POISON(b, sizeof(Buf) + b->len);
    slab_release(s);
}

/* Ints copied on the engine thread (a record's vals, an engine batch's ints), until the
 * sender encodes them: carved like payloads from a pool of the GIL holders' (the sender's
 * vpool; they are released at once after encoding, so its slabs cycle without touching
 * new memory), or malloc'd (pool NULL). 8-byte aligned. End with ints_end() before the
 * next ints_alloc() on the pool, or free. */
void *ints_alloc(Pool *pool, size_t bytes) {
    Buf *b = buf_new(pool, bytes);
    return b ? b->data : NULL;
}

static inline Buf *ints_buf(void *v) { return (Buf *)((unsigned char *)v - offsetof(Buf, data)); }

void ints_end(void *v, size_t bytes) { buf_end(ints_buf(v), (unsigned char *)v + bytes); }

void ints_free(void *v) {
    if (v) buf_unref(ints_buf(v));
}

void buf_free_zmq(void *data, void *hint) { buf_unref((Buf *)hint); }

/* A payload as new bytes, the buffer released (None for NULL: nothing encoded natively). */
PyObject *buf_bytes(Buf *b) {
    if (!b) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize((const char *)b->data, (Py_ssize_t)b->len);
    buf_unref(b);
    return out;
}

/* A payload as Python sees it: a read-only buffer over a Buf, holding a reference. */
typedef struct {
    PyObject_HEAD
    Buf *buf;
} Payload;

PyObject *payload_wrap(Buf *b) { /* takes a new reference to b */
    Payload *p = PyObject_New(Payload, &PayloadType);
    if (!p) return NULL;
    buf_ref(b);
    p->buf = b;
    return (PyObject *)p;
}

Buf *payload_buf(PyObject *payload) { return ((Payload *)payload)->buf; }

static void payload_dealloc(Payload *p) {
    buf_unref(p->buf);
    PyObject_Free(p);
}

static int payload_getbuffer(Payload *p, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)p, p->buf->data, (Py_ssize_t)p->buf->len, 1, flags);
}

static Py_ssize_t payload_len(Payload *p) { return (Py_ssize_t)p->buf->len; }

static PyBufferProcs payload_as_buffer = {(getbufferproc)payload_getbuffer, NULL};
static PySequenceMethods payload_as_seq = {.sq_length = (lenfunc)payload_len};

PyTypeObject PayloadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwire.publisher._sender.Payload",
    .tp_basicsize = sizeof(Payload),
    .tp_dealloc = (destructor)payload_dealloc,
    .tp_as_buffer = &payload_as_buffer,
    .tp_as_sequence = &payload_as_seq,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A sent batch's payload (read-only buffer, shared, never copied).",
};
