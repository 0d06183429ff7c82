"""Decode attention on CPU: one query token per request against its KV in the paged pool.

Per request b, KV head g, query head j of the group:

    scores[b, l] = scale * q[b, g, j] . K[slots[b, l], g]      (-inf where hidden[b, l])
    out[b, g, j] = sum_l softmax(scores[b])[l] * V[slots[b, l], g]

Two implementations of it:
- `native` (kernels/native/paged_decode.c, through kernels.native): reads K and V
  through `slots` straight from the pool, each row once for all query heads of its
  group, with an online softmax; fp32; built with the machine's C compiler at the
  decode's start-up. Keys are the positions in [start, len) of `bounds(window)`.
- `gathered`: portable torch. Copies K and V of every key out of the pool
  ([B, L, KH, D]) and runs two batched matmuls; each layer of each step pays that copy.
  Used for other dtypes, with --disable-compile, and where no C compiler is found.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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
