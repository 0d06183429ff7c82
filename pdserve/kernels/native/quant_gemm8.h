/* --quant-activations int8 at a batch of rows (prefill, batched decode): a register-tiled
 * integer GEMM over the same arithmetic as quant_int8.h's per-row kernels.
 *
 * Why: the per-row kernels form a weight block's codes once per 4 rows of x and spend a
 * sign, a convert, a multiply-add and a reduction per (weight row, x row, block): at a
 * prompt's 512 rows that bookkeeping, not the integer dots, sets the pace. Here a tile
 * of TILE weight rows is unpacked once into codes and integer scales (L1), and every
 * instruction of the inner loop is a VNNI dot serving 16 rows of x at once:
 *
 *   x, once per call (pd_quant_x8_tiles): rows in groups of G8 = 16, a group's codes
 *     interleaved so that int32 lane r of a 64-byte vector holds 4 consecutive codes of
 *     row r, as unsigned bytes q + 128 (vpdpbusd takes its unsigned operand from them);
 *   a weight row's 4 codes broadcast to every lane (the signed operand), so one vpdpbusd
 *     adds 4 products to each of 16 rows' sums; a tile of 4 weight rows x 32 rows of x
 *     keeps its 8 integer sums (and 8 float sums) in registers;
 *   the + 128 comes back off exactly: every sum starts at -128 * (the block's sum of
 *     codes), formed with the codes; a K type's sub-block sums are scaled by their
 *     integer scales (vpmulld) into one integer sum per super-block, as the reference;
 *   per block (or super-block) the integer sums meet the float scales d_x * d_w in one
 *     convert and one multiply-add per 16 rows; mins (Q4_1, Q5_1: s32; Q4_K, Q5_K:
 *     pairs of sub-block sums of x against pairs of 6-bit mins, vpdpwssd) likewise.
 *
 * Every integer sum is the exact one of the per-row kernels (tests/int8_reference.py);
 * the float steps differ only in where float32 rounds. AVX-512 VNNI only: elsewhere
 * pd_quant_gemm8_supported says no and the per-row kernels run.
 *
 * Threads: a range of tiles, SUPER (4) unpacked at a time; each pair of groups meets
 * the SUPER tiles in turn (the pair stays in cache), and its 32 rows x 16 columns of y
 * are written a 64-byte row at a time (a wide y's lines fetched once). */
#ifndef PD_QUANT_GEMM8_H
#define PD_QUANT_GEMM8_H

#include "quant_int8.h"

#include "quant_x8_tiles.h" /* x laid out in groups of 16 rows: xt_* */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMM8 1

/* A tile's weight rows unpacked (gemm8_unpack): codes int8 [TILE][k] in order, and per
 * block (32) or super-block (256) of each row: */
typedef struct {
    int8_t *codes;
    int32_t *corr; /* [TILE][blocks] -128 * sum of codes (256: each scaled by its sc) */
    float *d, *m;  /* [TILE][blocks] d, and the min (32) or dmin (256) */
    int32_t *sc;   /* 256: [TILE][blocks][16] sub-block scales */
    int32_t *mn;   /* 256: [TILE][blocks][4] pairs of 6-bit mins (2p low, 2p + 1 high) */
    int64_t blocks;
} Tile8;

/* the sums of codes over the two 16-byte halves of c */
static inline void sums16(__m256i c, int32_t *lo, int32_t *hi) {
    __m256i s = _mm256_sad_epu8(_mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)),
                                _mm256_setzero_si256());
    int64_t l[4];
    _mm256_storeu_si256((__m256i *)l, s);
    *lo = (int32_t)(l[0] + l[1]) - 128 * 16;
    *hi = (int32_t)(l[2] + l[3]) - 128 * 16;
}

static inline int32_t sum32(__m256i c) {
    int32_t lo, hi;
    sums16(c, &lo, &hi);
    return lo + hi;
}

/* one weight row (blocks of 32) into row t of the tile */
static void unpack32(const uint8_t *b, int64_t k, int type, Tile8 *tl, int t) {
    const int size = type == Q8_0 ? 34 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 18;
    const int min = type == Q4_1 || type == Q5_1;
    int8_t *codes = tl->codes + t * k;
    int64_t at = t * tl->blocks;
    for (int64_t i = 0; i < k / 32; i++, b += size) {
        __m256i c = codes32(b, type);
        _mm256_storeu_si256((__m256i *)(codes + 32 * i), c);
        tl->corr[at + i] = -128 * sum32(c);
        tl->d[at + i] = half(b);
        tl->m[at + i] = min ? half(b + 2) : 0.0f;
    }
}

