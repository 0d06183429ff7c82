/* A Llama-family or Gemma 3 decode forward in one call: embedding -> layers -> final
 * norm -> head.
 *
 * Why: the same step issued from Python is ~10 kernel calls per layer, each a ctypes
 * call that drops and re-takes the GIL. The decode's scheduler thread (which prepares
 * step N+1 while step N runs) then waits for the GIL at every one of them, so the
 * overlap gained nothing on CPU, and each call's Python costs 5-20 us. Here the whole
 * forward is one ctypes call: the GIL is free for its length.
 *
 * It computes nothing itself but the embedding's scale (one float32 multiply per value,
 * as torch's): it calls the same kernels the per-call path calls (linear_f32.c,
 * paged_decode.c, decode_ops.c, par.c), through function pointers the caller takes from
 * those libraries, in the same order on the same buffers' shapes. So its logits equal
 * the per-call path's bit for bit (tests/test_decode_forward.py,
 * tests/test_decode_forward_gemma3.py).
 *
 * One token per request, B requests; h = the embedding rows (times embed_scale, Gemma's
 * sqrt(hidden), where set); per layer (x, h, delta [B, hidden]):
 *
 *     x = norm(h += delta)            input norm (no delta before layer 0)
 *     qkv = x @ Wqkv^T + b            [B, (H + 2 KH) D]; q, k normed per head (Qwen3,
 *                                     Gemma 3) and rotated in place by the layer's rope
 *     pool[out_slot] = k, v           then attention over the pool -> attn [B, H D]
 *     delta = attn @ Wo^T
 *     x = norm(h += delta)            post-attention norm
 *     delta = act(gate) * up @ Wdown^T  act: SiLU or GELU-tanh (plan.act_mul); a sparse
 *                                     layer (moe set): its routed experts (decode_moe.h)
 *
 * A Gemma 3 layer (pre_ff_norm set) norms each sublayer's output before it joins h:
 * the attention's delta by post_norm, then x = pre_ff_norm(h += that); the MLP's delta
 * by post_ff_norm. Then logits = norm(h += delta) @ Whead^T. Ids, positions and slots
 * are checked before anything is written (status 1, 2, 3); a shape the attention does
 * not take is status 4 (the pool may hold this step's first layer's K/V then: slots the
 * step owns); a tile buffer no memory was left for is status 5.
 *
 * Threads: a projection splits its panels, the attention its requests, over
 * threads_now() parts on par.c's workers (the experts' grouped calls a group at a time,
 * decode_moe.h); the elementwise passes run on this thread.
 * With a core share (kernels/core_share.py) the count is read before every split from
 * the shared records, as the per-call path does; while the engine's schedule thread
 * claims a core for its host work (`host_busy`, core_share.HostCore) the split takes one
 * part fewer, never fewer than one. */
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "kernel_args.h"

#define MAX_WINDOWS 4 /* distinct attention windows a model may have (0: full) */

typedef int (*par_fn)(pd_range_fn, const void *, int64_t, int);
typedef int (*chunks_fn)(pd_range_fn, const void *, int64_t, int, int64_t);
typedef void (*norm_fn)(float *, const float *, const float *, float *, int64_t, int64_t, float);
typedef void (*act_fn)(const float *, float *, int64_t, int64_t);
typedef void (*heads_fn)(float *, int64_t, const float *, int64_t, int64_t, int64_t, float);
typedef void (*rope_fn)(float *, int64_t, const float *, const float *, int64_t, int64_t,
                        int64_t);
typedef void (*x8_fn)(const float *, int64_t, int64_t, uint8_t *);
typedef int (*kv_fn)(float *, float *, int64_t, const int64_t *, const float *, int64_t,
                     const float *, int64_t, int64_t, int64_t);
/* moe_ops.h (decode_ops.c's library) */
typedef void (*route_fn)(const float *, int64_t, int64_t, int64_t, int32_t, float *, int64_t *);
typedef void (*combine_fn)(const float *, const float *, const int64_t *, int64_t, int64_t,
                           float *, int64_t);
