/* y = x @ W^T + b with W kept in its GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), float32 activations, float32 sums.
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
 * Compute, per tile of TILE output rows (a thread's range is whole tiles), in chunks of
 * KC elements of k:
 *     de-quantize the chunk of the tile's rows (quant_blocks.h) into a per-thread buffer
 *     [TILE][KC] (8 KB, L1-resident with the chunk of XR rows of x it meets);
 *     for each row of x (XR at a time): TILE dot products over the chunk, sums kept per
 *     lane of 16 across chunks: lane l adds the products at k = l, l + 16, ... in
 *     ascending k; after the last chunk the 16 lanes sum in one tree (lanes_sum). The
 *     tile is de-quantized once and reused by every row of x, so a batch of 64 pays the
 *     de-quantizing once, and every operand of the inner loop is in L1.
 *
 *     AVX-512   a lane set is one zmm; 6 x rows x TILE rows = 24 sums in registers
 *     AVX2      a lane set is two ymm; 2 x rows
 *     portable  plain C with the same lanes (the compiler vectorizes what it can)
 * Every path adds the same products in the same order per lane; a decode's single row
 * of x (m = 1) takes a fused path that never stores the weights (quant_dot.h).
 *
 * --quant-activations int8 (x's rows quantized, QuantArgs.xq): integer dots per row of
 * x (quant_int8.h), and from a batch of rows the tiled integer GEMM (quant_gemm8.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "abi.h"
#include "kernel_args.h" /* QuantArgs */

#define TILE 4
#define REG_ROWS 8     /* up to this many rows of x: the register kernels (few_rows) */
#define REG_FLOATS 8192 /* floats of x few_rows keeps in L1 (32 KB) */
#define KC 512 /* elements of a tile's rows de-quantized at once: a multiple of every block */

#include "quant_blocks.h" /* the GGUF types, half(), row_of */
#include "quant_dot.h"    /* one row of x: dot_of, dot_blocks */
#include "quant_int8.h"   /* --quant-activations int8: pd_quant_x8, int8_dot_of */
#include "quant_gemm8.h"  /* int8 at a batch of rows: the tiled GEMM's parts */

/* 1 if `type` has a kernel here (the wrapper asks before it keeps a tensor's blocks) */
int pd_quant_supported(int32_t type) { return row_of(type) != 0; }

/* 1 if `type` has an integer kernel for x quantized to 8 bits (quant_int8.h) */
int pd_quant_int8_supported(int32_t type) { return int8_dot_of(type) != 0; }

/* bytes of one row of k quantized by pd_quant_x8 (kernel_args.h) */
int64_t pd_quant_xq_bytes(int64_t k) { return pd_xq_bytes(k); }

/* out [count][k] = the de-quantized rows ids[i] of w (embedding lookups); 1: no kernel */
int pd_quant_rows(int32_t type, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                  int64_t count, int64_t k, float *out) {
    row_fn f = fast_row_of(type);
    if (!f) return 1;
    for (int64_t i = 0; i < count; i++) f(w + ids[i] * row_bytes, out + i * k, k);
    return 0;
}

/* acc[r][t][l] += the products x_r[i] * w_t[i] at i = l, l + 16, ... < len (ascending)
 * for XR rows of x (xr[r]: a row, or zeros past the batch) and TILE weight rows (ldw
 * apart); len a multiple of 16 (every type's block is). A weight vector loaded once
 * feeds XR FMAs: on AVX-512 6 x 4 sums stay in registers over the chunk. */
#if defined(__AVX512F__)
#define XR 6
#else
#define XR 2
#endif
typedef float Acc[TILE][LANES];
#if defined(__AVX512F__)
/* inlined at each constant `rows` (dots' switch): a short block computes only its rows */
static inline __attribute__((always_inline)) void dots512(const float *const *xr,
                                                          const float *w, int64_t ldw,
                                                          int64_t len, Acc *acc,
                                                          const int rows) {
    __m512 c[XR][TILE];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++) c[r][t] = _mm512_loadu_ps(acc[r][t]);
    for (int64_t i = 0; i < len; i += LANES) {
        __m512 wv[TILE];
        for (int t = 0; t < TILE; t++) wv[t] = _mm512_loadu_ps(w + t * ldw + i);
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_loadu_ps(xr[r] + i);
            /* x in a register: folded into each FMA as a memory operand (GCC's choice at
             * this register pressure) it would be loaded TILE times, and loads, not FMAs,
             * would set the pace */
            __asm__("" : "+v"(xv));
            for (int t = 0; t < TILE; t++) c[r][t] = _mm512_fmadd_ps(xv, wv[t], c[r][t]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE; t++) _mm512_storeu_ps(acc[r][t], c[r][t]);
}
#endif

