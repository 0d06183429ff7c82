/* zmq_send.c: one multipart message whose payload frames libzmq reads in place, sent
 * through libzmq's own C API (transfer/zmq_native.py says why and when).
 *
 *   pd_zmq_send(api, socket, head, head_len, addrs, sizes, n, pending) -> 0 or errno
 *       head            copied into the first frame (a KVChunk header: ~150 bytes)
 *       addrs / sizes   n payload frames, read by libzmq's I/O thread in place
 *       pending         set to n here; libzmq's I/O thread decrements it once per frame
 *                       it no longer reads (frame_done), so 0 means the caller may reuse
 *                       or free the frames' memory
 *
 * No libzmq header and no link: `api` holds the functions of the libzmq that pyzmq
 * loaded (the one the socket belongs to), looked up by the caller. zmq_msg_t is 64
 * opaque bytes (zmq.h since 4.1). The socket is used from one thread, the caller's.
 *
 * Invariant: every frame handed to libzmq is counted in *pending exactly once and
 * decremented exactly once (by libzmq when it lets go, or here for frames never handed
 * over), so *pending reaches 0 on every path, errors included. *pending must stay
 * valid for as long as libzmq may hold a frame (the caller never frees it).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "abi.h" /* kernels/native/abi.h, on the include path */

typedef struct {
    _Alignas(8) unsigned char bytes[64];
} zmq_msg;

typedef void (*free_fn)(void *data, void *hint);

typedef struct {
    int (*msg_init_size)(zmq_msg *msg, size_t size);
    int (*msg_init_data)(zmq_msg *msg, void *data, size_t size, free_fn ffn, void *hint);
    void *(*msg_data)(zmq_msg *msg);
    int (*msg_send)(zmq_msg *msg, void *socket, int flags);
    int (*msg_close)(zmq_msg *msg);
    int (*errno_)(void);
} ZmqApi;

enum { SNDMORE = 2 }; /* ZMQ_SNDMORE */

/* Called by libzmq (its I/O thread, or the closing thread) once per frame it lets go. */
static void frame_done(void *data, void *hint) {
    (void)data;
    __atomic_sub_fetch((int64_t *)hint, 1, __ATOMIC_RELEASE);
}

static int fail(const ZmqApi *z, zmq_msg *msg, int64_t *pending, int64_t never_handed) {
    int err = z->errno_();
    if (msg)
        z->msg_close(msg); /* a payload frame: libzmq calls frame_done for it */
    __atomic_sub_fetch(pending, never_handed, __ATOMIC_RELEASE);
    return err ? err : -1;
}

int pd_zmq_send(const ZmqApi *z, void *socket, const void *head, int64_t head_len,
                const void *const *addrs, const int64_t *sizes, int64_t n, int64_t *pending) {
    zmq_msg msg;
    __atomic_store_n(pending, n, __ATOMIC_RELEASE);
    if (z->msg_init_size(&msg, (size_t)head_len) != 0)
        return fail(z, NULL, pending, n);
    memcpy(z->msg_data(&msg), head, (size_t)head_len);
    if (z->msg_send(&msg, socket, n > 0 ? SNDMORE : 0) < 0) {
        int err = z->errno_();
        z->msg_close(&msg); /* the header (no frame_done: it is a copy) */
        __atomic_sub_fetch(pending, n, __ATOMIC_RELEASE);
        return err ? err : -1;
    }
    for (int64_t i = 0; i < n; i++) {
        void *data = (void *)addrs[i];
        if (z->msg_init_data(&msg, data, (size_t)sizes[i], frame_done, pending) != 0)
            return fail(z, NULL, pending, n - i);
        if (z->msg_send(&msg, socket, i + 1 < n ? SNDMORE : 0) < 0)
            return fail(z, &msg, pending, n - i - 1);
    }
    return 0;
}

/* The layout transfer/zmq_native.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(ZmqApi),
    PD_ABI_FIELD(ZmqApi, msg_init_size), PD_ABI_FIELD(ZmqApi, msg_init_data),
    PD_ABI_FIELD(ZmqApi, msg_data), PD_ABI_FIELD(ZmqApi, msg_send),
    PD_ABI_FIELD(ZmqApi, msg_close), PD_ABI_FIELD(ZmqApi, errno_),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