/* one weight row (super-blocks of 256) into row t of the tile */
static void unpack256(const uint8_t *b, int64_t k, int type, Tile8 *tl, int t) {
    const int size = type == Q4_K ? 144 : type == Q5_K ? 176 : type == Q6_K ? 210 : 136;
    int8_t *codes = tl->codes + t * k;
    const __m256i mask = _mm256_set1_epi8(0xf), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t i = 0; i < k / 256; i++, b += size) {
        int64_t at = t * tl->blocks + i;
        int8_t *c8 = codes + 256 * i;
        int32_t *sc = tl->sc + 16 * at, *mn = tl->mn + 4 * at, sub[16];
        __m256i c[8];
        int nsub = 8;
        tl->m[at] = 0.0f;
        if (type == Q4_K || type == Q5_K) {
            const int five = type == Q5_K;
            uint8_t s8[8], m8[8];
            k_scales8(b + 4, s8, m8);
            const uint8_t *qs = b + 16 + (five ? 32 : 0);
            __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                c[2 * j] = _mm256_and_si256(v, mask);
                c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                if (five) {
                    c[2 * j] = _mm256_or_si256(c[2 * j], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
                    c[2 * j + 1] = _mm256_or_si256(c[2 * j + 1], _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
                    qh = _mm256_srli_epi16(qh, 2);
                }
            }
            for (int j = 0; j < 8; j++) sc[j] = s8[j];
            for (int p = 0; p < 4; p++)
                mn[p] = (int32_t)((uint32_t)m8[2 * p] | ((uint32_t)m8[2 * p + 1] << 16));
            tl->d[at] = half(b);
            tl->m[at] = half(b + 2);
        } else if (type == Q6_K) {
            for (int h = 0; h < 2; h++) q6k_codes(b, h, c + 4 * h);
            for (int j = 0; j < 8; j++) c[j] = _mm256_sub_epi8(c[j], _mm256_set1_epi8(32));
            for (int s = 0; s < 16; s++) sc[s] = ((const int8_t *)(b + 192))[s];
            tl->d[at] = half(b + 208);
            nsub = 16;
        } else { /* IQ4_XS */
            const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
            for (int j = 0; j < 8; j++) {
                c[j] = _mm256_shuffle_epi8(kv, nib32(b + 8 + 16 * j));
                sc[j] = iq4_xs_scale(b, j);
            }
            tl->d[at] = half(b);
        }
        int32_t corr = 0;
        for (int j = 0; j < 8; j++) {
            _mm256_storeu_si256((__m256i *)(c8 + 32 * j), c[j]);
            sums16(c[j], sub + 2 * j, sub + 2 * j + 1);
        }
        if (nsub == 16)
            for (int s = 0; s < 16; s++) corr += sc[s] * sub[s];
        else
            for (int j = 0; j < 8; j++) corr += sc[j] * (sub[2 * j] + sub[2 * j + 1]);
        tl->corr[at] = -128 * corr;
    }
}

#define B4(p) _mm512_set1_epi32(*(const int32_t *)(p)) /* 4 codes in every lane */

/* out[g][t][r] = tile row t . row r of group g (XG groups, blocks of 32), over the
 * blocks [b0, b1) */
AI void pass32(const Tile8 *tl, const uint8_t *const *grp, int64_t k, int64_t b0, int64_t b1,
               __m512 (*f)[TILE], const int xg, const int min) {
    for (int64_t b = b0; b < b1; b++) {
        __m512i s[2][TILE];
        for (int t = 0; t < TILE; t++)
            for (int g = 0; g < xg; g++) s[g][t] = _mm512_set1_epi32(tl->corr[t * tl->blocks + b]);
        for (int st = 0; st < 8; st++) {
            __m512i xv[2];
            for (int g = 0; g < xg; g++)
                xv[g] = _mm512_loadu_si512(grp[g] + 64 * (8 * b + st));
            for (int t = 0; t < TILE; t++) {
                __m512i wv = B4(tl->codes + t * k + 32 * b + 4 * st);
                for (int g = 0; g < xg; g++) s[g][t] = _mm512_dpbusd_epi32(s[g][t], xv[g], wv);
            }
        }
        for (int g = 0; g < xg; g++) {
            const float *dx = (const float *)(grp[g] + 16 * k) + 16 * b;
            __m512 dv = _mm512_loadu_ps(dx);
            for (int t = 0; t < TILE; t++) {
                __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(tl->d[t * tl->blocks + b]));
                f[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][t]), sc, f[g][t]);
            }
            if (min) {
                __m512 sv = _mm512_loadu_ps(dx + 16 * (k / 32));
                for (int t = 0; t < TILE; t++)
                    f[g][t] = _mm512_fmadd_ps(_mm512_set1_ps(tl->m[t * tl->blocks + b]), sv, f[g][t]);
            }
        }
    }
}