static void dots(const float *const *xr, const float *w, int64_t ldw, int64_t len, Acc *acc,
                 int rows) {
#if defined(__AVX512F__)
    switch (rows) {
    case 1: dots512(xr, w, ldw, len, acc, 1); return;
    case 2: dots512(xr, w, ldw, len, acc, 2); return;
    case 3: dots512(xr, w, ldw, len, acc, 3); return;
    case 4: dots512(xr, w, ldw, len, acc, 4); return;
    case 5: dots512(xr, w, ldw, len, acc, 5); return;
    default: dots512(xr, w, ldw, len, acc, 6); return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    (void)rows; /* XR = 2: the zero row costs little (its sums are never read) */
    __m256 c[XR][TILE][2];
    for (int r = 0; r < XR; r++)
        for (int t = 0; t < TILE; t++)
            for (int h = 0; h < 2; h++) c[r][t][h] = _mm256_loadu_ps(acc[r][t] + 8 * h);
    for (int64_t i = 0; i < len; i += LANES) {
        for (int h = 0; h < 2; h++) {
            __m256 x0 = _mm256_loadu_ps(xr[0] + i + 8 * h), x1 = _mm256_loadu_ps(xr[1] + i + 8 * h);
            for (int t = 0; t < TILE; t++) {
                __m256 wv = _mm256_loadu_ps(w + t * ldw + i + 8 * h);
                c[0][t][h] = _mm256_fmadd_ps(x0, wv, c[0][t][h]);
                c[1][t][h] = _mm256_fmadd_ps(x1, wv, c[1][t][h]);
            }
        }
    }
    for (int r = 0; r < XR; r++)
        for (int t = 0; t < TILE; t++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc[r][t] + 8 * h, c[r][t][h]);
#else
    (void)rows;
    for (int r = 0; r < XR; r++)
        for (int t = 0; t < TILE; t++)
            for (int64_t i = 0; i < len; i += LANES)
                for (int l = 0; l < LANES; l++) acc[r][t][l] += xr[r][i + l] * w[t * ldw + i + l];
#endif
}

/* Ask for the bytes [from, to) of W ahead of use: a row of blocks is a few cache lines,
 * computed in less time than memory takes to send the next, so without asking the
 * kernel waits on every row (the weights, unlike float32 panels, are read so fast that
 * memory latency, not bandwidth, sets the pace). Clipped to W's end. */
static inline void ahead(const QuantArgs *a, int64_t from, int64_t to) {
#if defined(__SSE__)
    int64_t end = a->n * a->row_bytes;
    to = to < end ? to : end;
    for (int64_t off = from & ~(int64_t)63; off < to; off += 64)
        _mm_prefetch((const char *)(a->w + off), _MM_HINT_T0);
#else
    (void)a, (void)from, (void)to;
#endif
}

/* out[t] = the 16 lanes of s[t] added, t < TILE (4): on AVX-512 the four sums at once
 * (pairs interleaved and added, then 128-bit quarters), a tenth of the instructions of
 * four lanes_sum, which a batch of 64 pays for every 4 weight rows */
_Static_assert(TILE == 4, "tile_sums adds four rows' sums");
static void tile_sums(const float (*s)[LANES], float *out) {
#if defined(__AVX512F__)
    __m512 c0 = _mm512_loadu_ps(s[0]), c1 = _mm512_loadu_ps(s[1]);
    __m512 c2 = _mm512_loadu_ps(s[2]), c3 = _mm512_loadu_ps(s[3]);
    __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
    __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(c2, c3), _mm512_unpackhi_ps(c2, c3));
    /* per 128-bit quarter: (a0 + a2, a1 + a3, b0 + b2, b1 + b3) = sums of s0, s1, s2, s3 */
    __m512 q = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    for (int t = 0; t < TILE; t++) out[t] = lanes_sum(s[t]);
#endif
}

#define AHEAD_ROWS 4 /* fused path: rows of W asked for ahead of the one computed */

/* The rows [lo, hi) x TILE of W against a few rows of x (m = 1, or up to REG_ROWS with
 * dots_of), no tile buffer: each weight row's blocks de-quantized in registers once per
 * MR rows of x. In chunks of k that keep every row of x's chunk in L1 (REG_FLOATS floats
 * together): a pass over a chunk of W rows reads x from L1, and each chunk's sums add
 * into y (the first onto the bias). */
