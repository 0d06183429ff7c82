"""kernels/native/page_copy.c: KV pages between a pool and a chunk's frames, both sides.

    scatter_runs(dst, tpages, P, t0, runs, srcs, hashes=None, block=0)  ->  all matched
        dst    uint8 [L, num_pages, page bytes]: the pool's K or V, a page per row
        position p = t0, t0 + 1, ... (runs[0] + runs[1] + ... of them) of layer l:
            row p % P of page tpages[p // P] of dst[l]  =  the next row of
            srcs[l * len(runs) + r] (r: the run p falls in; each a buffer of rows)
        tpages int64: a request's pages in prompt order (page i holds positions
                      i * P .. i * P + P - 1)
        hashes the chunk's block hashes (transfer/checksum.py: each `block` bytes of a
               source): each block is hashed and compared right before it is written,
               while it is in L1, and a layer stops at its first block that does not match
        One call writes a whole received chunk of one kind, pages entered or left
        mid-way included (transfer/receiving/writer.py, through a PageWriter: the same call
        with its C arguments made once per pool, each chunk setting only its own).

    gather_runs(src, tpages, P, t0, runs, frames, block)  ->  the frames' block hashes
        The inverse, on the prefill: a piece's rows out of the request's pages into
        its frames (writable, one per layer and run), each frame hashed while it is
        still in the cache of the core that filled it (transfer/sending/push.py, a piece whose
        pages are scattered over the pool).

    block_hashes(frames, block)  ->  the frames' block hashes (transfer/checksum.py),
        through the xxhash package's own library

All three split their work (layers, frames) over par.c's threads when made with a
Split: as many as the engine's kernels may use (Split.threads: --num-threads, or the
share of a host's cores that kernels/core_share.py gives), as the KVReceiver and the
KVSender do (a call that finds the threads busy with a forward runs on its own thread).
The last chunk's hash and write are the tail of a transfer, after its last byte
arrived. A block is hashed just before it is written, while it is in L1, so the
received bytes are read from memory once instead of twice (hash the chunk, then write).

Non-temporal stores where the CPU has them (page_copy.c says why): the pages written are
not read again soon, so they need not displace the cache, which makes the write faster
than numpy's fancy-index assignment. A request's slots that are not
whole pages in prompt order (never the decode's allocator) go through numpy instead
(transfer/receiving/writer.py). The decode's KVReceiver loads it at start-up (library.load: once per
process), unless --disable-compile. The wrapper checks what
the C code trusts (dtypes, shapes, strides, writability, the hash count); the C code
checks the page numbers before it writes anything.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.kernels.native.abi import HashArgs, PageRuns
from pdserve.kernels.native.library import load
from pdserve.kernels.native.par import Split, Threads, range_fn

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

MAX_RUNS = 64  # runs a KVChunk may name (transfer/receiving/validate.py; a prefill sends at most sending/pieces.MAX_RUNS)


def _paged(a: np.ndarray) -> bool:
    """[L, pages, page bytes] uint8 with contiguous pages (layers at any stride)."""
    return a.dtype == np.uint8 and a.ndim == 3 and a.strides[2] == 1 and a.strides[1] == a.shape[2]


def _address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only (bytes, a view over them) or empty
        return int(np.frombuffer(buf, np.uint8).ctypes.data)


def xxh3_address() -> int | None:
    """The address of XXH3-64 in the xxhash package's own extension library, or None
    where that library does not export it. The `_dispatch` entry picks the CPU's widest
    vector code at run time, as the package's Python API does (the plain entry is the
    library's baseline build: 1.4x slower here on a 4 MiB frame)."""
    import xxhash._xxhash as ext

    try:
        lib = ctypes.CDLL(ext.__file__)
    except OSError:
        return None
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(lib, name, None)
        if fn is not None:
            return ctypes.cast(fn, _ptr).value
    return None


