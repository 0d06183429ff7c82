"""Rotary position embeddings (rotate-half layout, as Llama checkpoints expect).

The angles of each scaling (model/rope_scaling.py) are tabled once per position; where
`rotary_dim` < head_dim (Phi-3's partial_rotary_factor) only a head's first rotary_dim
values turn and the rest pass through."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.model.rope_scaling import angles


class RotaryEmbedding:
    """cos/sin tables [max_positions, rotary_dim] for positions [0, max_positions),
    computed once in float32 and scaled by the scaling's attention factor (yarn, longrope)
    before the cast, as transformers scales them."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: str,
        rotary_dim: int | None = None,
    ) -> None:
        dim = head_dim if rotary_dim is None else rotary_dim
        freqs, factor = angles(dim, max_positions, theta, scaling)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * factor).to(dtype=dtype, device=device)
        # sin with its first half negated: rotate_half(x) * sin, with rotate_half(x) =
        # cat(-x2, x1), equals roll(x, D/2) * sin_signed bit for bit (negation is exact),
        # in one roll instead of two slices, a negation and a cat
        half, sin = dim // 2, (emb.sin() * factor).to(dtype=dtype, device=device)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) at `positions` [T], shaped [T, 1, D]: gathered once per
        forward and shared by every layer."""
        return self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by the (cos, sin_signed) tables of its positions; tables
    narrower than D turn the first values of each head only."""
    cos, sin_signed = tables
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([rotate(x[..., :rd], tables), x[..., rd:]], dim=-1)
    return x * cos + torch.roll(x, rd // 2, dims=-1) * sin_signed
