"""kernels/native/linear_f32.c: fp32 y = x @ W.T + b, weights in 16-column panels."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels.native.abi import LinearArgs
from pdserve.kernels.native.library import load
from pdserve.kernels.native.par import Split, Threads, range_fn

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class LinearF32:
    """kernels/native/linear_f32.c: y = x @ W.T + b for fp32, weights in 16-column panels."""

    PANEL = 16

    def __init__(self, lib: ctypes.CDLL, split: Split) -> None:
        self._pack = lib.pd_linear_pack
        self._pack.restype = None
        self._pack.argtypes = [_ptr, _ptr, _i64, _i64]
        self._fn = range_fn(lib, "pd_linear_f32_range")
        self._split = split

    def pack(
        self, w: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W [N, K] fp32 -> panels [ceil(N/16), K, 16] (zero-padded); bias -> padded [panels*16]."""
        n, k = w.shape
        panels = -(-n // self.PANEL)
        w = w.detach().contiguous()
        out = torch.empty(panels, k, self.PANEL, dtype=torch.float32)
        self._pack(w.data_ptr(), out.data_ptr(), n, k)
        if bias is None:
            return out, None
        padded = torch.zeros(panels * self.PANEL, dtype=torch.float32)
        padded[:n] = bias
        return out, padded

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """x [M, K] fp32 -> [M, n]; the panels split over threads (each part writes its
        own columns)."""
        x = x.contiguous()
        m, k = x.shape
        # NOTE: the kernel trusts these (it reads K * 16 floats per panel, M * K of x)
        if x.dtype != torch.float32 or x.device.type != "cpu" or k != packed.shape[1]:
            raise ValueError(f"linear_f32: x {x.dtype} {tuple(x.shape)} for panels {packed.shape}")
        y = torch.empty(m, n, dtype=torch.float32)
        if m == 0:
            return y
        b = 0 if bias is None else bias.data_ptr()
        args = LinearArgs(x.data_ptr(), packed.data_ptr(), b, y.data_ptr(), m, n, k)
        panels = packed.shape[0]
        self._split(self._fn, args, panels, self.grain(m, panels))
        return y

    CHUNK_ROWS = 32  # from this many rows (a prompt's) a call is split in chunks

    @staticmethod
    def grain(m: int, panels: int) -> int:
        """Panels per chunk: 0 (one fixed range per thread) for a decode's few rows, whose
        whole call lasts 10-500 us; for a prompt's rows an even count (whole pairs on
        AVX-512) near panels / 16, so each thread takes 8 or more chunks of 0.1-1 ms."""
        if m < LinearF32.CHUNK_ROWS:
            return 0
        return max(2, panels // 16 // 2 * 2)


def linear_f32(cache_dir: Path, kernel_threads: Threads | None = None) -> LinearF32 | None:
    """None where the library cannot be built; `kernel_threads`: par.Split's."""
    lib = load("linear_f32", cache_dir)
    return None if lib is None else LinearF32(lib, Split(cache_dir, kernel_threads))
