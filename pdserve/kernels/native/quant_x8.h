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
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
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

/* rows [m][k] of x -> m rows of pd_xq_bytes(k) (kernel_args.h's layout) */
void pd_quant_x8(const float *x, int64_t m, int64_t k, uint8_t *out) {
    for (int64_t r = 0; r < m; r++, x += k, out += pd_xq_bytes(k)) {
        int8_t *q = (int8_t *)out;
        float *d = (float *)(out + k), *s = d + k / 32;
        for (int64_t b = 0; b < k / 32; b++) {
            d[b] = quant_block(x + 32 * b, 32, q + 32 * b);
            int sum = 0;
            for (int i = 0; i < 32; i++) sum += q[32 * b + i];
            s[b] = d[b] * (float)sum;
        }
        if (k % 256) continue;
        int8_t *q2 = (int8_t *)(s + k / 32);
        float *d2 = (float *)(q2 + k);
        int16_t *bsum = (int16_t *)(d2 + k / 256);
        for (int64_t b = 0; b < k / 256; b++) d2[b] = quant_block(x + 256 * b, 256, q2 + 256 * b);
        for (int64_t g = 0; g < k / 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q2[16 * g + i];
            bsum[g] = (int16_t)sum;
        }
    }
}
#endif
