/* The decode attention walk in AVX-512 (included by paged_decode.c when the compiler
   targets AVX-512F): four query heads of one kv group share every instruction.

   Why another form: the 8-lane walk reduces each score q . k_t with a shuffle tree, one
   tree per key per head, and reads every K and V row once per query head; with 16
   lanes the trees would cost half as much again per multiply-add. Here the 16 lanes
   hold 4 heads x 4 dimensions instead, so the sum over dimensions mostly happens inside
   the multiply-adds:

       qv[c]   = [q_0[4c..4c+3] | q_1[4c..4c+3] | q_2[...] | q_3[...]]    (scale folded in)
       a_t    += qv[c] * (k_t[4c..4c+3] broadcast to all four 128-bit lanes)   c < D/4

   leaves, in 128-bit lane h, head h's four partial sums of q_h . k_t. Four keys' a_t
   reduce together (two unpack-and-add steps) into one vector of scores laid out
   [head 0: keys t..t+3 | head 1: ... | ...], which is also the layout the online softmax
   works in: a head's running max m and sum l sit replicated (m) or split (l, four
   partial sums) over its own four lanes. The V side reads each row once for the four
   heads: acc_h += p_h,t * v_t, with acc_h in registers for 64 dimensions at a time.

   Groups of g != 4 heads run in quads padded with zero queries (their scores are 0, their
   outputs are not written): g = 3 uses 3 of 4, g = 8 two full quads. Groups of 1 and 2
   stay on the 8-lane walk (paged_decode.c's pick_walk): a quad padded to 4 wastes half
   or more of its lanes there. The walk keeps the
   8-lane walk's order of memory: a block of BLOCK keys is read whole (all kv heads of a
   slot), once, in slot order, and the rows a block or two ahead are prefetched as it
   computes (quad_block). Results agree with the
   8-lane walk to fp32 rounding, not bit for bit (the sums are added in another order). */

#include <immintrin.h>

#define QUADS 16             /* quads per walk: their state lives on the stack */
#define QMAX_D 128           /* D = 64 or 128 */
#define GROUPS (BLOCK / 4)   /* score vectors per block: four keys each */

typedef struct {
    __m512 qv[QMAX_D / 4];  /* interleaved queries, as above */
    __m512 acc[4][QMAX_D / 16];
    __m512 m, l;
} Quad;

/* [h: x_h0 x_h1 x_h2 x_h3] -> the max (sum) of each head's four lanes, in all four. */
static inline __m512 group_max(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_ps(x, x, 0xB1));  // swap neighbours
    return _mm512_max_ps(x, _mm512_shuffle_ps(x, x, 0x4E));  // swap halves
}

static inline __m512 group_sum(__m512 x) {
    x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0xB1));
    return _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0x4E));
}

/* Four keys' partial sums a[0..3] -> [head h: score(h, t0) .. score(h, t3)] per lane h. */
static inline __m512 reduce4(const __m512 *a) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

/* exp_poly on sixteen lanes (the same steps as exp8 in paged_decode.c). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    __m512 nf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nf), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline void quad_init(Quad *qd, const float *q, int64_t nq, float scale, const int D) {
    for (int c = 0; c < D / 4; c++) {
        float lanes[16];
        for (int h = 0; h < 4; h++)
            for (int i = 0; i < 4; i++) lanes[4 * h + i] = h < nq ? q[h * D + 4 * c + i] * scale : 0.0f;
        qd->qv[c] = _mm512_loadu_ps(lanes);
    }
    for (int h = 0; h < 4; h++)
        for (int z = 0; z < D / 16; z++) qd->acc[h][z] = _mm512_setzero_ps();
    qd->m = _mm512_set1_ps(-INFINITY);
    qd->l = _mm512_setzero_ps();
}

/* Scores of keys krow[0..n) (rows past n repeat a valid row) into sc[GROUPS]; lanes of
   keys >= n are -inf. Eight keys at a time: eight independent multiply-add chains. */
