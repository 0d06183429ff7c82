"""The decode's state of one transfer: its reservation, what has arrived, and where its
rows go.

Coverage map (1 = received), per kind:
    cov[kind, layer, token]    kind 0 = K, 1 = V;  layer in [0, L);  token in [0, prompt_len)
KVDone is accepted only when every cell is exactly 1 (each written exactly once: a chunk
overlapping cells already received is refused before writing, validate.py).

Where the request's slots are whole pages in prompt order (as the decode's allocator
hands them out) and the pool is on the CPU, `paged` says where each position's row goes,
found once per transfer (`arm`: on the I/O thread right after the Ready is sent, while
the prefill's answer is on its way); elsewhere it is None and chunks are written row by
row (writer.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property

import msgspec
import numpy as np
import torch

from pdserve.kernels.page_io import Writer
from pdserve.kvcache.pools import KVPool
from pdserve.transfer.base import Ticket
from pdserve.transfer.messages import KVChunk, Ready
from pdserve.transfer.pages import PageViews, pool_views, request_pages


@dataclass
class Paged:
    """Where a transfer's rows go: position p to row p % P of page pages[p // P]."""

    kinds: tuple[np.ndarray, np.ndarray]  # the pool's K, V: uint8 [L, num_pages, page bytes]
    pages: np.ndarray  # int64, the request's pages in prompt order
    page_size: int
    writer: Writer | None = None  # into `kinds`, where the transfer was armed with one


@dataclass(eq=False)
class Transfer:
    req: Ticket
    pool: KVPool
    slots: torch.Tensor  # int64 on the pool's device, len == prompt_len
    session: int
    endpoint: str  # the prefill's bootstrap endpoint
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: bool = True  # guarded by lock: False once terminal; no write after that
    started: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (index, checksum) written
    claimed: bool = False  # the prefill claimed the room (its Claim, or a chunk came)
    ready: Ready | None = None  # the Ready sent (again, under a new session: `again`)
    previous: int = 0  # the session `again` replaced (its late KVDone gets the Ready again)
    pushes: int = 1  # times the prefill was asked for the KV
    ready_sent: float = 0.0  # when the Ready last went (0: not yet)

    def again(self, session: int) -> Ready:
        """Start over under `session` (the I/O thread, holding `lock` and the receiver's
        lock): nothing received counts any more, chunks of the old session are stale.
        Returns the Ready that asks the prefill for all of the KV again."""
        assert self.ready is not None
        self.previous, self.session = self.session, session
        self.cov[:] = 0
        self.chunks.clear()
        self.pushes += 1
        self.ready = msgspec.structs.replace(self.ready, session=session, again_of=self.previous)
        return self.ready

    # NOTE: cached_property: made once (by `arm` on the I/O thread, not in the engine's
    # expect()), then a plain attribute read for every chunk
    @cached_property
    def cov(self) -> np.ndarray:
        """The coverage map (module docstring)."""
        return np.zeros((2, self.pool.layout.num_layers, self.req.prompt_len), np.uint8)

    @cached_property
    def paged(self) -> Paged | None:
        """Where this request's rows go in the pool's pages; None where chunks go row by
        row (a GPU pool, slots that are not whole pages in prompt order)."""
        return self._find_pages(None)

    def arm(self, views: PageViews | None = None, writer: Writer | None = None) -> None:
        """Make what the first chunk needs (I/O thread, once the Ready is sent: the
        prefill's answer takes longer than this). `views`: the pool's as pages
        (PoolPages.of); `writer`: the receiver's writer into them (writer.PoolWriters)."""
        _ = self.cov
        if "paged" not in self.__dict__:
            self.paged = self._find_pages(views)
        if self.paged is not None:
            self.paged.writer = writer

    def record(self, kinds: tuple[int, ...], h: KVChunk) -> None:
        """Chunk `h` was written whole: mark its cells of each of `kinds` (check_chunk
        found none set) and keep its (index, checksum) for the transfer's digest."""
        for kind in kinds:
            self.cov[kind, h.layer_start : h.layer_end, h.tok_start : h.tok_end] = 1
        self.chunks.append((h.index, h.checksum))

    def _find_pages(self, views: PageViews | None) -> Paged | None:
        page_size = self.pool.layout.page_size
        k, v = views or pool_views(self.pool)
        pages = request_pages(self.slots.numpy(), page_size) if k is not None else None
        if k is None or v is None or pages is None:
            return None
        return Paged((k, v), pages, page_size)
