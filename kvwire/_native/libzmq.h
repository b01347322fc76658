/* The few libzmq calls kvwire's native threads make, resolved at run time.
 *
 * pyzmq wheels bundle their own libzmq and ship no header, so an extension
 * cannot link against it. Instead the extension is handed the path of the
 * libzmq already mapped into the process (kvwire._native.libzmq_path(), read
 * from /proc/self/maps after `import zmq`) and opens it with RTLD_NOLOAD: the
 * same library instance, hence the same contexts and sockets, as pyzmq's. A
 * socket is then used through its `zmq.Socket.underlying` address, from one
 * thread at a time, as libzmq requires.
 *
 * Include in exactly one translation unit per extension (the table is static).
 */
#ifndef KVWIRE_LIBZMQ_H
#define KVWIRE_LIBZMQ_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

/* libzmq's zmq_msg_t: 64 opaque bytes, pointer-aligned (zmq.h, 4.x). */
typedef struct kvw_zmq_msg {
    __attribute__((aligned(sizeof(void *)))) unsigned char _[64];
} kvw_zmq_msg;

typedef void(kvw_zmq_free_fn)(void *data, void *hint);

#define KVW_ZMQ_DONTWAIT 1
#define KVW_ZMQ_SNDMORE 2
#define KVW_ZMQ_RCVMORE 13
#define KVW_ZMQ_EVENTS 15
#define KVW_ZMQ_POLLIN 1
#define KVW_ZMQ_POLLOUT 2
#define KVW_EAGAIN 11
#define KVW_EINTR 4

typedef struct kvw_zmq_api {
    int (*send)(void *socket, const void *buf, size_t len, int flags);
    int (*msg_init)(kvw_zmq_msg *msg);
    int (*msg_init_size)(kvw_zmq_msg *msg, size_t size);
    int (*msg_init_data)(kvw_zmq_msg *msg, void *data, size_t size, kvw_zmq_free_fn *ffn,
                         void *hint);
    int (*msg_send)(kvw_zmq_msg *msg, void *socket, int flags);
    int (*msg_recv)(kvw_zmq_msg *msg, void *socket, int flags);
    int (*msg_close)(kvw_zmq_msg *msg);
    void *(*msg_data)(kvw_zmq_msg *msg);
    size_t (*msg_size)(const kvw_zmq_msg *msg);
    int (*msg_more)(const kvw_zmq_msg *msg);
    int (*getsockopt)(void *socket, int option, void *value, size_t *len);
    int (*errno_)(void);
    const char *(*strerror)(int errnum);
} kvw_zmq_api;

static kvw_zmq_api kvw_zmq;
static int kvw_zmq_loaded = 0;

/* Resolve the table from the libzmq at `path`, which must already be loaded.
 * Returns 0, or -1 with a message in `err` (size `errlen`). Idempotent. */
static int kvw_zmq_load(const char *path, char *err, size_t errlen) {
    if (kvw_zmq_loaded)
        return 0;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, errlen, "libzmq %s is not loaded in this process: %s", path, dlerror());
        return -1;
    }
    kvw_zmq_api api;
#define KVW_SYM(field, name)                                                                   \
    do {                                                                                       \
        *(void **)(&api.field) = dlsym(lib, name);                                             \
        if (api.field == NULL) {                                                               \
            snprintf(err, errlen, "libzmq %s lacks %s", path, name);                           \
            dlclose(lib);                                                                      \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)
    KVW_SYM(send, "zmq_send");
    KVW_SYM(msg_init, "zmq_msg_init");
    KVW_SYM(msg_init_size, "zmq_msg_init_size");
    KVW_SYM(msg_init_data, "zmq_msg_init_data");
    KVW_SYM(msg_send, "zmq_msg_send");
    KVW_SYM(msg_recv, "zmq_msg_recv");
    KVW_SYM(msg_close, "zmq_msg_close");
    KVW_SYM(msg_data, "zmq_msg_data");
    KVW_SYM(msg_size, "zmq_msg_size");
    KVW_SYM(msg_more, "zmq_msg_more");
    KVW_SYM(getsockopt, "zmq_getsockopt");
    KVW_SYM(errno_, "zmq_errno");
    KVW_SYM(strerror, "zmq_strerror");
#undef KVW_SYM
    /* The handle stays open for the life of the process, as pyzmq's does. */
    kvw_zmq = api;
    kvw_zmq_loaded = 1;
    return 0;
}

#endif /* KVWIRE_LIBZMQ_H */
