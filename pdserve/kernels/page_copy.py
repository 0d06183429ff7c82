"""kernels/cpu/page_copy.c: KV pages from a received frame into the pool (decode side).

    scatter_runs(dst, tpages, P, t0, runs, srcs)
        dst    uint8 [L, num_pages, page bytes]: the pool's K or V, a page per row
        position p = t0, t0 + 1, ... (runs[0] + runs[1] + ... of them) of layer l:
            row p % P of page tpages[p // P] of dst[l]  =  the next row of
            srcs[l * len(runs) + r] (r: the run p falls in; each a buffer of rows)
        tpages int64: a request's pages in prompt order (page i holds positions
                      i * P .. i * P + P - 1)
        One call writes a whole received chunk of one kind, pages entered or left
        mid-way included (transfer/validate.py).

Non-temporal stores where the CPU has them (page_copy.c says why): about 1.4x numpy's
fancy-index assignment on one core here (8.8 vs 6.3 GB/s, 8 KiB pages, a 256 MiB
pool, measured on the per-page call this one replaced). A request's slots that are not
whole pages in prompt order (never the decode's allocator) go through numpy instead
(transfer/staging.py). The decode's KVReceiver loads it at start-up (cpu_native.load: once per
process), unless --disable-compile. The wrapper checks what
the C code trusts (dtypes, shapes, strides, writability); the C code checks the page
numbers before it writes anything.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.kernels.cpu_native import load

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _paged(a: np.ndarray) -> bool:
    """[L, pages, page bytes] uint8 with contiguous pages (layers at any stride)."""
    return a.dtype == np.uint8 and a.ndim == 3 and a.strides[2] == 1 and a.strides[1] == a.shape[2]


def _address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only (bytes, a view over them) or empty
        return int(np.frombuffer(buf, np.uint8).ctypes.data)


class PageCopy:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._runs = lib.pd_page_scatter_runs
        self._runs.restype = ctypes.c_int
        self._runs.argtypes = [
            _ptr,
            _i64,
            _i64,
            _ptr,
            _i64,
            _i64,
            _i64,
            _i64,
            _ptr,
            _i64,
            _ptr,
            _i64,
        ]

    def scatter_runs(
        self,
        dst: np.ndarray,
        tpages: np.ndarray,
        page_size: int,
        t0: int,
        runs: list[int],
        srcs: list[Any],
    ) -> None:
        """See the module docstring. Checks what the C code trusts: the destination's
        layout, each source's size and contiguity; the C code checks the positions and
        pages before it writes anything."""
        layers, num_pages, pb = dst.shape if dst.ndim == 3 else (0, 0, -1)
        rb = pb // page_size if page_size > 0 and pb % page_size == 0 else -1
        views = [memoryview(s) for s in srcs]
        ok = rb > 0 and _paged(dst) and dst.flags.writeable and len(views) == layers * len(runs)
        ok = ok and tpages.dtype == np.int64 and tpages.ndim == 1 and tpages.flags.c_contiguous
        ok = ok and all(v.c_contiguous and v.nbytes == c * rb for v, c in zip(views, runs * layers))
        if not ok:
            raise ValueError(
                f"page_copy: {dst.dtype} {dst.shape} {dst.strides} <- {len(views)} frames"
                f" {[v.nbytes for v in views[:4]]} for runs {runs[:4]} of {layers} layers"
            )
        addrs = (ctypes.c_void_p * len(views))(*map(_address, views))
        counts = (ctypes.c_int64 * len(runs))(*runs)
        status = self._runs(dst.ctypes.data, dst.strides[0], num_pages, tpages.ctypes.data,
                            len(tpages), page_size, rb, t0, counts, len(runs), addrs,
                            layers)  # fmt: skip
        if status:
            raise ValueError(
                f"page_copy: positions {t0} + {sum(runs)} outside the request's"
                f" {len(tpages)} pages, or a page outside [0, {num_pages})"
            )


def page_copy(cache_dir: Path) -> PageCopy | None:
    lib = load("page_copy", cache_dir)
    return None if lib is None else PageCopy(lib)
