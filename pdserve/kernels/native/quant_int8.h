/* --quant-activations int8: x quantized to 8 bits per block, integer dot products
 * against the weights' codes, the blocks' scales applied to the integer sums.
 *
 * Why: de-quantizing to float costs a convert (or a look-up) and an FMA per 16 weights;
 * an integer dot (AVX-512 VNNI vpdpbusd / vpdpwssd, AVX2 vpmaddubsw + vpmaddwd) takes
 * 32 at once, with one float multiply-add per block, as llama.cpp computes.
 *
 * What it computes (tests/test_quant_int8.py holds the same in numpy), x quantized as
 * kernel_args.h's pd_xq_bytes layout says; a weight block's codes c (integers) and
 * scales as gguf's de-quantize forms them (d, m: the block's halves; sc, mn: 6-bit):
 *
 *   block of 32 (x: q32, d32, s32)         y += (d32 * d) * sum(c * q32) [+ m * s32]
 *     Q8_0 c = q   Q4_0 c = q - 8   Q5_0 c = q - 16   IQ4_NL c = KVALUES[q]
 *     Q4_1, Q5_1 c = q and the min term
 *   super-block of 256 (x: q256, d256, bsum)
 *     Q4_K, Q5_K  y += (d256 * d) * sum_j sc_j * sum(c * q256 over sub-block j of 32)
 *                    - (d256 * dmin) * sum_j mn_j * (bsum of sub-block j)
 *     Q6_K        y += (d256 * d) * sum_s sc_s * (sum(c * q256 over 16) - 32 * bsum_s)
 *     IQ4_XS      y += (d256 * d) * sum_j (ls_j - 32) * sum(KVALUES[c] * q256 over 32)
 *
 * Every sum of integers is exact; the float steps differ from the reference only in the
 * order blocks are added (and the conversion of an integer sum past 2^24 to float).
 * It is not "de-quantize, then the float matmul": x itself is rounded to 8 bits.
 * AVX2 (and VNNI where the CPU has it) only; without AVX2 every type takes the float
 * kernels (int8_dot_of is NULL). */
#ifndef PD_QUANT_INT8_H
#define PD_QUANT_INT8_H

#include "quant_int8_ops.h"
#include "quant_x8.h"

#if defined(__AVX2__) && defined(__FMA__)
/* out[r] = weight row b . row r of x quantized (rows < XR8, each xb bytes apart) */
typedef void (*idot_fn)(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
                        int rows);

/* a block of 32's codes (integers: signed, or unsigned for the types with a min) */
AI __m256i codes32(const uint8_t *b, const int type) {
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    switch (type) {
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case Q4_0: return _mm256_sub_epi8(nib32(b + 2), _mm256_set1_epi8(8));
    case Q4_1: return nib32(b + 4);
    case Q5_0: return _mm256_sub_epi8(nib32h(b + 6, b + 2), _mm256_set1_epi8(16));
    case Q5_1: return nib32h(b + 8, b + 4);
    default: return _mm256_shuffle_epi8(kv, nib32(b + 2)); /* IQ4_NL */
    }
}

/* 4 rows of x against one weight row of blocks of 32 with a min (Q4_1, Q5_1; as dot32
 * below): the 4 rows' lanes added pairwise (vphaddd) into one vector [r0 r1 r2 r3 | r0 r1
 * r2 r3] (each row's lanes 0-3 and 4-7), so one convert, one multiply-add and one
 * min step serve 4 rows where dot32 takes 4 of each */
AI void dot32x4(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
                const int type) {
    const int size = type == Q8_0 ? 34 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 18;
    const int min = type == Q4_1 || type == Q5_1;
    const float *dx[4];
    for (int r = 0; r < 4; r++) dx[r] = (const float *)(xq + r * xb + k);
    __m256 acc = _mm256_setzero_ps();
    __m128 mins = _mm_setzero_ps();
    for (int64_t i = 0; i < k / 32; i++, b += size) {
        __m256i c = codes32(b, type), u = min ? c : _mm256_sign_epi8(c, c), l[4];
        for (int r = 0; r < 4; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(xq + r * xb + 32 * i));
            l[r] = dpb(_mm256_setzero_si256(), u, min ? v : _mm256_sign_epi8(v, c));
        }
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(l[0], l[1]), _mm256_hadd_epi32(l[2], l[3]));
        __m128 d4 = _mm_mul_ps(_mm_setr_ps(dx[0][i], dx[1][i], dx[2][i], dx[3][i]), _mm_set1_ps(half(b)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set_m128(d4, d4), acc);
        if (min) { /* s32 of the 4 rows */
            int64_t j = k / 32 + i;
            __m128 s4 = _mm_setr_ps(dx[0][j], dx[1][j], dx[2][j], dx[3][j]);
            mins = _mm_fmadd_ps(_mm_set1_ps(half(b + 2)), s4, mins);
        }
    }
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    _mm_storeu_ps(out, _mm_add_ps(sum, mins));
}

