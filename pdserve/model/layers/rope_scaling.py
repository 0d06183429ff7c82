"""The rotation angles of every position under each rope scaling, as transformers 5
computes them (modeling_rope_utils), and the factor its cos/sin tables are scaled by.

    default, linear, llama3   one inverse-frequency vector for every position
    yarn                      one vector (the paper's ramp between interpolated and
                              extrapolated frequencies) and cos/sin scaled by the
                              attention factor (`attention_factor`, else from `factor`,
                              `mscale`, `mscale_all_dim`)
    longrope                  `short_factor` at positions < original_max_position_embeddings,
                              `long_factor` from there on; cos/sin scaled as yarn
    dynamic                   the default vector below max_position_embeddings; at p past
                              it, NTK's base for a sequence of p + 1 tokens

transformers switches longrope's and dynamic's frequencies per forward, by its sequence
length (the longest position + 1): a generation step at p turns position p by the vector
of a sequence of p + 1 tokens and keeps the keys cached before; a prompt longer than the
switch turns all its positions by its length's vector. pdserve applies that rule per
request: the table per position (`angles`) is what a generation step uses, and an
extend of a request whose length passes the switch takes `sequence_angles` of that
length (layers/rope.py). A prompt prefilled in chunks takes its whole length in every
chunk, and a prompt past the switch neither takes nor leaves prefix-cache pages (its keys
are turned by its own length's frequencies: scheduler/prefill.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_base(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    """theta ** -(2i / dim) for i < dim / 2, in float32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def angles(
    dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(freqs [max_positions, dim / 2] = position * inverse frequency, attention factor);
    `dim`: the rotated dimensions of a head."""
    kind = "default" if not scaling else scaling["rope_type"]
    pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
    if kind == "yarn":
        inv, factor = _yarn(dim, theta, scaling or {})
        return pos * inv[None, :], factor
    if kind == "longrope":
        return _longrope(dim, max_positions, theta, scaling or {})
    if kind == "dynamic":
        return _dynamic(dim, max_positions, theta, scaling or {}), 1.0
    inv = inv_base(dim, theta)
    if kind == "llama3":
        inv = _llama3(inv, scaling or {})
    elif kind == "linear":
        inv = inv / float((scaling or {})["factor"])
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return pos * inv[None, :], 1.0


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: dict[str, Any]) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim))
    return yarn_mscale(factor)


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Frequencies below the band [low, high] of dimensions are interpolated (divided by
    `factor`), those above it kept, a linear ramp between."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, yarn_attention_factor(s)


def longrope_attention_factor(s: dict[str, Any]) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    factor = s.get("factor")
    factor = float(s["max_position_embeddings"]) / old_ctx if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))


def switch_length(scaling: dict[str, Any] | None) -> int | None:
    """The sequence length past which longrope / dynamic change their frequencies."""
    kind = None if not scaling else scaling["rope_type"]
    if kind == "longrope":
        return int(scaling["original_max_position_embeddings"])  # type: ignore[index]
    if kind == "dynamic":
        return int(scaling["max_position_embeddings"])  # type: ignore[index]
    return None


def _longrope_inv(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def _dynamic_inv(dim: int, theta: float, s: dict[str, Any], seq_len: int) -> torch.Tensor:
    """NTK's frequencies for a sequence of `seq_len` tokens, the base computed in float32
    tensors as transformers computes it."""
    factor, old_ctx = float(s["factor"]), int(s["max_position_embeddings"])
    seq = torch.tensor(max(seq_len, old_ctx))
    return inv_base(dim, theta * ((factor * seq / old_ctx) - (factor - 1)) ** (dim / (dim - 2)))


def sequence_angles(
    dim: int, theta: float, scaling: dict[str, Any], seq_len: int, positions: torch.Tensor
) -> torch.Tensor:
    """freqs [len(positions), dim / 2] as a forward over a sequence of `seq_len` tokens
    past the switch turns `positions` (float32)."""
    if scaling["rope_type"] == "longrope":
        inv = _longrope_inv(dim, theta, scaling["long_factor"])
    else:
        inv = _dynamic_inv(dim, theta, scaling, seq_len)
    return positions.float()[:, None] * inv[None, :]


def _longrope(
    dim: int, max_positions: int, theta: float, s: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    short = _longrope_inv(dim, theta, s["short_factor"])
    pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
    freqs = pos * short[None, :]
    old_ctx = int(s["original_max_position_embeddings"])
    freqs[old_ctx:] = sequence_angles(dim, theta, s, old_ctx + 1, pos[old_ctx:, 0])
    return freqs, longrope_attention_factor(s)


def _dynamic(dim: int, max_positions: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """At p < max_position_embeddings the default frequencies; at p past it those of a
    sequence of p + 1 tokens."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_base(dim, theta)
    for p in range(int(s["max_position_embeddings"]), max_positions):
        freqs[p] = sequence_angles(dim, theta, s, p + 1, torch.tensor([p]))[0]
    return freqs
