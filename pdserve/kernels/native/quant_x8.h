/* --quant-activations int8: the rows of x quantized to 8 bits per block, in
 * kernel_args.h's layout (pd_xq_bytes), once per projection; quant_int8.h's kernels read
 * them. */
#ifndef PD_QUANT_X8_H
#define PD_QUANT_X8_H

#include <math.h>

#include "kernel_args.h"
#include "quant_blocks.h" /* immintrin.h */

/* q[0, n) = x / d rounded to nearest (even: the rounding mode), d = max |x| / 127, n a
 * multiple of 32; returns d */
static float quant_block(const float *x, int n, int8_t *q) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    /* the 8 lanes' max in a tree (max is exact: any order gives the same value) */
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
#endif
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX2__)
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lanes */
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vid));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
#else
    for (int i = 0; i < n; i++) q[i] = (int8_t)lrintf(x[i] * id);
#endif
    return d;
}

/* the sums of n int8 (n a multiple of 16) in sums of 16: out[i] = q[16i] + .. + q[16i + 15] */
static inline void sums_of16(const int8_t *q, int n, int32_t *out) {
#if defined(__AVX2__)
    for (int i = 0; i < n; i += 32) {
        __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + i)), _mm256_set1_epi8((char)0x80));
        int64_t l[4]; /* sad against 0: the sums of 8 bytes, each + 128 */
        _mm256_storeu_si256((__m256i *)l, _mm256_sad_epu8(v, _mm256_setzero_si256()));
        out[i / 16] = (int32_t)(l[0] + l[1]) - 2048;
        if (i + 16 < n) out[i / 16 + 1] = (int32_t)(l[2] + l[3]) - 2048;
    }
#else
    for (int i = 0; i < n / 16; i++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * i + j];
        out[i] = s;
    }
#endif
}

/* rows [m][k] of x -> m rows of pd_xq_bytes(k) (kernel_args.h's layout) */
void pd_quant_x8(const float *x, int64_t m, int64_t k, uint8_t *out) {
    for (int64_t r = 0; r < m; r++, x += k, out += pd_xq_bytes(k)) {
        int8_t *q = (int8_t *)out;
        float *d = (float *)(out + k), *s = d + k / 32;
        for (int64_t b = 0; b < k / 32; b++) {
            d[b] = quant_block(x + 32 * b, 32, q + 32 * b);
            int32_t half[2];
            sums_of16(q + 32 * b, 32, half);
            s[b] = d[b] * (float)(half[0] + half[1]);
        }
        if (k % 256) continue;
        int8_t *q2 = (int8_t *)(s + k / 32);
        float *d2 = (float *)(q2 + k);
        int16_t *bsum = (int16_t *)(d2 + k / 256);
        for (int64_t b = 0; b < k / 256; b++) {
            int32_t sums[16];
            d2[b] = quant_block(x + 256 * b, 256, q2 + 256 * b);
            sums_of16(q2 + 256 * b, 256, sums);
            for (int g = 0; g < 16; g++) bsum[16 * b + g] = (int16_t)sums[g];
        }
    }
}
#endif
