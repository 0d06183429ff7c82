/* One row of x (m = 1, a decode step of one request) against one weight row in GGUF
 * blocks, de-quantized in registers and never stored (dot_of picks the kernel per type):
 * the weights' bytes are the only memory traffic, so a step reads 4.5-8.5 bits a weight.
 *
 * Every kernel forms each weight's float value exactly as gguf's de-quantize does, then
 * adds x * w into float32 lanes; only the order of the sum differs from the float
 * matmul's. Two ways to a value, both exact:
 *   convert   the integer code to float, times the block's scale (plus its min);
 *   look up   4- and 5-bit codes index a table of the 16 or 32 values the block's codes
 *             stand for, computed once per block with gguf's operations
 *             (_mm512_permutexvar_ps / _mm512_permutex2var_ps use the index's low 4 or 5
 *             bits, so a code needs no masking above them). The look-up replaces a
 *             convert and a multiply per 16 weights.
 *
 * AVX-512: every type; AVX2: Q8_0, Q4_0, Q4_1 (the others take dot_blocks, which
 * de-quantizes a block at a time into a 1 KB buffer that stays in L1). */
#ifndef PD_QUANT_DOT_H
#define PD_QUANT_DOT_H

#include "quant_blocks.h"

#define LANES 16

/* the 16 lane sums of one dot product, added in one fixed tree (every path alike) */
static float lanes_sum(const float *s) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = s[l] + s[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

typedef float (*dot_fn)(const float *, const uint8_t *, int64_t);

/* Any type: a block de-quantized (quant_blocks.h) into an L1 buffer, then its dot. */
static float dot_blocks(const float *x, const uint8_t *b, int64_t k, row_fn f, int elems,
                        int bytes) {
    float buf[256] __attribute__((aligned(64)));
    float s[LANES] = {0};
    for (int64_t i = 0; i < k; i += elems, b += bytes, x += elems) {
        f(b, buf, elems);
        for (int j = 0; j < elems; j += LANES)
            for (int l = 0; l < LANES; l++) s[l] += x[j + l] * buf[j + l];
    }
    return lanes_sum(s);
}

#if defined(__AVX512F__)
#define MR 8 /* rows of x one pass over a weight row serves (a decode batch of up to 8) */
#define AI static inline __attribute__((always_inline))
typedef __m512 Sums[MR]; /* one slot's sums, one zmm per row of x */

/* out[r] = row r's sums added: one row keeps 4 slots (4 chains of FMAs in flight),
 * several rows one slot each (their rows are the independent chains) */
AI void finish(Sums *c, float *out, const int rows) {
    float s[LANES];
    if (rows == 1) {
        _mm512_storeu_ps(s, _mm512_add_ps(_mm512_add_ps(c[0][0], c[1][0]), _mm512_add_ps(c[2][0], c[3][0])));
        out[0] = lanes_sum(s);
        return;
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(s, c[0][r]);
        out[r] = lanes_sum(s);
    }
}

static inline __m512 f16x(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
static inline __m512i u16x(__m128i q) { return _mm512_cvtepu8_epi32(q); }
static inline __m128i lo128(__m256i v) { return _mm256_castsi256_si128(v); }
static inline __m128i hi128(__m256i v) { return _mm256_extracti128_si256(v, 1); }

#define SUMS(c)                                                                             \
    Sums c[4];                                                                              \
    for (int s_ = 0; s_ < 4; s_++)                                                          \
        for (int r_ = 0; r_ < MR; r_++) c[s_][r_] = _mm512_setzero_ps()
#define SLOT(i) c[rows > 1 ? 0 : (i)] /* the slot a vector of weights adds into */
#define IOTA _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* Each kernel's body serves three ways, `rows` a constant at each use: 1, a dot (p is x,
 * the 16 values w at p[0, 16) add x * w into the slot); 2..MR, as many dots with the rows
 * of x ldx apart, each vector of weights formed once for all; 0, a de-quantize (w stored
 * at p[0, 16): the tiles' rows). */
AI void put(__m512 *c, float *p, __m512 w, const int rows, int64_t ldx) {
    if (rows == 0) _mm512_storeu_ps(p, w);
    for (int r = 0; r < rows; r++) c[r] = _mm512_fmadd_ps(_mm512_loadu_ps(p + r * ldx), w, c[r]);
}

/* a 4-bit look-up (index bits past 4 ignored) */
AI void look(__m512 *c, float *p, __m512i idx, __m512 table, const int rows, int64_t ldx) {
    put(c, p, _mm512_permutexvar_ps(idx, table), rows, ldx);
}

/* a 5-bit look-up over 32 values */
AI void look32(__m512 *c, float *p, __m512i idx, __m512 lo, __m512 hi, const int rows,
               int64_t ldx) {
    put(c, p, _mm512_permutex2var_ps(lo, idx, hi), rows, ldx);
}

AI void q8_0(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    for (int64_t i = 0; i < k; i += 32, b += 34, x += 32) {
        __m512 d = _mm512_set1_ps(half(b));
        for (int h = 0; h < 2; h++) {
            __m512 w = _mm512_mul_ps(d, f16x(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * h))));
            put(SLOT(h), x + 16 * h, w, rows, ldx);
        }
    }
    finish(c, out, rows);
}