typedef void (*gated_fn)(float *, const float *, const float *, int64_t, int64_t);

#define MAX_PARTS 3 /* the parts of a fused projection in GGUF blocks (q, k, v) */

typedef struct { /* a projection's weights in GGUF blocks (linear_quant.c), part by part */
    const uint8_t *w[MAX_PARTS];  /* each part's rows, stacked into W */
    int64_t rows[MAX_PARTS], row_bytes[MAX_PARTS];
    int32_t type[MAX_PARTS];
    int32_t parts;
} QuantProj;

typedef struct { /* a projection: weights in 16-column panels (linear_f32.c), or blocks */
    const float *packed, *bias; /* bias padded to whole panels (blocks: [n]), or NULL */
    int64_t n, k_dim, panels;
    const QuantProj *quant;     /* NULL: the panels */
} Proj;

typedef struct { /* one projection of a layer's experts in GGUF blocks: expert e's rows at
                  * w + e * rows * row_bytes */
    const uint8_t *w;
    int64_t rows, row_bytes;
    int32_t type;
} ExpertProj;

typedef struct { /* a sparse layer's MLP (decode_moe.h) */
    Proj router;             /* [experts, hidden] */
    ExpertProj gate, up, down; /* gate, up: inter rows of hidden; down: hidden rows of inter */
    Proj shared_gate_up, shared_down, shared_gate; /* Qwen2-MoE's shared expert (n 0: none) */
    int64_t experts, top_k, inter;
    int32_t norm_topk; /* the top k's weights divided by their sum */
} MoeLayer;

typedef struct {
    const float *input_norm, *post_norm;
    const float *pre_ff_norm, *post_ff_norm; /* Gemma 3's sandwich norms, or NULL: Llama's */
    const float *q_norm, *k_norm; /* [D] each, or NULL: no q/k norms */
    const float *cos, *sin;       /* the layer's rope [max_pos, D] (sin's first half negated) */
    Proj qkv, o, gate_up, down;
    float *k_pool, *v_pool; /* this layer's [num_slots, KH, D] */
    int64_t window;         /* index into DecodePlan.bounds */
    const MoeLayer *moe;    /* NULL: the dense MLP (gate_up, down) */
} DecodeLayer;

typedef struct {
    /* kernels */
    pd_range_fn linear, attend;
    par_fn par_run; /* NULL: every part on this thread */
    chunks_fn par_chunks; /* pd_par_run_chunks (the experts' grouped calls), or NULL */
    norm_fn norm;
    heads_fn head_norm;
    act_fn act_mul;           /* pd_silu_mul or pd_gelu_tanh_mul */
    rope_fn rope;
    kv_fn kv_write;
    pd_range_fn quant_linear; /* NULL where no projection is in blocks */
    pd_rows_fn quant_rows;    /* NULL where the embedding is not in blocks */
    x8_fn quant_x8;           /* NULL: float x; else pd_quant_x8 (--quant-activations int8) */
    pd_range_fn quant_groups; /* pd_quant_groups_range; NULL where no layer is sparse */
    route_fn moe_route;
    combine_fn moe_combine;
    gated_fn moe_gated_add;
    /* the model */
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, num_slots, max_pos;
    int64_t moe_experts, moe_top_k, moe_inter, moe_shared; /* the sparse layers' largest */
    float eps, scale, embed_scale; /* embed_scale 0: the rows as looked up */
    const float *embed;     /* [vocab, hidden], or NULL: embed_blocks */
    const uint8_t *embed_blocks; /* [vocab] rows of embed_row_bytes, GGUF type embed_type */
    int64_t embed_row_bytes;
    int32_t embed_type;
    const float *final_norm;
    Proj head;
    const DecodeLayer *layer;
    /* threads: `threads`, or with `share` (core_share.py's records, 24 bytes each) own
     * share plus the shares of peers not computing now */
    int64_t threads;
    const uint8_t *share;
    int64_t share_engines, share_slot, share_own;
    const int32_t *host_busy; /* NULL, or 1 while the schedule thread computes beside us */
    /* the step */
    int64_t b;
    const int64_t *ids, *positions, *out_slots; /* [B] */
    const int64_t *slots;                       /* [B, slot_stride] the keys' slots */
    int64_t slot_stride;
    const int64_t *bounds[MAX_WINDOWS];         /* [B, 2] (first key, keys) per window */
    float *scratch;                             /* scratch_floats(B) floats */
    float *logits;                              /* [B, vocab] */
    int32_t status;
} DecodePlan;

