/* Decode attention on CPU, read in place from the paged KV pool (fp32).

   One query token per request b; its keys are positions [start[b], len[b]) whose KV
   rows sit at slots[b, pos] of one layer's pool:

       k_pool, v_pool   [S, KH, D]     row (slot s, kv head h) at (s * KH + h) * D
       q, out           [B, H, D]      query head j uses kv head j / (H / KH)

   For each (b, kv head) the G = H / KH query heads of the group walk the keys once,
   in blocks of BLOCK positions, with an online softmax (running max m, running sum l,
   output accumulator acc rescaled when m grows):

       s_t  = scale * q . k_t                      for t in the block
       m'   = max(m, max_t s_t);   a = exp(m - m')
       l    = a * l + sum_t exp(s_t - m')
       acc  = a * acc + sum_t exp(s_t - m') * v_t
       out  = acc / l                              after the last block

   so every K and V row is read from memory once per step (not once per query head),
   nothing is gathered into a temporary, and no [B, L] score matrix is materialised.
   D = 64 and 128 have their own copies with D fixed at compile time (below).

   Plain C loops over D in 8 independent lanes, so the compiler vectorises them
   without -ffast-math (each lane's sum keeps its order: results do not depend on the
   compiler's choices; -fno-trapping-math lets it vectorise the selects). exp is a
   vectorisable polynomial (Cephes' expf coefficients, within 2 ulp of expf over the
   range softmax uses). Called through ctypes, which releases the GIL for the call. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define LANES 8
#define MAX_D 256
#define MAX_G 16

static inline float exp_poly(float x) {
    /* exp(x) for x <= 0 (softmax arguments); below -87.3 the result is 0. */
    if (x < -87.3f) x = -87.3f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < d; i++) s += a[i] * b[i];
    for (int j = 0; j < LANES; j++) s += lane[j];
    return s;
}

static inline float sum_lanes(const float *restrict x, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += x[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int j = 0; j < LANES; j++) s += lane[j];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] += a * x[i];
}

static inline void scale_row(float *restrict y, float a, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] *= a;
}

/* One (request, kv head `head` of n_kv): g query rows q[0..g) (stride d) -> out rows (stride d). */
static void attend_group(const float *q, const float *k_pool, const float *v_pool,
                         const int64_t *slots, int64_t start, int64_t len, int64_t head,
                         int64_t n_kv, int64_t g, int64_t d, float scale, float *out) {
    float acc[MAX_G][MAX_D];
    float m[MAX_G], l[MAX_G], s[MAX_G][BLOCK];
    const float *krow[BLOCK], *vrow[BLOCK];
    for (int64_t j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        memset(acc[j], 0, sizeof(float) * d);
    }
    for (int64_t t0 = start; t0 < len; t0 += BLOCK) {
        int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        for (int64_t t = 0; t < n; t++) {
            int64_t row = slots[t0 + t] * n_kv + head;
            krow[t] = k_pool + row * d;
            vrow[t] = v_pool + row * d;
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < g; j++) s[j][t] = scale * dot(q + j * d, krow[t], d);
        for (int64_t j = 0; j < g; j++) {
            float mb = m[j];
            for (int64_t t = 0; t < n; t++) mb = s[j][t] > mb ? s[j][t] : mb;
            float a = exp_poly(m[j] - mb);
            for (int64_t t = 0; t < n; t++) s[j][t] = exp_poly(s[j][t] - mb);  // vectorised
            l[j] = l[j] * a + sum_lanes(s[j], n);
            m[j] = mb;
            if (a != 1.0f) scale_row(acc[j], a, d);
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < g; j++) axpy(acc[j], s[j][t], vrow[t], d);
    }
    for (int64_t j = 0; j < g; j++) {
        float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[j * d + i] = acc[j][i] * inv;
    }
}

