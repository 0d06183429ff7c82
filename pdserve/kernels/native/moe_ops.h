/* A mixture-of-experts layer's passes around its experts (model/arch/moe.py), part of
 * decode_ops.c's library: the per-call path calls them through decode_ops.py, the one-call
 * decode forward (decode_moe.h) through pointers to the same functions, so both compute
 * the same bits.
 *
 *   pd_moe_route      per token: p = softmax(logits) in float32 (max subtracted, exp, sum,
 *                     divide); its top k (largest first, of equal values the lower
 *                     expert first) -> chosen [t][k], their p -> w [t][k], divided by
 *                     their sum where `norm` (norm_topk_prob; Mixtral always)
 *   pd_moe_combine    out [t][n] = for each (token, slot) pair in the order given (the
 *                     pairs grouped by expert): out[token] += w * y[pair], from zero
 *   pd_moe_gated_add  out[r] += sigmoid(gate[r]) * shared[r]  (Qwen2-MoE's shared expert)
 *
 * Precondition (the callers check): 1 <= k <= e <= PD_MOE_MAX_EXPERTS; every token index
 * within [0, t). Needs exp_poly (decode_ops.c defines it before including this). */
#ifndef PD_MOE_OPS_H
#define PD_MOE_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PD_MOE_MAX_EXPERTS 1024

static void softmax_row(const float *l, int64_t e, float *p) {
    float top = l[0];
    for (int64_t i = 1; i < e; i++) top = l[i] > top ? l[i] : top;
    float sum = 0.0f;
    for (int64_t i = 0; i < e; i++) {
        float d = l[i] - top; /* <= 0; a NaN row stays NaN, as torch's */
        p[i] = exp_poly(d < -87.3f ? -87.3f : d);
        sum += p[i];
    }
    for (int64_t i = 0; i < e; i++) p[i] /= sum;
}

void pd_moe_route(const float *logits, int64_t t, int64_t e, int64_t k, int32_t norm, float *w,
                  int64_t *chosen) {
    float p[PD_MOE_MAX_EXPERTS];
    unsigned char taken[PD_MOE_MAX_EXPERTS];
    for (int64_t r = 0; r < t; r++) {
        softmax_row(logits + r * e, e, p);
        memset(taken, 0, (size_t)e);
        float *wr = w + r * k;
        int64_t *cr = chosen + r * k;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1; /* the first expert not taken, then any larger one */
            for (int64_t i = 0; i < e; i++)
                if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
            taken[best] = 1;
            cr[j] = best;
            wr[j] = p[best];
        }
        if (!norm) continue;
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += wr[j];
        for (int64_t j = 0; j < k; j++) wr[j] /= sum;
    }
}

void pd_moe_combine(const float *y, const float *w, const int64_t *tokens, int64_t pairs,
                    int64_t n, float *out, int64_t t) {
    memset(out, 0, (size_t)(t * n) * sizeof(float));
    for (int64_t q = 0; q < pairs; q++) {
        float *o = out + tokens[q] * n, wq = w[q];
        const float *yq = y + q * n;
        for (int64_t i = 0; i < n; i++) o[i] += wq * yq[i];
    }
}

void pd_moe_gated_add(float *out, const float *gate, const float *shared, int64_t t, int64_t n) {
    for (int64_t r = 0; r < t; r++) {
        float g = gate[r];
        float s = 1.0f / (1.0f + exp_poly(-g)); /* exp_poly: inf past 88.7, ~0 below */
        for (int64_t i = 0; i < n; i++) out[r * n + i] += s * shared[r * n + i];
    }
}

#endif