static inline __attribute__((always_inline)) void quad_scores(
    const Quad *qd, const float *const *krow, int64_t n, __m512 *sc, const int D) {
    const __m512i key = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
    for (int64_t i = 0; 4 * i < n; i += 2) {
        __m512 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
        for (int c = 0; c < D / 4; c++) {
            __m512 qc = qd->qv[c];
            for (int u = 0; u < 8; u++) {
                __m128 k4 = _mm_loadu_ps(krow[4 * i + u] + 4 * c);
                a[u] = _mm512_fmadd_ps(qc, _mm512_broadcast_f32x4(k4), a[u]);
            }
        }
        for (int w = 0; w < 2; w++) {
            __mmask16 ok = _mm512_cmplt_epi32_mask(
                _mm512_add_epi32(key, _mm512_set1_epi32((int)(4 * (i + w)))),
                _mm512_set1_epi32((int)n));
            sc[i + w] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), reduce4(a + 4 * w));
        }
    }
}

/* One block of n keys for one quad: the online softmax update, then acc += p * V. While
   it multiplies key t's V row it prefetches rows pk[t] and pv[t] (t < npf), a block or
   two ahead: spread one row per key through the arithmetic, the misses stay in flight
   while it computes. (Issued in a burst at the start of each block they fill the miss
   buffers, and the loads behind them wait: memory and arithmetic then take about the
   sum of their times instead of overlapping; benchmarks/decode_attention.py.) */
static inline __attribute__((always_inline)) void quad_block(
    Quad *qd, const float *const *krow, const float *const *vrow, int64_t n, const int D,
    const float *const *pk, const float *const *pv, int64_t npf) {
    __m512 sc[GROUPS];
    int64_t ng = ((n + 7) / 8) * 2;  // score vectors written (in pairs)
    quad_scores(qd, krow, n, sc, D);
    __m512 mx = sc[0];
    for (int64_t i = 1; i < ng; i++) mx = _mm512_max_ps(mx, sc[i]);
    __m512 mnew = _mm512_max_ps(qd->m, group_max(mx));
    __m512 alpha = exp16(_mm512_sub_ps(qd->m, mnew));
    qd->m = mnew;
    float p[GROUPS * 16] __attribute__((aligned(64)));
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < ng; i++) {
        __mmask16 ok = _mm512_cmp_ps_mask(sc[i], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(ok, exp16(_mm512_sub_ps(sc[i], mnew)));
        lsum = _mm512_add_ps(lsum, e);
        _mm512_store_ps(p + 16 * i, e);
    }
    qd->l = _mm512_fmadd_ps(qd->l, alpha, lsum);
    float al[16] __attribute__((aligned(64)));
    _mm512_store_ps(al, alpha);
    for (int z0 = 0; z0 < D / 16; z0 += 4) {  // 64 dimensions at a time: 16 sums in registers
        __m512 acc[4][4];
        for (int h = 0; h < 4; h++)
            for (int z = 0; z < 4; z++)
                acc[h][z] = _mm512_mul_ps(qd->acc[h][z0 + z], _mm512_set1_ps(al[4 * h]));
        for (int64_t t = 0; t < n; t++) {
            if (z0 == 0 && t < npf)
                for (int c = 0; c < D; c += 16) {  // one 64-byte line per 16 floats, to L2
                    __builtin_prefetch(pk[t] + c, 0, 2);
                    __builtin_prefetch(pv[t] + c, 0, 2);
                }
            const float *pt = p + 16 * (t / 4) + t % 4;
            __m512 v[4];
            for (int z = 0; z < 4; z++) v[z] = _mm512_loadu_ps(vrow[t] + 16 * (z0 + z));
            for (int h = 0; h < 4; h++) {
                __m512 ph = _mm512_set1_ps(pt[4 * h]);
                for (int z = 0; z < 4; z++) acc[h][z] = _mm512_fmadd_ps(ph, v[z], acc[h][z]);
            }
        }
        for (int h = 0; h < 4; h++)
            for (int z = 0; z < 4; z++) qd->acc[h][z0 + z] = acc[h][z];
    }
}