/* Q4_0 (off 8, no min) and Q4_1 (off 0, min): the 16 values d * (q - off) + m */
AI void q4(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows, int size,
           int min) {
    SUMS(c);
    const __m512 codes = _mm512_sub_ps(IOTA, _mm512_set1_ps(min ? 0.0f : 8.0f));
    for (int64_t i = 0; i < k; i += 32, b += size, x += 32) {
        __m512 d = _mm512_set1_ps(half(b)), m = _mm512_set1_ps(min ? half(b + 2) : 0.0f);
        __m512 table = _mm512_fmadd_ps(d, codes, m); /* d * q exact: + m one rounding */
        __m128i v = _mm_loadu_si128((const __m128i *)(b + (min ? 4 : 2)));
        look(SLOT(0), x, u16x(v), table, rows, ldx);
        look(SLOT(1), x + 16, u16x(_mm_srli_epi16(v, 4)), table, rows, ldx);
    }
    finish(c, out, rows);
}

AI void q4_0(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    q4(x, ldx, b, k, out, rows, 18, 0);
}
AI void q4_1(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    q4(x, ldx, b, k, out, rows, 20, 1);
}

/* Q5_0 (values d * (q - 16)) and Q5_1 (d * q + m): 5-bit codes, bit 4 from qh */
AI void q5(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows, int size,
           int min) {
    SUMS(c);
    const __m512 off = _mm512_set1_ps(min ? 0.0f : 16.0f), sixteen = _mm512_set1_ps(16.0f);
    const __m512i bit4 = _mm512_set1_epi32(16);
    const __m128i mask = _mm_set1_epi8(0xf);
    for (int64_t i = 0; i < k; i += 32, b += size, x += 32) {
        __m512 d = _mm512_set1_ps(half(b)), m = _mm512_set1_ps(min ? half(b + 2) : 0.0f);
        __m512 lo = _mm512_fmadd_ps(d, _mm512_sub_ps(IOTA, off), m);
        __m512 hi = _mm512_fmadd_ps(d, _mm512_sub_ps(_mm512_add_ps(IOTA, sixteen), off), m);
        uint32_t qh;
        memcpy(&qh, b + (min ? 4 : 2), 4);
        __m128i v = _mm_loadu_si128((const __m128i *)(b + (min ? 8 : 6)));
        __m512i i0 = u16x(_mm_and_si128(v, mask));
        __m512i i1 = u16x(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
        i0 = _mm512_mask_or_epi32(i0, (__mmask16)qh, i0, bit4);
        i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> 16), i1, bit4);
        look32(SLOT(0), x, i0, lo, hi, rows, ldx);
        look32(SLOT(1), x + 16, i1, lo, hi, rows, ldx);
    }
    finish(c, out, rows);
}

