"""The prefill's KV frame gathered and hashed in one pass (kernels/cpu/kv_gather.c).

    pool   [L, S, ...]    pool.k or pool.v (CPU, contiguous)
    slots  [n]            the request's slots in position order
    frame  [L, n, ...]    written front to back; returns XXH3-64 of the frame's bytes

Hashing the frame a block at a time right after the block is written reads it from
cache instead of memory: on the 2-core VM of docs/benchmarks.md (ninth round) the
sender's transfer thread used about a quarter less CPU per byte than gathering with
torch and hashing the whole frame after. The hash is the xxhash package's XXH3 through
its streaming functions (their addresses taken from the loaded extension module), so
`gather_hash(...) == xxhash.xxh3_64_intdigest(frame)` bit for bit. The call holds no GIL.

`native_gather` returns None (callers keep torch's gather and a separate hash) where
the library is not built (no compiler) or the xxhash module does not export the
streaming functions.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import torch

from pdserve.kernels.cpu_native import load

log = logging.getLogger(__name__)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_HASH_FNS = ("XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest")


class _GatherArgs(ctypes.Structure):  # kv_gather.c GatherArgs
    _fields_ = [("src", _ptr), ("layer_stride", _i64), ("row_bytes", _i64),
                ("num_slots", _i64), ("runs", _ptr), ("num_runs", _i64), ("layers", _i64),
                ("dst", _ptr), ("state", _ptr), ("reset", _ptr), ("update", _ptr),
                ("digest", _ptr), ("hash", ctypes.c_uint64),
                ("status", ctypes.c_int32)]  # fmt: skip


def slot_runs(slots: np.ndarray) -> np.ndarray:
    """[num_runs, 2] int64 (first slot, count): `slots` cut where they stop being
    consecutive. A request's pages give one run a page, or fewer where pages follow."""
    if len(slots) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.flatnonzero(np.diff(slots) != 1) + 1
    first = np.concatenate(([0], starts))
    counts = np.diff(np.concatenate((first, [len(slots)])))
    return np.ascontiguousarray(np.stack([slots[first], counts], axis=1), dtype=np.int64)


class NativeGather:
    """One XXH3 state: call from one thread at a time (the sender's I/O thread)."""

    def __init__(self, lib: ctypes.CDLL, hash_lib: ctypes.CDLL) -> None:
        self._fn = lib.pd_kv_gather_hash
        self._fn.restype, self._fn.argtypes = None, [_ptr]
        create = hash_lib.XXH3_createState
        create.restype = _ptr
        self._state = create()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        self._hash_fns = [ctypes.cast(hash_lib[name], _ptr).value for name in _HASH_FNS]

    def __call__(self, src: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> int:
        """out[:, i] = src[:, slots[i]]; returns XXH3-64 of out's bytes."""
        n = len(slots)
        if src.device.type != "cpu" or not src.is_contiguous() or not out.is_contiguous():
            raise ValueError("kv gather: src and out must be contiguous CPU tensors")
        if out.dtype != src.dtype or out.shape != (src.shape[0], n, *src.shape[2:]):
            raise ValueError(f"kv gather: out {tuple(out.shape)} for src {tuple(src.shape)}")
        runs = slot_runs(slots.numpy().astype(np.int64, copy=False))
        row_bytes = src[0, 0].numel() * src.element_size()
        args = _GatherArgs(src.data_ptr(), src.stride(0) * src.element_size(), row_bytes,
                           src.shape[1], runs.ctypes.data, len(runs), src.shape[0],
                           out.data_ptr(), self._state, *self._hash_fns, 0, 0)  # fmt: skip
        self._fn(ctypes.byref(args))
        if args.status == 1:
            raise IndexError(f"kv gather: a slot outside [0, {src.shape[1]})")
        if args.status:
            raise RuntimeError("kv gather: XXH3 reported an error")
        return int(args.hash)


def _hash_lib() -> ctypes.CDLL | None:
    import xxhash._xxhash as ext  # the compiled module the checksums already use

    try:
        lib = ctypes.CDLL(ext.__file__)
        for name in ("XXH3_createState", *_HASH_FNS):
            lib[name]  # noqa: B018 (raises AttributeError when not exported)
    except (OSError, AttributeError) as e:
        log.info("xxhash exports no streaming XXH3 (%s): KV frames hashed after the gather", e)
        return None
    return lib


def native_gather(cache_dir: Path) -> NativeGather | None:
    lib = load("kv_gather", cache_dir)
    hash_lib = None if lib is None else _hash_lib()
    return None if lib is None or hash_lib is None else NativeGather(lib, hash_lib)
