"""Reusable host staging buffers for outgoing KV frames, and the page-wise copies
between pool slots and a frame.

A buffer is handed to ZeroMQ zero-copy; it is reused only after every message
that referenced it reports done through its MessageTracker. Reuse matters: a
fresh 10 MB allocation page-faults on first touch, which costs more than the copy.

A request's slots come in pages (runs of `page_size` consecutive slots starting at a
multiple of page_size), so rows move a page at a time when they can:

    pool   [L, S, H, D]        viewed as [L, S / P, P * H * D]   (one row = one page)
    frame  [L, n, H, D]        viewed as [L, n / P, P * H * D]
    slots  [p0*P .. p0*P+P-1, p1*P .. ]  ->  pages [p0, p1, ...]

Any other slot list (a partial last page, a page entered mid-way) moves row by row.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import zmq

from pdserve.transfer import stages


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
        self._busy: list[tuple[torch.Tensor, list[zmq.MessageTracker]]] = []

    def gather(self, src: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """Copy src[:, idx] ([L, n, ...] with idx over dim 1) into a staging buffer.

        Returns (buffer, numpy view of the gathered bytes). Precondition: the result
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
        return buf, out.numpy()

    def hold(self, buf: torch.Tensor, trackers: list[zmq.MessageTracker]) -> None:
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


def whole_pages(idx: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """The page numbers if `idx` is whole pages (see the module docstring), else None."""
    n = len(idx)
    if page_size <= 1 or n == 0 or n % page_size:
        return None
    rows = idx.view(-1, page_size)
    first = rows[:, 0]
    step = torch.arange(page_size, device=idx.device, dtype=idx.dtype)
    if bool((first % page_size).any()) or not bool((rows == first[:, None] + step).all()):
        return None
    return first // page_size


def _paged(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """[L, S, H, D] (contiguous rows) viewed as [L, S / P, P * H * D]."""
    return t.view(t.shape[0], t.shape[1] // page_size, -1)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, page_size: int) -> None:
    """out[:, i] = src[:, idx[i]]. out: contiguous [L, len(idx), ...]."""
    pages = whole_pages(idx, page_size) if src.shape[1] % max(page_size, 1) == 0 else None
    if pages is None:
        torch.index_select(src, 1, idx, out=out)
    else:
        torch.index_select(_paged(src, page_size), 1, pages, out=_paged(out, page_size))


def scatter_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, page_size: int) -> None:
    """dst[:, idx[i]] = src[:, i]. src: contiguous [L, len(idx), ...] on dst's device."""
    pages = whole_pages(idx, page_size) if dst.shape[1] % max(page_size, 1) == 0 else None
    if pages is None:
        dst.index_copy_(1, idx, src)
    else:
        _paged(dst, page_size).index_copy_(1, pages, _paged(src, page_size))
