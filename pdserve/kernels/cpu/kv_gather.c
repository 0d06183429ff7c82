/* A KV frame gathered out of the pool and hashed in the same pass (the prefill's send).
 *
 *   pool   [layers, num_slots, row]       pool.k or pool.v, rows of row_bytes contiguous
 *   runs   [num_runs][2]                  (first slot, slots): the request's slots in
 *                                         position order, cut where they stop being
 *                                         consecutive (a page, or pages that follow)
 *   frame  [layers, sum of the runs' slots, row]   written front to back
 *
 *   pd_kv_gather_hash  frame = the runs' rows, layer by layer; hash = XXH3-64 of the
 *                      frame's bytes, fed to the hash a block at a time right after the
 *                      block is written, so it reads the block from cache, not memory
 *
 * The hash is the xxhash package's own XXH3 (its streaming reset / update / digest,
 * passed in as function pointers taken from the loaded extension module), so the result
 * equals xxhash.xxh3_64_intdigest(frame) bit for bit and the wire format is unchanged.
 * Apart from the function pointers it reads and writes nothing but the arguments, and
 * checks every run against num_slots before the first byte is copied.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* bytes written between two hash updates: the block is still in L2 when hashed */
#define HASH_BLOCK (256 << 10)

typedef int (*hash_reset_fn)(void *state);
typedef int (*hash_update_fn)(void *state, const void *data, size_t len);
typedef uint64_t (*hash_digest_fn)(const void *state);

typedef struct {
    const char *src;       /* the pool: layer l, slot s at src + l * layer_stride + s * row_bytes */
    int64_t layer_stride;  /* bytes */
    int64_t row_bytes;
    int64_t num_slots;     /* slots per layer: every run lies in [0, num_slots) */
    const int64_t *runs;   /* [num_runs][2] */
    int64_t num_runs;
    int64_t layers;
    char *dst;             /* the frame: layers * (sum of run lengths) * row_bytes bytes */
    void *state;           /* an XXH3 state, used by one caller at a time */
    hash_reset_fn reset;
    hash_update_fn update;
    hash_digest_fn digest;
    uint64_t hash;         /* out */
    int32_t status;        /* out: 0 ok; 1 a run outside the pool (nothing copied); 2 hash error */
} GatherArgs;

static int runs_inside(const GatherArgs *a) {
    for (int64_t i = 0; i < a->num_runs; i++) {
        int64_t first = a->runs[2 * i], n = a->runs[2 * i + 1];
        if (first < 0 || n < 0 || first > a->num_slots - n) return 0;
    }
    return 1;
}

void pd_kv_gather_hash(GatherArgs *a) {
    a->hash = 0;
    if (!runs_inside(a)) {
        a->status = 1;
        return;
    }
    a->status = a->reset(a->state) ? 2 : 0;
    char *out = a->dst, *unhashed = a->dst;
    for (int64_t l = 0; l < a->layers && !a->status; l++) {
        const char *layer = a->src + l * a->layer_stride;
        for (int64_t i = 0; i < a->num_runs; i++) {
            size_t n = (size_t)(a->runs[2 * i + 1] * a->row_bytes);
            memcpy(out, layer + a->runs[2 * i] * a->row_bytes, n);
            out += n;
            if (out - unhashed >= HASH_BLOCK) {
                if (a->update(a->state, unhashed, (size_t)(out - unhashed))) a->status = 2;
                unhashed = out;
            }
        }
    }
    if (!a->status && out > unhashed && a->update(a->state, unhashed, (size_t)(out - unhashed)))
        a->status = 2;
    if (!a->status) a->hash = a->digest(a->state);
}
