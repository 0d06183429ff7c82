/* Page copies between KV frames and a pool, both sides of the transfer.
 *
 *   pd_page_runs_check, then pd_page_scatter_layers     the decode: a received chunk's
 *                     rows, by prompt position, into the request's pages (any alignment):
 *                     one call per kind of a chunk (transfer/validate.py), its layers a
 *                     par.c range function (kernels/page_copy.py scatter_runs)
 *   pd_page_runs_check, then pd_page_gather_layers      the prefill: a piece's rows out of
 *                     the request's pages into its frames (one per layer and run), each
 *                     frame hashed as soon as it is filled (gather_runs)
 *   pd_hash_frames    the frames' XXH3-64 hashes (the receiver's checksum), split the
 *                     same way
 *
 * A page is pb bytes (page_size tokens of one layer's K or V). The pool is far larger
 * than the caches and is not read again until a decode step, so the scatter's stores
 * bypass the caches (non-temporal) where the CPU has them and the destination is aligned:
 * a cached store first reads the line it overwrites, a third of the memory traffic of a
 * copy (benchmarks/kv_transfer.py's scatter column). The gather's stores stay cached:
 * its frame is hashed at once, then read by libzmq. Elsewhere (other CPUs, odd sizes)
 * each page is one memcpy. The caller (kernels/page_copy.py) checks shapes and strides;
 * this file checks only the page numbers, before copying anything.
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

/* Where a chunk's rows are, in the pool and in its frames: the rows of prompt positions
 * t0 .. t0 + runs[0] + runs[1] + ... of each layer; run r of layer l is frame
 * frames[l * n_runs + r] (row j at j * rb); position p is row p % ps of page
 * tpages[p / ps] of the pool's layer l (a page entered or left mid-way is copied in
 * part). Layers touch disjoint pages and frames, so they go to par.c's threads.
 * Scatter: frames -> pool (the decode). Gather: pool -> frames, and hashes[i] = hash of
 * frame i once it is filled (the prefill; hashes may be NULL). */
typedef uint64_t (*hash64_fn)(const void *, size_t);

typedef struct {
    char *pool;
    int64_t pool_ls, num_pages;
    const int64_t *tpages;
    int64_t n_tpages, ps, rb, t0;
    const int64_t *runs;
    int64_t n_runs;
    char *const *frames;
    int64_t layers;
    uint64_t *hashes;
    hash64_fn hash;
} PageRuns;

/* 1 if every position of the chunk has a page in tpages and every such page is inside
 * [0, num_pages); 0 (the caller copies nothing) otherwise. Checked once, before any
 * layer is copied. */
int pd_page_runs_check(const PageRuns *a) {
    int64_t total = 0;
    for (int64_t r = 0; r < a->n_runs; r++) {
        if (a->runs[r] < 0) return 0;
        total += a->runs[r];
    }
    if (a->t0 < 0 || a->ps < 1 || (total && (a->t0 + total - 1) / a->ps >= a->n_tpages)) return 0;
    int64_t first = a->t0 / a->ps;
    return !total || pages_ok(a->tpages + first, (a->t0 + total - 1) / a->ps - first + 1,
                              a->num_pages);
}

static void scatter_layer(const PageRuns *a, int64_t l, int nt) {
    int64_t p = a->t0, pb = a->ps * a->rb;
    (void)nt; /* unused where the CPU has no non-temporal stores */
    for (int64_t r = 0; r < a->n_runs; r++) {
        const char *s = a->frames[l * a->n_runs + r];
        for (int64_t end = p + a->runs[r]; p < end;) {
            int64_t row = p % a->ps, seg = a->ps - row < end - p ? a->ps - row : end - p;
            char *d = a->pool + l * a->pool_ls + a->tpages[p / a->ps] * pb + row * a->rb;
#ifdef NT_BYTES
            if (nt) copy_nt(d, s, seg * a->rb);
            else
#endif
                memcpy(d, s, (size_t)(seg * a->rb));
            s += seg * a->rb;
            p += seg;
        }
    }
}

/* par.c range function: layers [lo, hi) of a chunk pd_page_runs_check accepted. */
void pd_page_scatter_layers(const void *args, int64_t lo, int64_t hi) {
    const PageRuns *a = args;
    int nt = nt_ok(a->pool, a->pool_ls, a->rb); /* rows aligned: so is every page, whole or in part */
    for (int64_t l = lo; l < hi; l++) scatter_layer(a, l, nt);
#ifdef NT_BYTES
    /* NOTE: streamed lines are weakly ordered; fenced before this thread reports done */
    if (nt) _mm_sfence();
#endif
}

static void gather_layer(const PageRuns *a, int64_t l) {
    int64_t p = a->t0, pb = a->ps * a->rb;
    for (int64_t r = 0; r < a->n_runs; r++) {
        char *frame = a->frames[l * a->n_runs + r], *d = frame;
        for (int64_t end = p + a->runs[r]; p < end;) {
            int64_t row = p % a->ps, seg = a->ps - row < end - p ? a->ps - row : end - p;
            memcpy(d, a->pool + l * a->pool_ls + a->tpages[p / a->ps] * pb + row * a->rb,
                   (size_t)(seg * a->rb));
            d += seg * a->rb;
            p += seg;
        }
        /* NOTE: while the frame is still in this core's cache */
        if (a->hashes) a->hashes[l * a->n_runs + r] = a->hash(frame, (size_t)(d - frame));
    }
}

/* par.c range function: layers [lo, hi) of a piece pd_page_runs_check accepted. */
void pd_page_gather_layers(const void *args, int64_t lo, int64_t hi) {
    const PageRuns *a = args;
    for (int64_t l = lo; l < hi; l++) gather_layer(a, l);
}

/* Frame hashes for the receiver's checksum (transfer/checksum.py), on par.c's threads:
 * out[i] = hash(srcs[i], sizes[i]) for i in [lo, hi). `hash` is XXH3-64 as the xxhash
 * package's own library exports it (kernels/page_copy.py finds it), so the values are
 * the ones its Python API gives. */
typedef struct {
    const char *const *srcs;
    const int64_t *sizes;
    uint64_t *out;
    hash64_fn hash;
} HashArgs;

void pd_hash_frames(const void *args, int64_t lo, int64_t hi) {
    const HashArgs *a = args;
    for (int64_t i = lo; i < hi; i++) a->out[i] = a->hash(a->srcs[i], (size_t)a->sizes[i]);
}
