"""kernels/native/linear_quant.c: y = x @ W.T + b, W in its GGUF block format."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.kernels.native.abi import Gemm8Args, QuantArgs, QuantGroups, X8Args
from pdserve.kernels.native.library import load
from pdserve.kernels.native.par import Split, range_fn

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p

# GGML type number -> (name, elements a block, bytes a block): the types the C computes
TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}


@dataclass(frozen=True)
class QuantTensor:
    """One GGUF tensor's blocks: uint8 [rows, row bytes] of GGML type `type_id`."""

    name: str  # the Hugging Face name
    data: torch.Tensor
    type_id: int
    cols: int  # elements a row (K)

    @property
    def type_name(self) -> str:
        return TYPES[self.type_id][0]


TILE = 4  # linear_quant.c TILE: output rows a thread de-quantizes at once


class Group(NamedTuple):
    """One projection of a grouped call: y[:, col : col + N] = x [M, K] @ W.T, W = `w`
    uint8 [N, row bytes] of type `type_id`; y [M, ldy] float32."""

    x: torch.Tensor
    w: torch.Tensor
    type_id: int
    y: torch.Tensor
    col: int = 0
    xq: torch.Tensor | None = None  # LinearQuant.quantize(x), for the integer kernels


def _args(c: Group, bias: torch.Tensor | None, xq_bytes: Callable[[int], int]) -> QuantArgs:
    """The kernel's arguments for `c`, checked: the kernel trusts them (it reads M * K
    floats of x, and M rows of xq_bytes(K) of xq where given, N rows of W, writes M rows
    of y)."""
    x, w, y, xq = c.x, c.w, c.y, c.xq
    (m, k), n = x.shape, w.shape[0]
    ok = x.dtype == y.dtype == torch.float32 and w.dtype == torch.uint8
    ok = ok and x.is_contiguous() and y.is_contiguous() and w.is_contiguous()
    ok = ok and c.type_id in TYPES and w.shape[1] == row_bytes(c.type_id, k)
    ok = ok and y.shape[0] == m and c.col + n <= y.shape[1]
    ok = ok and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)))
    if xq is not None:
        ok = ok and xq.dtype == torch.uint8 and xq.is_contiguous()
        ok = ok and tuple(xq.shape) == (m, xq_bytes(k))
    if not ok:
        raise ValueError(
            f"linear_quant: x {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)} "
            f"type {c.type_id}, y {tuple(y.shape)} at column {c.col}"
        )
    b = 0 if bias is None else bias.data_ptr()
    xq_ptr = 0 if xq is None else xq.data_ptr()
    return QuantArgs(x.data_ptr(), xq_ptr, w.data_ptr(), b, y.data_ptr() + c.col * 4, m, n,
                     k, y.shape[1], w.shape[1], c.type_id, 0)  # fmt: skip


def row_bytes(type_id: int, k: int) -> int:
    """Bytes of one row of k elements in type `type_id` (k a whole number of blocks)."""
    name, block, size = TYPES[type_id]
    if k % block:
        raise ValueError(f"{name}: a row of {k} is not a whole number of {block}-blocks")
    return k // block * size


