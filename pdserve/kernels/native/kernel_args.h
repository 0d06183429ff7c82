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

/* pd_quant_linear_range: y [m][ldy] columns [0, n) = x @ W^T + bias over tiles [lo, hi)
 * of 4 rows of W, W in GGUF blocks (linear_quant.c) */
typedef struct {
    const float *x;     /* [m][k_dim] */
    const uint8_t *xq;  /* NULL, or x's rows quantized (pd_xq_bytes(k_dim) apart): int8 dots */
    const uint8_t *w;   /* [n] rows of row_bytes */
    const float *bias;  /* [n] or NULL */
    float *y;           /* [m][ldy], columns [0, n) written */
    int64_t m, n, k_dim, ldy, row_bytes;
    int32_t type;       /* a GGML type number (the enum above) */
    int32_t status;     /* 1: a type without a kernel (nothing written) */
} QuantArgs;

/* --quant-activations int8: one row of x (k_dim a multiple of 32) quantized two ways,
 * pd_xq_bytes(k) bytes (quant_int8.h writes and reads it):
 *     q32   int8 [k]        per block b of 32: round-to-nearest-even(x / d32[b])
 *     d32   float [k / 32]  max |x| of the block / 127
 *     s32   float [k / 32]  d32[b] * (the sum of the block's q32)
 *   then only where k % 256 == 0 (the K types' super-blocks, as llama.cpp's q8_K):
 *     q256  int8 [k]        per block of 256, as q32
 *     d256  float [k / 256]
 *     bsum  int16 [k / 16]  the sum of each 16 q256 */
static inline int64_t pd_xq_bytes(int64_t k) {
    return k + k / 4 + (k % 256 ? 0 : k + k / 64 + k / 8);
}
/* pd_quant_groups_range: several projections of one shape (a layer's routed experts) in
 * one call: tiles [lo, hi) of the groups' tiles laid end to end, group g's tile t at
 * g * tiles + t; each group its own x, W, y and m (0: skipped) */
typedef struct {
    QuantArgs *groups; /* [count], each n rows (tiles = ceil(n / 4)) */
    int64_t count, tiles;
} QuantGroups;

/* pd_quant_gemm8_range: q's projection over tiles [lo, hi) by the tiled integer GEMM,
 * x given as pd_quant_x8_tiles laid it out (quant_gemm8.h); q->xq is not read */
typedef struct {
    QuantArgs *q;
    const uint8_t *xt;
} Gemm8Args;

/* pd_quant_x8_range: groups [lo, hi) of 16 rows of x [m][k]: quantized into xq where x
 * is given (pd_quant_x8), then laid out into xt for the GEMM where xt is given */
typedef struct {
    const float *x;
    uint8_t *xq, *xt;
    int64_t m, k;
} X8Args;

/* pd_quant_rows: out [count][k] = the de-quantized rows ids of W (embedding look-ups) */
typedef int (*pd_rows_fn)(int32_t type, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                          int64_t count, int64_t k, float *out);

/* pd_paged_decode_range: (request, kv head) pairs [lo, hi), request-major. Every part
 * checks the same shape limits, so `status` ends the same whichever part writes it. */
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
