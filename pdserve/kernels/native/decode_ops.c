/* The elementwise passes of a forward, one call each instead of 5-10 torch ops (fp32).
 *
 * At a decode's few rows every torch op costs more in dispatch than in arithmetic: a
 * layer's norms, rotation, activation and residual adds were ~30 ops. Here they are
 * loops over contiguous rows, each value read once (a prefill uses them too: fewer
 * passes over its activations, its rows split over threads by the *_range functions):
 *
 *   pd_add_rms_norm  h[r] += delta[r] (when delta is given), then
 *                    out[r] = w * (h[r] * 1 / sqrt(sum(h[r]^2) / n + eps))
 *   pd_rms_norm_heads  x[t][head] = w * rms_norm(x[t][head]) in place, each head's D
 *                    values a row (q/k norms, Qwen3); rows of a token ld apart
 *   pd_silu_mul      out[r][i] = silu(gu[r][i]) * gu[r][I + i]     gu = [gate | up]
 *   pd_gelu_tanh_mul out[r][i] = gelu_tanh(gu[r][i]) * gu[r][I + i]  (Gemma's
 *                    gelu_pytorch_tanh, computed as g / (1 + exp(-2u)): see gelu_tanh)
 *   pd_rope          x[t][head] rotated in place (rotate-half: the pair (j, j + D/2) by
 *                    the angle of position t, tables cos[t][j], sin[t][j] with the first
 *                    half of sin negated, as model/rope.py keeps them)
 *   pd_kv_write      k_pool[slot[t]] = k[t], v_pool[slot[t]] = v[t]; 1 (nothing written)
 *                    when a slot is outside the pool
 *   pd_moe_*         a mixture-of-experts layer's routing and sums (moe_ops.h)
 *   pd_argmax        the index of each row's first largest value; a NaN counts as the
 *                    largest (the first NaN wins), as torch.argmax does
 *
 * Each operation keeps the reference's order (torch's rms_norm: sum of squares, divide by
 * n, add eps, 1/sqrt, scale, then weight), so results differ from torch's only in the
 * rounding of the sum's partial order and of exp (a polynomial within 2 ulp of expf).
 * Plain C in lanes of 8 that the compiler vectorises, except the argmax (a max with its
 * index does not vectorise from C): AVX2 intrinsics where the compiler targets AVX2, a
 * scalar loop elsewhere; so it builds anywhere a C compiler is. The callers check
 * shapes and strides (kernels/native/decode_ops.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "exp_poly.h"

#define LANES 8

/* o = w * (x / sqrt(mean(x^2) + eps)) for one row of n; o may be x (each value is read
 * before it is written) */
static void norm_row(const float *x, const float *w, float *o, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * x[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += x[i] * x[i];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t j = 0; j < n; j++) o[j] = w[j] * (x[j] * inv);
}

void pd_add_rms_norm(float *h, const float *delta, const float *w, float *out, int64_t m,
                     int64_t n, float eps) {
    for (int64_t r = 0; r < m; r++) {
        float *hr = h + r * n;
        if (delta)
            for (int64_t i = 0; i < n; i++) hr[i] += delta[r * n + i];
        norm_row(hr, w, out + r * n, n, eps);
    }
}

void pd_rms_norm_heads(float *x, int64_t ld, const float *w, int64_t t, int64_t heads,
                       int64_t d, float eps) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t hd = 0; hd < heads; hd++) {
            float *row = x + i * ld + hd * d;
            norm_row(row, w, row, d, eps);
        }
}

static inline float exp_poly(float x) {
    /* expf(x) for all x: overflow gives inf, underflow ~0 */
    float big = x > 88.72f ? INFINITY : 0.0f;
    float e = pd_exp_in_range(x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x));
    return big != 0.0f ? big : e;
}

#include "moe_ops.h" /* the routing passes of a mixture-of-experts layer */

void pd_silu_mul(const float *gu, float *out, int64_t m, int64_t inter) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

/* 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as g * sigmoid(2u): the same
 * value without 1 + tanh's cancellation for negative g, through the exp polynomial silu
 * uses. Within a few ulp of the exact value; torch's (1 + tanh) form differs from it in
 * the last bits, so the per-call path calls this kernel too (model/layers/ops.py). */
static inline float gelu_tanh(float g) {
    float two_u = g * (1.59576912160573071f + 0.0713548162726008f * (g * g));
    return g / (1.0f + exp_poly(-two_u));
}

void pd_gelu_tanh_mul(const float *gu, float *out, int64_t m, int64_t inter) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = gelu_tanh(g[i]) * u[i];
    }
}

void pd_rope(float *x, int64_t ld, const float *cos, const float *sin, int64_t t,
             int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < t; i++) {
        const float *c = cos + i * d, *s = sin + i * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *a = x + i * ld + hd * d, *b = a + half;
            for (int64_t j = 0; j < half; j++) {
                float aj = a[j], bj = b[j];
                a[j] = aj * c[j] + bj * s[j];
                b[j] = bj * c[half + j] + aj * s[half + j];
            }
        }
    }
}