AI void q5_0(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    q5(x, ldx, b, k, out, rows, 22, 0);
}
AI void q5_1(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    q5(x, ldx, b, k, out, rows, 24, 1);
}

/* Q4_K / Q5_K: the 8 sub-blocks' ds = d * sc and -dm = -(dmin * m) (gguf's products,
 * exact in float32), unpacked 4 at a time from the 12 scale bytes (little-endian words):
 * sc 0-3 and m 0-3 are bytes 0-3 and 4-7 masked to 6 bits; sc 4-7 and m 4-7 take their
 * low 4 bits from bytes 8-11 and their top 2 from bits 6-7 of bytes 0-3 and 4-7. */
static inline void k_scales(const uint8_t *b, float *ds, float *ndm) {
    uint32_t w[3], u[4];
    memcpy(w, b + 4, 12);
    u[0] = w[0] & 0x3f3f3f3f;
    u[1] = (w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030);
    u[2] = w[1] & 0x3f3f3f3f;
    u[3] = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030);
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
    __m512 dd = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half(b)), _mm512_set1_ps(-half(b + 2)));
    float out[16];
    _mm512_storeu_ps(out, _mm512_mul_ps(dd, v));
    memcpy(ds, out, 8 * sizeof(float));
    memcpy(ndm, out + 8, 8 * sizeof(float));
}

/* sub-block j's values ds * q - dm for q in [0, 16) (+ 16 with `upper`): ds * q exact */
static inline __m512 k_table(const float *ds, const float *ndm, int j, int upper) {
    __m512 q = upper ? _mm512_add_ps(IOTA, _mm512_set1_ps(16.0f)) : IOTA;
    return _mm512_fmadd_ps(_mm512_set1_ps(ds[j]), q, _mm512_set1_ps(ndm[j]));
}

AI void q4_k(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    for (int64_t i = 0; i < k; i += 256, b += 144, x += 256) {
        float ds[8], ndm[8];
        k_scales(b, ds, ndm);
        for (int j = 0; j < 4; j++) { /* 32 bytes: sub-block 2j low nibbles, 2j + 1 high */
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
            __m256i h = _mm256_srli_epi16(v, 4);
            __m512 t0 = k_table(ds, ndm, 2 * j, 0), t1 = k_table(ds, ndm, 2 * j + 1, 0);
            float *xj = x + 64 * j;
            look(SLOT(0), xj, u16x(lo128(v)), t0, rows, ldx);
            look(SLOT(1), xj + 16, u16x(hi128(v)), t0, rows, ldx);
            look(SLOT(2), xj + 32, u16x(lo128(h)), t1, rows, ldx);
            look(SLOT(3), xj + 48, u16x(hi128(h)), t1, rows, ldx);
        }
    }
    finish(c, out, rows);
}

AI void q5_k(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    const __m256i mask = _mm256_set1_epi8(0xf), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t i = 0; i < k; i += 256, b += 176, x += 256) {
        float ds[8], ndm[8];
        k_scales(b, ds, ndm);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)); /* bit j: sub-block j */
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * j));
            __m256i q0 = _mm256_and_si256(v, mask), q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            q0 = _mm256_or_si256(q0, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
            q1 = _mm256_or_si256(q1, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
            qh = _mm256_srli_epi16(qh, 2); /* bits past a byte's own are masked off above */
            __m512 t0 = k_table(ds, ndm, 2 * j, 0), u0 = k_table(ds, ndm, 2 * j, 1);
            __m512 t1 = k_table(ds, ndm, 2 * j + 1, 0), u1 = k_table(ds, ndm, 2 * j + 1, 1);
            float *xj = x + 64 * j;
            look32(SLOT(0), xj, u16x(lo128(q0)), t0, u0, rows, ldx);
            look32(SLOT(1), xj + 16, u16x(hi128(q0)), t0, u0, rows, ldx);
            look32(SLOT(2), xj + 32, u16x(lo128(q1)), t1, u1, rows, ldx);
            look32(SLOT(3), xj + 48, u16x(hi128(q1)), t1, u1, rows, ldx);
        }
    }
    finish(c, out, rows);
}

