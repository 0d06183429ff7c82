"""kernels/native/decode_forward.c: a whole decode forward in one ctypes call (fp32, CPU).

The C side computes nothing itself but the embedding's scale: it calls the kernels the
per-call path uses (linear_f32.c, paged_decode.c, decode_ops.c, par.c), taken here from
their loaded libraries as function pointers. One ctypes call releases the GIL for the
whole forward, so the decode's scheduler thread runs its Python while the step computes.

This module knows the C structs and the libraries, not the model: model/native_forward.py
fills a `DecodePlan` from a model's weights and a step's batch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels.native.abi import DecodePlan
from pdserve.kernels.native.library import load

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
# pd_decode_forward's status -> what was wrong (nothing computed, except 4: see the C)
STATUS = {
    1: "a token id outside the vocabulary",
    2: "a position beyond the rotary tables (max_context)",
    3: "a KV slot outside the pool",
    4: "an attention shape the native kernel does not take",
    5: "no memory for a tile buffer (linear_quant)",
}


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(lib[name], _ptr).value or 0


class DecodeForward:
    """The loaded decode_forward library with the kernel pointers it calls."""

    def __init__(
        self,
        libs: dict[str, ctypes.CDLL],
        par: ctypes.CDLL | None,
        quant: ctypes.CDLL | None = None,
    ) -> None:
        """`quant`: linear_quant, for projections and an embedding in GGUF blocks."""
        lib = libs["decode_forward"]
        self._run = lib.pd_decode_forward
        self._run.restype, self._run.argtypes = ctypes.c_int, [ctypes.POINTER(DecodePlan)]
        self._scratch = lib.pd_decode_scratch_floats
        self._scratch.restype, self._scratch.argtypes = _i64, [ctypes.POINTER(DecodePlan), _i64]
        ops, self._libs = libs["decode_ops"], libs  # the libraries stay loaded while used
        self.kernels = {
            "linear": _address(libs["linear_f32"], "pd_linear_f32_range"),
            "attend": _address(libs["paged_decode"], "pd_paged_decode_range"),
            "par_run": 0 if par is None else _address(par, "pd_par_run"),
            "par_chunks": 0 if par is None else _address(par, "pd_par_run_chunks"),
            "norm": _address(ops, "pd_add_rms_norm"),
            "head_norm": _address(ops, "pd_rms_norm_heads"),
            "rope": _address(ops, "pd_rope"),
            "kv_write": _address(ops, "pd_kv_write"),
            "quant_linear": 0 if quant is None else _address(quant, "pd_quant_linear_range"),
            "quant_rows": 0 if quant is None else _address(quant, "pd_quant_rows"),
            "quant_groups": 0 if quant is None else _address(quant, "pd_quant_groups_range"),
            "moe_route": _address(ops, "pd_moe_route"),
            "moe_combine": _address(ops, "pd_moe_combine"),
            "moe_gated_add": _address(ops, "pd_moe_gated_add"),
        }
        # the MLP activations a plan's act_mul may take (layers/activations.py NATIVE_ACTS)
        self.act_muls = {name: _address(ops, f"pd_{name}_mul") for name in ("silu", "gelu_tanh")}
        self._quant = quant  # stays loaded while used
        # pd_quant_x8, which a plan takes only with --quant-activations int8 (plan.quant_x8)
        self.quant_x8 = 0 if quant is None else _address(quant, "pd_quant_x8")

    def plan(self) -> DecodePlan:
        """A zeroed plan with the kernel pointers filled in (act_mul: the caller's)."""
        p = DecodePlan()
        for name, addr in self.kernels.items():
            setattr(p, name, addr)
        return p

    def scratch_floats(self, plan: DecodePlan, b: int) -> int:
        return int(self._scratch(ctypes.byref(plan), b))

    def __call__(self, plan: DecodePlan) -> None:
        """Runs plan.b requests into plan.logits; ValueError (STATUS) when an input was
        out of range."""
        rc = self._run(ctypes.byref(plan))
        if rc:
            raise ValueError(f"decode_forward: {STATUS.get(rc, f'status {rc}')}")


def decode_forward(cache_dir: Path) -> DecodeForward | None:
    """None when any of the libraries it calls is not built (no compiler, no AVX2)."""
    names = ("decode_forward", "linear_f32", "paged_decode", "decode_ops")
    libs = {name: load(name, cache_dir) for name in names}
    if any(lib is None for lib in libs.values()):
        return None
    libs_ok = {k: v for k, v in libs.items() if v is not None}
    return DecodeForward(libs_ok, load("par", cache_dir), load("linear_quant", cache_dir))


def float_ptr(t: torch.Tensor | None) -> int:
    """A tensor's data address for the plan (0 for None); the caller keeps it alive."""
    return 0 if t is None else t.data_ptr()
