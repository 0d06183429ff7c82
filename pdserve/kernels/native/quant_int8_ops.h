/* The vector steps quant_int8.h's kernels share: integer dot products (VNNI where the
 * CPU has it, else AVX2), the codes of 4- and 5-bit blocks, the K types' scales and mins,
 * the parts of a row of x. AVX2 and up only. */
#ifndef PD_QUANT_INT8_OPS_H
#define PD_QUANT_INT8_OPS_H

#include "kernel_args.h"
#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__)
/* acc + the sums of 4 adjacent products u8 * s8 (|u| <= 128, |s| <= 127: no overflow) */
static inline __m256i dpb(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else /* vpmaddubsw saturates past 32767: 2 * 128 * 127 stays below */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* acc + the sums of 2 adjacent products i16 * i16 */
static inline __m256i dpw(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 32 bytes: byte i is 0xff where bit i of `bits` is set */
static inline __m256i bit_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_movm_epi8((__mmask32)bits);
#else
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)); /* all but bit i */
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
#endif
}

/* a block of 32's 4-bit codes: elements 0-15 the low nibbles of 16 bytes, 16-31 the high */
static inline __m256i nib32(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0xf);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

/* 5-bit codes: nib32 plus 16 where bit i of qh is set */
static inline __m256i nib32h(const uint8_t *p, const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_or_si256(nib32(p), _mm256_and_si256(bit_bytes(h), _mm256_set1_epi8(0x10)));
}

#define XR8 4 /* rows of x one pass over a weight row serves (each block's codes formed once) */
#define AI static inline __attribute__((always_inline))

#define ADD(acc, lanes, scale)                                                              \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(scale), acc)

/* row r of x's q256 parts (kernel_args.h) */
#define XQ256(r)                                                                            \
    const int8_t *q = (const int8_t *)(xq + (r) * xb + k + k / 4);                          \
    const float *dx = (const float *)(q + k);                                               \
    const int16_t *bsum = (const int16_t *)(dx + k / 256);                                  \
    (void)bsum

/* Q4_K / Q5_K's 8 scales and 8 mins (6 bits each) from the 12 packed bytes */
static inline void k_scales8(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t w[3], u[4];
    memcpy(w, s, 12);
    u[0] = w[0] & 0x3f3f3f3f;
    u[1] = (w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030);
    u[2] = w[1] & 0x3f3f3f3f;
    u[3] = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030);
    memcpy(sc, u, 8);
    memcpy(mn, u + 2, 8);
}

/* int16 lane l of v (both 128-bit halves alike) in every lane: vpshufb of bytes 2l, 2l + 1 */
static inline __m256i lane16(__m256i v, int l) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * l)));
}

/* Q4_K / Q5_K's scales and mins as 16 bytes [sc0 .. sc7 | mn0 .. mn7] from the 12 packed
 * bytes at s, in vector registers (k_scales8's scalar steps cost a 2-row dot a sixth of its
 * instructions). Reads 16 bytes: a block's codes follow its scales. */
static inline __m128i k_scales16(const uint8_t *s) {
    __m128i r = _mm_loadu_si128((const __m128i *)s);             /* w0 w1 w2 - */
    __m128i p = _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 1, 2, 0));   /* w0 w2 w1 w2 */
    __m128i q = _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 1, 0, 0));   /* w0 w0 w1 w1 */
    /* low bits: w0 & 63, w2 & 15, w1 & 63, (w2 >> 4) & 15; high bits of the last 4 of
     * each: the top two bits of w0 (scales) and w1 (mins), as bits 4-5 */
    __m128i lo = _mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)),
                               _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi32(q, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

#endif

#endif