static void few_rows(QuantArgs *a, int64_t lo, int64_t hi, row_fn f, int elems, int bytes) {
    dot_fn one = dot_of(a->type);
    dots_fn many = dots_of(a->type);
    int64_t k = a->k_dim, rb = a->row_bytes, first = lo * TILE;
    int64_t end = hi * TILE < a->n ? hi * TILE : a->n;
    int64_t chunk = REG_FLOATS / a->m / 256 * 256; /* 256: a multiple of every block */
    chunk = chunk < 256 ? 256 : chunk >= k ? k : chunk;
    for (int64_t kc = 0; kc < k; kc += chunk) {
        int64_t len = k - kc < chunk ? k - kc : chunk;
        int64_t skip = kc / elems * bytes, seg = len / elems * bytes;
        for (int64_t n = first; n < end && n < first + AHEAD_ROWS; n++)
            ahead(a, n * rb + skip, n * rb + skip + seg);
        for (int64_t n = first; n < end; n++) {
            int64_t next = n + AHEAD_ROWS; /* its chunk asked for AHEAD_ROWS rows ahead */
            if (next < end) ahead(a, next * rb + skip, next * rb + skip + seg);
            const uint8_t *w = a->w + n * rb + skip;
            float bias = a->bias ? a->bias[n] : 0.0f;
            for (int64_t r = 0; r < a->m; r += MR) { /* MR rows of x a pass over the row */
                const float *x = a->x + r * k + kc;
                float out[MR];
                int rows = a->m - r < MR ? (int)(a->m - r) : MR;
                if (rows > 1)
                    many(x, k, w, len, out, rows);
                else
                    out[0] = one ? one(x, w, len) : dot_blocks(x, w, len, f, elems, bytes);
                for (int i = 0; i < rows; i++) {
                    float *y = a->y + (r + i) * a->ldy + n;
                    *y = (kc ? *y : bias) + out[i];
                }
            }
        }
    }
}

/* The rows [lo, hi) x TILE of W against every row of x quantized (a->xq): integer dots,
 * XR8 rows of x a pass over a weight row (its codes formed once for them), the row read
 * from memory once and from L1 by the passes after the first.
 * No software prefetch: the rows are one sequential stream, which the hardware's
 * prefetcher follows; asking for lines ahead (as few_rows does) measured slower here. */
static void int8_rows(QuantArgs *a, int64_t lo, int64_t hi, idot_fn dot) {
    int64_t k = a->k_dim, rb = a->row_bytes, xb = pd_xq_bytes(k), first = lo * TILE;
    int64_t end = hi * TILE < a->n ? hi * TILE : a->n;
    for (int64_t n = first; n < end; n++) {
        const uint8_t *w = a->w + n * rb;
        float bias = a->bias ? a->bias[n] : 0.0f;
        for (int64_t r = 0; r < a->m; r += XR8) {
            float out[XR8];
            int rows = a->m - r < XR8 ? (int)(a->m - r) : XR8;
            dot(w, a->xq + r * xb, xb, k, out, rows);
            for (int i = 0; i < rows; i++) a->y[(r + i) * a->ldy + n] = bias + out[i];
        }
    }
}

/* Tiles [lo, hi) of TILE output rows: y[:, tile rows] = x @ W[tile rows]^T + b. With x
 * quantized, from gemm8_takes's rows on, the tiled GEMM; below, int8_rows. */
void pd_quant_linear_range(const void *args, int64_t lo, int64_t hi) {
    QuantArgs *a = (QuantArgs *)args;
    row_fn f = fast_row_of(a->type);
    int64_t k = a->k_dim;
    if (!f) {
        a->status = 1;
        return;
    }
    idot_fn idot = a->xq ? int8_dot_of(a->type) : 0;
    if (idot && gemm8_takes(a->type, a->m)) {
        gemm8_local(a, lo, hi);
        return;
    }
    if (idot) {
        int8_rows(a, lo, hi, idot);
        return;
    }
    int elems, bytes;
    block_of(a->type, &elems, &bytes);
    if (a->m == 1 || (dots_of(a->type) && a->m <= REG_ROWS)) {
        few_rows(a, lo, hi, f, elems, bytes);
        return;
    }
    /* the tile's rows de-quantized KC at a time, the sums of every row of x (and XR - 1
     * more for a short block) kept per lane between chunks */
    int64_t groups = (a->m + XR - 1) / XR;
    size_t floats = (size_t)((TILE + 1) * KC) + (size_t)(groups * XR) * TILE * LANES;
    float *buf = aligned_alloc(64, floats * sizeof(float));
    if (!buf) {
        a->status = 2;
        return;
    }
    float *zero = buf + TILE * KC; /* the rows of x past the batch in a short block */
    Acc *acc = (Acc *)(zero + KC);
    memset(zero, 0, KC * sizeof(float));
    for (int64_t tile = lo; tile < hi; tile++) {
        int64_t n0 = tile * TILE, cols = a->n - n0 < TILE ? a->n - n0 : TILE;
        if (tile + 1 < hi) /* the next tile's rows, while this one computes */
            ahead(a, (n0 + TILE) * a->row_bytes, (n0 + 2 * TILE) * a->row_bytes);
        memset(acc, 0, (size_t)(groups * XR) * sizeof(Acc));
        for (int64_t kc = 0; kc < k; kc += KC) {
            int64_t len = k - kc < KC ? k - kc : KC, skip = kc / elems * bytes;
            for (int t = 0; t < TILE; t++) /* a short last tile repeats its last row */
                f(a->w + (n0 + (t < cols ? t : cols - 1)) * a->row_bytes + skip, buf + t * KC, len);
            for (int64_t r = 0; r < a->m; r += XR) {
                int rows = a->m - r >= XR ? XR : (int)(a->m - r);
                const float *xr[XR];
                for (int i = 0; i < XR; i++) xr[i] = i < rows ? a->x + (r + i) * k + kc : zero;
                dots(xr, buf, KC, len, acc + r, rows);
            }
        }
        for (int64_t r = 0; r < a->m; r++) {
            float out[TILE];
            tile_sums(acc[r], out);
            for (int t = 0; t < cols; t++)
                a->y[r * a->ldy + n0 + t] = out[t] + (a->bias ? a->bias[n0 + t] : 0.0f);
        }
    }
    free(buf);
}