static inline void quad_finish(const Quad *qd, int64_t nq, float *out, const int D) {
    float l[16] __attribute__((aligned(64)));
    _mm512_store_ps(l, group_sum(qd->l));
    for (int h = 0; h < nq; h++) {
        __m512 inv = _mm512_set1_ps(l[4 * h] > 0.0f ? 1.0f / l[4 * h] : 0.0f);
        for (int z = 0; z < D / 16; z++)
            _mm512_storeu_ps(out + h * D + 16 * z, _mm512_mul_ps(qd->acc[h][z], inv));
    }
}

/* One request, kv heads [k0, k1) of n_kv (at most QUADS quads: (k1 - k0) * ceil(g / 4)),
   query rows q (stride D) -> out rows (stride D). */
static inline __attribute__((always_inline)) void attend_quads(
    const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
    int64_t start, int64_t len, int64_t k0, int64_t k1, int64_t n_kv, int64_t g,
    float scale, float *out, const int D) {
    const int64_t width = n_kv * D, per_kv = (g + 3) / 4;
    Quad quads[QUADS];
    const float *krow[BLOCK], *vrow[BLOCK], *pk[BLOCK], *pv[BLOCK];
    for (int64_t kv = k0; kv < k1; kv++)
        for (int64_t u = 0; u < per_kv; u++) {
            int64_t h0 = (kv - k0) * g + 4 * u, nq = g - 4 * u < 4 ? g - 4 * u : 4;
            quad_init(&quads[(kv - k0) * per_kv + u], q + h0 * D, nq, scale, D);
        }
    for (int64_t t0 = start; t0 < len; t0 += BLOCK) {
        int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        int64_t pf = t0 + PF_DIST, pn = len - pf < BLOCK ? len - pf : BLOCK;
        pn = pn > 0 ? pn : 0;  // rows [pf, pf + pn): prefetched inside the block
        for (int64_t kv = k0; kv < k1; kv++) {
            for (int64_t t = 0; t < BLOCK; t++) {  // rows past n repeat row 0 (masked)
                int64_t row = slots[t0 + (t < n ? t : 0)] * width + kv * D;
                krow[t] = k_pool + row;
                vrow[t] = v_pool + row;
            }
            for (int64_t t = 0; t < pn; t++) {
                int64_t row = slots[pf + t] * width + kv * D;
                pk[t] = k_pool + row;
                pv[t] = v_pool + row;
            }
            for (int64_t u = 0; u < per_kv; u++)  // the first quad of a kv head prefetches
                quad_block(&quads[(kv - k0) * per_kv + u], krow, vrow, n, D, pk, pv,
                           u == 0 ? pn : 0);
        }
    }
    for (int64_t kv = k0; kv < k1; kv++)
        for (int64_t u = 0; u < per_kv; u++) {
            int64_t h0 = (kv - k0) * g + 4 * u, nq = g - 4 * u < 4 ? g - 4 * u : 4;
            quad_finish(&quads[(kv - k0) * per_kv + u], nq, out + h0 * D, D);
        }
}

static void attend_quads_64(const float *q, const float *k_pool, const float *v_pool,
                            const int64_t *slots, int64_t start, int64_t len, int64_t k0,
                            int64_t k1, int64_t n_kv, int64_t g, float scale, float *out) {
    attend_quads(q, k_pool, v_pool, slots, start, len, k0, k1, n_kv, g, scale, out, 64);
}

static void attend_quads_128(const float *q, const float *k_pool, const float *v_pool,
                             const int64_t *slots, int64_t start, int64_t len, int64_t k0,
                             int64_t k1, int64_t n_kv, int64_t g, float scale, float *out) {
    attend_quads(q, k_pool, v_pool, slots, start, len, k0, k1, n_kv, g, scale, out, 128);
}