AI void q6_k(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    const __m256i off = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < k; i += 256, b += 210, x += 256) {
        float ds[16]; /* d * sc per sub-block of 16, as gguf: exact */
        __m512 sc = f16x(_mm_loadu_si128((const __m128i *)(b + 192)));
        _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_set1_ps(half(b + 208)), sc));
        for (int h = 0; h < 2; h++) { /* 128 values: ql [64 bytes], qh [32 bytes] */
            __m256i q[4];
            q6k_codes(b, h, q);
            for (int g = 0; g < 4; g++) { /* 32 values, sub-blocks s and s + 1 of 16 */
                __m256i v = _mm256_sub_epi8(q[g], off);
                int s = 8 * h + 2 * g;
                __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(ds[s]), f16x(lo128(v)));
                __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(ds[s + 1]), f16x(hi128(v)));
                float *xg = x + 128 * h + 32 * g;
                put(SLOT(g), xg, w0, rows, ldx);
                put(SLOT(g), xg + 16, w1, rows, ldx);
            }
        }
    }
    finish(c, out, rows);
}

/* Q2_K: the 16 sub-blocks' d * sc and -(dmin * m) from the 16 scale bytes (exact) */
static inline void q2k_scales(const uint8_t *b, float *dl, float *nml) {
    __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(s, _mm512_set1_epi32(0xf)));
    __m512 mn = _mm512_cvtepi32_ps(_mm512_srli_epi32(s, 4));
    _mm512_storeu_ps(dl, _mm512_mul_ps(_mm512_set1_ps(half(b + 80)), sc));
    _mm512_storeu_ps(nml, _mm512_mul_ps(_mm512_set1_ps(-half(b + 82)), mn));
}

/* Q2_K / Q3_K: 32 values (two sub-blocks of 16) from their codes (up to 3 bits) through
 * the sub-blocks' tables */
AI void look2(Sums *c, float *x, int64_t ldx, __m256i q, __m512 t0, __m512 t1, const int rows) {
    look(c, x, u16x(lo128(q)), t0, rows, ldx);
    look(c, x + 16, u16x(hi128(q)), t1, rows, ldx);
}

/* Q2_K: values (d * sc) * q - dmin * m, q of 2 bits (quant_blocks.h, row_q2_k) */
AI void q2_k(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    const __m256i three = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < k; i += 256, b += 84, x += 256) {
        float dl[16], nml[16];
        q2k_scales(b, dl, nml);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
            for (int s = 0; s < 4; s++) {
                int j = 8 * h + 2 * s;
                __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(dl[j]), IOTA, _mm512_set1_ps(nml[j]));
                __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(dl[j + 1]), IOTA, _mm512_set1_ps(nml[j + 1]));
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three);
                look2(SLOT(s), x + 128 * h + 32 * s, ldx, q, t0, t1, rows);
            }
        }
    }
    finish(c, out, rows);
}

/* Q3_K: values (d * scale) * (c - 4), c = the 2 low bits | the hmask bit << 2 (a set bit
 * is gguf's zero offset, a clear one its -4) */
AI void q3_k(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m512 codes = _mm512_sub_ps(IOTA, _mm512_set1_ps(4.0f));
    for (int64_t i = 0; i < k; i += 256, b += 110, x += 256) {
        float d = half(b + 108), dl[16];
        for (int j = 0; j < 16; j++) dl[j] = d * (float)q3k_scale(b + 96, j);
        __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
            for (int s = 0; s < 4; s++) {
                int j = 8 * h + 2 * s;
                __m512 t0 = _mm512_mul_ps(_mm512_set1_ps(dl[j]), codes);
                __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(dl[j + 1]), codes);
                __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three);
                __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
                __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
                look2(SLOT(s), x + 128 * h + 32 * s, ldx, q, t0, t1, rows);
            }
        }
    }
    finish(c, out, rows);
}

