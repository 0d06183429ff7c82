"""Reusable host staging buffers for outgoing KV frames, and the gather of pool slots
into a frame (rows a page at a time where they can: transfer/pages.py).

A buffer is handed to ZeroMQ zero-copy; it is reused only after every message
that referenced it reports done through its MessageTracker. Reuse matters: a
fresh 10 MB allocation page-faults on first touch, which costs more than the copy.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import zmq

from pdserve.transfer import stages
from pdserve.transfer.checksum import HASH_BLOCK
from pdserve.transfer.pages import byte_rows, pieces

if TYPE_CHECKING:
    from pdserve.kernels.page_io import PageIO
    from pdserve.transfer.zmq_io import Tracker


class StagingPool:
    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        pin: bool = False,
        max_busy: int = 8,
        page_size: int = 1,
    ) -> None:
        self.numel = numel
        self.page_size = page_size
        self.max_busy = max_busy
        self.dtype = dtype
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, list[Tracker]]] = []

    def gather(self, src: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """Copy src[:, idx] ([L, n, ...] with idx over dim 1) into a staging buffer.

        Returns (buffer, uint8 numpy view of the gathered bytes). Precondition: the result
        fits (L * n * row elements <= numel); call `hold` once the view is sent.
        """
        with stages.timed("send"):  # NOTE: waits here when every buffer is still in flight
            buf = self._take()
        t0 = time.perf_counter()
        shape = (src.shape[0], len(idx), *src.shape[2:])
        n = int(np.prod(shape))
        out = buf[:n].view(shape)
        if src.is_cuda:
            out.copy_(src.index_select(1, idx))
        else:
            gather_rows(src, idx, out, self.page_size)
        stages.add("gather", time.perf_counter() - t0)
        return buf, byte_rows(out)  # NOTE: as bytes: numpy has no bfloat16

    def gather_pages(
        self, src: np.ndarray, tpages: np.ndarray, t0: int, n: int, pages: PageIO
    ) -> tuple[torch.Tensor, np.ndarray, bytes]:
        """Copy positions t0 .. t0 + n - 1 of `src` (a CPU pool's K or V as pages,
        paged_view; position p in page tpages[p // page_size]) into a staging buffer,
        layer after layer, each layer hashed as soon as it is filled (pages.gather_runs,
        natively on the kernel threads). Returns (buffer, the bytes as [layers, n * row
        bytes], their block hashes); the hash counts as part of the gather. Same
        precondition as `gather`."""
        with stages.timed("send"):  # NOTE: waits here when every buffer is still in flight
            buf = self._take()
        t0_s = time.perf_counter()
        layers, row = src.shape[0], src.shape[2] // self.page_size
        out = buf.view(torch.uint8)[: layers * n * row].numpy().reshape(layers, n * row)
        hashes = pages.gather_runs(src, tpages, self.page_size, t0, [n], list(out), HASH_BLOCK)
        stages.add("gather", time.perf_counter() - t0_s)
        return buf, out, hashes

    def hold(self, buf: torch.Tensor, trackers: list[Tracker]) -> None:
        """`buf` is in flight until every tracker is done."""
        self._busy.append((buf, trackers))

    def _take(self) -> torch.Tensor:
        self._reclaim()
        if not self._free and len(self._busy) >= self.max_busy:
            # backpressure: bounded wait for the oldest frame (a dead peer never finishes)
            for t in self._busy[0][1]:
                try:
                    t.wait(timeout=0.05)
                except zmq.NotDone:
                    break
            self._reclaim()
        if self._free:
            return self._free.pop()
        return torch.empty(self.numel, dtype=self.dtype, pin_memory=self.pin)

    def _reclaim(self) -> None:
        still = []
        for buf, trackers in self._busy:
            if all(t.done for t in trackers):
                self._free.append(buf)
            else:
                still.append((buf, trackers))
        self._busy = still


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, page_size: int) -> None:
    """out[:, i] = src[:, idx[i]] (CPU). out: contiguous [L, len(idx), ...]."""
    mid, pages, rest = pieces(idx.numpy(), page_size, src.shape[1])
    if len(pages):
        paged = out[:, mid].view(out.shape[0], len(pages), -1)  # raises rather than copy
        src_pages, page_t = src.view(src.shape[0], -1, paged.shape[2]), torch.from_numpy(pages)
        if paged.is_contiguous():  # the usual case: the piece starts and ends on pages
            torch.index_select(src_pages, 1, page_t, out=paged)
        else:
            paged.copy_(src_pages.index_select(1, page_t))
    for part in rest:
        if part.start < part.stop:
            out[:, part] = src.index_select(1, idx[part])