static int64_t shared_threads(const DecodePlan *p) {
    if (!p->share) return p->threads;
    int64_t t = p->share_own;
    for (int64_t e = 0; e < p->share_engines; e++) {
        if (e == p->share_slot) continue;
        const uint8_t *rec = p->share + 24 * e; /* f64 last_end, i32 computing, i32 share */
        int32_t computing = __atomic_load_n((const int32_t *)(rec + 8), __ATOMIC_RELAXED);
        int32_t share = __atomic_load_n((const int32_t *)(rec + 12), __ATOMIC_RELAXED);
        if (!computing) t += share;
    }
    return t;
}

static int64_t threads_now(const DecodePlan *p) {
    int64_t t = shared_threads(p);
    if (p->host_busy) t -= __atomic_load_n(p->host_busy, __ATOMIC_RELAXED);
    return t < 1 ? 1 : t;
}

static void split(const DecodePlan *p, pd_range_fn fn, const void *args, int64_t n) {
    int64_t parts = threads_now(p);
    parts = parts < n ? parts : n;
    if (p->par_run == NULL || parts <= 1)
        fn(args, 0, n);
    else
        p->par_run(fn, args, n, (int)parts);
}

static int64_t qkv_width(const DecodePlan *p);
static int64_t float_scratch(const DecodePlan *p, int64_t b);

/* the quantized rows of a projection's x (--quant-activations int8): past the floats */
static uint8_t *xq_area(const DecodePlan *p) {
    return (uint8_t *)(p->scratch + float_scratch(p, p->b));
}

static void project(const DecodePlan *p, const Proj *w, const float *x, float *y) {
    const QuantProj *q = w->quant;
    const uint8_t *xq = NULL;
    if (q && p->quant_x8) { /* x quantized once for every part */
        uint8_t *buf = xq_area(p);
        p->quant_x8(x, p->b, w->k_dim, buf);
        xq = buf;
    }
    if (q) { /* each part into its columns of y, as model/linear.py's per-call path */
        for (int32_t i = 0, col = 0; i < q->parts; col += (int32_t)q->rows[i], i++) {
            QuantArgs a = {.x = x, .xq = xq, .w = q->w[i], .bias = w->bias ? w->bias + col : NULL,
                           .y = y + col, .m = p->b, .n = q->rows[i], .k_dim = w->k_dim,
                           .ldy = w->n, .row_bytes = q->row_bytes[i], .type = q->type[i]};
            split(p, p->quant_linear, &a, (q->rows[i] + 3) / 4); /* linear_quant.c TILE */
        }
        return;
    }
    LinearArgs a = {x, w->packed, w->bias, y, p->b, w->n, w->k_dim};
    split(p, p->linear, &a, w->panels);
}

static int64_t qkv_width(const DecodePlan *p) {
    return (p->heads + 2 * p->kv_heads) * p->head_dim;
}

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; } /* 64-byte aligned parts */
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t dense_floats(const DecodePlan *p, int64_t b) {
    return b * (4 * p->hidden + qkv_width(p) + p->heads * p->head_dim + 3 * p->inter);
}

#include "decode_moe.h" /* moe_floats, moe_ffn: a sparse layer's MLP */

