"""The structs Python hands to the native kernels, each declared once, and their check.

Each Structure here is named as its C typedef. When a library loads (library.load),
the layout the compiler gave each struct the library uses is read from the library
itself (abi.h: `pd_abi_layout`, a table of sizeof and offsetof per field) and compared
with the Structure's, field by field. Any difference (a field on one side only, at
another offset or of another size, another total size) refuses the load with
AbiMismatch, naming the struct and the field: a kernel never reads a struct whose
layout Python guessed.

    library          structs
    paged_decode     PagedDecodeArgs (kernel_args.h)
    linear_f32       LinearArgs (kernel_args.h)
    linear_quant     QuantArgs, QuantGroups, Gemm8Args, X8Args
    decode_ops       RowsArgs
    page_copy        PageRuns, HashArgs
    decode_forward   QuantProj, Proj, ExpertProj, MoeLayer, DecodeLayer, DecodePlan
    zmq_send         ZmqApi (transfer/zmq_native.py declares it, beside its own C file)
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p

MAX_WINDOWS = 4  # decode_forward.c MAX_WINDOWS: attention windows a plan's layers use


class PagedDecodeArgs(ctypes.Structure):
    _fields_ = [("q", _ptr), ("q_stride", _i64), ("k_pool", _ptr), ("v_pool", _ptr),
                ("slots", _ptr), ("slot_stride", _i64), ("bounds", _ptr), ("h", _i64),
                ("kh", _i64), ("d", _i64), ("scale", _f32), ("out", _ptr),
                ("status", _i32)]  # fmt: skip


class LinearArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("packed", _ptr), ("bias", _ptr), ("y", _ptr), ("m", _i64),
                ("n", _i64), ("k_dim", _i64)]  # fmt: skip


class QuantArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("xq", _ptr), ("w", _ptr), ("bias", _ptr), ("y", _ptr), ("m", _i64),
                ("n", _i64), ("k_dim", _i64), ("ldy", _i64), ("row_bytes", _i64),
                ("type", _i32), ("status", _i32)]  # fmt: skip


class QuantGroups(ctypes.Structure):
    _fields_ = [("groups", _ptr), ("count", _i64), ("tiles", _i64)]


class Gemm8Args(ctypes.Structure):
    _fields_ = [("q", _ptr), ("xt", _ptr)]


class X8Args(ctypes.Structure):
    _fields_ = [("x", _ptr), ("xq", _ptr), ("xt", _ptr), ("m", _i64), ("k", _i64)]


class RowsArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("delta", _ptr), ("w", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("out", _ptr), ("ld", _i64), ("n", _i64), ("heads", _i64), ("d", _i64),
                ("eps", _f32)]  # fmt: skip


class PageRuns(ctypes.Structure):
    _fields_ = [("pool", _ptr), ("pool_ls", _i64), ("num_pages", _i64), ("tpages", _ptr),
                ("n_tpages", _i64), ("ps", _i64), ("rb", _i64), ("t0", _i64), ("runs", _ptr),
                ("n_runs", _i64), ("frames", _ptr), ("layers", _i64), ("hashes", _ptr),
                ("hash", _ptr), ("block", _i64), ("bad", _ptr), ("sizes", _ptr),
                ("n_frames", _i64), ("n_hashes", _i64)]  # fmt: skip


class HashArgs(ctypes.Structure):
    _fields_ = [("srcs", _ptr), ("sizes", _ptr), ("first", _ptr), ("out", _ptr),
                ("hash", _ptr), ("block", _i64)]  # fmt: skip


MAX_PARTS = 3  # decode_forward.c MAX_PARTS: parts of a fused projection in blocks


class QuantProj(ctypes.Structure):
    _fields_ = [("w", _ptr * MAX_PARTS), ("rows", _i64 * MAX_PARTS),
                ("row_bytes", _i64 * MAX_PARTS), ("type", _i32 * MAX_PARTS),
                ("parts", _i32)]  # fmt: skip


class Proj(ctypes.Structure):
    _fields_ = [("packed", _ptr), ("bias", _ptr), ("n", _i64), ("k_dim", _i64), ("panels", _i64),
                ("quant", ctypes.POINTER(QuantProj))]  # fmt: skip


class ExpertProj(ctypes.Structure):
    _fields_ = [("w", _ptr), ("rows", _i64), ("row_bytes", _i64), ("type", _i32)]


class MoeLayer(ctypes.Structure):
    _fields_ = [("router", Proj), ("gate", ExpertProj), ("up", ExpertProj), ("down", ExpertProj),
                ("shared_gate_up", Proj), ("shared_down", Proj), ("shared_gate", Proj),
                ("experts", _i64), ("top_k", _i64), ("inter", _i64),
                ("norm_topk", _i32)]  # fmt: skip


class DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("pre_ff_norm", _ptr),
                ("post_ff_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("cos", _ptr),
                ("sin", _ptr), ("qkv", Proj), ("o", Proj),
                ("gate_up", Proj), ("down", Proj), ("k_pool", _ptr), ("v_pool", _ptr),
                ("window", _i64), ("moe", ctypes.POINTER(MoeLayer))]  # fmt: skip


class DecodePlan(ctypes.Structure):
    _fields_ = [("linear", _ptr), ("attend", _ptr), ("par_run", _ptr), ("par_chunks", _ptr),
                ("norm", _ptr),
                ("head_norm", _ptr), ("act_mul", _ptr), ("rope", _ptr), ("kv_write", _ptr),
                ("quant_linear", _ptr), ("quant_rows", _ptr), ("quant_x8", _ptr),
                ("quant_groups", _ptr), ("moe_route", _ptr), ("moe_combine", _ptr),
                ("moe_gated_add", _ptr),
                ("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("inter", _i64), ("vocab", _i64), ("num_slots", _i64),
                ("max_pos", _i64), ("moe_experts", _i64), ("moe_top_k", _i64),
                ("moe_inter", _i64), ("moe_shared", _i64), ("eps", _f32), ("scale", _f32), ("embed_scale", _f32),
                ("embed", _ptr), ("embed_blocks", _ptr), ("embed_row_bytes", _i64),
                ("embed_type", _i32), ("final_norm", _ptr),
                ("head", Proj), ("layer", ctypes.POINTER(DecodeLayer)),
                ("threads", _i64), ("share", _ptr), ("share_engines", _i64),
                ("share_slot", _i64), ("share_own", _i64), ("host_busy", _ptr),
                ("b", _i64), ("ids", _ptr), ("positions", _ptr), ("out_slots", _ptr),
                ("slots", _ptr), ("slot_stride", _i64), ("bounds", _ptr * MAX_WINDOWS),
                ("scratch", _ptr), ("logits", _ptr), ("status", _i32)]  # fmt: skip


Structs = Sequence[type[ctypes.Structure]]

# library -> the structs Python hands it (library.load checks these)
STRUCTS: dict[str, Structs] = {
    "paged_decode": (PagedDecodeArgs,),
    "linear_f32": (LinearArgs,),
    "linear_quant": (QuantArgs, QuantGroups, Gemm8Args, X8Args),
    "decode_ops": (RowsArgs,),
    "page_copy": (PageRuns, HashArgs),
    "decode_forward": (QuantProj, Proj, ExpertProj, MoeLayer, DecodeLayer, DecodePlan),
}


class AbiMismatch(RuntimeError):
    """A struct's layout differs between Python and the C library: never loaded."""


