"""A prefill/decode pair on loopback without a model: random KV pools, page
reservations on each side, and helpers that drive one transfer. Used by the
transfer tests and benchmarks/kv_transfer.py."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import TransferConfig
from pdserve.kvcache.pools import KVLayout, KVPool, slots_of
from pdserve.transfer.base import KVTicket, Ticket


def transfer_settings(**fields: Any) -> TransferConfig:
    """A KVSender's or KVReceiver's settings on loopback: the bootstrap socket on any
    free port, `fields` (TransferConfig's) as given, the rest its defaults."""
    return TransferConfig(**{"bootstrap_port": 0, **fields})


def random_pool(layout: KVLayout, num_tokens: int, seed: int, device: str = "cpu") -> KVPool:
    """A pool with room for `num_tokens` (+ padding page), filled with random values
    (drawn on the CPU: the same seed gives the same pool on every device)."""
    pool = KVPool(layout, -(-num_tokens // layout.page_size) + 1, device)
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen).to(pool.k.dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen).to(pool.v.dtype))
    return pool


def reserve(
    pool: KVPool, num_tokens: int, seed: int, shuffle: bool = True
) -> tuple[list[int], torch.Tensor]:
    """Pages for `num_tokens` in a shuffled (non-contiguous) order, or with `shuffle`
    False in the allocator's own order, and their slots."""
    pages = pool.allocator.alloc(pool.allocator.pages_for(num_tokens))
    assert pages is not None, "pool too small"
    if shuffle:
        random.Random(seed).shuffle(pages)
    return pages, slots_of(pages, num_tokens, pool.page_size)


def make_req(rid: str, room: int, prompt_len: int, bootstrap_port: int) -> KVTicket:
    return KVTicket(rid, room, prompt_len, "127.0.0.1", bootstrap_port)


def gather(pool: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots` in position order: [L, n, H, D] each."""
    return pool.k[:, slots].clone(), pool.v[:, slots].clone()


def wait_for(poll: Callable[[], list], n: int = 1, timeout_s: float = 10.0) -> list:
    """Poll until `n` events arrived (or the timeout passed); returns what arrived."""
    out: list = []
    end = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < end:
        out += poll()
        if len(out) < n:
            time.sleep(0.002)
    return out


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


@dataclass
class Side:
    """One side of a transfer: its pool, the request's pages and slots."""

    pool: KVPool
    pages: list[int]
    slots: torch.Tensor


def push_prompt(sink, req: Ticket, side: Side, chunk: int, first_token: int = 7) -> None:
    """Drive a KVSink like a chunked prefill would: admit, chunks of `chunk` tokens, done."""
    sink.on_admit(req)
    for start in range(0, req.prompt_len, chunk):
        sink.on_chunk(req, side.pool, side.slots, start, min(req.prompt_len, start + chunk))
    sink.on_done(req, first_token, -0.5)