/* the dense buffers, then the sparse layers' (decode_moe.h) */
static int64_t float_scratch(const DecodePlan *p, int64_t b) {
    return up16(dense_floats(p, b)) + moe_floats(p, b);
}

/* Floats of scratch a step of b requests needs (the caller allocates them): the float
 * buffers, then with quant_x8 the widest projection input's quantized rows (b of them,
 * or b * top_k for the experts) */
int64_t pd_decode_scratch_floats(const DecodePlan *p, int64_t b) {
    int64_t k = max64(max64(p->hidden, p->inter), p->heads * p->head_dim);
    k = max64(k, max64(p->moe_inter, p->moe_shared));
    int64_t rows = max64(b, b * p->moe_top_k);
    return float_scratch(p, b) + (p->quant_x8 ? (rows * pd_xq_bytes(k) + 3) / 4 : 0);
}

static int32_t check_inputs(const DecodePlan *p) {
    for (int64_t i = 0; i < p->b; i++) {
        if (p->ids[i] < 0 || p->ids[i] >= p->vocab) return 1;
        if (p->positions[i] < 0 || p->positions[i] >= p->max_pos) return 2;
        if (p->out_slots[i] < 0 || p->out_slots[i] >= p->num_slots) return 3;
    }
    return 0;
}

/* One layer's attention sublayer: x -> delta (qkv and attn are scratch). */
static int32_t attention(const DecodePlan *p, const DecodeLayer *w, const float *x, float *qkv,
                         float *attn, float *delta) {
    int64_t d = p->head_dim, ld = qkv_width(p), q_size = p->heads * d, kv = p->kv_heads * d;
    project(p, &w->qkv, x, qkv);
    if (w->q_norm) { /* each head's q and k normed, then rotated (as the per-call path) */
        p->head_norm(qkv, ld, w->q_norm, p->b, p->heads, d, p->eps);
        p->head_norm(qkv + q_size, ld, w->k_norm, p->b, p->kv_heads, d, p->eps);
    }
    for (int64_t i = 0; i < p->b; i++) { /* q and k side by side: one rotation */
        int64_t pos = p->positions[i];
        p->rope(qkv + i * ld, ld, w->cos + pos * d, w->sin + pos * d, 1, p->heads + p->kv_heads,
                d);
    }
    const float *k = qkv + q_size, *v = qkv + q_size + kv;
    if (p->kv_write(w->k_pool, w->v_pool, p->num_slots, p->out_slots, k, ld, v, ld, p->b, kv))
        return 3;
    PagedDecodeArgs a = {qkv, ld, w->k_pool, w->v_pool, p->slots, p->slot_stride,
                         p->bounds[w->window], p->heads, p->kv_heads, d, p->scale, attn, 0};
    split(p, p->attend, &a, p->b * p->kv_heads); /* (request, kv head): one request splits */
    if (a.status) return 4;
    project(p, &w->o, attn, delta);
    return 0;
}

static void embed(const DecodePlan *p, float *h) {
    int64_t b = p->b, hd = p->hidden;
    if (p->embed_blocks)
        p->quant_rows(p->embed_type, p->embed_blocks, p->embed_row_bytes, p->ids, b, hd, h);
    else
        for (int64_t i = 0; i < b; i++)
            memcpy(h + i * hd, p->embed + p->ids[i] * hd, (size_t)hd * sizeof(float));
    if (p->embed_scale != 0.0f)
        for (int64_t i = 0; i < b * hd; i++) h[i] *= p->embed_scale;
}

