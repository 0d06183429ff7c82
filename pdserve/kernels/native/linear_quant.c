/* y = x @ W^T + b with W kept in its GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
 * Q5_K, Q6_K), float32 activations, float32 sums.
 *
 * Why: a decode step reads every weight once; GGUF blocks hold 4.5-8.5 bits a weight
 * where float32 holds 32, so the step reads 4-7x fewer bytes. The values are the ones
 * `gguf`'s de-quantize gives (the same float operations, per block: d * q, d * q + m,
 * (d * sc) * q, (d * sc) * q - dmin * m), so a projection computes what "de-quantize,
 * then the float32 matmul" computes up to summation order (and one rounding where the
 * compiler fuses a multiply-add of a weight's value).
 *
 * Layout: W [N][K] as the file stores it: each row its K / block_size blocks, rows
 * `row_bytes` apart (the GGUF tensor's bytes, rows permuted for Llama's Q/K).
 *
 * Compute, per tile of TILE output rows (a thread's range is whole tiles):
 *     de-quantize the tile's rows into a per-thread buffer [TILE][K] (L1/L2-resident);
 *     for each row of x (in pairs): TILE dot products over k, sums kept per lane of 16:
 *     lane l adds the products at k = l, l + 16, ... in ascending k; the 16 lanes then
 *     sum in one fixed tree. The tile is de-quantized once and reused by every row of
 *     x, so a batch of 64 pays the de-quantizing once.
 *
 *     AVX-512   a lane set is one zmm; 2 x rows x TILE rows = 8 sums in registers
 *     AVX2      a lane set is two ymm
 *     portable  plain C with the same lanes (the compiler vectorizes what it can)
 * Every path adds the same products in the same order per lane. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 4
#define LANES 16

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct {
    const float *x;     /* [m][k_dim] */
    const uint8_t *w;   /* [n] rows of row_bytes */
    const float *bias;  /* [n] or NULL */
    float *y;           /* [m][ldy], columns [0, n) written */
    int64_t m, n, k_dim, ldy, row_bytes;
    int32_t type;       /* a GGML type number (the enum above) */
    int32_t status;     /* 1: a type without a kernel (nothing written) */
} QuantArgs;

/* IEEE half -> float, exact (subnormals, infinities and NaN included). */
static float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void row_q8_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 34, y += 32) {
        float d = half(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int l = 0; l < 32; l++) y[l] = d * (float)q[l];
    }
}

static void row_q4_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 18, y += 32) {
        float d = half(b);
        const uint8_t *q = b + 2;
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)((q[l] & 0xf) - 8);
            y[l + 16] = d * (float)((q[l] >> 4) - 8);
        }
    }
}

static void row_q4_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 20, y += 32) {
        float d = half(b), m = half(b + 2);
        const uint8_t *q = b + 4;
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)(q[l] & 0xf) + m;
            y[l + 16] = d * (float)(q[l] >> 4) + m;
        }
    }
}

static void row_q5_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 32, b += 22, y += 32) {
        float d = half(b);
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const uint8_t *q = b + 6;
        for (int l = 0; l < 16; l++) {
            int lo = (q[l] & 0xf) | (int)(((qh >> l) & 1) << 4);
            int hi = (q[l] >> 4) | (int)(((qh >> (l + 16)) & 1) << 4);
            y[l] = d * (float)(lo - 16);
            y[l + 16] = d * (float)(hi - 16);
        }
    }
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes */
static void scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void row_q4_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 256, b += 144) {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *s = b + 4, *q = b + 16;
        for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
            int sc0, m0, sc1, m1;
            scale_min(s, j, &sc0, &m0);
            scale_min(s, j + 1, &sc1, &m1);
            float d0 = d * (float)sc0, dm0 = dmin * (float)m0;
            float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                y[l] = d0 * (float)(q[l] & 0xf) - dm0;
                y[l + 32] = d1 * (float)(q[l] >> 4) - dm1;
            }
        }
    }
}

static void row_q5_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 256, b += 176) {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *s = b + 4, *qh = b + 16, *q = b + 48;
        for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
            int sc0, m0, sc1, m1;
            scale_min(s, j, &sc0, &m0);
            scale_min(s, j + 1, &sc1, &m1);
            float d0 = d * (float)sc0, dm0 = dmin * (float)m0;
            float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                int lo = (q[l] & 0xf) | (((qh[l] >> j) & 1) << 4);
                int hi = (q[l] >> 4) | (((qh[l] >> (j + 1)) & 1) << 4);
                y[l] = d0 * (float)lo - dm0;
                y[l + 32] = d1 * (float)hi - dm1;
            }
        }
    }
}

static void row_q6_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i += 256, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = half(b + 208);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            float ds[8];
            for (int s = 0; s < 8; s++) ds[s] = d * (float)sc[s];
            for (int l = 0; l < 32; l++) {
                int q0 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q1 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = ds[l / 16] * (float)q0;
                y[l + 32] = ds[2 + l / 16] * (float)q1;
                y[l + 64] = ds[4 + l / 16] * (float)q2;
                y[l + 96] = ds[6 + l / 16] * (float)q3;
            }
        }
    }
}

