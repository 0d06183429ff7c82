/* A sparse layer's MLP in the one-call decode forward (decode_forward.c includes this
 * after its projections): what model/arch/moe.py's MoeModel._mlp computes on the
 * per-call path, with the same kernels on the same shapes in the same order, so the
 * same bits. For the step's B tokens, x [B, hidden]:
 *
 *     logits = x @ Wrouter^T                      [B, E]
 *     (w, chosen) = route(logits)                 moe_ops.h: softmax, top k, renormalised
 *     pairs (token, slot), P = B k, sorted by expert (stable): expert j's tokens are one
 *       run of counts[j] rows, in token order
 *     xs = x[token of each pair]                  [P, hidden] (int8: quantized once)
 *     h = xs @ [gate_j | up_j]^T for each run     one grouped call (linear_quant.c
 *                                                 pd_quant_groups_range): only routed
 *                                                 experts are read, each once a step
 *     y = act(gate) * up @ down_j^T for each run  a second grouped call
 *     out[token] = sum of its pairs' w * y, in the pairs' order (moe_ops.h)
 *     out += sigmoid(x @ Wsg^T) * shared(x)       Qwen2-MoE's shared expert, where set
 *
 * The grouped calls split all routed experts' tiles over the threads at once. Buffers
 * come from the plan's scratch (moe_carve); the quantized rows from xq_area. */
#ifndef PD_DECODE_MOE_H
#define PD_DECODE_MOE_H

typedef struct {
    float *logits, *w, *wp, *xs, *h, *act, *y, *sgu, *sact, *sy, *sg;
    int64_t *chosen, *tokens, *counts, *next;
    QuantArgs *groups;
} MoeScratch;

/* Lays b tokens' buffers out from `base` (NULL: only sizes them); returns their floats. */
static int64_t moe_carve(const DecodePlan *p, int64_t b, float *base, MoeScratch *s) {
    int64_t at = 0, pr = b * p->moe_top_k, hd = p->hidden, in = p->moe_inter;
    int64_t sh = p->moe_shared, e = p->moe_experts;
#define TAKE(field, type, count)                                                            \
    s->field = base ? (type *)(void *)(base + at) : NULL;                                   \
    at += up16(((int64_t)(count) * (int64_t)sizeof(type) + 3) / 4)
    TAKE(logits, float, b * e);
    TAKE(w, float, pr);
    TAKE(wp, float, pr);
    TAKE(xs, float, pr * hd);
    TAKE(h, float, pr * 2 * in);
    TAKE(act, float, pr * in);
    TAKE(y, float, pr * hd);
    TAKE(sgu, float, b * 2 * sh);
    TAKE(sact, float, b * sh);
    TAKE(sy, float, b * hd);
    TAKE(sg, float, b);
    TAKE(chosen, int64_t, pr);
    TAKE(tokens, int64_t, pr);
    TAKE(counts, int64_t, e);
    TAKE(next, int64_t, e);
    TAKE(groups, QuantArgs, 2 * e);
#undef TAKE
    return at;
}

static int64_t moe_floats(const DecodePlan *p, int64_t b) {
    MoeScratch s;
    return p->moe_experts ? moe_carve(p, b, NULL, &s) : 0;
}

/* The grouped call's arguments for expert e's projection `t` over rows [a, a + m) of x
 * (k wide; xq: x's quantized rows, or NULL) into columns [col, col + rows) of y. */
static QuantArgs expert_rows(const ExpertProj *t, int64_t e, const float *x, const uint8_t *xq,
                             int64_t k, int64_t a, int64_t m, float *y, int64_t ldy, int64_t col) {
    QuantArgs q = {.x = x + a * k, .xq = xq ? xq + a * pd_xq_bytes(k) : NULL,
                   .w = t->w + e * t->rows * t->row_bytes, .bias = NULL, .y = y + a * ldy + col,
                   .m = m, .n = t->rows, .k_dim = k, .ldy = ldy, .row_bytes = t->row_bytes,
                   .type = t->type, .status = 0};
    return q;
}

