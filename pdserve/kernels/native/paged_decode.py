"""kernels/native/paged_decode.c: fp32 decode attention read in place from the pool."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels.native.abi import PagedDecodeArgs
from pdserve.kernels.native.library import load
from pdserve.kernels.native.par import Split, Threads, range_fn

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class PagedDecode:
    """kernels/native/paged_decode.c: fp32 decode attention read in place from the pool."""

    def __init__(self, lib: ctypes.CDLL, split: Split) -> None:
        self._fn = range_fn(lib, "pd_paged_decode_range")
        self._split = split

    @staticmethod
    def supports(q: torch.Tensor, kc: torch.Tensor) -> bool:
        return q.dtype == kc.dtype == torch.float32 and kc.device.type == "cpu"

    def takes(self, h: int, kh: int, d: int) -> bool:
        """Whether the kernel takes h query heads over kh KV heads of d (asked of the C
        itself, on one zero query over one key)."""
        q, kv = torch.zeros(1, h, d), torch.zeros(1, kh, d)
        one = torch.tensor([[0]], dtype=torch.int64)
        try:
            self(q, kv, kv, one, torch.tensor([[0, 1]], dtype=torch.int64), 1.0)
        except ValueError:
            return False
        return True

    def __call__(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slots: torch.Tensor,
        bounds: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        grain: int = 0,
    ) -> torch.Tensor:
        """q [B, H, D] (rows of H * D contiguous); kc, vc [S, KH, D] contiguous; slots
        [B, Lmax] int64 (rows may share one: stride 0); bounds [B, 2] int64 (first key
        position, number of keys). Into `out` [B, H, D] contiguous, or a new tensor.
        `grain` > 0: requests go to threads in chunks of that many (Split)."""
        b, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        assert kc.is_contiguous() and vc.is_contiguous() and slots.stride(1) == 1
        assert slots.dtype == bounds.dtype == torch.int64 and bounds.is_contiguous()
        assert bounds.shape == (b, 2) and slots.shape[0] == b
        if out is None:
            out = torch.empty(b, h, d, dtype=q.dtype)
        assert out.shape == (b, h, d) and out.is_contiguous() and out.dtype == q.dtype
        if b == 0:
            return out
        args = PagedDecodeArgs(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(),
                                slots.data_ptr(), slots.stride(0), bounds.data_ptr(), h,
                                kc.shape[1], d, scale, out.data_ptr(), 0)  # fmt: skip
        kh = kc.shape[1]  # units: (request, kv head) pairs, so one request splits too
        self._split(self._fn, args, b * kh, grain * kh)
        if args.status:
            raise ValueError(f"paged_decode: unsupported shape H={h} KH={kc.shape[1]} D={d}")
        return out


def paged_decode(cache_dir: Path, kernel_threads: Threads | None = None) -> PagedDecode | None:
    """None where the library cannot be built; `kernel_threads`: par.Split's."""
    lib = load("paged_decode", cache_dir)
    return None if lib is None else PagedDecode(lib, Split(cache_dir, kernel_threads))