/* as pass32 for super-blocks of 256: nsub sub-blocks (8 of 32, 16 of 16), mins where
 * `mins` (Q4_K, Q5_K) */
AI void pass256(const Tile8 *tl, const uint8_t *const *grp, int64_t k, int64_t b0, int64_t b1,
                __m512 (*f)[TILE], const int xg, const int nsub, const int mins) {
    const int steps = 64 / nsub; /* 4-code steps a sub-block */
    for (int64_t b = b0; b < b1; b++) {
        __m512i acc[2][TILE];
        for (int t = 0; t < TILE; t++)
            for (int g = 0; g < xg; g++) acc[g][t] = _mm512_set1_epi32(tl->corr[t * tl->blocks + b]);
        for (int j = 0; j < nsub; j++) {
            __m512i s[2][TILE];
            for (int t = 0; t < TILE; t++)
                for (int g = 0; g < xg; g++) s[g][t] = _mm512_setzero_si512();
            for (int st = 0; st < steps; st++) {
                int64_t step = 64 * b + steps * j + st;
                __m512i xv[2];
                for (int g = 0; g < xg; g++) xv[g] = _mm512_loadu_si512(grp[g] + 64 * step);
                for (int t = 0; t < TILE; t++) {
                    __m512i wv = B4(tl->codes + t * k + 4 * step);
                    for (int g = 0; g < xg; g++) s[g][t] = _mm512_dpbusd_epi32(s[g][t], xv[g], wv);
                }
            }
            for (int t = 0; t < TILE; t++) {
                __m512i sc = _mm512_set1_epi32(tl->sc[16 * (t * tl->blocks + b) + j]);
                for (int g = 0; g < xg; g++)
                    acc[g][t] = _mm512_add_epi32(acc[g][t], _mm512_mullo_epi32(s[g][t], sc));
            }
        }
        for (int g = 0; g < xg; g++) {
            const float *dx = (const float *)(grp[g] + 16 * k) + 16 * b;
            __m512 dv = _mm512_loadu_ps(dx);
            __m512i im[TILE];
            if (mins) {
                /* the pairs of sub-block sums: after every super-block's d256, 4 a block */
                const int32_t *bs = (const int32_t *)(dx - 16 * b + 16 * (k / 256)) + 64 * b;
                for (int t = 0; t < TILE; t++) im[t] = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++) {
                    __m512i bp = _mm512_loadu_si512(bs + 16 * p);
                    for (int t = 0; t < TILE; t++)
                        im[t] = _mm512_dpwssd_epi32(im[t], bp, _mm512_set1_epi32(tl->mn[4 * (t * tl->blocks + b) + p]));
                }
            }
            for (int t = 0; t < TILE; t++) {
                int64_t at = t * tl->blocks + b;
                __m512 sd = _mm512_mul_ps(dv, _mm512_set1_ps(tl->d[at]));
                f[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][t]), sd, f[g][t]);
                if (mins) {
                    __m512 sm = _mm512_mul_ps(dv, _mm512_set1_ps(tl->m[at]));
                    f[g][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im[t]), sm, f[g][t]);
                }
            }
        }
    }
}