/* Every group of one call (each its expert's rows of the same width) over the threads,
 * a group at a time to whichever thread is free: the groups' rows of x differ (an
 * expert's tokens), so equal ranges of tiles would not be equal work. */
static int32_t run_groups(const DecodePlan *p, QuantArgs *g, int64_t count) {
    if (count == 0) return 0;
    int64_t tiles = (g[0].n + 3) / 4; /* linear_quant.c TILE */
    QuantGroups a = {g, count, tiles};
    int64_t parts = threads_now(p);
    parts = parts < count ? parts : count;
    if (p->par_chunks && parts > 1)
        p->par_chunks(p->quant_groups, &a, tiles * count, (int)parts, tiles);
    else
        split(p, p->quant_groups, &a, tiles * count);
    for (int64_t i = 0; i < count; i++)
        if (g[i].status) return 5;
    return 0;
}

/* The pairs sorted by expert (stable): tokens[], their weights wp[], counts[] per expert. */
static void group_pairs(const MoeLayer *m, int64_t pairs, MoeScratch *s) {
    memset(s->counts, 0, (size_t)m->experts * sizeof(int64_t));
    for (int64_t q = 0; q < pairs; q++) s->counts[s->chosen[q]]++;
    for (int64_t j = 0, at = 0; j < m->experts; at += s->counts[j], j++) s->next[j] = at;
    for (int64_t q = 0; q < pairs; q++) {
        int64_t at = s->next[s->chosen[q]]++;
        s->tokens[at] = q / m->top_k;
        s->wp[at] = s->w[q];
    }
}

/* x [B, hidden] -> out [B, hidden]; 0, or 5 (no memory for a tile buffer). */
static int32_t moe_ffn(const DecodePlan *p, const MoeLayer *m, const float *x, float *out) {
    int64_t b = p->b, pr = b * m->top_k, hd = p->hidden, in = m->inter, n, a;
    MoeScratch s;
    moe_carve(p, b, p->scratch + up16(dense_floats(p, b)), &s);
    project(p, &m->router, x, s.logits);
    p->moe_route(s.logits, b, m->experts, m->top_k, m->norm_topk, s.w, s.chosen);
    group_pairs(m, pr, &s);
    for (int64_t q = 0; q < pr; q++)
        memcpy(s.xs + q * hd, x + s.tokens[q] * hd, (size_t)hd * sizeof(float));
    uint8_t *xq = p->quant_x8 ? xq_area(p) : NULL;
    if (xq) p->quant_x8(s.xs, pr, hd, xq);
    n = a = 0;
    for (int64_t j = 0; j < m->experts; a += s.counts[j], j++) {
        if (!s.counts[j]) continue; /* never read */
        s.groups[n++] = expert_rows(&m->gate, j, s.xs, xq, hd, a, s.counts[j], s.h, 2 * in, 0);
        s.groups[n++] = expert_rows(&m->up, j, s.xs, xq, hd, a, s.counts[j], s.h, 2 * in, in);
    }
    if (run_groups(p, s.groups, n)) return 5;
    p->act_mul(s.h, s.act, pr, in);
    if (xq) p->quant_x8(s.act, pr, in, xq);
    n = a = 0;
    for (int64_t j = 0; j < m->experts; a += s.counts[j], j++)
        if (s.counts[j])
            s.groups[n++] = expert_rows(&m->down, j, s.act, xq, in, a, s.counts[j], s.y, hd, 0);
    if (run_groups(p, s.groups, n)) return 5;
    p->moe_combine(s.y, s.wp, s.tokens, pr, hd, out, b);
    if (m->shared_down.n) {
        project(p, &m->shared_gate_up, x, s.sgu);
        p->act_mul(s.sgu, s.sact, b, m->shared_down.k_dim);
        project(p, &m->shared_down, s.sact, s.sy);
        project(p, &m->shared_gate, x, s.sg);
        p->moe_gated_add(out, s.sg, s.sy, b, hd);
    }
    return 0;
}

#endif