/* IQ4_NL / IQ4_XS: 32 values dl * KVALUES[code] from 16 bytes, the table per 32 */
AI void iq4_look(Sums *c, float *x, int64_t ldx, const uint8_t *qs, float dl, const int rows) {
    const __m512 kv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)KVALUES)));
    __m512 table = _mm512_mul_ps(_mm512_set1_ps(dl), kv); /* exact: 11 + 6 + 7 bits */
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    look(SLOT(0), x, u16x(v), table, rows, ldx);
    look(SLOT(1), x + 16, u16x(_mm_srli_epi16(v, 4)), table, rows, ldx);
}

AI void iq4_nl(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    for (int64_t i = 0; i < k; i += 32, b += 18, x += 32) iq4_look(c, x, ldx, b + 2, half(b), rows);
    finish(c, out, rows);
}

AI void iq4_xs(float *x, int64_t ldx, const uint8_t *b, int64_t k, float *out, const int rows) {
    SUMS(c);
    for (int64_t i = 0; i < k; i += 256, b += 136, x += 256) {
        float d = half(b);
        for (int j = 0; j < 8; j++)
            iq4_look(c + (rows > 1 ? 0 : 2 * (j & 1)), x + 32 * j, ldx, b + 8 + 16 * j,
                     d * (float)iq4_xs_scale(b, j), rows);
    }
    finish(c, out, rows);
}

/* dot_<type> (one row of x), dots_<type> (2..MR rows ldx apart) and row512_<type> (a
 * de-quantize), from one body each; x is only read where rows > 0 */
#define KERNEL(name)                                                                        \
    static float dot_##name(const float *x, const uint8_t *b, int64_t k) {                   \
        float out;                                                                          \
        name((float *)x, 0, b, k, &out, 1);                                                 \
        return out;                                                                         \
    }                                                                                       \
    static void dots_##name(const float *x, int64_t ldx, const uint8_t *b, int64_t k,        \
                            float *out, int rows) {                                         \
        switch (rows) {                                                                     \
        case 2: name((float *)x, ldx, b, k, out, 2); return;                                \
        case 3: name((float *)x, ldx, b, k, out, 3); return;                                \
        case 4: name((float *)x, ldx, b, k, out, 4); return;                                \
        case 5: name((float *)x, ldx, b, k, out, 5); return;                                \
        case 6: name((float *)x, ldx, b, k, out, 6); return;                                \
        case 7: name((float *)x, ldx, b, k, out, 7); return;                                \
        default: name((float *)x, ldx, b, k, out, MR); return;                              \
        }                                                                                   \
    }                                                                                       \
    static void row512_##name(const uint8_t *b, float *y, int64_t k) { name(y, 0, b, k, 0, 0); }
KERNEL(q8_0)
KERNEL(q4_0)
KERNEL(q4_1)
KERNEL(q5_0)
KERNEL(q5_1)
KERNEL(q2_k)
KERNEL(q3_k)
KERNEL(q4_k)
KERNEL(q5_k)
KERNEL(q6_k)
KERNEL(iq4_nl)
KERNEL(iq4_xs)

/* rows 2..MR of x against one weight row: out[r] = x_r . w (0 where a type has none) */
typedef void (*dots_fn)(const float *, int64_t, const uint8_t *, int64_t, float *, int);
static dots_fn dots_of(int32_t type) {
    switch (type) {
    case Q8_0: return dots_q8_0;
    case Q4_0: return dots_q4_0;
    case Q4_1: return dots_q4_1;
    case Q5_0: return dots_q5_0;
    case Q5_1: return dots_q5_1;
    case Q2_K: return dots_q2_k;
    case Q3_K: return dots_q3_k;
    case Q4_K: return dots_q4_k;
    case Q5_K: return dots_q5_k;
    case Q6_K: return dots_q6_k;
    case IQ4_NL: return dots_iq4_nl;
    case IQ4_XS: return dots_iq4_xs;
    default: return 0;
    }
}

