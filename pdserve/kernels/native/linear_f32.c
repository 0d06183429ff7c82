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
 * Compute (pd_linear_f32): for each panel (AVX-512: each pair of whole panels), the rows
 * of x in blocks of at most MR, of near-equal size (64 rows on AVX-512: 6 blocks of
 * 10-11, not 5 of 12 and one of 4); a block keeps its sums in registers, adds one k at
 * a time (one FMA per register, k ascending), and is stored once. Every path adds the
 * same products in the same order, so they give the same bits. The first block of a
 * panel streams it from memory and prefetches the next; later blocks read it from L1/L2.
 *
 *     AVX2      MR = 6 rows x 16 columns: 12 ymm sums
 *     AVX-512   MR = 12 rows x 32 columns (two panels): 24 zmm sums, so each broadcast
 *               x value feeds two FMAs and >= 8 chains keep both FMA ports busy
 *
 * Callers split [p_lo, p_hi) panels across threads; panels write disjoint columns.
 * Needs AVX2 and FMA (x86-64 since 2013); elsewhere the build fails and the caller keeps
 * oneDNN (model/linear.py).
 */
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "linear_f32 needs AVX2 and FMA"
#endif
#include <immintrin.h>

#include "abi.h"
#include "kernel_args.h" /* LinearArgs */

#define NR 16

void pd_linear_pack(const float *w, float *out, int64_t n, int64_t k_dim) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < k_dim; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                out[(p * k_dim + k) * NR + j] = col < n ? w[col * k_dim + k] : 0.0f;
            }
}

typedef void (*block_fn)(const float *, int64_t, const float *, const float *, int64_t,
                         const float *, float *, int64_t);

#if defined(__AVX512F__)
#define MR 12
#define HAVE_PAIRS 1
/* Row r's sums over panel 0 (and, in a pair, panel 1 = the next K * 16 floats). `ROWS > r`
 * and PAIR are compile-time constants in each block function: unused rows vanish and
 * the sums stay in registers. */
#define ACC(r) __m512 c##r##0 = b0, c##r##1 = b1;
#define FMA(r)                                                                             \
    if (ROWS > r) {                                                                        \
        __m512 xv = _mm512_set1_ps(x[r * ldx + k]);                                        \
        c##r##0 = _mm512_fmadd_ps(xv, w0, c##r##0);                                        \
        if (PAIR)                                                                          \
            c##r##1 = _mm512_fmadd_ps(xv, w1, c##r##1);                                    \
    }
#define STORE(r)                                                                           \
    if (ROWS > r) {                                                                        \
        _mm512_storeu_ps(y + r * ldy, c##r##0);                                            \
        if (PAIR)                                                                          \
            _mm512_storeu_ps(y + r * ldy + NR, c##r##1);                                   \
    }
#define ROWS_12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

#define BLOCK(NAME, R, P)                                                                  \
    static void NAME(const float *x, int64_t ldx, const float *panel, const float *next,  \
                     int64_t k_dim, const float *bias, float *y, int64_t ldy) {           \
        enum { ROWS = R, PAIR = P };                                                       \
        const float *panel1 = panel + k_dim * NR;                                          \
        __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                   \
        __m512 b1 = PAIR && bias ? _mm512_loadu_ps(bias + NR) : _mm512_setzero_ps();      \
        ROWS_12(ACC)                                                                       \
        for (int64_t k = 0; k < k_dim; k++) {                                              \
            __m512 w0 = _mm512_loadu_ps(panel + k * NR);                                   \
            __m512 w1 = PAIR ? _mm512_loadu_ps(panel1 + k * NR) : w0;                      \
            if (next) { /* one k = one cache line of each next panel */                    \
                _mm_prefetch((const char *)(next + k * NR), _MM_HINT_T0);                  \
                if (PAIR)                                                                  \
                    _mm_prefetch((const char *)(next + (k_dim + k) * NR), _MM_HINT_T0);    \
            }                                                                              \
            ROWS_12(FMA)                                                                   \
        }                                                                                  \
        ROWS_12(STORE)                                                                     \
    }
#define BOTH(R) BLOCK(block##R, R, 0) BLOCK(pair##R, R, 1)
BOTH(1) BOTH(2) BOTH(3) BOTH(4) BOTH(5) BOTH(6)
BOTH(7) BOTH(8) BOTH(9) BOTH(10) BOTH(11) BOTH(12)
static const block_fn BLOCKS[MR + 1] = {0,      block1, block2, block3, block4,
                                        block5, block6, block7, block8, block9,
                                        block10, block11, block12};
static const block_fn PAIRS[MR + 1] = {0,     pair1, pair2, pair3,  pair4,  pair5, pair6,
                                       pair7, pair8, pair9, pair10, pair11, pair12};
#else
#define MR 6
#define HAVE_PAIRS 0 /* 16 columns fill the 12 sums already */
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

static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6};
static const block_fn *const PAIRS = BLOCKS; /* never taken */
#endif

/* One block of `rows` rows over one panel (or a pair): y rows, ldy apart. */
static void run_block(const float *x, int64_t k_dim, const float *panel, const float *pf,
                      const float *pb, float *y, int64_t ldy, int rows, int pair) {
    (pair ? PAIRS : BLOCKS)[rows](x, k_dim, panel, pf, k_dim, pb, y, ldy);
}

/* y [m][n] = x [m][k_dim] @ W^T (+ bias [padded to whole panels]) over panels
 * [p_lo, p_hi). x and y row-major, contiguous. */
void pd_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                   int64_t m, int64_t n, int64_t k_dim, int64_t p_lo, int64_t p_hi) {
    int64_t blocks = (m + MR - 1) / MR, per = blocks ? (m + blocks - 1) / blocks : MR;
    for (int64_t p = p_lo, step; p < p_hi; p += step) {
        /* a pair: two whole panels (the padded last one goes alone, through tmp) */
        int pair = HAVE_PAIRS && p + 1 < p_hi && n - p * NR >= 2 * NR;
        step = pair ? 2 : 1;
        const float *panel = packed + p * k_dim * NR;
        const float *next = p + step < p_hi ? panel + step * k_dim * NR : 0;
        const float *pb = bias ? bias + p * NR : 0;
        int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        for (int64_t r = 0; r < m; r += per) {
            int rows = m - r < per ? (int)(m - r) : (int)per;
            const float *pf = r == 0 ? next : 0;
            if (pair || cols == NR) {
                run_block(x + r * k_dim, k_dim, panel, pf, pb, y + r * n + p * NR, n, rows, pair);
            } else { /* the last, padded panel: through a 16-wide buffer */
                float tmp[MR * NR];
                run_block(x + r * k_dim, k_dim, panel, pf, pb, tmp, NR, rows, 0);
                for (int i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + p * NR, tmp + i * NR, (size_t)cols * sizeof(float));
            }
        }
    }
}

void pd_linear_f32_range(const void *args, int64_t lo, int64_t hi) {
    const LinearArgs *a = args;
    pd_linear_f32(a->x, a->packed, a->bias, a->y, a->m, a->n, a->k_dim, lo, hi);
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(LinearArgs),
    PD_ABI_FIELD(LinearArgs, x), PD_ABI_FIELD(LinearArgs, packed),
    PD_ABI_FIELD(LinearArgs, bias), PD_ABI_FIELD(LinearArgs, y),
    PD_ABI_FIELD(LinearArgs, m), PD_ABI_FIELD(LinearArgs, n),
    PD_ABI_FIELD(LinearArgs, k_dim),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
