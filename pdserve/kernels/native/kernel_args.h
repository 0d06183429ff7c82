/* The argument structs of the kernels that run in parts on par.c's workers, shared by
 * the kernels (linear_f32.c, paged_decode.c) and by decode_forward.c, which calls them
 * through function pointers. kernels/native/library.py mirrors them as ctypes Structures:
 * a field changed here is changed there too. */
#ifndef PD_KERNEL_ARGS_H
#define PD_KERNEL_ARGS_H

#include <stdint.h>

/* fn(args, lo, hi): one part [lo, hi) of a kernel's range (panels, requests) */
typedef void (*pd_range_fn)(const void *args, int64_t lo, int64_t hi);

/* pd_linear_f32_range: y [m][n] = x [m][k_dim] @ W^T + bias over panels [lo, hi) */
typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, n, k_dim;
} LinearArgs;

/* pd_paged_decode_range: requests [lo, hi). Every part checks the same shape limits,
 * so `status` ends the same whichever part writes it. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const float *k_pool, *v_pool;
    const int64_t *slots;
    int64_t slot_stride;
    const int64_t *bounds;
    int64_t h, kh, d;
    float scale;
    float *out;
    int32_t status;
} PagedDecodeArgs;

#endif