typedef void (*row_fn)(const uint8_t *, float *, int64_t);

static row_fn row_of(int32_t type) {
    switch (type) {
    case Q8_0: return row_q8_0;
    case Q4_0: return row_q4_0;
    case Q4_1: return row_q4_1;
    case Q5_0: return row_q5_0;
    case Q4_K: return row_q4_k;
    case Q5_K: return row_q5_k;
    case Q6_K: return row_q6_k;
    default: return 0;
    }
}

/* 1 if `type` has a kernel here (the wrapper asks before it keeps a tensor's blocks) */
int pd_quant_supported(int32_t type) { return row_of(type) != 0; }

/* out [count][k] = the de-quantized rows ids[i] of w (embedding lookups); 1: no kernel */
int pd_quant_rows(int32_t type, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                  int64_t count, int64_t k, float *out) {
    row_fn f = row_of(type);
    if (!f) return 1;
    for (int64_t i = 0; i < count; i++) f(w + ids[i] * row_bytes, out + i * k, k);
    return 0;
}

/* the 16 lane sums of one dot product, added in one fixed tree (every path alike) */
static float lanes_sum(const float *s) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = s[l] + s[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* out[r][t] = x_r . w_t for R x rows (ldx apart) and TILE weight rows (k apart);
 * k a multiple of 16 (every type's block is). */
static void dots(const float *x, int64_t ldx, int rows, const float *w, int64_t k,
                 float out[2][TILE]) {
    float s[2][TILE][LANES];
#if defined(__AVX512F__)
    __m512 c[2][TILE];
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < TILE; t++) c[r][t] = _mm512_setzero_ps();
    if (rows == 2) {
        for (int64_t i = 0; i < k; i += LANES) {
            __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + ldx + i);
            for (int t = 0; t < TILE; t++) {
                __m512 wv = _mm512_loadu_ps(w + t * k + i);
                c[0][t] = _mm512_fmadd_ps(x0, wv, c[0][t]);
                c[1][t] = _mm512_fmadd_ps(x1, wv, c[1][t]);
            }
        }
    } else {
        for (int64_t i = 0; i < k; i += LANES) {
            __m512 x0 = _mm512_loadu_ps(x + i);
            for (int t = 0; t < TILE; t++)
                c[0][t] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w + t * k + i), c[0][t]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++) _mm512_storeu_ps(s[r][t], c[r][t]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 c[2][TILE][2];
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < TILE; t++) c[r][t][0] = c[r][t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += LANES) {
        for (int h = 0; h < 2; h++) {
            __m256 x0 = _mm256_loadu_ps(x + i + 8 * h);
            __m256 x1 = rows == 2 ? _mm256_loadu_ps(x + ldx + i + 8 * h) : x0;
            for (int t = 0; t < TILE; t++) {
                __m256 wv = _mm256_loadu_ps(w + t * k + i + 8 * h);
                c[0][t][h] = _mm256_fmadd_ps(x0, wv, c[0][t][h]);
                if (rows == 2) c[1][t][h] = _mm256_fmadd_ps(x1, wv, c[1][t][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++) {
            _mm256_storeu_ps(s[r][t], c[r][t][0]);
            _mm256_storeu_ps(s[r][t] + 8, c[r][t][1]);
        }
#else
    memset(s, 0, sizeof s);
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++)
            for (int64_t i = 0; i < k; i += LANES)
                for (int l = 0; l < LANES; l++) s[r][t][l] += x[r * ldx + i + l] * w[t * k + i + l];
#endif
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++) out[r][t] = lanes_sum(s[r][t]);
}

/* Tiles [lo, hi) of TILE output rows: y[:, tile rows] = x @ W[tile rows]^T + b. */
void pd_quant_linear_range(const void *args, int64_t lo, int64_t hi) {
    QuantArgs *a = (QuantArgs *)args;
    row_fn f = row_of(a->type);
    int64_t k = a->k_dim;
    if (!f) {
        a->status = 1;
        return;
    }
    float *buf = aligned_alloc(64, (size_t)(TILE * k) * sizeof(float));
    if (!buf) {
        a->status = 2;
        return;
    }
    for (int64_t tile = lo; tile < hi; tile++) {
        int64_t n0 = tile * TILE, cols = a->n - n0 < TILE ? a->n - n0 : TILE;
        for (int t = 0; t < TILE; t++) /* a short last tile repeats its last row */
            f(a->w + (n0 + (t < cols ? t : cols - 1)) * a->row_bytes, buf + t * k, k);
        for (int64_t r = 0; r < a->m; r += 2) {
            int rows = a->m - r >= 2 ? 2 : 1;
            float out[2][TILE];
            dots(a->x + r * k, k, rows, buf, k, out);
            for (int i = 0; i < rows; i++)
                for (int t = 0; t < cols; t++)
                    a->y[(r + i) * a->ldy + n0 + t] =
                        out[i][t] + (a->bias ? a->bias[n0 + t] : 0.0f);
        }
    }
    free(buf);
}
