/* fp32 linear y = x @ W^T + b for the decode's few rows, weights streamed from memory.
 *
 * Why: a decode step multiplies a handful of rows (the batch) by every weight of the
 * model, which does not fit in cache. oneDNN's prepacked GEMM reaches only a fraction of
 * the core's peak there: the weights arrive from memory slower than it could use them,
 * and nothing asks for them ahead. This kernel reads each weight exactly once per call,
 * in the order it is stored, and prefetches the next panel while it computes the current.
 *
 * Layout (pd_linear_pack): W [N][K] row-major becomes panels of NR = 16 output columns,
 * panel p = [K][16] contiguous (W[p*16 + j][k] at p*K*16 + k*16 + j); the last panel is
 * zero-padded when N is not a multiple of 16.
 *
 * Compute (pd_linear_f32): for each panel, the rows of x in blocks of up to MR = 6; a
 * block keeps 6 x 16 sums in 12 AVX registers, adds one k at a time (one FMA per
 * register, k ascending), and is stored once. The first block of a panel streams it from
 * memory and prefetches the next; the later blocks read it from L1/L2.
 * Callers split [p_lo, p_hi) panels across threads; panels write disjoint columns.
 *
 * Needs AVX2 and FMA (x86-64 since 2013); elsewhere the build fails and the caller keeps
 * oneDNN (model/linear.py).
 */
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "linear_f32 needs AVX2 and FMA"
#endif
#include <immintrin.h>

#define NR 16
#define MR 6

void pd_linear_pack(const float *w, float *out, int64_t n, int64_t k_dim) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < k_dim; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                out[(p * k_dim + k) * NR + j] = col < n ? w[col * k_dim + k] : 0.0f;
            }
}

/* One row's two accumulators (columns 0-7, 8-15): declared, fed, stored. `ROWS > r` is a
 * compile-time constant in each block function, so unused rows vanish and the sums stay
 * in registers (an array of __m256 would be spilled to the stack every k). */
#define ACC(r) __m256 c##r##0 = b0, c##r##1 = b1;
#define FMA(r)                                                                             \
    if (ROWS > r) {                                                                        \
        __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);                                  \
        c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);                                        \
        c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);                                        \
    }
#define STORE(r)                                                                           \
    if (ROWS > r) {                                                                        \
        _mm256_storeu_ps(y + r * ldy, c##r##0);                                            \
        _mm256_storeu_ps(y + r * ldy + 8, c##r##1);                                        \
    }

#define BLOCK(R)                                                                           \
    static void block##R(const float *x, int64_t ldx, const float *panel,                 \
                         const float *next, int64_t k_dim, const float *bias, float *y,    \
                         int64_t ldy) {                                                    \
        enum { ROWS = R };                                                                 \
        __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                   \
        __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();                \
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)                                          \
        for (int64_t k = 0; k < k_dim; k++) {                                              \
            __m256 w0 = _mm256_loadu_ps(panel + k * NR);                                   \
            __m256 w1 = _mm256_loadu_ps(panel + k * NR + 8);                               \
            if (next && (k & 3) == 0) /* 4 k = 256 bytes = 4 cache lines ahead */           \
                for (int l = 0; l < 4; l++)                                                \
                    _mm_prefetch((const char *)(next + k * NR + l * NR), _MM_HINT_T0);     \
            FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)                                      \
        }                                                                                  \
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)                              \
    }

BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)
BLOCK(5)
BLOCK(6)

typedef void (*block_fn)(const float *, int64_t, const float *, const float *, int64_t,
                         const float *, float *, int64_t);
static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6};

/* y [m][n] = x [m][k_dim] @ W^T (+ bias [padded to whole panels]) over panels
 * [p_lo, p_hi). x and y row-major, contiguous. */
void pd_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                   int64_t m, int64_t n, int64_t k_dim, int64_t p_lo, int64_t p_hi) {
    for (int64_t p = p_lo; p < p_hi; p++) {
        const float *panel = packed + p * k_dim * NR;
        const float *next = p + 1 < p_hi ? panel + k_dim * NR : 0;
        const float *pb = bias ? bias + p * NR : 0;
        int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        for (int64_t r = 0; r < m; r += MR) {
            int rows = m - r < MR ? (int)(m - r) : MR;
            const float *pf = r == 0 ? next : 0;
            if (cols == NR) {
                BLOCKS[rows](x + r * k_dim, k_dim, panel, pf, k_dim, pb, y + r * n + p * NR, n);
            } else { /* the last, padded panel: through a 16-wide buffer */
                float tmp[MR * NR];
                BLOCKS[rows](x + r * k_dim, k_dim, panel, pf, k_dim, pb, tmp, NR);
                for (int i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + p * NR, tmp + i * NR, (size_t)cols * sizeof(float));
            }
        }
    }
}
