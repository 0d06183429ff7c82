"""Request rows and the paged KV cache.

    req_to_token[rows, max_context]  int32   position -> KV slot
    row 0 ............ padding (never handed out; padded batch entries point here)
    rows 1..R-1 ...... requests

    KV pool, per layer:  k[layer][slot, kv_heads, head_dim], v likewise
    slot = page * page_size + offset
    page 0 ........... padding (absorbs writes of padded positions)
    pages 1..P-1 ..... handed out by PageAllocator

Accounting is exact: after every request has ended, `free_rows == total_rows`
and `free_pages == total_pages`. A double free or a free of something never
handed out raises at once, because silently "fixing" it hides a use-after-free.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pdserve.kvcache.page_runs import PageRuns


class PoolError(RuntimeError):
    """Misuse of a pool: double free, foreign id, or exhaustion where it must not happen."""


class _FreeList:
    """Ids 1..n-1 (id 0 is reserved), LIFO (a just-freed row is the next one handed
    out: the row-reuse race of docs/architecture.md §3 happens at once); a set tracks
    what is out."""

    def __init__(self, n: int, what: str) -> None:
        self.what = what
        self.total = n - 1
        self._free = list(range(n - 1, 0, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def alloc(self, k: int) -> list[int] | None:
        with self._lock:
            if k > len(self._free):
                return None
            out = [self._free.pop() for _ in range(k)]
            self._used.update(out)
            return out

    def free(self, ids: list[int]) -> None:
        with self._lock:
            if len(set(ids)) != len(ids):
                raise PoolError(f"{self.what}s freed twice in one call: {sorted(ids)}")
            for i in ids:
                if i not in self._used:
                    raise PoolError(f"free of {self.what} {i} that is not allocated")
            for i in reversed(ids):  # NOTE: after the checks: a bad free changes nothing
                self._used.remove(i)
                self._free.append(i)

    @property
    def available(self) -> int:
        return len(self._free)


class ReqToTokenPool:
    """Request rows. `handouts[row]` counts how often a row was handed out (stats and
    tests read it to see rows being reused); nothing uses it for correctness."""

    def __init__(self, rows: int, max_context: int, device: str = "cpu") -> None:
        self.max_context = max_context
        self.req_to_token = torch.zeros(rows, max_context, dtype=torch.int32, device=device)
        self.handouts = [0] * rows
        self._rows = _FreeList(rows, "row")

    def alloc(self) -> int | None:
        got = self._rows.alloc(1)
        if got is None:
            return None
        self.handouts[got[0]] += 1
        return got[0]

    def free(self, row: int) -> None:
        self._rows.free([row])

    @property
    def free_rows(self) -> int:
        return self._rows.available

    @property
    def total_rows(self) -> int:
        return self._rows.total


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._pages = PageRuns(num_pages, PoolError)  # in runs: kvcache/page_runs.py

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int] | None:
        """All `num_pages` or nothing (None)."""
        return self._pages.alloc(num_pages)

    def free(self, pages: list[int]) -> None:
        self._pages.free(pages)

    @property
    def free_pages(self) -> int:
        return self._pages.available

    @property
    def total_pages(self) -> int:
        return self._pages.total


def slots_of(pages: list[int], num_tokens: int, page_size: int) -> torch.Tensor:
    """KV slots of positions 0..num_tokens-1 for a request owning `pages` in order."""
    p = torch.tensor(pages, dtype=torch.int64)
    slots = (p[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return slots[:num_tokens]


@dataclass(frozen=True)
class KVLayout:
    """Everything two pools must agree on to exchange KV bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    page_size: int

    def fingerprint(self) -> str:
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}-P{self.page_size}"

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of K (or of V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize


class KVPool:
    """Per-layer K and V tensors over slots, plus the page allocator."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu") -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.allocator = PageAllocator(num_pages, layout.page_size)
        num_slots = num_pages * layout.page_size
        dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, num_slots, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