/* the passes at each constant (groups, type) */
static void gemm8_pass(const Tile8 *tl, const uint8_t *const *grp, int64_t k, int64_t b0,
                       int64_t b1, __m512 (*f)[TILE], int xg, int type) {
#define P32(MIN)                                                                            \
    (xg == 2 ? pass32(tl, grp, k, b0, b1, f, 2, MIN) : pass32(tl, grp, k, b0, b1, f, 1, MIN))
#define P256(NSUB, MINS)                                                                    \
    (xg == 2 ? pass256(tl, grp, k, b0, b1, f, 2, NSUB, MINS)                                \
             : pass256(tl, grp, k, b0, b1, f, 1, NSUB, MINS))
    switch (type) {
    case Q4_1:
    case Q5_1: P32(1); return;
    case Q4_K:
    case Q5_K: P256(8, 1); return;
    case Q6_K: P256(16, 0); return;
    case IQ4_XS: P256(8, 0); return;
    default: P32(0); return;
    }
#undef P32
#undef P256
}

static int gemm8_block(int32_t type) {
    switch (type) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case IQ4_NL: return 32;
    case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return 256;
    default: return 0;
    }
}
#else
static int gemm8_block(int32_t type) {
    (void)type;
    return 0;
}
#endif

/* From this many rows of x the GEMM is the faster; 0: never. A group of 16 rows costs
 * the GEMM what 16 do, while the per-row kernels' time grows with every row at a rate
 * of their type's (IQ4_XS's table look-ups cost the most per row, Q4_K's nibbles the
 * least), so each type crosses over at its own count (benchmarks/quant_kernels.py
 * --batch 4 .. 16). Depends on the type and m alone, so every caller computes the same
 * bits. */
static int64_t gemm8_rows(int32_t type) {
    if (!gemm8_block(type)) return 0;
    switch (type) {
    case Q4_K: return 12;
    case Q5_K: return 11;
    case Q6_K: return 10;
    case IQ4_XS: return 7;
    default: return 8; /* the blocks of 32 */
    }
}

static int gemm8_takes(int32_t type, int64_t m) {
    return gemm8_rows(type) && m >= gemm8_rows(type);
}

#if defined(GEMM8)
#define SUPER 4 /* tiles unpacked together: x's group pair is read once for all SUPER */

/* stage[r][4s .. 4s + 4) = tile s's sums f for row r of groups (xg of them), plus the
 * bias: a group's 4 x 16 sums transposed in registers (a 4 x 4 per 128-bit lane) */
