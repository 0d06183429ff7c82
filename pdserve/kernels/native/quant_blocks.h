/* GGUF's block formats, de-quantized a row at a time (row_q8_0 .. iq4_xs, chosen by
 * row_of): the float values `gguf`'s de-quantize gives, per type.
 *
 * Why a header of its own: what a block holds is one concern, how the linear tiles, dots
 * and threads the rows (linear_quant.c, its one includer) another. The build key hashes
 * the headers here with each source (kernels/native/library.py). */
#ifndef PD_QUANT_BLOCKS_H
#define PD_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

enum {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
    Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23
};

/* IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for (gguf's IQ4_NL.kvalues) */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};


/* IEEE half -> float, exact (subnormals, infinities and NaN included): one instruction
 * with F16C, else by its bits. A block's scales are converted once per block per row. */
#if defined(__F16C__)
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
#else
static float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* y[0, 16) = s * q[0, 16) + m: the only float arithmetic of a de-quantize (the q are
 * exact small integers, so where gguf computes d * q + m this is the same). */
static inline void scale16(const int8_t *q, float s, float m, float *y) {
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s), f), _mm512_set1_ps(m)));
#elif defined(__AVX2__)
    for (int h = 0; h < 16; h += 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(q + h));
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        _mm256_storeu_ps(y + h, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s), f),
                                              _mm256_set1_ps(m)));
    }
#else
    for (int l = 0; l < 16; l++) y[l] = s * (float)q[l] + m;
#endif
}

/* lo[l] = (src[l] & 15) - off, hi[l] = (src[l] >> 4) - off for l < n (n: 16 or 32) */
static inline void nibbles(const uint8_t *src, int n, int off, int8_t *lo, int8_t *hi) {
#if defined(__SSE2__)
    const __m128i mask = _mm_set1_epi8(0xf), o = _mm_set1_epi8((char)off);
    for (int l = 0; l < n; l += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(src + l));
        _mm_storeu_si128((__m128i *)(lo + l), _mm_sub_epi8(_mm_and_si128(v, mask), o));
        __m128i h = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        _mm_storeu_si128((__m128i *)(hi + l), _mm_sub_epi8(h, o));
    }
#else
    for (int l = 0; l < n; l++) {
        lo[l] = (int8_t)((src[l] & 0xf) - off);
        hi[l] = (int8_t)((src[l] >> 4) - off);
    }
#endif
}

/* The integer stage of each type fills q[] (exact small integers as int8, byte loops the
 * compiler vectorizes); scale16 applies the block's scale (and min). */

static void row_q8_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 34, y += 32) {
        float d = half(b);
        scale16((const int8_t *)(b + 2), d, 0.0f, y);
        scale16((const int8_t *)(b + 18), d, 0.0f, y + 16);
    }
}

static void row_q4_0(const uint8_t *b, float *y, int64_t k) {
    int8_t q[32];
    for (int64_t i = 0; i < k; i += 32, b += 18, y += 32) {
        float d = half(b);
        nibbles(b + 2, 16, 8, q, q + 16);
        scale16(q, d, 0.0f, y);
        scale16(q + 16, d, 0.0f, y + 16);
    }
}

static void row_q4_1(const uint8_t *b, float *y, int64_t k) {
    int8_t q[32];
    for (int64_t i = 0; i < k; i += 32, b += 20, y += 32) {
        float d = half(b), m = half(b + 2);
        nibbles(b + 4, 16, 0, q, q + 16);
        scale16(q, d, m, y);
        scale16(q + 16, d, m, y + 16);
    }
}

/* Q5_0 / Q5_1: q[l] |= 16 where bit l of qh is set (l < 32), 8 bits a step: the byte's
 * bits spread one per byte (multiply, mask, carry into bit 0), then moved to bit 4 */
static void high_bits(uint32_t qh, int8_t *q) {
    for (int g = 0; g < 4; g++) {
        uint64_t bits = ((qh >> (8 * g)) & 0xff) * 0x0101010101010101ull;
        bits &= 0x8040201008040201ull; /* byte i keeps bit i */
        bits = ((bits + 0x7f7f7f7f7f7f7f7full) >> 7) & 0x0101010101010101ull;
        uint64_t word;
        memcpy(&word, q + 8 * g, 8);
        word |= bits << 4;
        memcpy(q + 8 * g, &word, 8);
    }
}

