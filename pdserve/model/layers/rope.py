"""Rotary position embeddings (rotate-half layout, as Llama checkpoints expect)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3(inv, scaling)
    if kind == "linear":
        return inv / float(scaling["factor"])
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3 frequency-dependent scaling: long wavelengths are divided by `factor`,
    short ones kept, and the band between them interpolated smoothly."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), computed once in float32."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # sin with its first half negated: rotate_half(x) * sin, with rotate_half(x) =
        # cat(-x2, x1), equals roll(x, D/2) * sin_signed bit for bit (negation is exact),
        # in one roll instead of two slices, a negation and a cat
        half, sin = head_dim // 2, emb.sin().to(dtype=dtype, device=device)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) at `positions` [T], shaped [T, 1, D]: gathered once per
        forward and shared by every layer."""
        return self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by the (cos, sin_signed) tables of its positions."""
    cos, sin_signed = tables
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