/* the de-quantize the tiles and embedding look-ups use: these kernels' stores */
static row_fn fast_row_of(int32_t type) {
    switch (type) {
    case Q8_0: return row512_q8_0;
    case Q4_0: return row512_q4_0;
    case Q4_1: return row512_q4_1;
    case Q5_0: return row512_q5_0;
    case Q5_1: return row512_q5_1;
    case Q2_K: return row512_q2_k;
    case Q3_K: return row512_q3_k;
    case Q4_K: return row512_q4_k;
    case Q5_K: return row512_q5_k;
    case Q6_K: return row512_q6_k;
    case IQ4_NL: return row512_iq4_nl;
    case IQ4_XS: return row512_iq4_xs;
    default: return row_of(type);
    }
}

static dot_fn dot_of(int32_t type) {
    switch (type) {
    case Q8_0: return dot_q8_0;
    case Q4_0: return dot_q4_0;
    case Q4_1: return dot_q4_1;
    case Q5_0: return dot_q5_0;
    case Q5_1: return dot_q5_1;
    case Q2_K: return dot_q2_k;
    case Q3_K: return dot_q3_k;
    case Q4_K: return dot_q4_k;
    case Q5_K: return dot_q5_k;
    case Q6_K: return dot_q6_k;
    case IQ4_NL: return dot_iq4_nl;
    case IQ4_XS: return dot_iq4_xs;
    default: return 0;
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
static inline float sum8x4(__m256 a0, __m256 a1, __m256 b0, __m256 b1) {
    float s[LANES], t[LANES];
    _mm256_storeu_ps(s, a0);
    _mm256_storeu_ps(s + 8, a1);
    _mm256_storeu_ps(t, b0);
    _mm256_storeu_ps(t + 8, b1);
    for (int l = 0; l < LANES; l++) s[l] += t[l];
    return lanes_sum(s);
}

static inline __m256 f8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

static inline float dot_q4(const float *x, const uint8_t *b, int64_t k, int size, int min) {
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    const __m128i mask = _mm_set1_epi8(0xf), off = _mm_set1_epi8(min ? 0 : 8);
    for (int64_t i = 0; i < k; i += 32, b += size) {
        __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(min ? half(b + 2) : 0.0f);
        __m128i v = _mm_loadu_si128((const __m128i *)(b + (min ? 4 : 2)));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), off);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), off);
        __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++) {
            __m256 w = _mm256_add_ps(_mm256_mul_ps(d, f8(q[j])), m);
            c[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * j), w, c[j]);
        }
    }
    return sum8x4(c[0], c[1], c[2], c[3]);
}

static float dot_q8_0(const float *x, const uint8_t *b, int64_t k) {
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t i = 0; i < k; i += 32, b += 34) {
        __m256 d = _mm256_set1_ps(half(b));
        for (int j = 0; j < 4; j++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
            c[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * j), _mm256_mul_ps(d, f8(q)), c[j]);
        }
    }
    return sum8x4(c[0], c[1], c[2], c[3]);
}

static float dot_q4_0(const float *x, const uint8_t *b, int64_t k) { return dot_q4(x, b, k, 18, 0); }
static float dot_q4_1(const float *x, const uint8_t *b, int64_t k) { return dot_q4(x, b, k, 20, 1); }

static dot_fn dot_of(int32_t type) {
    switch (type) {
    case Q8_0: return dot_q8_0;
    case Q4_0: return dot_q4_0;
    case Q4_1: return dot_q4_1;
    default: return 0;
    }
}
#else
static dot_fn dot_of(int32_t type) {
    (void)type;
    return 0;
}
#endif

#if !defined(__AVX512F__)
#define MR 1
typedef void (*dots_fn)(const float *, int64_t, const uint8_t *, int64_t, float *, int);
static dots_fn dots_of(int32_t type) {
    (void)type;
    return 0;
}
static row_fn fast_row_of(int32_t type) { return row_of(type); }
#endif

#endif