static void row_q5_0(const uint8_t *b, float *y, int64_t k) {
    int8_t q[32];
    for (int64_t i = 0; i < k; i += 32, b += 22, y += 32) {
        float d = half(b);
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        nibbles(b + 6, 16, 0, q, q + 16);
        high_bits(qh, q);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)(q[l] - 16);
        scale16(q, d, 0.0f, y);
        scale16(q + 16, d, 0.0f, y + 16);
    }
}

static void row_q5_1(const uint8_t *b, float *y, int64_t k) {
    int8_t q[32];
    for (int64_t i = 0; i < k; i += 32, b += 24, y += 32) {
        float d = half(b), m = half(b + 2);
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        nibbles(b + 8, 16, 0, q, q + 16);
        high_bits(qh, q);
        scale16(q, d, m, y);
        scale16(q + 16, d, m, y + 16);
    }
}

/* IQ4_NL / IQ4_XS: 32 values dl * KVALUES[code] from 16 bytes (low nibbles first) */
static void iq4_32(const uint8_t *qs, float dl, float *y) {
    for (int l = 0; l < 16; l++) {
        y[l] = dl * (float)KVALUES[qs[l] & 0xf];
        y[l + 16] = dl * (float)KVALUES[qs[l] >> 4];
    }
}

static void row_iq4_nl(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 18, y += 32) iq4_32(b + 2, half(b), y);
}

/* IQ4_XS: sub-block j's scale, 6 bits (4 from scales_l, 2 from scales_h) less 32 */
static inline int iq4_xs_scale(const uint8_t *b, int j) {
    int h = (b[2] | (b[3] << 8)) >> (2 * j) & 3;
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xf) | (h << 4)) - 32;
}

static void row_iq4_xs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 256, b += 136, y += 256) {
        float d = half(b);
        for (int j = 0; j < 8; j++) iq4_32(b + 8 + 16 * j, d * (float)iq4_xs_scale(b, j), y + 32 * j);
    }
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes */
static void scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K / Q5_K: 8 sub-blocks of 32, value (d * sc) * q - dmin * m; q[256] filled */
static void scale_k(const uint8_t *b, const int8_t *q, float *y) {
    float d = half(b), dmin = half(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min(b + 4, j, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn;
        scale16(q + 32 * j, ds, -dm, y + 32 * j); /* + (-dm) is - dm exactly */
        scale16(q + 32 * j + 16, ds, -dm, y + 32 * j + 16);
    }
}

static void row_q4_k(const uint8_t *b, float *y, int64_t k) {
    int8_t q[256];
    for (int64_t i = 0; i < k; i += 256, b += 144, y += 256) {
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++) nibbles(qs + 32 * c, 32, 0, q + 64 * c, q + 64 * c + 32);
        scale_k(b, q, y);
    }
}

static void row_q5_k(const uint8_t *b, float *y, int64_t k) {
    int8_t q[256];
    for (int64_t i = 0; i < k; i += 256, b += 176, y += 256) {
        const uint8_t *qs = b + 48;
        uint8_t h[32]; /* qh, shifted 2 bits on per chunk: constant shifts vectorize */
        memcpy(h, b + 16, 32);
        for (int c = 0; c < 4; c++) {
            int8_t *lo = q + 64 * c, *hi = lo + 32;
            nibbles(qs + 32 * c, 32, 0, lo, hi);
            for (int l = 0; l < 32; l++) {
                lo[l] |= (int8_t)((h[l] << 4) & 0x10);
                hi[l] |= (int8_t)((h[l] << 3) & 0x10);
                h[l] = (uint8_t)(h[l] >> 2);
            }
        }
        scale_k(b, q, y);
    }
}

static void row_q6_k(const uint8_t *b, float *y, int64_t k) {
    int8_t q[256];
    for (int64_t i = 0; i < k; i += 256, b += 210, y += 256) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = half(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            int8_t *o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (int8_t)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int s = 0; s < 16; s++) scale16(q + 16 * s, d * (float)sc[s], 0.0f, y + 16 * s);
    }
}

/* Q2_K / Q3_K: value e = 128h + 32s + l (h < 2, s < 4, l < 32) takes bits 2s, 2s + 1 of
 * qs[32h + l], and lies in sub-block e / 16 of 16 values (each with its own scale) */
static void low2(const uint8_t *qs, int8_t *q) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * s + l] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
}