/* The passes above over rows [lo, hi) of their arguments (par.c range functions): a
 * prompt's rows go to the engine's threads in chunks (kernels/native/decode_ops.py). Rows are
 * independent, so any split gives the same bits. */
typedef struct {
    float *x; /* h (norm), x (heads, rope), gu (silu) */
    const float *delta, *w, *cos, *sin;
    float *out;
    int64_t ld, n, heads, d;
    float eps;
} RowsArgs;

void pd_add_rms_norm_range(const void *args, int64_t lo, int64_t hi) {
    const RowsArgs *a = args;
    const float *delta = a->delta ? a->delta + lo * a->n : 0;
    pd_add_rms_norm(a->x + lo * a->n, delta, a->w, a->out + lo * a->n, hi - lo, a->n, a->eps);
}

void pd_rms_norm_heads_range(const void *args, int64_t lo, int64_t hi) {
    const RowsArgs *a = args;
    pd_rms_norm_heads(a->x + lo * a->ld, a->ld, a->w, hi - lo, a->heads, a->d, a->eps);
}

void pd_silu_mul_range(const void *args, int64_t lo, int64_t hi) {
    const RowsArgs *a = args; /* n: the intermediate width I (gu rows are 2 I wide) */
    pd_silu_mul(a->x + lo * 2 * a->n, a->out + lo * a->n, hi - lo, a->n);
}

void pd_gelu_tanh_mul_range(const void *args, int64_t lo, int64_t hi) {
    const RowsArgs *a = args; /* as pd_silu_mul_range */
    pd_gelu_tanh_mul(a->x + lo * 2 * a->n, a->out + lo * a->n, hi - lo, a->n);
}

void pd_rope_range(const void *args, int64_t lo, int64_t hi) {
    const RowsArgs *a = args;
    pd_rope(a->x + lo * a->ld, a->ld, a->cos + lo * a->d, a->sin + lo * a->d, hi - lo, a->heads,
            a->d);
}

int pd_kv_write(float *kc, float *vc, int64_t num_slots, const int64_t *slots, const float *k,
                int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t row) {
    for (int64_t i = 0; i < t; i++) /* all checked before any is written */
        if (slots[i] < 0 || slots[i] >= num_slots) return 1;
    for (int64_t i = 0; i < t; i++) {
        memcpy(kc + slots[i] * row, k + i * ldk, (size_t)row * sizeof(float));
        memcpy(vc + slots[i] * row, v + i * ldv, (size_t)row * sizeof(float));
    }
    return 0;
}

#ifdef __AVX2__
#include <immintrin.h>

/* the maximum of x[0, n) (NaNs skipped) and whether a NaN is there, 8 lanes at a time */
static float max_and_nan(const float *x, int64_t n, int *any_nan) {
    __m256 top8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top8 = _mm256_max_ps(v, top8); /* a NaN in v yields top8: skipped */
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    *any_nan = _mm256_movemask_ps(nan8) != 0;
    for (; i < n; i++) {
        *any_nan |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    return top;
}

/* the first i with x[i] == top (top a number), 8 lanes at a time */
static int64_t first_equal(const float *x, int64_t n, float top) {
    __m256 t8 = _mm256_set1_ps(top);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t8, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == top) return i;
    return 0;
}
#else
static float max_and_nan(const float *x, int64_t n, int *any_nan) {
    float top = -INFINITY;
    *any_nan = 0;
    for (int64_t i = 0; i < n; i++) {
        *any_nan |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    return top;
}

static int64_t first_equal(const float *x, int64_t n, float top) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] == top) return i;
    return 0;
}
#endif

static int64_t argmax_row(const float *x, int64_t n) {
    int any_nan;
    float top = max_and_nan(x, n, &any_nan);
    if (any_nan) /* rare: the first NaN, found one by one */
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return first_equal(x, n, top); /* all -inf: top is -inf, found at 0 */
}

void pd_argmax(const float *x, int64_t m, int64_t n, int64_t ld, int64_t *out) {
    for (int64_t r = 0; r < m; r++) out[r] = argmax_row(x + r * ld, n);
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(RowsArgs),
    PD_ABI_FIELD(RowsArgs, x), PD_ABI_FIELD(RowsArgs, delta), PD_ABI_FIELD(RowsArgs, w),
    PD_ABI_FIELD(RowsArgs, cos), PD_ABI_FIELD(RowsArgs, sin), PD_ABI_FIELD(RowsArgs, out),
    PD_ABI_FIELD(RowsArgs, ld), PD_ABI_FIELD(RowsArgs, n), PD_ABI_FIELD(RowsArgs, heads),
    PD_ABI_FIELD(RowsArgs, d), PD_ABI_FIELD(RowsArgs, eps),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
