/* Page copies between KV frames and a pool, both sides of the transfer.
 *
 *   pd_page_runs_check, then pd_page_scatter_layers     the decode: a received chunk's
 *                     rows, by prompt position, into the request's pages (any alignment):
 *                     one call per kind of a chunk (transfer/receiving/writer.py), its layers a
 *                     par.c range function (kernels/native/page_copy.py scatter_runs); with the
 *                     chunk's block hashes, each block is hashed and compared right
 *                     before it is written, while it is in this core's L1
 *   pd_page_runs_check, then pd_page_gather_layers      the prefill: a piece's rows out of
 *                     the request's pages into its frames (one per layer and run), each
 *                     frame's blocks hashed as soon as it is filled (gather_runs)
 *   pd_hash_blocks    the block hashes of frames (transfer/checksum.py), split the
 *                     same way
 *
 * Blocks (transfer/checksum.py): each frame (a segment: one layer's run of rows) is
 * hashed in blocks of `block` bytes, the last one shorter; hashes[i] is block i, frames
 * in order. A frame of layer l, run r starts at block l * (blocks of a layer) + (blocks
 * of runs 0 .. r-1): every layer holds the same runs.
 *
 * A page is pb bytes (page_size tokens of one layer's K or V). The pool is far larger
 * than the caches and is not read again until a decode step, so the scatter's stores
 * bypass the caches (non-temporal) where the CPU has them and the destination is aligned:
 * a cached store first reads the line it overwrites, a third of the memory traffic of a
 * copy (benchmarks/kv_transfer.py's scatter column). The gather's stores stay cached:
 * its frame is hashed at once, then read by libzmq. Elsewhere (other CPUs, odd sizes)
 * each piece is one memcpy. The caller (kernels/native/page_copy.py) checks shapes, strides and
 * the hash count; this file checks only the page numbers, before copying anything.
 */
#include <stdint.h>
#include <string.h>

#include "abi.h"

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

/* 1 if non-temporal stores may write every piece: each starts on a store's alignment
 * and is a whole number of stores (the pool's base, its layer stride, the row and the
 * block size all multiples of it; so is a page, ps rows) */
static int nt_ok(const char *dst, int64_t dst_ls, int64_t rb, int64_t block) {
#ifdef NT_BYTES
    return ((uintptr_t)dst % NT_BYTES == 0) && dst_ls % NT_BYTES == 0 && rb % NT_BYTES == 0 &&
           block % NT_BYTES == 0;
#else
    (void)dst, (void)dst_ls, (void)rb, (void)block;
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
 * Scatter: frames -> pool (the decode); with hashes, block i is written only if its hash
 * is hashes[i], and a layer stops at its first block that is not (bad[layer] = 1).
 * Gather: pool -> frames, and hashes[i] = hash of block i once its frame is filled (the
 * prefill; hashes may be NULL). */
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
    int64_t block; /* bytes per hashed block (> 0 where hashes is set) */
    int32_t *bad;  /* scatter with hashes: one flag per layer */
    /* where set (kernels/native/page_copy.py PageWriter), pd_page_runs_check also checks the
     * frames' count and sizes, and the hash count where hashes is set */
    const int64_t *sizes;
    int64_t n_frames, n_hashes;
} PageRuns;

static int64_t blocks_of(int64_t nbytes, int64_t block) { return (nbytes + block - 1) / block; }

/* the blocks of one layer's frames (every layer holds the same runs) */
static int64_t layer_blocks(const PageRuns *a) {
    int64_t n = 0;
    for (int64_t r = 0; r < a->n_runs; r++) n += blocks_of(a->runs[r] * a->rb, a->block);
    return n;
}

/* 1 if the frames hold what the runs say (where sizes is set) */
static int32_t frames_ok(const PageRuns *a) {
    if (a->n_frames != a->layers * a->n_runs) return 0;
    for (int64_t l = 0; l < a->layers; l++)
        for (int64_t r = 0; r < a->n_runs; r++)
            if (a->sizes[l * a->n_runs + r] != a->runs[r] * a->rb) return 0;
    return !a->hashes || (a->block > 0 && a->n_hashes == a->layers * layer_blocks(a));
}

/* 1 if every position of the chunk has a page in tpages and every such page is inside
 * [0, num_pages), and (where sizes is set) the frames and hashes are what the runs say;
 * 0 (the caller copies nothing) otherwise. Checked once, before any layer is copied. */
int pd_page_runs_check(const PageRuns *a) {
    int64_t total = 0;
    for (int64_t r = 0; r < a->n_runs; r++) {
        if (a->runs[r] < 0) return 0;
        total += a->runs[r];
    }
    if (a->sizes && !frames_ok(a)) return 0;
    if (a->t0 < 0 || a->ps < 1 || (total && (a->t0 + total - 1) / a->ps >= a->n_tpages)) return 0;
    int64_t first = a->t0 / a->ps;
    return !total || pages_ok(a->tpages + first, (a->t0 + total - 1) / a->ps - first + 1,
                              a->num_pages);
}

/* Bytes [at, at + len) of layer l's positions (byte at of position at / rb) from s into
 * the pool, split where pages end. */
static void put(const PageRuns *a, int64_t l, int64_t at, const char *s, int64_t len, int nt) {
    int64_t pb = a->ps * a->rb;
    (void)nt; /* unused where the CPU has no non-temporal stores */
    while (len > 0) {
        int64_t off = at % pb, n = pb - off < len ? pb - off : len;
        char *d = a->pool + l * a->pool_ls + a->tpages[at / pb] * pb + off;
#ifdef NT_BYTES
        if (nt) copy_nt(d, s, n);
        else
#endif
            memcpy(d, s, (size_t)n);
        s += n, at += n, len -= n;
    }
}