/* One weight row of blocks of 32 against rows of x (q32, d32, s32): signed codes meet x
 * through |c| and x with c's sign; unsigned codes (Q4_1, Q5_1) meet x as it is, and
 * their min meets s32. */
AI void dot32(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
              const int rows, const int type) {
    const int size = type == Q8_0 ? 34 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 18;
    const int min = type == Q4_1 || type == Q5_1;
    if (rows == 4 && min) { /* measured: the types without a min run faster below */
        dot32x4(b, xq, xb, k, out, type);
        return;
    }
    __m256 acc[XR8];
    float mins[XR8];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    for (int64_t i = 0; i < k / 32; i++, b += size) {
        __m256i c = codes32(b, type), u = min ? c : _mm256_sign_epi8(c, c);
        float m = min ? half(b + 2) : 0.0f;
        __m256 d = _mm256_set1_ps(half(b));
        for (int r = 0; r < rows; r++) {
            const uint8_t *x = xq + r * xb;
            const float *dx = (const float *)(x + k);
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
            __m256i lanes = dpb(_mm256_setzero_si256(), u, min ? v : _mm256_sign_epi8(v, c));
            __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(dx + i), d); /* d32 * d */
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, acc[r]);
            if (min) mins[r] += m * dx[k / 32 + i]; /* s32 */
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum8(acc[r]) + mins[r];
}

/* Q4_K and Q5_K (`five`): codes 0-15 / 0-31, unsigned, against q256; two chains of dpw
 * per row (sub-blocks 2j and 2j + 1). A block's scale sum S (8 lanes) and min sum M meet
 * their floats together: hadd(S, M) = [S S M M | S S M M] times [d d -dmin -dmin] dx. */
AI void dot_qk(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
               const int rows, const int five) {
    const int size = five ? 176 : 144;
    __m256 acc[XR8];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0xf), bit4 = _mm256_set1_epi8(0x10);
    const __m128i pairs = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (int64_t i = 0; i < k / 256; i++, b += size) {
        __m128i sm = k_scales16(b + 4);
        __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        __m256i mn2 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, pairs)); /* m0 m0 m1 m1 .. */
        const uint8_t *qs = b + 16 + (five ? 32 : 0);
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256i sums[XR8][2];
        for (int j = 0; j < 4; j++) { /* 32 bytes: sub-block 2j low nibbles, 2j + 1 high */
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i c0 = _mm256_and_si256(v, mask), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if (five) {
                c0 = _mm256_or_si256(c0, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
                c1 = _mm256_or_si256(c1, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            __m256i s0 = lane16(sc16, 2 * j), s1 = lane16(sc16, 2 * j + 1);
            for (int r = 0; r < rows; r++) {
                XQ256(r);
                const int8_t *x = q + 256 * i + 64 * j;
                __m256i p0 = _mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)x));
                __m256i p1 = _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)(x + 32)));
                if (j == 0) { /* a chain starts with a product, not an add to zero */
                    sums[r][0] = _mm256_madd_epi16(p0, s0);
                    sums[r][1] = _mm256_madd_epi16(p1, s1);
                } else {
                    sums[r][0] = dpw(sums[r][0], p0, s0);
                    sums[r][1] = dpw(sums[r][1], p1, s1);
                }
            }
        }
        uint32_t halves; /* d, dmin */
        memcpy(&halves, b, 4);
        __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
        h = _mm_permute_ps(_mm_xor_ps(h, _mm_setr_ps(0.0f, -0.0f, 0.0f, 0.0f)), _MM_SHUFFLE(1, 1, 0, 0));
        __m256 dm = _mm256_set_m128(h, h);
        for (int r = 0; r < rows; r++) {
            XQ256(r);
            __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + 16 * i)), mn2);
            __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(sums[r][0], sums[r][1]), mins);
            __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(dx + i), dm);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum8(acc[r]);
}

/* Q6_K: codes 0-63, 16 signed scales of 16; the codes' -32 taken off through bsum: the
 * first chain starts at bsum_s times -32 sc_s (|32 sc| <= 4096, an int16) */