_Static_assert(TILE == 4, "gemm8_stage transposes 4 weight rows");
static void gemm8_stage(const QuantArgs *a, int64_t n0, int s, int xg, __m512 (*f)[TILE],
                        float (*stage)[SUPER * TILE]) {
    float b4[TILE] = {0};
    for (int t = 0; t < TILE && n0 + t < a->n && a->bias; t++) b4[t] = a->bias[n0 + t];
    __m128 bias = _mm_loadu_ps(b4);
    for (int gi = 0; gi < xg; gi++) {
        __m512 t0 = _mm512_unpacklo_ps(f[gi][0], f[gi][1]), t1 = _mm512_unpackhi_ps(f[gi][0], f[gi][1]);
        __m512 t2 = _mm512_unpacklo_ps(f[gi][2], f[gi][3]), t3 = _mm512_unpackhi_ps(f[gi][2], f[gi][3]);
        __m512 o[4]; /* o[j], lane L: row 4L + j's 4 columns */
        o[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
        o[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
        o[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
        o[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 4; l++) {
                __m128 v = _mm512_extractf32x4_ps(o[j], 0);
                if (l == 1) v = _mm512_extractf32x4_ps(o[j], 1);
                if (l == 2) v = _mm512_extractf32x4_ps(o[j], 2);
                if (l == 3) v = _mm512_extractf32x4_ps(o[j], 3);
                _mm_storeu_ps(stage[G8 * gi + 4 * l + j] + TILE * s, _mm_add_ps(v, bias));
            }
    }
}

/* y rows of groups g, g + xg, columns [n0, n0 + cols) = the staged rows: one 64-byte
 * store a row (each tile's own 16 bytes, stored apart, would each fetch the line again
 * once a wide y has pushed it out of cache) */
static void gemm8_store(QuantArgs *a, int64_t n0, int64_t cols, int64_t g, int xg,
                        float (*stage)[SUPER * TILE]) {
    __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < G8 * xg && g * G8 + r < a->m; r++)
        _mm512_mask_storeu_ps(a->y + (g * G8 + r) * a->ldy + n0, keep, _mm512_loadu_ps(stage[r]));
}

/* Tiles [lo, hi) of TILE output rows, SUPER at a time: their rows unpacked once, then
 * every group pair of x's rows against each of them over all of k; the group pair
 * stays in cache across the SUPER tiles, the tiles' codes across the pairs. */
void pd_quant_gemm8_range(const void *args, int64_t lo, int64_t hi) {
    const Gemm8Args *ga = (const Gemm8Args *)args;
    QuantArgs *a = ga->q;
    int block = gemm8_block(a->type);
    if (!block || a->k_dim % block) {
        a->status = 1;
        return;
    }
    int64_t k = a->k_dim, nb = k / block, groups = xt_groups(a->m);
    size_t ints = (size_t)TILE * (size_t)nb * 21; /* corr, sc [16], mn [4] */
    size_t one = ((size_t)(TILE * k) + 4 * ints + 8 * (size_t)(TILE * nb) + 63) / 64 * 64;
    uint8_t *buf = aligned_alloc(64, SUPER * one);
    if (!buf) {
        a->status = 2;
        return;
    }
    Tile8 tl[SUPER];
    for (int s = 0; s < SUPER; s++) {
        uint8_t *at = buf + s * one;
        tl[s] = (Tile8){.codes = (int8_t *)at, .blocks = nb};
        tl[s].corr = (int32_t *)(at + TILE * k);
        tl[s].sc = tl[s].corr + TILE * nb;
        tl[s].mn = tl[s].sc + 16 * TILE * nb;
        tl[s].d = (float *)(tl[s].mn + 4 * TILE * nb);
        tl[s].m = tl[s].d + TILE * nb;
    }
    for (int64_t first = lo; first < hi; first += SUPER) {
        int count = hi - first < SUPER ? (int)(hi - first) : SUPER;
        for (int s = 0; s < count; s++) {
            int64_t n0 = (first + s) * TILE, cols = a->n - n0 < TILE ? a->n - n0 : TILE;
            for (int t = 0; t < TILE; t++) { /* a short last tile repeats its last row */
                const uint8_t *w = a->w + (n0 + (t < cols ? t : cols - 1)) * a->row_bytes;
                if (block == 32)
                    unpack32(w, k, a->type, &tl[s], t);
                else
                    unpack256(w, k, a->type, &tl[s], t);
            }
        }
        for (int64_t g = 0; g < groups; g += 2) {
            int xg = groups - g >= 2 ? 2 : 1;
            const uint8_t *grp[2] = {xt_group(ga->xt, a->m, k, block, g), 0};
            if (xg == 2) grp[1] = xt_group(ga->xt, a->m, k, block, g + 1);
            float stage[2 * G8][SUPER * TILE];
            for (int s = 0; s < count; s++) {
                __m512 f[2][TILE];
                for (int gi = 0; gi < 2; gi++)
                    for (int t = 0; t < TILE; t++) f[gi][t] = _mm512_setzero_ps();
                gemm8_pass(&tl[s], grp, k, 0, nb, f, xg, a->type);
                gemm8_stage(a, (first + s) * TILE, s, xg, f, stage);
            }
            int64_t n0 = first * TILE, cols = a->n - n0 < count * TILE ? a->n - n0 : count * TILE;
            gemm8_store(a, n0, cols, g, xg, stage);
        }
    }
    free(buf);
}
#else
void pd_quant_gemm8_range(const void *args, int64_t lo, int64_t hi) {
    (void)lo, (void)hi;
    ((const Gemm8Args *)args)->q->status = 1;
}
#endif

/* The GEMM from x's rows quantized (a->xq), laid out here for this range alone: a
 * caller that splits a batch's projection in one range per thread (the decode's one
 * call) pays the layout once a thread; a prompt's caller lays it out once a call
 * (pd_quant_x8_range) and calls pd_quant_gemm8_range. */
#if defined(GEMM8)
static void gemm8_local(QuantArgs *a, int64_t lo, int64_t hi) {
    uint8_t *xt = aligned_alloc(64, (size_t)(xt_bytes(a->m, a->k_dim) + 63) / 64 * 64);
    if (!xt) {
        a->status = 2;
        return;
    }
    xt_fill(a->xq, a->m, a->k_dim, xt, 0, xt_groups(a->m));
    Gemm8Args g = {a, xt};
    pd_quant_gemm8_range(&g, lo, hi);
    free(xt);
}
#else
static void gemm8_local(QuantArgs *a, int64_t lo, int64_t hi) { /* never called: no GEMM */
    (void)lo, (void)hi;
    a->status = 1;
}
#endif

#endif