/* The same walk with D fixed at compile time (64 or 128: DV vectors of 8 floats), in
   GCC/Clang vector types: a query row and a head's accumulator stay in registers
   across a block's keys instead of being reloaded per key. Same sums, same order. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8 v) {
    float s = 0.0f;
    for (int k = 0; k < LANES; k++) s += v[k];
    return s;
}

#define DEFINE_GROUP_FIXED(NAME, DV)                                                         \
    static void NAME(const float *q, const float *k_pool, const float *v_pool,              \
                     const int64_t *slots, int64_t start, int64_t len, int64_t head,         \
                     int64_t n_kv, int64_t g, float scale, float *out) {                     \
        const int64_t d = DV * LANES;                                                        \
        v8 acc[MAX_G][DV];                                                                   \
        float m[MAX_G], l[MAX_G], s[MAX_G][BLOCK];                                           \
        const float *krow[BLOCK], *vrow[BLOCK];                                              \
        for (int64_t j = 0; j < g; j++) {                                                    \
            m[j] = -INFINITY;                                                                \
            l[j] = 0.0f;                                                                     \
            for (int i = 0; i < DV; i++) acc[j][i] = (v8){0};                                \
        }                                                                                    \
        for (int64_t t0 = start; t0 < len; t0 += BLOCK) {                                    \
            int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;                                 \
            for (int64_t t = 0; t < n; t++) {                                                \
                int64_t row = slots[t0 + t] * n_kv + head;                                   \
                krow[t] = k_pool + row * d;                                                  \
                vrow[t] = v_pool + row * d;                                                  \
            }                                                                                \
            for (int64_t j = 0; j < g; j++) {                                                \
                v8 qv[DV];                                                                   \
                for (int i = 0; i < DV; i++) qv[i] = load8(q + j * d + i * LANES);           \
                for (int64_t t = 0; t < n; t++) {                                            \
                    v8 sum = {0};                                                            \
                    for (int i = 0; i < DV; i++) sum += qv[i] * load8(krow[t] + i * LANES);  \
                    s[j][t] = scale * hsum8(sum);                                            \
                }                                                                            \
            }                                                                                \
            for (int64_t j = 0; j < g; j++) {                                                \
                float mb = m[j];                                                             \
                for (int64_t t = 0; t < n; t++) mb = s[j][t] > mb ? s[j][t] : mb;            \
                float a = exp_poly(m[j] - mb);                                               \
                for (int64_t t = 0; t < n; t++) s[j][t] = exp_poly(s[j][t] - mb);            \
                l[j] = l[j] * a + sum_lanes(s[j], n);                                        \
                m[j] = mb;                                                                   \
                v8 av[DV];                                                                   \
                for (int i = 0; i < DV; i++) av[i] = acc[j][i] * a;                          \
                for (int64_t t = 0; t < n; t++)                                              \
                    for (int i = 0; i < DV; i++) av[i] += s[j][t] * load8(vrow[t] + i * LANES); \
                for (int i = 0; i < DV; i++) acc[j][i] = av[i];                              \
            }                                                                                \
        }                                                                                    \
        for (int64_t j = 0; j < g; j++) {                                                    \
            float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;                                    \
            for (int i = 0; i < DV; i++) {                                                   \
                v8 o = acc[j][i] * inv;                                                      \
                memcpy(out + j * d + i * LANES, &o, sizeof o);                               \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_GROUP_FIXED(attend_group_64, 8)
DEFINE_GROUP_FIXED(attend_group_128, 16)

/* Requests [b0, b1) of the batch. q rows are q + b * q_stride (H * D contiguous);
   slots is [B, slot_stride] row-major; bounds is [B, 2] = (start, len) per request.
   Returns 0, or -1 if a shape exceeds the kernel's fixed limits (nothing written). */
int pd_paged_decode_f32(const float *q, int64_t q_stride, const float *k_pool,
                        const float *v_pool, const int64_t *slots, int64_t slot_stride,
                        const int64_t *bounds, int64_t b0, int64_t b1, int64_t h, int64_t kh,
                        int64_t d, float scale, float *out) {
    if (kh <= 0 || h % kh != 0 || h / kh > MAX_G || d > MAX_D) return -1;
    int64_t g = h / kh;
    for (int64_t b = b0; b < b1; b++)
        for (int64_t k = 0; k < kh; k++) {
            const float *qb = q + b * q_stride + k * g * d;
            const int64_t *sb = slots + b * slot_stride;
            int64_t lo = bounds[2 * b], hi = bounds[2 * b + 1];
            float *ob = out + (b * h + k * g) * d;
            if (d == 64)
                attend_group_64(qb, k_pool, v_pool, sb, lo, hi, k, kh, g, scale, ob);
            else if (d == 128)
                attend_group_128(qb, k_pool, v_pool, sb, lo, hi, k, kh, g, scale, ob);
            else
                attend_group(qb, k_pool, v_pool, sb, lo, hi, k, kh, g, d, scale, ob);
        }
    return 0;
}