AI void dot_q6k(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
                const int rows) {
    __m256 acc[XR8];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / 256; i++, b += 210) {
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        __m256i neg32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5));
        __m256i sums[XR8][2];
        for (int r = 0; r < rows; r++) {
            XQ256(r);
            sums[r][0] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + 16 * i)), neg32);
            sums[r][1] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; h++) { /* 128 values: ql [64 bytes], qh [32 bytes] */
            /* scales 8h .. 8h + 7 in both halves, so a vpshufb picks s low and s + 1 high */
            /* two calls, each with its immediate: gcc need not unroll this loop */
            __m256i sch = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                            : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            __m256i c[4];
            q6k_codes(b, h, c);
            for (int g = 0; g < 4; g++) { /* 32 values, sub-blocks s and s + 1 of 16 */
                short lo = (short)(0x0100 + 0x0202 * (2 * g)), hi = (short)(lo + 0x0202);
                __m256i scs = _mm256_shuffle_epi8(sch, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo)));
                for (int r = 0; r < rows; r++) {
                    XQ256(r);
                    __m256i x = _mm256_loadu_si256((const __m256i *)(q + 256 * i + 128 * h + 32 * g));
                    sums[r][g & 1] = dpw(sums[r][g & 1], _mm256_maddubs_epi16(c[g], x), scs);
                }
            }
        }
        __m256 d = _mm256_set1_ps(half(b + 208));
        for (int r = 0; r < rows; r++) {
            XQ256(r);
            __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(dx + i), d);
            __m256i s = _mm256_add_epi32(sums[r][0], sums[r][1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum8(acc[r]);
}

/* IQ4_XS: 8 sub-blocks of 32, signed codes KVALUES[q], scale ls - 32 */
AI void dot_iq4xs(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
                  const int rows) {
    __m256 acc[XR8];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    for (int64_t i = 0; i < k / 256; i++, b += 136) {
        __m256i sums[XR8][2];
        for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i c = _mm256_shuffle_epi8(kv, nib32(b + 8 + 16 * j)), u = _mm256_sign_epi8(c, c);
            __m256i ls = _mm256_set1_epi16((int16_t)iq4_xs_scale(b, j));
            for (int r = 0; r < rows; r++) {
                XQ256(r);
                __m256i x = _mm256_loadu_si256((const __m256i *)(q + 256 * i + 32 * j));
                __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(x, c));
                sums[r][j & 1] = dpw(sums[r][j & 1], p, ls);
            }
        }
        float d = half(b);
        for (int r = 0; r < rows; r++) {
            XQ256(r);
            ADD(acc[r], _mm256_add_epi32(sums[r][0], sums[r][1]), dx[i] * d);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum8(acc[r]);
}

/* idot_<type>: the kernel at each constant row count (1 .. XR8) */
#define IDOT(name, call)                                                                    \
    static void idot_##name(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k,      \
                            float *out, int rows) {                                         \
        switch (rows) {                                                                     \
        case 1: call(1); return;                                                            \
        case 2: call(2); return;                                                            \
        case 3: call(3); return;                                                            \
        default: call(XR8); return;                                                         \
        }                                                                                   \
    }
#define C_Q8_0(R) dot32(b, xq, xb, k, out, R, Q8_0)
#define C_Q4_0(R) dot32(b, xq, xb, k, out, R, Q4_0)
#define C_Q4_1(R) dot32(b, xq, xb, k, out, R, Q4_1)
#define C_Q5_0(R) dot32(b, xq, xb, k, out, R, Q5_0)
#define C_Q5_1(R) dot32(b, xq, xb, k, out, R, Q5_1)
#define C_IQ4_NL(R) dot32(b, xq, xb, k, out, R, IQ4_NL)
#define C_Q4_K(R) dot_qk(b, xq, xb, k, out, R, 0)
#define C_Q5_K(R) dot_qk(b, xq, xb, k, out, R, 1)
#define C_Q6_K(R) dot_q6k(b, xq, xb, k, out, R)
#define C_IQ4_XS(R) dot_iq4xs(b, xq, xb, k, out, R)
IDOT(q8_0, C_Q8_0)
IDOT(q4_0, C_Q4_0)
IDOT(q4_1, C_Q4_1)
IDOT(q5_0, C_Q5_0)
IDOT(q5_1, C_Q5_1)
IDOT(iq4_nl, C_IQ4_NL)
IDOT(q4_k, C_Q4_K)
IDOT(q5_k, C_Q5_K)
IDOT(q6_k, C_Q6_K)
IDOT(iq4_xs, C_IQ4_XS)

static idot_fn int8_dot_of(int32_t type) {
    switch (type) {
    case Q8_0: return idot_q8_0;
    case Q4_0: return idot_q4_0;
    case Q4_1: return idot_q4_1;
    case Q5_0: return idot_q5_0;
    case Q5_1: return idot_q5_1;
    case Q4_K: return idot_q4_k;
    case Q5_K: return idot_q5_k;
    case Q6_K: return idot_q6_k;
    case IQ4_NL: return idot_iq4_nl;
    case IQ4_XS: return idot_iq4_xs;
    default: return 0;
    }
}
#else
#define XR8 1
typedef void (*idot_fn)(const uint8_t *b, const uint8_t *xq, int64_t xb, int64_t k, float *out,
                        int rows);
static idot_fn int8_dot_of(int32_t type) {
    (void)type;
    return 0;
}
#endif

#endif