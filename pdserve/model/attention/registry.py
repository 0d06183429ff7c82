"""Attention backends by name. Each backend module knows only the shared interface
(`attention.AttentionBackend`); this registry knows every backend, nothing imports it back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kvcache.pools import KVPool
from pdserve.model.attention.backends import AttentionBackend, TorchAttention
from pdserve.model.attention.triton_backend import TritonAttention

BackendFactory = Callable[[KVPool, torch.Tensor, float, tuple[int, ...]], AttentionBackend]
ATTENTION_BACKENDS: dict[str, BackendFactory] = {"torch": TorchAttention, "triton": TritonAttention}


def make_attention(
    name: str,
    pool: KVPool,
    req_to_token: torch.Tensor,
    scale: float,
    windows: tuple[int, ...] = (),
) -> AttentionBackend:
    """`auto` picks triton on CUDA, torch otherwise (Triton runs interpreted on CPU).
    `windows[layer]`: 0 for full causal attention, W for a sliding window of W keys.
    "torch" is the portable CPU backend; a CPU engine's warm-up moves it onto the native
    kernel where that builds (model/native_kernels.py)."""
    if name == "auto":
        name = "triton" if pool.k.is_cuda else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](pool, req_to_token, scale, windows)