/* The forward of plan->b requests into plan->logits; returns plan->status (0: done). */
int pd_decode_forward(DecodePlan *p) {
    int64_t b = p->b, hd = p->hidden;
    p->status = check_inputs(p);
    if (p->status || b == 0) return p->status;
    float *h = p->scratch, *x = h + b * hd, *delta = x + b * hd, *y = delta + b * hd;
    float *qkv = y + b * hd, *attn = qkv + b * qkv_width(p);
    float *gu = attn + b * p->heads * p->head_dim, *act = gu + 2 * b * p->inter;
    const float *add = NULL; /* what the next norm adds to h: delta, or y (Gemma 3) */
    embed(p, h);
    for (int64_t l = 0; l < p->layers; l++) {
        const DecodeLayer *w = &p->layer[l];
        p->norm(h, add, w->input_norm, x, b, hd, p->eps);
        p->status = attention(p, w, x, qkv, attn, delta);
        if (p->status) return p->status;
        if (w->pre_ff_norm) {
            p->norm(delta, NULL, w->post_norm, y, b, hd, p->eps);
            p->norm(h, y, w->pre_ff_norm, x, b, hd, p->eps);
        } else {
            p->norm(h, delta, w->post_norm, x, b, hd, p->eps);
        }
        if (w->moe) {
            p->status = moe_ffn(p, w->moe, x, delta);
            if (p->status) return p->status;
        } else {
            project(p, &w->gate_up, x, gu);
            p->act_mul(gu, act, b, p->inter);
            project(p, &w->down, act, delta);
        }
        add = delta;
        if (w->post_ff_norm) {
            p->norm(delta, NULL, w->post_ff_norm, y, b, hd, p->eps);
            add = y;
        }
    }
    p->norm(h, add, p->final_norm, x, b, hd, p->eps);
    project(p, &p->head, x, p->logits);
    return 0;
}

