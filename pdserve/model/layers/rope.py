"""Rotary position embeddings (rotate-half layout, as Llama checkpoints expect).

The angles of each scaling (layers/rope_scaling.py) are tabled once per position; where
`rotary_dim` < head_dim (Phi-3's partial_rotary_factor) only a head's first rotary_dim
values turn and the rest pass through."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.rope_scaling import angles, sequence_angles, switch_length


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
        self.dim = head_dim if rotary_dim is None else rotary_dim
        self.theta, self.scaling, self.dtype, self.device = theta, scaling, dtype, device
        self.switch = switch_length(scaling)  # longrope / dynamic: see tables()
        freqs, self.factor = angles(self.dim, max_positions, theta, scaling)
        self.cos, self.sin_signed = self._cos_sin(freqs)

    def _cos_sin(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.factor).to(dtype=self.dtype, device=self.device)
        # sin with its first half negated: rotate_half(x) * sin, with rotate_half(x) =
        # cat(-x2, x1), equals roll(x, D/2) * sin_signed bit for bit (negation is exact),
        # in one roll instead of two slices, a negation and a cat
        half = self.dim // 2
        sin = (emb.sin() * self.factor).to(dtype=self.dtype, device=self.device)
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def tables(
        self, positions: torch.Tensor, batch: ForwardBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) at `positions` [T], shaped [T, 1, D]: gathered once per
        forward and shared by every layer. Under longrope / dynamic an extend request
        whose length after `batch` passes the switch turns all its tokens by that
        length's frequencies (transformers' per-forward rule; rope_scaling.py)."""
        cos, sin = self.cos[positions], self.sin_signed[positions]
        if self.switch is not None and batch is not None and not batch.is_decode:
            cos, sin = self._long_requests(batch, cos, sin)
        return cos[:, None, :], sin[:, None, :]

    def _long_requests(
        self, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.switch is not None and self.scaling is not None
        start, cos, sin = 0, cos.clone(), sin.clone()
        lens = batch.rope_lens or batch.seq_lens
        for seq_len, rope_len, n in zip(batch.seq_lens, lens, batch.extend_lens, strict=True):
            if rope_len > self.switch:
                pos = torch.arange(seq_len - n, seq_len)
                freqs = sequence_angles(self.dim, self.theta, self.scaling, rope_len, pos)
                cos[start : start + n], sin[start : start + n] = self._cos_sin(freqs)
            start += n
        return cos, sin


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by the (cos, sin_signed) tables of its positions; tables
    narrower than D turn the first values of each head only."""
    cos, sin_signed = tables
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([rotate(x[..., :rd], tables), x[..., rd:]], dim=-1)
    return x * cos + torch.roll(x, rd // 2, dims=-1) * sin_signed