/* Q2_K: 16 bytes of scales (low nibble: the scale, high: the min), qs [64], d, dmin;
 * value (d * sc) * q - dmin * m, as gguf (d * sc * q exact: 11 + 4 + 2 bits) */
static void row_q2_k(const uint8_t *b, float *y, int64_t k) {
    int8_t q[256];
    for (int64_t i = 0; i < k; i += 256, b += 84, y += 256) {
        float d = half(b + 80), dmin = half(b + 82);
        low2(b + 16, q);
        for (int j = 0; j < 16; j++)
            scale16(q + 16 * j, d * (float)(b[j] & 0xf), -(dmin * (float)(b[j] >> 4)), y + 16 * j);
    }
}

/* Q3_K: sub-block j's 6-bit scale, less 32: its low 4 bits are nibble j / 8 of byte
 * j % 8, its top 2 bits 2 (j / 4) .. of byte 8 + j % 4 */
static inline int q3k_scale(const uint8_t *sc, int j) {
    int lo = (sc[j % 8] >> (4 * (j / 8))) & 0xf, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* Q3_K: hmask [32], qs [64], scales [12], d; value (d * scale) * (q - 4 * !hbit), hbit
 * of value e bit e / 32 of hmask[e % 32] (gguf: exact, 11 + 6 + 3 bits) */
static void row_q3_k(const uint8_t *b, float *y, int64_t k) {
    int8_t q[256];
    for (int64_t i = 0; i < k; i += 256, b += 110, y += 256) {
        float d = half(b + 108);
        low2(b + 32, q);
        for (int e = 0; e < 256; e++) q[e] = (int8_t)(q[e] - (((b[e % 32] >> (e / 32)) & 1) ? 0 : 4));
        for (int j = 0; j < 16; j++) scale16(q + 16 * j, d * (float)q3k_scale(b + 96, j), 0.0f, y + 16 * j);
    }
}

typedef void (*row_fn)(const uint8_t *, float *, int64_t);

static row_fn row_of(int32_t type) {
    switch (type) {
    case Q8_0: return row_q8_0;
    case Q4_0: return row_q4_0;
    case Q4_1: return row_q4_1;
    case Q5_0: return row_q5_0;
    case Q5_1: return row_q5_1;
    case Q2_K: return row_q2_k;
    case Q3_K: return row_q3_k;
    case Q4_K: return row_q4_k;
    case Q5_K: return row_q5_k;
    case Q6_K: return row_q6_k;
    case IQ4_NL: return row_iq4_nl;
    case IQ4_XS: return row_iq4_xs;
    default: return 0;
    }
}

/* elements and bytes of one block of `type` (0, 0 where it has no kernel) */
static void block_of(int32_t type, int *elems, int *bytes) {
    static const struct { int32_t type; int elems, bytes; } sizes[] = {
        {Q4_0, 32, 18},   {Q4_1, 32, 20},   {Q5_0, 32, 22},   {Q5_1, 32, 24},
        {Q8_0, 32, 34},   {Q2_K, 256, 84},  {Q3_K, 256, 110}, {Q4_K, 256, 144},
        {Q5_K, 256, 176}, {Q6_K, 256, 210},
        {IQ4_NL, 32, 18}, {IQ4_XS, 256, 136},
    };
    *elems = *bytes = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].type == type) *elems = sizes[i].elems, *bytes = sizes[i].bytes;
}

#if defined(__AVX2__)
/* Q6_K: half h of a 256-block's 6-bit codes (0..63, unsigned), 128 values as c[0..3] of 32
 * bytes: ql's low nibbles of bytes 0-31 and 32-63 then their high nibbles, each with its
 * 2 bits of qh (bits 0-1, 2-3, 4-5, 6-7) above them; c[g] covers sub-blocks 8h + 2g and
 * 8h + 2g + 1 of 16 values. Both Q6_K dot kernels (float and int8 x) read the codes so. */
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *b, int h, __m256i c[4]) {
    const __m256i mask = _mm256_set1_epi8(0xf), two = _mm256_set1_epi8(0x30);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    c[0] = _mm256_or_si256(_mm256_and_si256(l0, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
    c[1] = _mm256_or_si256(_mm256_and_si256(l1, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
    c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask), _mm256_and_si256(qh, two));
    c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
}
#endif

#endif
