"""Native CPU kernels: C sources under kernels/cpu/, built once per machine, called via ctypes.

    build:  $CC (else cc, gcc) -O3 -march=native -shared  kernels/cpu/<name>.c
            -> <cache>/native/<name>-<key>.so      key = hash(source and the folder's
                                                   headers, compiler, flags, CPU)
    call:   ctypes, which releases the GIL for the length of the call (the decode's
            forward thread computes while the schedule thread runs Python)
    split:  a kernel's range function over as many parts as the calling thread's torch
            thread count, on par.c's spinning workers (~1 us a hand-off; Python helper
            threads cost ~100 us, more than a small projection's whole work)

The library is built for the CPU it runs on (-march=native), so the key includes the
CPU's model and feature flags: a cache directory shared between machines never hands
one machine another's build. Building takes about a second; it happens at engine
start-up (warm_up), never inside a step. No C compiler (a slim container image):
`load` returns None, with a warning, and callers keep their portable path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SRC_DIR = Path(__file__).parent / "cpu"
# -ffp-contract=fast: a * b + c becomes one fused multiply-add (-std=c11 alone forbids it,
# which doubles the kernel's arithmetic instructions)
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast")
FLAGS += ("-std=c11", "-fPIC", "-shared", "-pthread")

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_CFn = Any  # a ctypes foreign function (typeshed has no public name for its class)
_loaded: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))  # the first core's lines (all cores alike)


def _key(src: bytes, cc: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(src)
    for part in (version, " ".join(flags), _cpu_id()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build(name: str, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """Path of the built library `name` (from kernels/cpu/<name>.c), building it if needed.
    `extra_flags` (tests): e.g. -mno-avx512f builds the AVX2 path on an AVX-512 CPU."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (set CC): native CPU kernel %s not built", name)
        return None
    src = (SRC_DIR / f"{name}.c").read_bytes()
    src += b"".join(h.read_bytes() for h in sorted(SRC_DIR.glob("*.h")))  # what it includes
    flags = FLAGS + extra_flags
    out = cache_dir / "native" / f"{name}-{_key(src, cc, flags)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, str(SRC_DIR / f"{name}.c"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("building native CPU kernel %s failed:\n%s", name, proc.stderr[-2000:])
        return None
    os.replace(tmp, out)  # NOTE: atomic: a concurrent engine start sees all of it or none
    return out


def load(name: str, cache_dir: Path) -> ctypes.CDLL | None:
    """The library `name`, built and loaded once per process; None if it cannot be
    (no compiler, a read-only cache directory, a library that does not load)."""
    with _lock:
        if name not in _loaded:
            try:
                path = build(name, cache_dir)
                _loaded[name] = None if path is None else ctypes.CDLL(str(path))
            except OSError as e:
                log.warning("native CPU kernel %s unavailable: %s", name, e)
                _loaded[name] = None
        return _loaded[name]


class Split:
    """Runs a kernel's range function `fn(args, lo, hi)` over [0, n) in parts: on
    kernels/cpu/par.c's workers, or on this thread alone where par.c is not built."""

    def __init__(self, cache_dir: Path) -> None:
        lib = load("par", cache_dir)
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

    # threads for each call; None: the calling thread's torch threads. An engine sharing
    # its host's cores (kernels/core_share.py) sets CoreShare.kernel_threads here.
    budget: Callable[[], int] | None = None

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

    @staticmethod
    def threads() -> int:
        """Threads a call may use now: the budget's, else this process's torch threads
        (--num-threads)."""
        return torch.get_num_threads() if Split.budget is None else Split.budget()

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


class _PagedDecodeArgs(ctypes.Structure):  # paged_decode.c PagedDecodeArgs
    _fields_ = [("q", _ptr), ("q_stride", _i64), ("k_pool", _ptr), ("v_pool", _ptr),
                ("slots", _ptr), ("slot_stride", _i64), ("bounds", _ptr), ("h", _i64),
                ("kh", _i64), ("d", _i64), ("scale", _f32), ("out", _ptr),
                ("status", ctypes.c_int32)]  # fmt: skip


class _LinearArgs(ctypes.Structure):  # linear_f32.c LinearArgs
    _fields_ = [("x", _ptr), ("packed", _ptr), ("bias", _ptr), ("y", _ptr), ("m", _i64),
                ("n", _i64), ("k_dim", _i64)]  # fmt: skip


class PagedDecode:
    """kernels/cpu/paged_decode.c: fp32 decode attention read in place from the pool."""

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
        args = _PagedDecodeArgs(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(),
                                slots.data_ptr(), slots.stride(0), bounds.data_ptr(), h,
                                kc.shape[1], d, scale, out.data_ptr(), 0)  # fmt: skip
        self._split(self._fn, args, b, grain)  # requests
        if args.status:
            raise ValueError(f"paged_decode: unsupported shape H={h} KH={kc.shape[1]} D={d}")
        return out


def paged_decode(cache_dir: Path) -> PagedDecode | None:
    lib = load("paged_decode", cache_dir)
    return None if lib is None else PagedDecode(lib, Split(cache_dir))


class LinearF32:
    """kernels/cpu/linear_f32.c: y = x @ W.T + b for fp32, weights in 16-column panels."""

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
        args = _LinearArgs(x.data_ptr(), packed.data_ptr(), b, y.data_ptr(), m, n, k)
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


def linear_f32(cache_dir: Path) -> LinearF32 | None:
    lib = load("linear_f32", cache_dir)
    return None if lib is None else LinearF32(lib, Split(cache_dir))
