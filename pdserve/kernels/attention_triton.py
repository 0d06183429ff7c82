"""Paged attention kernels: decode (one query token per request) and extend (causal chunk).

Both read K/V of one layer through the request rows, never from a contiguous copy:

    q        [T, H, D]        this step's queries (last dim contiguous)
    k, v     [S, KH, D]       one layer of the KV pool (pool.k[layer]); H = KH * GROUP
    req_to_token[R, C] int32  position -> slot;  slot of request b at position p:
                              req_to_token[rows[b], p]
    out      [T, H, D]        written only at the tokens of the listed requests

decode : request b has one token at index tok[b]; it sees positions 0 .. seq_lens[b]-1.
extend : request b has extend_lens[b] tokens at starts[b] .. starts[b]+extend_lens[b]-1,
         the last seq_lens[b] - extend_lens[b] positions before them (the prefix) are
         already in the pool; token j sits at position prefix + j and sees 0 .. prefix + j.
window : with window W > 0 a query at position p sees only p-W+1 .. p (the sliding
         window of transformers' Mistral/Qwen2/Qwen3); 0 means no window.

Preconditions (checked by the wrappers where it costs no device sync): every listed
position's K/V is already in the pool (the backend writes this step's K/V first) and
seq_lens[b] >= extend_lens[b] >= 1. Softmax runs in float32 with an online max
(flash-attention style), so no [T, L] score matrix is ever materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, r2t_ptr, rows_ptr, lens_ptr, tok_ptr, scale, window,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h, s_r2t,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program: one request (axis 0) x one KV head (axis 1) with its GROUP query heads
    b = tl.program_id(0)
    kh = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    t = tl.load(tok_ptr + b).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kh * GROUP + g
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = tl.maximum(seq_len - window, 0)  # window: first visible position
    for start in range(lo, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        slots = tl.load(r2t_ptr + row * s_r2t + n, mask=n_mask, other=0).to(tl.int64)
        nd_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + slots[:, None] * sk_s + kh * sk_h + d[None, :], mask=nd_mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * sv_s + kh * sv_h + d[None, :], mask=nd_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # position lo is in the first block, so m_new is finite from the first iteration on
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [G, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + t * so_t + heads[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, r2t_ptr, rows_ptr, lens_ptr, ext_ptr, starts_ptr, scale, window,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h, s_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # one program: one request (axis 0) x BLOCK_M of its new tokens (axis 1) x one head (axis 2)
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    n_new = tl.load(ext_ptr + b)
    if mb * BLOCK_M >= n_new:
        return
    kh = h // GROUP
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    t0 = tl.load(starts_ptr + b).to(tl.int64)
    prefix = seq_len - n_new
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    md_mask = (m < n_new)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (t0 + m)[:, None] * sq_t + h * sq_h + d[None, :], mask=md_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # rows past n_new act as the last token (its keys are visible); results not stored
    q_pos = prefix + tl.minimum(m, n_new - 1)
    end = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)  # causal: later keys unseen
    lo = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)  # window: earlier keys unseen
    for start in range(lo, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(r2t_ptr + row * s_r2t + n, mask=n_mask, other=0).to(tl.int64)
        nd_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * sk_s + kh * sk_h + d[None, :], mask=nd_mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * sv_s + kh * sv_h + d[None, :], mask=nd_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # a row may see no key of this block yet (window): keep its max finite so that
        # exp() gives 0, not NaN; every row sees its own position in some block
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (t0 + m)[:, None] * so_t + h * so_h + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=md_mask)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    tok: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """out[tok[b]] = attention of q[tok[b]] over request b's seq_lens[b] positions
    (the last `window` of them when window > 0).
    rows, seq_lens, tok: [B] int32/int64 on q's device. Returns `out`."""
    group = _check_common(q, k, v, out, req_to_token, rows, seq_lens, tok)
    batch, kv_heads, head_dim = rows.shape[0], k.shape[1], q.shape[2]
    if batch == 0:
        return out
    _decode_kernel[(batch, kv_heads)](
        q, k, v, out, req_to_token, rows, seq_lens, tok, scale, _window_arg(window),
        *_strides(q, k, v, out), req_to_token.stride(0),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=32,
    )  # fmt: skip
    return out


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    starts: torch.Tensor,
    max_extend: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.
    rows, seq_lens, extend_lens, starts: [B] on q's device; max_extend >= max(extend_lens)
    (a host int: it sizes the grid without a device sync); window as in decode_attention.
    Returns `out`."""
    group = _check_common(q, k, v, out, req_to_token, rows, seq_lens, starts, extend_lens)
    batch, heads, head_dim = rows.shape[0], q.shape[1], q.shape[2]
    if batch == 0 or max_extend <= 0:
        return out
    block_m = 32
    grid = (batch, triton.cdiv(max_extend, block_m), heads)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # no TF32 rounding for fp32
    _extend_kernel[grid](
        q, k, v, out, req_to_token, rows, seq_lens, extend_lens, starts, scale,
        _window_arg(window), *_strides(q, k, v, out), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=32, PRECISION=precision,
    )  # fmt: skip
    return out


def decode_attention_ref(q, k, v, req_to_token, rows, seq_lens, tok, scale, window=0):
    """[B, H, D]: the torch reference of decode_attention, one request at a time."""
    outs = []
    for b in range(rows.shape[0]):
        total = int(seq_lens[b])
        slots = req_to_token[int(rows[b]), :total].long()
        outs.append(_attend(q[int(tok[b])][None], k[slots], v[slots], total - 1, scale, window)[0])
    return torch.stack(outs) if outs else q.new_empty(0, *q.shape[1:])


def extend_attention_ref(
    q, k, v, req_to_token, rows, seq_lens, extend_lens, starts, scale, window=0
):  # fmt: skip
    """list of [extend_lens[b], H, D]: the torch reference of extend_attention."""
    outs = []
    for b in range(rows.shape[0]):
        n, total, t0 = int(extend_lens[b]), int(seq_lens[b]), int(starts[b])
        slots = req_to_token[int(rows[b]), :total].long()
        outs.append(_attend(q[t0 : t0 + n], k[slots], v[slots], total - n, scale, window))
    return outs


def _attend(q, keys, vals, prefix: int, scale: float, window: int = 0) -> torch.Tensor:
    """q [n, H, D] at positions prefix.., keys/vals [L, KH, D] -> [n, H, D], in float32."""
    group = q.shape[1] // keys.shape[1]
    kf = keys.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vf = vals.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    pos = torch.arange(q.shape[0], device=q.device)[:, None] + prefix
    key_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    hidden = key_pos > pos
    if window:
        hidden = hidden | (key_pos <= pos - window)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, vf).to(q.dtype)


def _window_arg(window: int) -> int:
    """The kernels' window: 0 (no window) becomes one wider than any context."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    return window if window > 0 else 1 << 30


def _strides(q, k, v, out) -> tuple[int, ...]:
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1))  # fmt: skip


def _check_common(q, k, v, out, req_to_token, *index: torch.Tensor) -> int:
    """Shapes, dtypes, devices and strides shared by both kernels; returns GROUP."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or out.shape != q.shape:
        raise ValueError(
            f"need q/out [T, H, D] and k/v [S, KH, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}"
        )
    if k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"head_dim must match and H % KH == 0: q {q.shape}, k {k.shape}")
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype} k {k.dtype} v {v.dtype} out {out.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("req_to_token", req_to_token)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if req_to_token.dim() != 2 or req_to_token.dtype not in _INDEX_DTYPES:
        raise ValueError("req_to_token must be a 2-D int32/int64 tensor")
    for t in index:
        if t.dim() != 1 or t.shape != index[0].shape or t.dtype not in _INDEX_DTYPES:
            raise ValueError("index vectors must be 1-D int32/int64 of one length")
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"index vectors must be contiguous on {q.device}")
    return q.shape[1] // k.shape[1]
