"""kernels/native/par.c: a kernel's range function run in parts on spinning workers."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.kernels.native.library import load

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_CFn = Any  # a ctypes foreign function (typeshed has no public name for its class)
Threads = Callable[[], int]


class Split:
    """Runs a kernel's range function `fn(args, lo, hi)` over [0, n) in parts: on
    kernels/native/par.c's workers, or on this thread alone where par.c is not built."""

    def __init__(self, cache_dir: Path, kernel_threads: Threads | None = None) -> None:
        """`kernel_threads`: how many threads a call may use, asked at every call (an
        engine's core policy, kernels/core_share.Cores); None: the calling thread's torch
        threads (--num-threads)."""
        lib = load("par", cache_dir)
        self._threads: Threads = kernel_threads or torch.get_num_threads
        self._run: _CFn = None
        self._chunks: _CFn = None
        self._brief: _CFn = None
        if lib is not None:
            self._run, self._chunks = lib.pd_par_run, lib.pd_par_run_chunks
            self._brief = lib.pd_par_run_chunks_spin
            self._run.restype = self._chunks.restype = self._brief.restype = ctypes.c_int
            self._run.argtypes = [_ptr, _ptr, _i64, ctypes.c_int]
            self._chunks.argtypes = [_ptr, _ptr, _i64, ctypes.c_int, _i64]
            self._brief.argtypes = [_ptr, _ptr, _i64, ctypes.c_int, _i64, _i64]

    def __call__(self, fn: _CFn, args: ctypes.Structure, n: int, grain: int = 0) -> None:
        """fn over [0, n): one near-equal range per thread, or (grain > 0) chunks of
        `grain` that the threads take in turn (par.c pd_par_run_chunks: a thread another
        process preempts holds up only its chunk in progress)."""
        parts = max(1, min(self.threads(), n))
        if self._run is None or parts == 1:
            fn(ctypes.byref(args), 0, n)
        elif grain > 0:
            self._chunks(ctypes.cast(fn, _ptr), ctypes.byref(args), n, parts, grain)
        else:
            self._run(ctypes.cast(fn, _ptr), ctypes.byref(args), n, parts)

    def threads(self) -> int:
        """Threads a call may use now (kernel_threads)."""
        return self._threads()

    def alone(self, fn: _CFn, args: ctypes.Structure, n: int, threads: int = 0) -> None:
        """fn over [0, n) one index at a time, taken in turn by `threads` threads (0: as
        many as a kernel call, `threads()`), for a call that comes alone (the KV
        receiver's chunks): the workers sleep as soon as it is done, where a step's
        kernels keep them spinning for the next one; a spinning worker between two
        chunks takes a core from the socket I/O threads."""
        parts = min(threads or self.threads(), n)
        if self._brief is None or parts < 2:
            fn(ctypes.byref(args), 0, n)
        else:
            self._brief(ctypes.cast(fn, _ptr), ctypes.byref(args), n, parts, 1, 0)


def range_fn(lib: ctypes.CDLL, name: str) -> _CFn:
    fn = lib[name]
    fn.restype, fn.argtypes = None, [_ptr, _i64, _i64]
    return fn
