"""A pool's K and V as pages, and a request's slots as pages: the views both sides read
and write KV through.

A request's slots come in pages (runs of `page_size` consecutive slots starting at a
multiple of page_size), so rows move a page at a time when they can:

    pool   [L, S, H, D]        viewed as [L, S / P, P * H * D]   (one row = one page)
    frame  [L, n, H, D]        viewed as [L, n / P, P * H * D]
    slots  [p0*P .. p0*P+P-1, p1*P .. ]  ->  pages [p0, p1, ...]

Any other slot list (a partial last page, a page entered mid-way) moves row by row.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from pdserve.kvcache.pools import KVPool

PageViews = tuple[np.ndarray | None, np.ndarray | None]  # a pool's K, V: [L, pages, page bytes]


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
    return np_pages(byte_rows(pool), page_size)


def byte_rows(t: torch.Tensor) -> np.ndarray:
    """[L, S, ...] (contiguous rows) as a uint8 array [L, S, row bytes] sharing memory."""
    return t.view(t.shape[0], t.shape[1], -1).view(torch.uint8).numpy()


def np_pages(rows: np.ndarray, page_size: int) -> np.ndarray:
    """[L, S, R] viewed as [L, S / P, P * R]; raises rather than copy."""
    return np.reshape(rows, (rows.shape[0], -1, page_size * rows.shape[2]), copy=False)


def pieces(
    idx: np.ndarray, page_size: int, num_slots: int
) -> tuple[slice, np.ndarray, list[slice]]:
    """(whole-page positions, their pages, the other positions as slices)."""
    split = page_split(idx, page_size) if num_slots % max(page_size, 1) == 0 else None
    if split is None:
        return slice(0, 0), idx[:0], [slice(0, len(idx))]
    head, pages = split
    mid = slice(head, head + len(pages) * page_size)
    return mid, pages, [slice(0, head), slice(mid.stop, len(idx))]


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
