"""kernels/cpu/page_copy.c: KV pages from a received frame into the pool (decode side).

    scatter_frames(dst, pages, srcs)    dst[l, pages[i]] = srcs[l][i]
        dst   uint8 [L, num_pages, page bytes]  the pool's K or V, a page per row
        srcs  L arrays uint8 [n, page bytes]    each layer's whole pages, in prompt order
                                                (a frame sent in place, or a layer's rows
                                                of a gathered frame)

Non-temporal stores where the CPU has them (page_copy.c says why): about 1.4x numpy's
fancy-index assignment on one core here (8.8 vs 6.3 GB/s, 8 KiB pages, a 256 MiB
pool). The decode's KVReceiver loads it at start-up (cpu_native.load: once per
process), unless --disable-compile. The wrapper checks what
the C code trusts (dtypes, shapes, strides, writability); the C code checks the page
numbers before it writes anything.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from pdserve.kernels.cpu_native import load

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _paged(a: np.ndarray) -> bool:
    """[L, pages, page bytes] uint8 with contiguous pages (layers at any stride)."""
    return a.dtype == np.uint8 and a.ndim == 3 and a.strides[2] == 1 and a.strides[1] == a.shape[2]


class PageCopy:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._frames = lib.pd_page_scatter_frames
        self._frames.restype = ctypes.c_int
        self._frames.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64]

    def scatter_frames(self, dst: np.ndarray, pages: np.ndarray, srcs: list[np.ndarray]) -> None:
        n, pb = len(pages), dst.shape[2] if dst.ndim == 3 else -1
        ok = _paged(dst) and dst.flags.writeable and len(srcs) == dst.shape[0]
        ok = ok and pages.dtype == np.int64 and pages.shape == (n,)
        ok = ok and all(
            s.dtype == np.uint8 and s.shape == (n, pb) and s.flags.c_contiguous for s in srcs
        )
        if not ok:
            raise ValueError(
                f"page_copy: {dst.dtype} {dst.shape} {dst.strides} <- {len(srcs)} frames"
                f" {[(s.dtype, s.shape) for s in srcs[:2]]} at {pages.dtype} {pages.shape}"
            )
        pages = np.ascontiguousarray(pages)
        addrs = (ctypes.c_void_p * len(srcs))(*(s.ctypes.data for s in srcs))
        layers, num_pages, _ = dst.shape
        status = self._frames(dst.ctypes.data, dst.strides[0], num_pages, pages.ctypes.data,
                              n, addrs, pb, layers)  # fmt: skip
        if status:
            raise ValueError(f"page_copy: a page outside [0, {num_pages}) in {pages.tolist()}")


def page_copy(cache_dir: Path) -> PageCopy | None:
    lib = load("page_copy", cache_dir)
    return None if lib is None else PageCopy(lib)
