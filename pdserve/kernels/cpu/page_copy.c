/* Page copies between a received KV frame and the pool (the decode side's scatter).
 *
 *   pd_page_scatter_runs     a received chunk's rows, by prompt position, into the
 *                     request's pages (any alignment): one call per kind of a chunk
 *                     (transfer/validate.py)
 *
 * A page is pb bytes (page_size tokens of one layer's K or V). The pool is far larger
 * than the caches and is not read again until a decode step, so the stores bypass the
 * caches (non-temporal) where the CPU has them and the destination is aligned: a
 * cached store first reads the line it overwrites, a third of the memory traffic of a
 * copy (benchmarks/kv_transfer.py's scatter column). Elsewhere (other CPUs, odd sizes)
 * each page is one memcpy. The caller (kernels/page_copy.py) checks shapes and strides;
 * this file checks only the page numbers, before writing anything.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define NT_BYTES 64
static void copy_nt(char *d, const char *s, int64_t nbytes) {
    for (int64_t j = 0; j < nbytes; j += 64)
        _mm512_stream_si512((__m512i *)(d + j), _mm512_loadu_si512((const void *)(s + j)));
}
#elif defined(__AVX__)
#define NT_BYTES 32
static void copy_nt(char *d, const char *s, int64_t nbytes) {
    for (int64_t j = 0; j < nbytes; j += 32)
        _mm256_stream_si256((__m256i *)(d + j), _mm256_loadu_si256((const __m256i *)(s + j)));
}
#elif defined(__SSE2__)
#define NT_BYTES 16
static void copy_nt(char *d, const char *s, int64_t nbytes) {
    for (int64_t j = 0; j < nbytes; j += 16)
        _mm_stream_si128((__m128i *)(d + j), _mm_loadu_si128((const __m128i *)(s + j)));
}
#endif

/* 1 if non-temporal stores may write every page: each page starts on a store's alignment
 * (the pool's base, its layer stride and the page size all multiples of it) */
static int nt_ok(const char *dst, int64_t dst_ls, int64_t pb) {
#ifdef NT_BYTES
    return ((uintptr_t)dst % NT_BYTES == 0) && dst_ls % NT_BYTES == 0 && pb % NT_BYTES == 0;
#else
    (void)dst, (void)dst_ls, (void)pb;
    return 0;
#endif
}

static int32_t pages_ok(const int64_t *pages, int64_t n, int64_t num_pages) {
    for (int64_t i = 0; i < n; i++)
        if (pages[i] < 0 || pages[i] >= num_pages) return 0;
    return 1;
}

/* The rows of prompt positions t .. t + runs[0] + runs[1] + ... (t = t0) of each layer,
 * run r of layer l from srcs[l * n_runs + r] (row j at j * rb), into the request's pages:
 * position p is row p % ps of page tpages[p / ps]. A page entered or left mid-way is
 * written in part. 1 (nothing written) when a position has no page in tpages or a page
 * is outside [0, num_pages). */
int pd_page_scatter_runs(char *dst, int64_t dst_ls, int64_t num_pages, const int64_t *tpages,
                         int64_t n_tpages, int64_t ps, int64_t rb, int64_t t0,
                         const int64_t *runs, int64_t n_runs, const char *const *srcs,
                         int64_t layers) {
    int64_t total = 0;
    for (int64_t r = 0; r < n_runs; r++) {
        if (runs[r] < 0) return 1;
        total += runs[r];
    }
    if (t0 < 0 || ps < 1 || (total && (t0 + total - 1) / ps >= n_tpages)) return 1;
    if (total && !pages_ok(tpages + t0 / ps, (t0 + total - 1) / ps - t0 / ps + 1, num_pages))
        return 1;
    int64_t pb = ps * rb;
    int nt = nt_ok(dst, dst_ls, rb); /* rows aligned: so is every page, whole or in part */
    (void)nt; /* unused where the CPU has no non-temporal stores */
    for (int64_t l = 0; l < layers; l++) {
        int64_t p = t0;
        for (int64_t r = 0; r < n_runs; r++) {
            const char *s = srcs[l * n_runs + r];
            for (int64_t end = p + runs[r]; p < end;) {
                int64_t row = p % ps, seg = ps - row < end - p ? ps - row : end - p;
                char *d = dst + l * dst_ls + tpages[p / ps] * pb + row * rb;
#ifdef NT_BYTES
                if (nt) copy_nt(d, s, seg * rb);
                else
#endif
                    memcpy(d, s, (size_t)(seg * rb));
                s += seg * rb;
                p += seg;
            }
        }
    }
#ifdef NT_BYTES
    if (nt) _mm_sfence(); /* NOTE: the streamed lines are visible to other threads after this */
#endif
    return 0;
}