/* Tiles [lo, hi) of every group's tiles laid end to end (QuantGroups): a layer's routed
 * experts in one call, so the threads split all of them at once (a decode's token: k
 * experts, each on the m = 1 register path). A group's status is its own. */
void pd_quant_groups_range(const void *args, int64_t lo, int64_t hi) {
    const QuantGroups *a = (const QuantGroups *)args;
    while (lo < hi) {
        int64_t g = lo / a->tiles, base = g * a->tiles;
        int64_t end = hi - base < a->tiles ? hi - base : a->tiles;
        QuantArgs *q = a->groups + g;
        if (q->m > 0) pd_quant_linear_range(q, lo - base, end);
        lo = base + end;
    }
}

/* 1 if `type` has the tiled integer GEMM on this build (AVX-512 VNNI) */
int pd_quant_gemm8_supported(int32_t type) { return gemm8_block(type) != 0; }

/* the rows of x from which the int8 path of `type` is the GEMM (0: never) */
int64_t pd_quant_gemm8_rows(int32_t type) { return gemm8_rows(type); }

/* bytes of m rows of k laid out for the GEMM (quant_gemm8.h) */
int64_t pd_quant_xt_bytes(int64_t m, int64_t k) { return xt_bytes(m, k); }

/* Groups [lo, hi) of 16 rows of x (X8Args): quantized (pd_quant_x8) where x is given,
 * then laid out for the GEMM where xt is given; the threads split a prompt's rows. */
void pd_quant_x8_range(const void *args, int64_t lo, int64_t hi) {
    const X8Args *a = (const X8Args *)args;
    int64_t first = lo * G8, end = hi * G8 < a->m ? hi * G8 : a->m;
    if (a->x && end > first)
        pd_quant_x8(a->x + first * a->k, end - first, a->k, a->xq + first * pd_xq_bytes(a->k));
    if (a->xt) xt_fill(a->xq, a->m, a->k, a->xt, lo, hi);
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(QuantArgs),        PD_ABI_FIELD(QuantArgs, x),
    PD_ABI_FIELD(QuantArgs, xq),
    PD_ABI_FIELD(QuantArgs, w),      PD_ABI_FIELD(QuantArgs, bias),
    PD_ABI_FIELD(QuantArgs, y),      PD_ABI_FIELD(QuantArgs, m),
    PD_ABI_FIELD(QuantArgs, n),      PD_ABI_FIELD(QuantArgs, k_dim),
    PD_ABI_FIELD(QuantArgs, ldy),    PD_ABI_FIELD(QuantArgs, row_bytes),
    PD_ABI_FIELD(QuantArgs, type),   PD_ABI_FIELD(QuantArgs, status),
    PD_ABI_STRUCT(QuantGroups),      PD_ABI_FIELD(QuantGroups, groups),
    PD_ABI_FIELD(QuantGroups, count), PD_ABI_FIELD(QuantGroups, tiles),
    PD_ABI_STRUCT(Gemm8Args),        PD_ABI_FIELD(Gemm8Args, q),
    PD_ABI_FIELD(Gemm8Args, xt),
    PD_ABI_STRUCT(X8Args),           PD_ABI_FIELD(X8Args, x),
    PD_ABI_FIELD(X8Args, xq),        PD_ABI_FIELD(X8Args, xt),
    PD_ABI_FIELD(X8Args, m),         PD_ABI_FIELD(X8Args, k),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
