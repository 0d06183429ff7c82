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
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
import zmq

from pdserve.kvcache.pools import KVPool
from pdserve.transfer import stages
from pdserve.transfer.checksum import HASH_BLOCK

if TYPE_CHECKING:
    from pdserve.kernels.page_io import PageIO
    from pdserve.transfer.zmq_io import Tracker

PageViews = tuple[np.ndarray | None, np.ndarray | None]  # a pool's K, V: [L, pages, page bytes]


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
        return buf, _rows(out)  # NOTE: as bytes: numpy has no bfloat16

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


def page_split(idx: np.ndarray, page_size: int) -> tuple[int, np.ndarray] | None:
    """(head, pages): idx[:head] finish a page entered mid-way, idx[head : head + P *
    len(pages)] are the whole pages `pages`, the rest start a page. None if not so."""
    n = len(idx)
    if page_size <= 1 or n == 0:
        return None
    head = min(n, (-int(idx[0])) % page_size)
    m = (n - head) // page_size
    rows = idx[head : head + m * page_size].reshape(m, page_size)
    first = rows[:, 0]
    if (first % page_size).any() or (rows != first[:, None] + np.arange(page_size)).any():
        return None
    return head, first // page_size


def request_pages(slots: np.ndarray, page_size: int) -> np.ndarray | None:
    """int64 `pages` with slots[i] == pages[i // P] * P + i % P for every position i (a
    request's slots as the pool hands them out: whole pages, the last one maybe in
    part), or None if they are not so."""
    n = len(slots)
    if n == 0 or page_size < 1:
        return None
    # NOTE: few numpy calls: the decode arms each transfer with this, mostly cold
    first = slots[::page_size]
    pages, off = np.divmod(first, page_size)
    if off.any() or not (slots == (first[:, None] + np.arange(page_size)).ravel()[:n]).all():
        return None
    return pages.astype(np.int64, copy=False)


def paged_view(pool: torch.Tensor, page_size: int) -> np.ndarray | None:
    """A CPU pool's K or V [L, S, ...] as uint8 [L, S / P, page bytes] sharing memory,
    or None where it cannot be (on a GPU, S not a multiple of P)."""
    if pool.is_cuda or pool.shape[1] % page_size or not pool.is_contiguous():
        return None
    return _np_pages(_rows(pool), page_size)


def _rows(t: torch.Tensor) -> np.ndarray:
    """[L, S, ...] (contiguous rows) as a uint8 array [L, S, row bytes] sharing memory."""
    return t.view(t.shape[0], t.shape[1], -1).view(torch.uint8).numpy()


def _np_pages(rows: np.ndarray, page_size: int) -> np.ndarray:
    """[L, S, R] viewed as [L, S / P, P * R]; raises rather than copy."""
    return np.reshape(rows, (rows.shape[0], -1, page_size * rows.shape[2]), copy=False)


def _pieces(
    idx: np.ndarray, page_size: int, num_slots: int
) -> tuple[slice, np.ndarray, list[slice]]:
    """(whole-page positions, their pages, the other positions as slices)."""
    split = page_split(idx, page_size) if num_slots % max(page_size, 1) == 0 else None
    if split is None:
        return slice(0, 0), idx[:0], [slice(0, len(idx))]
    head, pages = split
    mid = slice(head, head + len(pages) * page_size)
    return mid, pages, [slice(0, head), slice(mid.stop, len(idx))]


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, page_size: int) -> None:
    """out[:, i] = src[:, idx[i]] (CPU). out: contiguous [L, len(idx), ...]."""
    mid, pages, rest = _pieces(idx.numpy(), page_size, src.shape[1])
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


def scatter_rows(
    dst: torch.Tensor,
    idx: torch.Tensor,
    frame: np.ndarray,
    page_size: int,
) -> None:
    """dst[:, idx[i]] = frame[:, i] (CPU). frame: uint8 [L, len(idx), row bytes], e.g. a
    view over a received ZeroMQ frame (read straight from it, no intermediate copy):
    scatter_runs with one run, each layer's rows a frame."""
    scatter_runs(dst, idx, [len(idx)], list(frame), page_size)


def scatter_runs(
    dst: torch.Tensor,
    idx: torch.Tensor,
    runs: list[int],
    frames: list,
    page_size: int,
) -> None:
    """dst[:, idx] = the frames' rows, from frames sent in place (messages.KVChunk.runs):
    frames[layer * len(runs) + r] holds run r's tokens of that layer (runs split idx in
    order), read straight from their buffers, whole pages by numpy's assignment (the
    receiver's native path is kernels/native/page_copy.py scatter_runs, transfer/validate.py)."""
    rows, slots, off = _rows(dst), idx.numpy(), 0
    for r, count in enumerate(runs):
        part = slots[off : off + count]
        mid, pages, rest = _pieces(part, page_size, dst.shape[1])
        per_layer = [
            np.frombuffer(frames[layer * len(runs) + r], dtype=np.uint8).reshape(count, -1)
            for layer in range(rows.shape[0])
        ]
        if len(pages):
            to = _np_pages(rows, page_size)
            srcs = [f[mid].reshape(len(pages), -1) for f in per_layer]  # raises rather than copy
            for layer, src in enumerate(srcs):
                to[layer, pages] = src
        for piece in rest:
            if piece.start < piece.stop:
                for layer, f in enumerate(per_layer):
                    rows[layer, part[piece]] = f[piece]
        off += count


def pool_views(pool: KVPool) -> PageViews:
    """`pool`'s K and V as pages (paged_view), made now."""
    size = pool.layout.page_size
    return paged_view(pool.k, size), paged_view(pool.v, size)


class PoolPages:
    """Each pool's K and V as pages (paged_view), made once per pool (about 20 us, the
    largest part of a transfer's set-up) and reused while its tensors are the same.
    One per receiver or sender, used by its I/O thread."""

    def __init__(self) -> None:
        self._seen: weakref.WeakKeyDictionary[KVPool, tuple] = weakref.WeakKeyDictionary()

    def of(self, pool: KVPool) -> PageViews:
        hit = self._seen.get(pool)
        if hit is None or hit[0] is not pool.k or hit[1] is not pool.v:
            hit = (pool.k, pool.v, pool_views(pool))
            self._seen[pool] = hit
        return hit[2]