/* The layouts kernels/native/abi.py checks at load (abi.h). */
static const PdAbiField abi[] = {
    PD_ABI_STRUCT(QuantProj),
    PD_ABI_FIELD(QuantProj, w), PD_ABI_FIELD(QuantProj, rows),
    PD_ABI_FIELD(QuantProj, row_bytes), PD_ABI_FIELD(QuantProj, type),
    PD_ABI_FIELD(QuantProj, parts),
    PD_ABI_STRUCT(Proj),
    PD_ABI_FIELD(Proj, packed), PD_ABI_FIELD(Proj, bias), PD_ABI_FIELD(Proj, n),
    PD_ABI_FIELD(Proj, k_dim), PD_ABI_FIELD(Proj, panels), PD_ABI_FIELD(Proj, quant),
    PD_ABI_STRUCT(DecodeLayer),
    PD_ABI_FIELD(DecodeLayer, input_norm), PD_ABI_FIELD(DecodeLayer, post_norm),
    PD_ABI_FIELD(DecodeLayer, pre_ff_norm), PD_ABI_FIELD(DecodeLayer, post_ff_norm),
    PD_ABI_FIELD(DecodeLayer, q_norm), PD_ABI_FIELD(DecodeLayer, k_norm),
    PD_ABI_FIELD(DecodeLayer, cos), PD_ABI_FIELD(DecodeLayer, sin),
    PD_ABI_FIELD(DecodeLayer, qkv), PD_ABI_FIELD(DecodeLayer, o),
    PD_ABI_FIELD(DecodeLayer, gate_up), PD_ABI_FIELD(DecodeLayer, down),
    PD_ABI_FIELD(DecodeLayer, k_pool), PD_ABI_FIELD(DecodeLayer, v_pool),
    PD_ABI_FIELD(DecodeLayer, window), PD_ABI_FIELD(DecodeLayer, moe),
    PD_ABI_STRUCT(ExpertProj),
    PD_ABI_FIELD(ExpertProj, w), PD_ABI_FIELD(ExpertProj, rows),
    PD_ABI_FIELD(ExpertProj, row_bytes), PD_ABI_FIELD(ExpertProj, type),
    PD_ABI_STRUCT(MoeLayer),
    PD_ABI_FIELD(MoeLayer, router), PD_ABI_FIELD(MoeLayer, gate), PD_ABI_FIELD(MoeLayer, up),
    PD_ABI_FIELD(MoeLayer, down), PD_ABI_FIELD(MoeLayer, shared_gate_up),
    PD_ABI_FIELD(MoeLayer, shared_down), PD_ABI_FIELD(MoeLayer, shared_gate),
    PD_ABI_FIELD(MoeLayer, experts), PD_ABI_FIELD(MoeLayer, top_k),
    PD_ABI_FIELD(MoeLayer, inter), PD_ABI_FIELD(MoeLayer, norm_topk),
    PD_ABI_STRUCT(DecodePlan),
    PD_ABI_FIELD(DecodePlan, linear), PD_ABI_FIELD(DecodePlan, attend),
    PD_ABI_FIELD(DecodePlan, par_run), PD_ABI_FIELD(DecodePlan, par_chunks),
    PD_ABI_FIELD(DecodePlan, norm),
    PD_ABI_FIELD(DecodePlan, head_norm), PD_ABI_FIELD(DecodePlan, act_mul),
    PD_ABI_FIELD(DecodePlan, rope), PD_ABI_FIELD(DecodePlan, kv_write),
    PD_ABI_FIELD(DecodePlan, quant_linear), PD_ABI_FIELD(DecodePlan, quant_rows),
    PD_ABI_FIELD(DecodePlan, quant_x8), PD_ABI_FIELD(DecodePlan, quant_groups),
    PD_ABI_FIELD(DecodePlan, moe_route), PD_ABI_FIELD(DecodePlan, moe_combine),
    PD_ABI_FIELD(DecodePlan, moe_gated_add),
    PD_ABI_FIELD(DecodePlan, layers), PD_ABI_FIELD(DecodePlan, hidden),
    PD_ABI_FIELD(DecodePlan, heads), PD_ABI_FIELD(DecodePlan, kv_heads),
    PD_ABI_FIELD(DecodePlan, head_dim), PD_ABI_FIELD(DecodePlan, inter),
    PD_ABI_FIELD(DecodePlan, vocab), PD_ABI_FIELD(DecodePlan, num_slots),
    PD_ABI_FIELD(DecodePlan, max_pos), PD_ABI_FIELD(DecodePlan, moe_experts),
    PD_ABI_FIELD(DecodePlan, moe_top_k), PD_ABI_FIELD(DecodePlan, moe_inter),
    PD_ABI_FIELD(DecodePlan, moe_shared), PD_ABI_FIELD(DecodePlan, eps),
    PD_ABI_FIELD(DecodePlan, scale), PD_ABI_FIELD(DecodePlan, embed_scale),
    PD_ABI_FIELD(DecodePlan, embed),
    PD_ABI_FIELD(DecodePlan, embed_blocks), PD_ABI_FIELD(DecodePlan, embed_row_bytes),
    PD_ABI_FIELD(DecodePlan, embed_type),
    PD_ABI_FIELD(DecodePlan, final_norm), PD_ABI_FIELD(DecodePlan, head),
    PD_ABI_FIELD(DecodePlan, layer), PD_ABI_FIELD(DecodePlan, threads),
    PD_ABI_FIELD(DecodePlan, share), PD_ABI_FIELD(DecodePlan, share_engines),
    PD_ABI_FIELD(DecodePlan, share_slot), PD_ABI_FIELD(DecodePlan, share_own),
    PD_ABI_FIELD(DecodePlan, host_busy), PD_ABI_FIELD(DecodePlan, b),
    PD_ABI_FIELD(DecodePlan, ids), PD_ABI_FIELD(DecodePlan, positions),
    PD_ABI_FIELD(DecodePlan, out_slots), PD_ABI_FIELD(DecodePlan, slots),
    PD_ABI_FIELD(DecodePlan, slot_stride), PD_ABI_FIELD(DecodePlan, bounds),
    PD_ABI_FIELD(DecodePlan, scratch), PD_ABI_FIELD(DecodePlan, logits),
    PD_ABI_FIELD(DecodePlan, status),
    PD_ABI_END,
};
PD_ABI_EXPORT(abi)
