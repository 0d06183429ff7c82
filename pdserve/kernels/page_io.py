"""KV pages in and out of a CPU pool's pages, with block hashes: one interface, two
implementations, chosen once when an engine is built (`page_io`).

    block_hashes(segments, block)                       -> each `block` bytes' XXH3-64
    gather_runs(src, tpages, P, t0, runs, frames, block) -> the frames' block hashes
    writer(kinds, P).scatter(kind, layers, tpages, t0, runs, srcs, hashes, block) -> bool

kernels/native/page_copy.py's docstring defines the three (pool layout, positions,
runs, frames). `NativePages` runs them in C on the engine's kernel threads, each block
hashed while it is in the core's cache; `PortablePages` in numpy and the xxhash
package, for a machine without a C compiler (or --disable-compile). Both give the same
bytes and hashes and refuse the same chunks (ValueError: positions or pages out of
range, frames of the wrong size); where a block does not match its hash the portable
writer writes nothing of the chunk, the native one stops each layer at that block:
either way False, and the caller fails the transfer.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from pdserve.kernels.native.page_copy import PageCopy, page_copy


class Writer(Protocol):
    def scatter(
        self,
        kind: int,
        layers: tuple[int, int],
        tpages: np.ndarray,
        t0: int,
        runs: list[int],
        srcs: list[memoryview],
        hashes: bytes,
        block: int,
    ) -> bool: ...


class PageIO(Protocol):
    def block_hashes(self, segments: Sequence[Any], block: int) -> bytes: ...

    def gather_runs(
        self,
        src: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        frames: list[Any],
        block: int,
    ) -> bytes: ...

    def writer(self, kinds: tuple[np.ndarray, np.ndarray], page_size: int) -> Writer: ...


def page_io(cache_dir: Path | None, kernel_threads: Callable[[], int] | None = None) -> PageIO:
    """The native implementation where it builds (`cache_dir` given, a C compiler),
    its work on `kernel_threads` threads (par.Split); else the portable one."""
    copy = None if cache_dir is None else page_copy(cache_dir, True, kernel_threads=kernel_threads)
    return PORTABLE if copy is None else NativePages(copy)


class PortablePages:
    def block_hashes(self, segments: Sequence[Any], block: int) -> bytes:
        out = []
        for seg in segments:
            view = memoryview(seg).cast("B")
            out += [xxhash.xxh3_64_intdigest(view[at : at + block])
                    for at in range(0, view.nbytes, block)]  # fmt: skip
        return struct.pack(f"<{len(out)}Q", *out)

    def gather_runs(
        self,
        src: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        frames: list[Any],
        block: int,
    ) -> bytes:
        rows = _rows_of(src, page_size)
        places = _places(tpages, page_size, t0, runs, src.shape[1])
        if len(frames) != rows.shape[0] * len(runs):
            raise ValueError(f"page_io: {len(frames)} frames for {len(runs)} runs")
        for i, frame in enumerate(frames):
            layer, run = divmod(i, len(runs))
            pages, at = places[run]
            out = _frame(frame, len(pages), rows.shape[3], writable=True)
            out[:] = rows[layer, pages, at]
        return self.block_hashes(frames, block)

    def writer(self, kinds: tuple[np.ndarray, np.ndarray], page_size: int) -> Writer:
        return _PortableWriter(self, kinds, page_size)


class _PortableWriter:
    def __init__(
        self, io: PortablePages, kinds: tuple[np.ndarray, np.ndarray], page_size: int
    ) -> None:
        self._io, self._page_size = io, page_size
        self._rows = [_rows_of(k, page_size) for k in kinds]
        if not all(k.flags.writeable for k in kinds):
            raise ValueError("page_io: the pool is read-only")

    def scatter(
        self,
        kind: int,
        layers: tuple[int, int],
        tpages: np.ndarray,
        t0: int,
        runs: list[int],
        srcs: list[memoryview],
        hashes: bytes,
        block: int,
    ) -> bool:
        rows, (lo, hi) = self._rows[kind], layers
        if not 0 <= lo < hi <= rows.shape[0] or len(srcs) != (hi - lo) * len(runs):
            raise ValueError(f"page_io: layers [{lo}, {hi}), {len(srcs)} frames, runs {runs[:4]}")
        places = _places(tpages, self._page_size, t0, runs, rows.shape[1])
        sources = [
            _frame(s, len(places[i % len(runs)][0]), rows.shape[3]) for i, s in enumerate(srcs)
        ]
        if self._io.block_hashes(srcs, block) != hashes:
            return False
        for i, source in enumerate(sources):
            pages, at = places[i % len(runs)]
            rows[lo + i // len(runs), pages, at] = source
        return True


def _rows_of(pool: np.ndarray, page_size: int) -> np.ndarray:
    """A pool's K or V, uint8 [L, pages, page bytes], as [L, pages, P, row bytes]."""
    ok = pool.dtype == np.uint8 and pool.ndim == 3 and page_size > 0
    if not ok or pool.shape[2] % page_size:
        raise ValueError(f"page_io: {pool.dtype} {pool.shape} pool, P {page_size}")
    shape = (*pool.shape[:2], page_size, pool.shape[2] // page_size)
    return np.reshape(pool, shape, copy=False)  # raises rather than copy: written through


def _places(
    tpages: np.ndarray, page_size: int, t0: int, runs: list[int], num_pages: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per run, the page and the row in it of each of its positions (t0 onwards)."""
    n = sum(runs)
    if t0 < 0 or min(runs, default=0) < 0 or (t0 + n + page_size - 1) // page_size > len(tpages):
        raise ValueError(f"page_io: positions {t0} + {n} outside the {len(tpages)} pages")
    pos = np.arange(t0, t0 + n)
    pages = np.asarray(tpages, dtype=np.int64)[pos // page_size]
    if n and (pages.min() < 0 or pages.max() >= num_pages):
        raise ValueError(f"page_io: a page outside [0, {num_pages})")
    cuts = np.cumsum([0, *runs])
    at = pos % page_size
    return [(pages[a:b], at[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _frame(buf: Any, n: int, row: int, writable: bool = False) -> np.ndarray:
    """A frame's bytes as [n, row] (no copy); ValueError where it is not that size."""
    view = memoryview(buf).cast("B")
    if view.nbytes != n * row or (writable and view.readonly):
        raise ValueError(f"page_io: a frame of {view.nbytes} bytes for {n} rows of {row}")
    return np.frombuffer(view, dtype=np.uint8).reshape(n, row)


class NativePages:
    """kernels/native/page_copy.py behind the interface; the portable code where the
    xxhash package's library exports no XXH3-64 (PageCopy says None) or a segment is
    not contiguous."""

    def __init__(self, copy: PageCopy) -> None:
        self.copy = copy

    def block_hashes(self, segments: Sequence[Any], block: int) -> bytes:
        hashes = self.copy.block_hashes(segments, block)
        return PORTABLE.block_hashes(segments, block) if hashes is None else hashes

    def gather_runs(
        self,
        src: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        frames: list[Any],
        block: int,
    ) -> bytes:
        hashes = self.copy.gather_runs(src, tpages, page_size, t0, runs, frames, block)
        return PORTABLE.block_hashes(frames, block) if hashes is None else hashes

    def writer(self, kinds: tuple[np.ndarray, np.ndarray], page_size: int) -> Writer:
        native = self.copy.writer(kinds, page_size)
        return PORTABLE.writer(kinds, page_size) if native is None else native


PORTABLE = PortablePages()