/* Layer l's frames into the pool; with hashes, each block checked first (returns 0 at
 * the first that fails: nothing of that block or after it is written). */
static int scatter_layer(const PageRuns *a, int64_t l, int nt) {
    int64_t at = a->t0 * a->rb, step = a->hashes ? a->block : INT64_MAX;
    const uint64_t *want = a->hashes ? a->hashes + l * layer_blocks(a) : NULL;
    for (int64_t r = 0; r < a->n_runs; r++) {
        const char *s = a->frames[l * a->n_runs + r];
        for (int64_t left = a->runs[r] * a->rb; left > 0;) {
            int64_t len = left < step ? left : step;
            /* NOTE: hashed while it is in L1, then written from there: one read of the
             * received bytes from memory, where hashing the frame first read it twice */
            if (want && a->hash(s, (size_t)len) != *want++) return 0;
            put(a, l, at, s, len, nt);
            s += len, at += len, left -= len;
        }
    }
    return 1;
}

/* par.c range function: layers [lo, hi) of a chunk pd_page_runs_check accepted. */
void pd_page_scatter_layers(const void *args, int64_t lo, int64_t hi) {
    const PageRuns *a = args;
    int nt = nt_ok(a->pool, a->pool_ls, a->rb, a->hashes ? a->block : a->rb);
    for (int64_t l = lo; l < hi; l++) {
        int ok = scatter_layer(a, l, nt);
        if (a->bad) a->bad[l] = !ok;
    }
#ifdef NT_BYTES
    /* NOTE: streamed lines are weakly ordered; fenced before this thread reports done */
    if (nt) _mm_sfence();
#endif
}

static void hash_blocks(const char *s, int64_t nbytes, int64_t block, hash64_fn hash,
                        uint64_t *out) {
    for (int64_t at = 0; at < nbytes; at += block)
        *out++ = hash(s + at, (size_t)(nbytes - at < block ? nbytes - at : block));
}

static void gather_layer(const PageRuns *a, int64_t l) {
    int64_t p = a->t0, pb = a->ps * a->rb;
    uint64_t *out = a->hashes ? a->hashes + l * layer_blocks(a) : NULL;
    for (int64_t r = 0; r < a->n_runs; r++) {
        char *frame = a->frames[l * a->n_runs + r], *d = frame;
        for (int64_t end = p + a->runs[r]; p < end;) {
            int64_t row = p % a->ps, seg = a->ps - row < end - p ? a->ps - row : end - p;
            memcpy(d, a->pool + l * a->pool_ls + a->tpages[p / a->ps] * pb + row * a->rb,
                   (size_t)(seg * a->rb));
            d += seg * a->rb;
            p += seg;
        }
        if (out) { /* NOTE: while the frame is still in this core's cache */
            hash_blocks(frame, d - frame, a->block, a->hash, out);
            out += blocks_of(d - frame, a->block);
        }
    }
}

/* par.c range function: layers [lo, hi) of a piece pd_page_runs_check accepted. */
void pd_page_gather_layers(const void *args, int64_t lo, int64_t hi) {
    const PageRuns *a = args;
    for (int64_t l = lo; l < hi; l++) gather_layer(a, l);
}

/* Block hashes of frames (transfer/checksum.py), on par.c's threads: frame i's blocks
 * into out[first[i]] onwards, for i in [lo, hi). `hash` is XXH3-64 as the xxhash
 * package's own library exports it (kernels/native/page_copy.py finds it), so the values are
 * the ones its Python API gives. */
typedef struct {
    const char *const *srcs;
    const int64_t *sizes, *first;
    uint64_t *out;
    hash64_fn hash;
    int64_t block;
} HashArgs;

void pd_hash_blocks(const void *args, int64_t lo, int64_t hi) {
    const HashArgs *a = args;
    for (int64_t i = lo; i < hi; i++)
        hash_blocks(a->srcs[i], a->sizes[i], a->block, a->hash, a->out + a->first[i]);
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(PageRuns),
    PD_ABI_FIELD(PageRuns, pool), PD_ABI_FIELD(PageRuns, pool_ls),
    PD_ABI_FIELD(PageRuns, num_pages), PD_ABI_FIELD(PageRuns, tpages),
    PD_ABI_FIELD(PageRuns, n_tpages), PD_ABI_FIELD(PageRuns, ps),
    PD_ABI_FIELD(PageRuns, rb), PD_ABI_FIELD(PageRuns, t0), PD_ABI_FIELD(PageRuns, runs),
    PD_ABI_FIELD(PageRuns, n_runs), PD_ABI_FIELD(PageRuns, frames),
    PD_ABI_FIELD(PageRuns, layers), PD_ABI_FIELD(PageRuns, hashes),
    PD_ABI_FIELD(PageRuns, hash), PD_ABI_FIELD(PageRuns, block),
    PD_ABI_FIELD(PageRuns, bad), PD_ABI_FIELD(PageRuns, sizes),
    PD_ABI_FIELD(PageRuns, n_frames), PD_ABI_FIELD(PageRuns, n_hashes),
    PD_ABI_STRUCT(HashArgs),
    PD_ABI_FIELD(HashArgs, srcs), PD_ABI_FIELD(HashArgs, sizes),
    PD_ABI_FIELD(HashArgs, first), PD_ABI_FIELD(HashArgs, out),
    PD_ABI_FIELD(HashArgs, hash), PD_ABI_FIELD(HashArgs, block),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
