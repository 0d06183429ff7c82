"""kernels/native/decode_ops.c: a forward's elementwise passes, one ctypes call each.

CPU engines turn them on at start-up (ModelRunner.warm_up_decode, warm_up_prefill); the
model then calls these instead of the torch ops that compute the same values
(model/layers/ops.py holds both sides). Each wrapper checks what the C code trusts (dtype,
device, contiguity, widths) and raises ValueError otherwise, so a bad call fails here
and never reads or writes out of bounds.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from pdserve.kernels.native.abi import RowsArgs
from pdserve.kernels.native.library import load
from pdserve.kernels.native.par import Split, Threads

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
MAX_EXPERTS = 1024  # moe_ops.h PD_MOE_MAX_EXPERTS: the experts a router may have
CHUNK_ROWS = 64  # from this many rows (a prompt's) a pass is split over threads in chunks


def _rows(x: torch.Tensor, name: str, width: int | None = None) -> None:
    """x: fp32 on the CPU, [T, width] with contiguous rows."""
    ok = x.dtype == torch.float32 and x.is_cpu and x.dim() == 2
    ok = ok and x.stride(1) == 1 and (width is None or x.shape[1] == width)
    if not ok:
        raise ValueError(f"decode_ops: {name} {x.dtype} {tuple(x.shape)} {x.stride()}")


class DecodeOps:
    """A pass over a prompt's rows (CHUNK_ROWS or more) goes to `split`'s threads in
    chunks of rows; a decode's few rows run on the calling thread."""

    def __init__(self, lib: ctypes.CDLL, split: Split | None = None) -> None:
        def fn(name: str, *args: type, ret: type | None = None) -> Any:
            f = getattr(lib, name)
            f.restype, f.argtypes = ret, list(args)
            return f

        self._split = split
        ranges = ("pd_add_rms_norm_range", "pd_rms_norm_heads_range", "pd_silu_mul_range",
                  "pd_gelu_tanh_mul_range", "pd_rope_range")  # fmt: skip
        self._ranges = {name: fn(name, _ptr, _i64, _i64) for name in ranges}

        self._norm = fn("pd_add_rms_norm", _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32)
        self._norm_heads = fn("pd_rms_norm_heads", _ptr, _i64, _ptr, _i64, _i64, _i64, _f32)
        self._act_muls = {name: fn(f"pd_{name}_mul", _ptr, _ptr, _i64, _i64)
                          for name in ("silu", "gelu_tanh")}  # fmt: skip
        self._rope = fn("pd_rope", _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64)
        kv_args = (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64)
        self._kv_write = fn("pd_kv_write", *kv_args, ret=ctypes.c_int)
        self._argmax = fn("pd_argmax", _ptr, _i64, _i64, _i64, _ptr)
        self._route = fn("pd_moe_route", _ptr, _i64, _i64, _i64, _i32, _ptr, _ptr)
        self._combine = fn("pd_moe_combine", _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64)
        self._gated_add = fn("pd_moe_gated_add", _ptr, _ptr, _ptr, _i64, _i64)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h += delta (in place, when given); returns w * rms_norm(h). h, delta [T, n]."""
        t, n = h.shape
        ok = h.is_contiguous() and h.dtype == torch.float32 and h.is_cpu
        ok = ok and w.shape == (n,) and w.is_contiguous() and w.dtype == torch.float32 and w.is_cpu
        if delta is not None:
            delta = delta.contiguous()
            ok = ok and delta.shape == h.shape and delta.dtype == torch.float32 and delta.is_cpu
        if not ok:
            got = "" if delta is None else f" + {tuple(delta.shape)}"
            raise ValueError(f"decode_ops: norm of {h.dtype} {tuple(h.shape)}{got} by {w.shape}")
        out = torch.empty_like(h)
        d = 0 if delta is None else delta.data_ptr()
        if self._chunked(t):
            args = RowsArgs(h.data_ptr(), d, w.data_ptr(), out=out.data_ptr(), n=n, eps=eps)
            self._run("pd_add_rms_norm_range", args, t)
        else:
            self._norm(h.data_ptr(), d, w.data_ptr(), out.data_ptr(), t, n, eps)
        return out

    def _chunked(self, rows: int) -> bool:
        return self._split is not None and rows >= CHUNK_ROWS

    def _run(self, name: str, args: RowsArgs, rows: int) -> None:
        assert self._split is not None
        self._split(self._ranges[name], args, rows, max(8, rows // 16))

    def rms_norm_heads_(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        """x [T, heads, D] (heads and D contiguous, rows strided): each head's D values
        replaced by w * rms_norm of them, in place (Qwen3's q/k norms)."""
        t, heads, d = x.shape
        ok = x.stride(2) == 1 and x.stride(1) == d and x.dtype == torch.float32 and x.is_cpu
        ok = ok and w.shape == (d,) and w.is_contiguous() and w.dtype == torch.float32 and w.is_cpu
        if not ok:
            raise ValueError(f"decode_ops: head norm of {tuple(x.shape)} {x.stride()} by {w.shape}")
        if self._chunked(t):
            ptrs = {"x": x.data_ptr(), "w": w.data_ptr()}
            args = RowsArgs(**ptrs, ld=x.stride(0), heads=heads, d=d, eps=eps)
            self._run("pd_rms_norm_heads_range", args, t)
        else:
            self._norm_heads(x.data_ptr(), x.stride(0), w.data_ptr(), t, heads, d, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
        return self._act_mul("silu", gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> gelu_tanh(gate) * up [T, I] (decode_ops.c gelu_tanh:
        within a few ulp of F.gelu(approximate="tanh"), not its bits)."""
        return self._act_mul("gelu_tanh", gate_up)

    def _act_mul(self, name: str, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        _rows(gate_up, "gate_up")
        t, two = gate_up.shape
        if two % 2:
            raise ValueError(f"decode_ops: gate_up of odd width {two}")
        out = torch.empty(t, two // 2, dtype=torch.float32)
        if self._chunked(t):
            args = RowsArgs(gate_up.data_ptr(), out=out.data_ptr(), n=two // 2)
            self._run(f"pd_{name}_mul_range", args, t)
        else:
            self._act_muls[name](gate_up.data_ptr(), out.data_ptr(), t, two // 2)
        return out

    def rope_(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        """x [T, heads, D] (heads and D contiguous, rows strided) rotated in place by the
        (cos, sin_signed) tables of its positions, each [T, 1, D] contiguous."""
        t, heads, d = x.shape
        cos, sin = tables
        ok = x.stride(2) == 1 and x.stride(1) == d and d % 2 == 0
        ok = ok and x.dtype == cos.dtype == sin.dtype == torch.float32
        ok = ok and x.is_cpu and cos.is_cpu and sin.is_cpu and cos.shape == sin.shape == (t, 1, d)
        if not (ok and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"decode_ops: rope of {tuple(x.shape)} {x.stride()} by {cos.shape}")
        if self._chunked(t):
            ptrs = {"x": x.data_ptr(), "cos": cos.data_ptr(), "sin": sin.data_ptr()}
            args = RowsArgs(**ptrs, ld=x.stride(0), heads=heads, d=d)
            self._run("pd_rope_range", args, t)
        else:
            self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d)

    def kv_write(
        self,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """kc[slots] = k, vc[slots] = v: one layer's pool [S, KH, D] (contiguous); k, v
        [T, KH, D], each row's KH * D contiguous (rows may be strided); slots [T] int64 in
        [0, S) (a slot outside: ValueError, nothing written)."""
        t, kh, d = k.shape
        ok = kc.is_contiguous() and vc.is_contiguous() and kc.shape == vc.shape
        ok = ok and kc.shape[1:] == (kh, d) and v.shape == k.shape and kc.dtype == torch.float32
        ok = ok and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (t,)
        for x in (k, v):
            ok = ok and x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == d
        if not ok:
            raise ValueError(f"decode_ops: kv write of {tuple(k.shape)} into {tuple(kc.shape)}")
        ptrs = (kc.data_ptr(), vc.data_ptr(), kc.shape[0], slots.data_ptr())
        rows = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
        if self._kv_write(*ptrs, *rows, t, kh * d):
            raise ValueError(f"decode_ops: a KV slot outside the pool's {kc.shape[0]}")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64, as x.argmax(dim=-1) (first largest; NaN counts as largest)."""
        _rows(x, "logits")
        b, v = x.shape
        out = torch.empty(b, dtype=torch.int64)
        if v == 0:
            raise ValueError("decode_ops: argmax of an empty row")
        self._argmax(x.data_ptr(), b, v, x.stride(0), out.data_ptr())
        return out

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int64): softmax,
        top k, divided by their sum where `norm` (moe_ops.h pd_moe_route)."""
        logits = logits.contiguous()
        _rows(logits, "router logits")
        t, e = logits.shape
        if not 1 <= top_k <= e <= MAX_EXPERTS:
            raise ValueError(f"decode_ops: top {top_k} of {e} experts")
        w = torch.empty(t, top_k, dtype=torch.float32)
        chosen = torch.empty(t, top_k, dtype=torch.int64)
        self._route(logits.data_ptr(), t, e, top_k, int(norm), w.data_ptr(), chosen.data_ptr())
        return w, chosen

    def moe_combine(
        self, y: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, t: int
    ) -> torch.Tensor:
        """[t, n]: each pair's row y[q] times w[q] added into row tokens[q], in the pairs'
        order, from zero (moe_ops.h pd_moe_combine)."""
        _rows(y, "expert outputs")
        p, n = y.shape
        ok = y.is_contiguous() and w.dtype == torch.float32 and w.shape == (p,)
        ok = ok and tokens.dtype == torch.int64 and tokens.shape == (p,)
        ok = ok and w.is_contiguous() and tokens.is_contiguous()
        if not ok or (p and not 0 <= int(tokens.min()) <= int(tokens.max()) < t):
            raise ValueError(f"decode_ops: combine of {tuple(y.shape)} into {t} tokens")
        out = torch.empty(t, n, dtype=torch.float32)
        self._combine(y.data_ptr(), w.data_ptr(), tokens.data_ptr(), p, n, out.data_ptr(), t)
        return out

    def moe_gated_add_(self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> None:
        """out [T, n] += sigmoid(gate [T, 1]) * shared [T, n], in place."""
        gate, shared = gate.contiguous(), shared.contiguous()
        for x in (out, gate, shared):
            _rows(x, "gated add")
        t, n = out.shape
        if not (out.is_contiguous() and gate.shape == (t, 1) and shared.shape == (t, n)):
            raise ValueError(f"decode_ops: gated add of {tuple(shared.shape)} to {(t, n)}")
        self._gated_add(out.data_ptr(), gate.data_ptr(), shared.data_ptr(), t, n)


def decode_ops(cache_dir: Path, kernel_threads: Threads | None = None) -> DecodeOps | None:
    """None where the library cannot be built; `kernel_threads`: par.Split's."""
    lib = load("decode_ops", cache_dir)
    return None if lib is None else DecodeOps(lib, Split(cache_dir, kernel_threads))