def blocks_of_frames(frames: Sequence[Any], block: int) -> int:
    """How many blocks of `block` bytes `frames` are hashed in (each its own, the last
    one shorter)."""
    return sum(-(-memoryview(f).nbytes // block) for f in frames)


class PageCopy:
    """With `split`: a chunk's layers (scatter, gather), and its frames' hashes, go to
    par.c's threads (as many as Split.threads says, or `threads` where > 0; work taken in
    turns: a thread that is not running is never waited for). The receiver's last chunk
    is hashed and written while the other core idles; with one thread that tail was
    about a fifth of a 1k-token transfer."""

    def __init__(self, lib: ctypes.CDLL, split: Split | None = None, threads: int = 0) -> None:
        self._split, self._threads = split, threads
        self._check = lib.pd_page_runs_check
        self._check.restype, self._check.argtypes = ctypes.c_int, [_ptr]
        self._scatter = range_fn(lib, "pd_page_scatter_layers")
        self._gather = range_fn(lib, "pd_page_gather_layers")
        self._hash_blocks = range_fn(lib, "pd_hash_blocks")
        self._xxh3 = xxh3_address()

    @property
    def verifies(self) -> bool:
        """Whether scatter_runs can check block hashes (XXH3 found in xxhash's library)."""
        return self._xxh3 is not None

    def scatter_runs(
        self,
        dst: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        srcs: list[Any],
        hashes: bytes | None = None,
        block: int = 0,
    ) -> bool:
        """See the module docstring; False if a block did not match its hash (its layer
        written up to that block, the others whole). Checks what the C code trusts: the
        destination's layout, each source's size and contiguity, the hash count; the C
        code checks the positions and pages before it writes anything. With `hashes`, a
        PageWriter made for this one call writes (ValueError without XXH3 in the xxhash
        library: the caller then compares the hashes first, block_hashes giving None)."""
        if hashes is not None:
            writer = self.writer((dst, dst), page_size)
            if writer is None:
                raise ValueError("page_copy: no XXH3-64 in the xxhash library to check hashes")
            views = [memoryview(s) for s in srcs]
            return writer.scatter(0, (0, len(dst)), tpages, t0, runs, views, hashes, block)
        args, _alive = self._page_runs(dst, tpages, page_size, t0, runs, srcs, into_pool=True)
        self._run(self._scatter, args, len(dst))
        return True

    def writer(self, kinds: tuple[np.ndarray, np.ndarray], page_size: int) -> PageWriter | None:
        """The scatter that checks block hashes (the module docstring's scatter_runs with
        hashes) into the pools `kinds` (the K and V of one pool), its C arguments made
        now (PageWriter); None where hashes cannot be checked (XXH3 not found)."""
        if self._xxh3 is None:
            return None
        return PageWriter(self, kinds, page_size)

    def gather_runs(
        self,
        src: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        frames: list[Any],
        block: int,
    ) -> bytes | None:
        """The inverse of scatter_runs: `frames` (writable) filled from `src`'s pages,
        and their block hashes, each `block` bytes hashed as each frame is filled (None
        for `block` 0, or where the xxhash library exports no XXH3-64: the caller hashes
        the frames)."""
        args, _alive = self._page_runs(src, tpages, page_size, t0, runs, frames, into_pool=False)
        hashing = self._xxh3 is not None and block > 0
        out = (ctypes.c_uint64 * (blocks_of_frames(frames, block) if hashing else 0))()
        if hashing:
            args.hashes, args.hash, args.block = ctypes.addressof(out), self._xxh3, block
        self._run(self._gather, args, len(src))
        return bytes(out) if hashing else None

    def _page_runs(
        self,
        pool: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        frames: list[Any],
        into_pool: bool,
    ) -> tuple[PageRuns, tuple]:
        """The C arguments, and the arrays they point into (to be held until the call
        returns), after checking what the C code trusts: the pool's layout, each frame's
        size and contiguity, that what is written (the pool `into_pool`, else the frames)
        is writable, and (in C) the positions and pages."""
        layers, num_pages, pb = pool.shape if pool.ndim == 3 else (0, 0, -1)
        rb = pb // page_size if page_size > 0 and pb % page_size == 0 else -1
        views = [memoryview(f) for f in frames]
        if not (pool.flags.writeable if into_pool else all(not v.readonly for v in views)):
            raise ValueError(f"page_copy: {'the pool is' if into_pool else 'a frame is'} read-only")
        ok = rb > 0 and _paged(pool) and len(views) == layers * len(runs)
        ok = ok and tpages.dtype == np.int64 and tpages.ndim == 1 and tpages.flags.c_contiguous
        ok = ok and all(v.c_contiguous and v.nbytes == c * rb for v, c in zip(views, runs * layers))
        if not ok:
            raise ValueError(
                f"page_copy: {pool.dtype} {pool.shape} {pool.strides} <-> {len(views)} frames"
                f" {[v.nbytes for v in views[:4]]} for runs {runs[:4]} of {layers} layers"
            )
        addrs = (ctypes.c_void_p * len(views))(*map(_address, views))
        counts = (ctypes.c_int64 * len(runs))(*runs)
        args = PageRuns(pool.ctypes.data, pool.strides[0], num_pages, tpages.ctypes.data,
                        len(tpages), page_size, rb, t0, ctypes.addressof(counts), len(runs),
                        ctypes.addressof(addrs), layers, None, None, 0, None)  # fmt: skip
        if not self._check(ctypes.byref(args)):
            raise ValueError(
                f"page_copy: positions {t0} + {sum(runs)} outside the request's"
                f" {len(tpages)} pages, or a page outside [0, {num_pages})"
            )
        return args, (addrs, counts, views)

    def block_hashes(self, frames: Sequence[Any], block: int) -> bytes | None:
        """checksum.block_hashes of `frames` (each `block` bytes of each hashed), on this
        kernel's threads; None where the xxhash library exports no XXH3-64 or a frame is
        not contiguous (the caller then hashes in Python)."""
        if self._xxh3 is None:
            return None
        views = [memoryview(f) for f in frames]
        if not all(v.c_contiguous for v in views):
            return None
        n, sizes = len(views), [v.nbytes for v in views]
        first = np.cumsum([0] + [-(-size // block) for size in sizes])
        addrs = (ctypes.c_void_p * n)(*map(_address, views))
        c_sizes = (ctypes.c_int64 * n)(*sizes)
        c_first = (ctypes.c_int64 * n)(*first[:-1].tolist())
        out = (ctypes.c_uint64 * int(first[-1]))()
        args = HashArgs(ctypes.addressof(addrs), ctypes.addressof(c_sizes),
                        ctypes.addressof(c_first), ctypes.addressof(out), self._xxh3,
                        block)  # fmt: skip
        self._run(self._hash_blocks, args, n)
        return bytes(out)

    def _run(self, fn: Any, args: ctypes.Structure, n: int) -> None:
        if self._split is None:
            fn(ctypes.byref(args), 0, n)
        else:
            self._split.alone(fn, args, n, self._threads)


def page_copy(
    cache_dir: Path, split: bool = False, threads: int = 0, kernel_threads: Threads | None = None
) -> PageCopy | None:
    """The native scatter, built and loaded once per process (None without a C
    compiler); `split`: over par.c's workers (PageCopy), as many as `kernel_threads`
    says at each call (par.Split) where `threads` is 0."""
    lib = load("page_copy", cache_dir)
    if lib is None:
        return None
    return PageCopy(lib, Split(cache_dir, kernel_threads) if split else None, threads)


class PageWriter:
    """The scatter with hashes (the module docstring's scatter_runs), into one pool's K
    and V, made once per pool (transfer/receiving/writer.py PoolWriters): each chunk sets only its own
    fields in C arguments made here. On this machine Python runs several times slower on a core that has been idle
    a few milliseconds (its caches taken meanwhile), as the decode's I/O thread is
    between a transfer's messages: what a chunk runs of it is kept to one short loop
    and two C calls.
    One caller at a time (the receiver's I/O thread).

    Checked here, once: the pools' layout and writability; per chunk: the layer range,
    the page numbers' dtype and each source's contiguity here; the positions' pages,
    the sources' sizes and the hash count in C (pd_page_runs_check), before any write.
    """

    def __init__(
        self, copy: PageCopy, kinds: tuple[np.ndarray, np.ndarray], page_size: int
    ) -> None:
        layers, num_pages, pb = kinds[0].shape if kinds[0].ndim == 3 else (0, 0, -1)
        rb = pb // page_size if page_size > 0 and pb % page_size == 0 else -1
        ok = rb > 0 and all(_paged(k) and k.shape == kinds[0].shape for k in kinds)
        if not ok or not all(k.flags.writeable for k in kinds):
            raise ValueError(f"page_copy: {kinds[0].dtype} {kinds[0].shape} pools, P {page_size}")
        self._copy, self._layers = copy, layers
        self._most = layers * MAX_RUNS  # frames a chunk of one kind may have
        self._addrs = (ctypes.c_void_p * self._most)()
        self._sizes = (ctypes.c_int64 * self._most)()
        self._counts = (ctypes.c_int64 * MAX_RUNS)()
        self._bad = (ctypes.c_int32 * layers)()
        self._base = [int(k.ctypes.data) for k in kinds]
        self._args = [
            PageRuns(base, k.strides[0], num_pages, None, 0, page_size, rb, 0,
                     ctypes.addressof(self._counts), 0, ctypes.addressof(self._addrs), 0, None,
                     copy._xxh3, 0, ctypes.addressof(self._bad), ctypes.addressof(self._sizes),
                     0, 0)
            for base, k in zip(self._base, kinds)
        ]  # fmt: skip
        self._keep = kinds  # NOTE: the C arguments point into them
        self._pages, self._pages_at = np.zeros(0, np.int64), 0  # the last chunk's, checked

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
        """scatter_runs(kinds[kind][layers[0]:layers[1]], tpages, P, t0, runs, srcs,
        hashes, block): False if a block did not match its hash (its layer written up
        to that block, the others whole). ValueError, nothing written, where the chunk
        does not fit (layers, runs, positions, pages, source sizes, hash count)."""
        a, (lo, hi), n = self._args[kind], layers, len(srcs)
        if not (0 <= lo < hi <= self._layers) or n > self._most or not 0 < len(runs) <= MAX_RUNS:
            raise ValueError(f"page_copy: layers [{lo}, {hi}), {len(runs)} runs, {n} frames")
        if tpages is not self._pages:  # NOTE: the same for all of a transfer's chunks
            if tpages.dtype != np.int64 or tpages.ndim != 1 or not tpages.flags.c_contiguous:
                raise ValueError(f"page_copy: pages {tpages.dtype} {tpages.shape}")
            self._pages, self._pages_at = tpages, int(tpages.ctypes.data)
        for i, src in enumerate(srcs):
            if not src.c_contiguous:
                raise ValueError("page_copy: a frame is not contiguous")
            self._addrs[i], self._sizes[i] = _address(src), src.nbytes
        self._counts[: len(runs)] = runs  # type: ignore[assignment]  # ctypes takes ints
        a.pool, a.layers, a.n_frames = self._base[kind] + lo * a.pool_ls, hi - lo, n
        a.tpages, a.n_tpages, a.t0, a.n_runs = self._pages_at, len(tpages), t0, len(runs)
        a.hashes, a.n_hashes, a.block = _address(hashes), len(hashes) // 8, block
        if len(hashes) % 8 or not self._copy._check(ctypes.byref(a)):
            raise ValueError(
                f"page_copy: positions {t0} + {sum(runs)} outside the request's"
                f" {len(tpages)} pages, frames {[self._sizes[i] for i in range(min(n, 4))]}"
                f" not runs {runs[:4]}, or {len(hashes)} bytes of hashes"
            )
        self._copy._run(self._copy._scatter, a, hi - lo)
        return not any(self._bad[: hi - lo])
