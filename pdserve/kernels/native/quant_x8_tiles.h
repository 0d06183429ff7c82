/* --quant-activations int8 at a batch of rows: x's rows quantized (quant_x8.h) laid out
 * for the tiled GEMM (quant_gemm8.h), once per projection.
 *
 * Why a layout of its own: the GEMM's vpdpbusd takes 4 codes of each of 16 rows in one
 * 64-byte vector (int32 lane r: row r), as its unsigned operand (the codes + 128), so
 * every vector of x it loads serves 16 rows at once. */
#ifndef PD_QUANT_X8_TILES_H
#define PD_QUANT_X8_TILES_H

#include "quant_x8.h"

#define G8 16 /* rows of x in a group: one int32 lane each */

/* The bytes of one group of 16 rows in kind `block` (32: q32, 256: q256):
 *   codes  uint32 [k / 4][16]     lane r: codes 4t .. 4t + 3 of row r, each + 128
 *   dx     float [k / block][16]  d32 or d256
 *   extra  block 32: float [k / 32][16] s32; block 256: int32 [k / 64][16], the pair of
 *          sums of q256 over sub-blocks of 32 (2p low 16 bits, 2p + 1 high)
 * The kind-32 part of every group comes first, then (k % 256 == 0) the kind-256 part. */
static inline int64_t xt_group_bytes(int64_t k, int block) {
    return 16 * k + 64 * (k / block) + 64 * (block == 32 ? k / 32 : k / 64);
}

static inline int64_t xt_groups(int64_t m) { return (m + G8 - 1) / G8; }

static inline int64_t xt_bytes(int64_t m, int64_t k) {
    return xt_groups(m) * (xt_group_bytes(k, 32) + (k % 256 ? 0 : xt_group_bytes(k, 256)));
}

/* group g's part of kind `block` */
static inline const uint8_t *xt_group(const uint8_t *xt, int64_t m, int64_t k, int block,
                                      int64_t g) {
    int64_t base = block == 32 ? 0 : xt_groups(m) * xt_group_bytes(k, 32);
    return xt + base + g * xt_group_bytes(k, block);
}

#if defined(__AVX512F__)
/* out[c] = lane c of every r[i] (16 x 16 int32): three rounds of unpacks and two of
 * 128-bit shuffles */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 16; a += 4) { /* u[a + j]: column 4L + j of rows a .. a + 3, lane L */
        u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        r[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}
#endif

/* one kind's group from its rows of x quantized (rows[r]: kernel_args.h's layout, or
 * NULL: zeros, a row past m) */
static void xt_rows(const uint8_t *const *rows, int64_t k, int block, uint8_t *grp) {
    uint32_t *codes = (uint32_t *)grp;
    float *dx = (float *)(grp + 16 * k);
    int32_t *extra = (int32_t *)(dx + 16 * (k / block));
    const int64_t off = block == 32 ? 0 : k + k / 4; /* q32 or q256 */
    int64_t t = 0;
#if defined(__AVX512F__)
    for (; t + 16 <= k / 4; t += 16) { /* 16 steps of 16 rows: one transpose */
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + off + 4 * t) : _mm512_setzero_si512();
        transpose16(r);
        for (int c = 0; c < 16; c++)
            _mm512_storeu_si512(codes + 16 * (t + c), _mm512_xor_si512(r[c], _mm512_set1_epi8((char)0x80)));
    }
#endif
    for (; t < k / 4; t++)
        for (int r = 0; r < G8; r++) {
            uint32_t v = 0;
            if (rows[r]) memcpy(&v, rows[r] + off + 4 * t, 4);
            codes[16 * t + r] = v ^ 0x80808080u;
        }
    for (int r = 0; r < G8; r++) {
        const float *d = rows[r] ? (const float *)(rows[r] + off + k) : 0;
        for (int64_t b = 0; b < k / block; b++) dx[16 * b + r] = d ? d[b] : 0.0f;
        if (block == 32) {
            for (int64_t b = 0; b < k / 32; b++) {
                float s = d ? d[k / 32 + b] : 0.0f;
                memcpy(extra + 16 * b + r, &s, 4);
            }
            continue;
        }
        const int16_t *bsum = d ? (const int16_t *)(d + k / 256) : 0;
        for (int64_t p = 0; p < k / 64; p++) {
            int32_t lo = bsum ? bsum[4 * p] + bsum[4 * p + 1] : 0;
            int32_t hi = bsum ? bsum[4 * p + 2] + bsum[4 * p + 3] : 0;
            extra[16 * p + r] = (int32_t)((uint32_t)(lo & 0xffff) | ((uint32_t)hi << 16));
        }
    }
}

/* groups [lo, hi) of x's rows (xq: m rows pd_xq_bytes(k) apart) into xt, both kinds */
static void xt_fill(const uint8_t *xq, int64_t m, int64_t k, uint8_t *xt, int64_t lo,
                    int64_t hi) {
    int64_t xb = pd_xq_bytes(k);
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *rows[G8];
        for (int r = 0; r < G8; r++) rows[r] = g * G8 + r < m ? xq + (g * G8 + r) * xb : 0;
        xt_rows(rows, k, 32, (uint8_t *)xt_group(xt, m, k, 32, g));
        if (k % 256 == 0) xt_rows(rows, k, 256, (uint8_t *)xt_group(xt, m, k, 256, g));
    }
}

#endif