class LinearQuant:
    """kernels/native/linear_quant.c: projections and row look-ups over GGUF blocks."""

    def __init__(self, lib: ctypes.CDLL, split: Split, int8: bool = False) -> None:
        """`int8`: --quant-activations int8, x quantized to 8 bits per block and integer
        dots (quant_int8.h) for each type int8_supported; the others stay float."""
        self._fn = range_fn(lib, "pd_quant_linear_range")
        self._groups = range_fn(lib, "pd_quant_groups_range")
        self._rows = lib.pd_quant_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = [_i32, _ptr, _i64, _ptr, _i64, _i64, _ptr]
        self._x8 = lib.pd_quant_x8
        self._x8.restype, self._x8.argtypes = None, [_ptr, _i64, _i64, _ptr]
        self._xq_bytes = lib.pd_quant_xq_bytes
        self._xq_bytes.restype, self._xq_bytes.argtypes = _i64, [_i64]
        self._int8_ok = lib.pd_quant_int8_supported
        self._int8_ok.restype, self._int8_ok.argtypes = ctypes.c_int, [_i32]
        self._gemm = range_fn(lib, "pd_quant_gemm8_range")
        self._gemm_ok = lib.pd_quant_gemm8_supported
        self._gemm_ok.restype, self._gemm_ok.argtypes = ctypes.c_int, [_i32]
        self._xt_bytes = lib.pd_quant_xt_bytes
        self._xt_bytes.restype, self._xt_bytes.argtypes = _i64, [_i64, _i64]
        self._x8_range = range_fn(lib, "pd_quant_x8_range")
        rows = lib.pd_quant_gemm8_rows
        rows.restype, rows.argtypes = _i64, [_i32]
        # from this many rows of x (per type) the C's int8 path is the GEMM
        self.gemm_rows = {t: int(rows(t)) for t in TYPES if rows(t)}
        self._split = split
        self.int8 = int8

    def int8_supported(self, type_id: int) -> bool:
        """Whether `type_id` has an integer kernel on this build (AVX2 and up)."""
        return bool(self._int8_ok(type_id))

    def gemm8_supported(self, type_id: int, m: int | None = None) -> bool:
        """Whether `type_id` has the tiled integer GEMM on this build (AVX-512 VNNI), and
        (`m` given) takes it at m rows of x."""
        if not self._gemm_ok(type_id):
            return False
        return m is None or m >= self.gemm_rows[type_id]

    def tiles(self, xq: torch.Tensor | None, k: int) -> torch.Tensor | None:
        """quantize(x)'s rows laid out for the tiled GEMM (quant_gemm8.h); None where the
        per-row kernels serve (float mode, fewer rows than any type's gemm_rows, no AVX-512
        VNNI)."""
        if xq is None or not self._tiled(xq.shape[0]):
            return None
        m = xq.shape[0]
        if tuple(xq.shape) != (m, self._xq_bytes(k)) or not xq.is_contiguous():
            raise ValueError(f"linear_quant tiles: xq {tuple(xq.shape)} for k {k}")
        return self._x8_run(None, xq, m, k)

    def prepare(
        self, x: torch.Tensor, types: Collection[int] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(quantize(x), tiles of it) in one run split across the threads: a
        projection's x, once for every part. `types`: the parts' GGUF types, tiled only
        where one of them takes the GEMM at x's rows (None: any type this build has)."""
        if not self.int8 or not self._tiled(x.shape[0], types):
            return self.quantize(x), None
        m, k = self._checked(x)
        xq = torch.empty(m, int(self._xq_bytes(k)), dtype=torch.uint8)
        return xq, self._x8_run(x, xq, m, k)

    def _tiled(self, m: int, types: Collection[int] | None = None) -> bool:
        return any(m >= self.gemm_rows[t] for t in self.gemm_rows if types is None or t in types)

    def _checked(self, x: torch.Tensor) -> tuple[int, int]:
        m, k = x.shape
        if k % 32 or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"linear_quant quantize: x {x.dtype} {tuple(x.shape)}")
        return m, k

    def _x8_run(self, x: torch.Tensor | None, xq: torch.Tensor, m: int, k: int) -> torch.Tensor:
        """xq = x quantized (x given), and the tiles of xq, returned; groups of 16 rows in
        chunks across the threads"""
        xt = torch.empty(int(self._xt_bytes(m, k)), dtype=torch.uint8)
        x_ptr = 0 if x is None else x.data_ptr()
        groups = -(-m // 16)
        args = X8Args(x_ptr, xq.data_ptr(), xt.data_ptr(), m, k)
        self._split(self._x8_range, args, groups, 1 if m >= self.CHUNK_ROWS else 0)
        return xt

    def quantize(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] float32 quantized for the integer kernels (kernel_args.h's layout,
        uint8 [M, row bytes]); None in float mode."""
        if not self.int8:
            return None
        m, k = self._checked(x)
        out = torch.empty(m, int(self._xq_bytes(k)), dtype=torch.uint8)
        self._x8(x.data_ptr(), m, k, out.data_ptr())
        return out

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        type_id: int,
        bias: torch.Tensor | None,
        y: torch.Tensor,
        col: int = 0,
        xq: torch.Tensor | None = None,
        xt: torch.Tensor | None = None,
    ) -> None:
        """y[:, col : col + N] = x [M, K] @ W.T (+ bias [N]), W = `w` uint8 [N, row bytes]
        of type `type_id`; y [M, ldy] float32, contiguous. `xq`: quantize(x), for the
        integer kernels (a type without one reads x); `xt`: tiles(xq), for the tiled
        GEMM where the type has it."""
        m, n = x.shape[0], w.shape[0]
        args = _args(Group(x, w, type_id, y, col, xq), bias, self._xq_bytes)
        if m == 0 or n == 0:
            return
        tiles = -(-n // TILE)
        if xt is not None and xq is not None and self.gemm8_supported(type_id, m):
            if xt.dtype != torch.uint8 or xt.numel() != self._xt_bytes(m, x.shape[1]):
                raise ValueError(f"linear_quant: xt {tuple(xt.shape)} for x {tuple(x.shape)}")
            gemm = Gemm8Args(ctypes.addressof(args), xt.data_ptr())
            self._split(self._gemm, gemm, tiles, self.grain(m, tiles))
        else:
            self._split(self._fn, args, tiles, self.grain(m, tiles))
        if args.status:
            raise MemoryError("linear_quant: no memory for a tile buffer")

    def groups(self, calls: Sequence[Group]) -> None:
        """Each call's y[:, col : col + N] = x @ W.T, all in one parallel run (a layer's
        routed experts): every W has the same N rows; a call with no rows is skipped."""
        if not calls:
            return
        n = calls[0].w.shape[0]
        if any(c.w.shape[0] != n for c in calls):
            raise ValueError("linear_quant groups: every W must have the same rows")
        array = (QuantArgs * len(calls))(*(_args(c, None, self._xq_bytes) for c in calls))
        tiles = -(-n // TILE)
        args = QuantGroups(ctypes.addressof(array), len(calls), tiles)
        m = max(c.x.shape[0] for c in calls)
        self._split(self._groups, args, tiles * len(calls), self.grain(m, tiles * len(calls)))
        if any(a.status for a in array):
            raise MemoryError("linear_quant: no memory for a tile buffer")

    def rows(self, w: torch.Tensor, type_id: int, ids: torch.Tensor, k: int) -> torch.Tensor:
        """The de-quantized rows `ids` of W ([len(ids), k] float32): an embedding look-up.
        Precondition: every id is within W's rows (the caller checks)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        if w.shape[1] != row_bytes(type_id, k) or not w.is_contiguous():
            raise ValueError(f"linear_quant rows: W {tuple(w.shape)} for {k} of type {type_id}")
        rc = self._rows(type_id, w.data_ptr(), w.shape[1], ids.data_ptr(), ids.numel(), k,
                        out.data_ptr())  # fmt: skip
        if rc:
            raise ValueError(f"linear_quant rows: type {type_id} has no kernel")
        return out

    CHUNK_ROWS = 32  # from this many rows (a prompt's) a call is split in chunks

    @staticmethod
    def grain(m: int, tiles: int) -> int:
        """Tiles per chunk: 0 (one range per thread) for a decode's few rows; for a
        prompt's rows about 16 chunks a call, so a preempted thread holds up little."""
        return 0 if m < LinearQuant.CHUNK_ROWS else max(1, tiles // 16)


def linear_quant(
    cache_dir: Path, lib: ctypes.CDLL | None = None, int8: bool = False
) -> LinearQuant | None:
    """The kernel (`lib`: a library built otherwise, as tests build each vector path;
    `int8`: LinearQuant's)."""
    lib = load("linear_quant", cache_dir) if lib is None else lib
    return None if lib is None else LinearQuant(lib, Split(cache_dir), int8)
