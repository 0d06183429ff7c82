"""Decode attention on CPU: one query token per request against its KV in the paged pool.

Two forms of the same arithmetic (per request b, KV head g, query head j of the group):

    scores[b, l] = scale * q[b, g, j] . K[slots[b, l], g]      (-inf where hidden[b, l])
    out[b, g, j] = sum_l softmax(scores[b])[l] * V[slots[b, l], g]

- `gathered`: eager. Copies K and V of every key out of the pool ([B, L, KH, D]) and
  runs two batched matmuls. Each layer of each step pays that copy.
- `in_place`: the same sums written as broadcast products and reductions, compiled by
  inductor (torch.compile, dynamic shapes) into loops that load K and V through
  `slots` straight from the pool: no gathered copy, no [B, L, KH, G, D] temporary.
  Shapes (B, L) are dynamic, so one compiled kernel serves every step; inductor's
  FX graph cache keeps it on disk (under the pdserve cache dir) across restarts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def gathered(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; kc, vc [S, KH, D] (one layer's pool); slots, hidden [B, L] -> [B, H, D]."""
    b, h, d = q.shape
    kh = kc.shape[1]
    keys = kc[slots].permute(0, 2, 3, 1)  # [B, KH, D, L]
    vals = vc[slots].transpose(1, 2)  # [B, KH, L, D]
    qg = q.view(b, kh, h // kh, d)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys) * scale  # [B, KH, G, L]
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, vals).reshape(b, h, d)


def in_place(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As `gathered`; meant to run compiled (eager it materialises [B, L, KH, G, D])."""
    b, h, d = q.shape
    kh = kc.shape[1]
    qg = q.view(b, 1, kh, h // kh, d)
    scores = (qg * kc[slots][:, :, :, None, :]).sum(-1).float() * scale  # [B, L, KH, G]
    scores = scores.masked_fill(hidden[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1).to(q.dtype)
    out = (probs[..., None] * vc[slots][:, :, :, None, :]).sum(1)  # [B, KH, G, D]
    return out.reshape(b, h, d)


_compiled: DecodeFn | None = None
_lock = threading.Lock()


def compiled_in_place(cache_dir: str | None = None) -> DecodeFn:
    """`in_place` under torch.compile (one per process). `cache_dir`: inductor's on-disk
    cache, used unless TORCHINDUCTOR_CACHE_DIR is set already."""
    global _compiled
    with _lock:
        if _compiled is None:
            if cache_dir is not None:
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
            _compiled = torch.compile(in_place, dynamic=True, fullgraph=True)
        return _compiled


def warm_up(fn: DecodeFn, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> None:
    """Compiles `fn` for the inputs a step gives it, so no step compiles on the forward
    stream. `k`, `v`: the pool [layers, S, KH, D]. As in a step, slots and hidden are made
    outside inference mode (on the schedule side), q and the layer's view of the pool
    inside it; batch 1 and batch >= 2 are distinct cases for dynamic shapes, and a
    decode token always sees >= 2 keys (its prompt's and its own)."""
    d = k.shape[-1]
    for b, length in ((1, 2), (2, 3)):
        slots = torch.zeros(b, length, dtype=torch.int64, device=k.device)
        hidden = torch.zeros(b, length, dtype=torch.bool, device=k.device)
        with torch.inference_mode():  # grad mode is part of the compiled guards
            q = torch.zeros(b, num_heads, d, dtype=k.dtype, device=k.device)
            fn(q, k[0], v[0], slots, hidden, 1.0)
