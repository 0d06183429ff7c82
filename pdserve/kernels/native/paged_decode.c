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
   without -ffast-math (each lane's sum keeps its order; -ffp-contract=fast fuses a
   multiply and an add into one FMA, so the last bit can differ between machines with
   and without FMA; -fno-trapping-math lets it vectorise the selects). exp is a
   vectorisable polynomial (Cephes' expf coefficients, within 2 ulp of expf over the
   range softmax uses). Called through ctypes, which releases the GIL for the call.

   On an AVX-512 build, D = 64 and 128 with groups of 3 or more query heads take
   attend_quad.h's walk instead (four query heads per vector): 0.81-0.85x the 8-lane
   walk's time with the KV in cache. From memory one core's bandwidth bounds both (they
   read at 70-87% of a sequential sum, benchmarks/decode_attention.py). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "exp_poly.h"
#include "kernel_args.h" /* PagedDecodeArgs */

#define BLOCK 32
#define LANES 8
#define MAX_D 256
#define MAX_G 16
#ifndef PF_DIST
#define PF_DIST 64
#endif
#define MAX_H 64 /* query heads per row walk (D = 64, 128) */

static inline float exp_poly(float x) {
    /* exp(x) for x <= 0 (softmax arguments); below -87.3 the result is 0. */
    return pd_exp_in_range(x < -87.3f ? -87.3f : x);
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
   GCC/Clang vector types, shaped for the machine rather than for the scalar reader:

   - scores eight keys at a time: one query vector is loaded per 8 multiply-adds into
     eight independent accumulators (no dependency chain waits on the adder), and the
     eight lane-sums are reduced together by a shuffle tree (hsum8x8) into one vector of
     eight scores, instead of a serial horizontal sum per key;
   - the softmax's exp runs on those vectors (exp8), and the scale is folded into q;
   - the rows PF_DIST keys ahead are prefetched while this block computes, one row per
     key inside the V loop of each kv head's first query head: rows sit wherever the slot
     table puts them (pages in any order), which the hardware prefetcher cannot follow
     across pages. One row per key rather than eight rows at once: eight at once
     outnumber the arithmetic between them and fill the miss buffers
     (benchmarks/decode_attention.py measures it).

   Per lane the dot product's terms are added in the same order as the generic walk;
   across lanes the tree adds them in another order (results agree to fp32 rounding). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

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

static inline v8 max8(v8 a, v8 b) {
    v8i m = a > b;
    return (v8)(((v8i)a & m) | ((v8i)b & ~m));
}

static inline float hmax8(v8 v) {
    float m = v[0];
    for (int k = 1; k < LANES; k++) m = v[k] > m ? v[k] : m;
    return m;
}

/* exp_poly on eight lanes (same constants, same steps). */
static inline v8 exp8(v8 x) {
    x = max8(x, (v8){0} - 87.3f);
    v8 t = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(t, v8i);  // truncates toward zero: floor needs -1 below
    n += (v8i)(__builtin_convertvector(n, v8) > t);
    v8 nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((n + 127) << 23);
}

#define SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* Eight vectors -> one vector of their eight lane-sums: out[k] = sum of a[k]'s lanes. */
static inline v8 hsum8x8(const v8 *a) {
    v8 p[4], z[2];
    for (int i = 0; i < 4; i++)  // [a0_02 a1_02 a0_13 a1_13 | a0_46 a1_46 a0_57 a1_57]
        p[i] = SHUF8(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               SHUF8(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; i++)  // [a0_0123 a1_0123 a2_0123 a3_0123 | a0_4567 ...]
        z[i] = SHUF8(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF8(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF8(z[0], z[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUF8(z[0], z[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline void prefetch_rows(const float *k_pool, const float *v_pool,
                                 const int64_t *slots, int64_t n, int64_t width) {
    for (int64_t t = 0; t < n; t++) {
        int64_t row = slots[t] * width;
        for (int64_t c = 0; c < width; c += 16) {  // one 64-byte line per 16 floats
            __builtin_prefetch(k_pool + row + c, 0, 2); // to L2: more misses in flight than L1 allows
            __builtin_prefetch(v_pool + row + c, 0, 2);
        }
    }
}

/* One request, kv heads [k0, k1) of n_kv at once (nh = (k1 - k0) * g <= MAX_H query
   heads): every block's K and V rows are read whole (all the heads of a slot sit side
   by side), once, in slot order, and the rows ahead are prefetched as it goes. Per kv head
   the group's g query heads then walk the block as above. */
#define DEFINE_ROWS_FIXED(NAME, DV)                                                          \
    static void NAME(const float *q, const float *k_pool, const float *v_pool,              \
                     const int64_t *slots, int64_t start, int64_t len, int64_t k0,           \
                     int64_t k1, int64_t n_kv, int64_t g, float scale, float *out) {         \
        const int64_t d = DV * LANES, width = n_kv * d, nh = (k1 - k0) * g;                 \
        v8 acc[MAX_H][DV], qs[MAX_H][DV], s[BLOCK / LANES];                                  \
        float m[MAX_H], l[MAX_H];                                                            \
        const float *krow[BLOCK], *vrow[BLOCK];                                              \
        for (int64_t j = 0; j < nh; j++) {                                                   \
            m[j] = -INFINITY;                                                                \
            l[j] = 0.0f;                                                                     \
            for (int i = 0; i < DV; i++) {                                                   \
                acc[j][i] = (v8){0};                                                         \
                qs[j][i] = load8(q + j * d + i * LANES) * scale;                             \
            }                                                                                \
        }                                                                                    \
        for (int64_t t0 = start; t0 < len; t0 += BLOCK) {                                    \
            int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;                                 \
            int64_t nv = (n + LANES - 1) / LANES; /* score vectors; lanes past n padded */   \
            int64_t next = len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK;              \
            (void)next;                                                                      \
            for (int64_t kv = k0; kv < k1; kv++) {                                           \
                for (int64_t t = 0; t < nv * LANES; t++) {                                   \
                    int64_t row = slots[t0 + (t < n ? t : 0)] * width + kv * d;              \
                    krow[t] = k_pool + row;                                                  \
                    vrow[t] = v_pool + row;                                                  \
                }                                                                            \
                for (int64_t j = (kv - k0) * g; j < (kv - k0 + 1) * g; j++) {               \
                    for (int64_t c = 0; c < nv; c++) {                                       \
                        const float *const *kr = krow + c * LANES;                           \
                        v8 a[LANES];                                                         \
                        for (int u = 0; u < LANES; u++) a[u] = qs[j][0] * load8(kr[u]);      \
                        for (int i = 1; i < DV; i++)                                         \
                            for (int u = 0; u < LANES; u++)                                  \
                                a[u] += qs[j][i] * load8(kr[u] + i * LANES);                 \
                        s[c] = hsum8x8(a);                                                   \
                    }                                                                        \
                    for (int64_t t = n; t < nv * LANES; t++) s[t / LANES][t % LANES] = -INFINITY; \
                    v8 mv = s[0];                                                            \
                    for (int64_t c = 1; c < nv; c++) mv = max8(mv, s[c]);                    \
                    float mb = hmax8(mv);                                                    \
                    mb = mb > m[j] ? mb : m[j];                                              \
                    float a_ = exp_poly(m[j] - mb);                                          \
                    v8 lv = {0};                                                             \
                    for (int64_t c = 0; c < nv; c++) {                                       \
                        s[c] = exp8(s[c] - mb);                                              \
                        lv += s[c];                                                          \
                    }                                                                        \
                    l[j] = l[j] * a_ + hsum8(lv);                                            \
                    m[j] = mb;                                                               \
                    const float *p = (const float *)s;                                       \
                    v8 av[DV];                                                               \
                    for (int i = 0; i < DV; i++) av[i] = acc[j][i] * a_;                     \
                    for (int64_t t = 0; t < n; t++) {                                        \
                        if (j == (kv - k0) * g && t0 + PF_DIST + t < len) {                  \
                            int64_t row = slots[t0 + PF_DIST + t] * width + kv * d;          \
                            for (int64_t c = 0; c < d; c += 16) {                            \
                                __builtin_prefetch(k_pool + row + c, 0, 2);                  \
                                __builtin_prefetch(v_pool + row + c, 0, 2);                  \
                            }                                                                \
                        }                                                                    \
                        for (int i = 0; i < DV; i++) av[i] += p[t] * load8(vrow[t] + i * LANES); \
                    }                                                                        \
                    for (int i = 0; i < DV; i++) acc[j][i] = av[i];                          \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t j = 0; j < nh; j++) {                                                   \
            float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;                                    \
            for (int i = 0; i < DV; i++) {                                                   \
                v8 o = acc[j][i] * inv;                                                      \
                memcpy(out + j * d + i * LANES, &o, sizeof o);                               \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_ROWS_FIXED(attend_rows_64, 8)
DEFINE_ROWS_FIXED(attend_rows_128, 16)

typedef void (*fixed_walk)(const float *, const float *, const float *, const int64_t *,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                           float *);

#if defined(__AVX512F__)
#include "attend_quad.h"
#endif

/* The walk for D = 64 / 128 and group size g, and how many kv heads one call takes. On
   AVX-512, groups of 3 or more take the quad walk; below that a padded quad wastes half
   or more of its lanes (the 8-lane walk is as fast at g = 2 and faster at g = 1). */
static fixed_walk pick_walk(int64_t d, int64_t g, int64_t *span) {
#if defined(__AVX512F__)
    if (g >= 3) {
        *span = QUADS / ((g + 3) / 4);
        return d == 64 ? attend_quads_64 : attend_quads_128;
    }
#endif
    *span = MAX_H / g;
    return d == 64 ? attend_rows_64 : attend_rows_128;
}

/* Units [u0, u1) of the batch's (request, kv head) pairs, request-major: unit u is
   request u / KH's kv head u % KH (with its G query heads). Each head's walk is its own
   (a walk of several heads computes each as alone), so a batch of one request splits
   over threads by heads, and a batch of many by requests as before. q rows are
   q + b * q_stride (H * D contiguous); slots is [B, slot_stride] row-major; bounds is
   [B, 2] = (start, len) per request. Returns 0, or -1 if a shape exceeds the kernel's
   fixed limits (nothing written). */
int pd_paged_decode_f32(const float *q, int64_t q_stride, const float *k_pool,
                        const float *v_pool, const int64_t *slots, int64_t slot_stride,
                        const int64_t *bounds, int64_t u0, int64_t u1, int64_t h, int64_t kh,
                        int64_t d, float scale, float *out) {
    if (kh <= 0 || h % kh != 0 || h / kh > MAX_G || d > MAX_D) return -1;
    int64_t g = h / kh, span = MAX_H / g;  // kv heads per walk
    fixed_walk walk = d == 64 || d == 128 ? pick_walk(d, g, &span) : NULL;
    for (int64_t u = u0; u < u1;) {
        int64_t b = u / kh, k_lo = u % kh, k_hi = k_lo + (u1 - u) < kh ? k_lo + (u1 - u) : kh;
        if (k_hi == kh && u + (kh - k_lo) < u1 && (d == 64 || d == 128)) {
            int64_t lo1 = bounds[2 * b + 2], n1 = bounds[2 * b + 3] - lo1;  // the next
            n1 = n1 < PF_DIST ? n1 : PF_DIST;  // request's first rows, while this one computes
            prefetch_rows(k_pool, v_pool, slots + (b + 1) * slot_stride + lo1, n1, kh * d);
        }
        const float *qb = q + b * q_stride;
        const int64_t *sb = slots + b * slot_stride;
        int64_t lo = bounds[2 * b], hi = bounds[2 * b + 1];
        float *ob = out + b * h * d;
        for (int64_t k0 = k_lo; k0 < k_hi; k0 += span) {
            int64_t k1 = k0 + span < k_hi ? k0 + span : k_hi;
            const float *qk = qb + k0 * g * d;
            float *ok = ob + k0 * g * d;
            if (walk)
                walk(qk, k_pool, v_pool, sb, lo, hi, k0, k1, kh, g, scale, ok);
            else
                for (int64_t k = k0; k < k1; k++)
                    attend_group(qb + k * g * d, k_pool, v_pool, sb, lo, hi, k, kh, g, d,
                                 scale, ob + k * g * d);
        }
        u += k_hi - k_lo;
    }
    return 0;
}

/* Units [lo, hi) of (request, kv head) pairs (pd_paged_decode_f32). */
void pd_paged_decode_range(const void *args, int64_t lo, int64_t hi) {
    const PagedDecodeArgs *a = args;
    int rc = pd_paged_decode_f32(a->q, a->q_stride, a->k_pool, a->v_pool, a->slots,
                                 a->slot_stride, a->bounds, lo, hi, a->h, a->kh, a->d,
                                 a->scale, a->out);
    if (rc) __atomic_store_n(&((PagedDecodeArgs *)a)->status, rc, __ATOMIC_RELAXED);
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(PagedDecodeArgs),
    PD_ABI_FIELD(PagedDecodeArgs, q), PD_ABI_FIELD(PagedDecodeArgs, q_stride),
    PD_ABI_FIELD(PagedDecodeArgs, k_pool), PD_ABI_FIELD(PagedDecodeArgs, v_pool),
    PD_ABI_FIELD(PagedDecodeArgs, slots), PD_ABI_FIELD(PagedDecodeArgs, slot_stride),
    PD_ABI_FIELD(PagedDecodeArgs, bounds), PD_ABI_FIELD(PagedDecodeArgs, h),
    PD_ABI_FIELD(PagedDecodeArgs, kh), PD_ABI_FIELD(PagedDecodeArgs, d),
    PD_ABI_FIELD(PagedDecodeArgs, scale), PD_ABI_FIELD(PagedDecodeArgs, out),
    PD_ABI_FIELD(PagedDecodeArgs, status),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