class _Entry(ctypes.Structure):  # abi.h PdAbiField
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _i64),
                ("size", _i64)]  # fmt: skip


Layout = dict[str, dict[str, tuple[int, int]]]  # struct -> field -> (offset, size)


def reported(lib: ctypes.CDLL) -> Layout:
    """The layouts `lib` reports about itself; {} where it exports no table. A struct's
    own size is under the field name ""."""
    fn = getattr(lib, "pd_abi_layout", None)
    if fn is None:
        return {}
    fn.restype, fn.argtypes = ctypes.POINTER(_Entry), []
    table, i = fn(), 0
    out: Layout = {}
    while table[i].type is not None:
        e = table[i]
        out.setdefault(e.type.decode(), {})[e.field.decode()] = (e.offset, e.size)
        i += 1
    return out


def declared(struct: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """A Structure's layout as `reported` gives a C struct's."""
    fields = {name: getattr(struct, name) for name, *_ in struct._fields_}
    out = {name: (f.offset, f.size) for name, f in fields.items()}
    out[""] = (0, ctypes.sizeof(struct))
    return out


def mismatches(c: Layout, structs: Structs) -> list[str]:
    """Every difference between the C layouts `c` and `structs`, one line each."""
    bad = []
    for struct in structs:
        name = struct.__name__
        if name not in c:
            bad.append(f"{name}: not reported by the library (abi.h table)")
            continue
        ours, theirs = declared(struct), c[name]
        for field in [*ours, *(f for f in theirs if f not in ours)]:
            what = f"{name}.{field}" if field else f"{name} (sizeof)"
            if field not in theirs:
                bad.append(f"{what}: declared in Python only")
            elif field not in ours:
                bad.append(f"{what}: in the C struct only")
            elif ours[field] != theirs[field]:
                bad.append(f"{what}: (offset, size) {ours[field]} in Python, {theirs[field]} in C")
    return bad


def check(lib: ctypes.CDLL, name: str, structs: Structs) -> None:
    """AbiMismatch, naming each struct and field that differ, unless `lib` (the library
    `name`) reports exactly the layouts of `structs`."""
    bad = mismatches(reported(lib), structs)
    if bad:
        raise AbiMismatch(
            f"native library {name} not loaded: its structs differ from Python's"
            f" (kernels/native/abi.py): " + "; ".join(bad)
        )
