"""Native CPU kernels: C sources under kernels/native/, built once per machine, called via ctypes.

    build:  $CC (else cc, gcc) -O3 -march=native -shared  kernels/native/<name>.c
            -> <cache>/native/<name>-<key>.so      key = hash(source and the headers it
                                                   may include, compiler, flags, CPU)
    check:  the structs Python hands the library against the layouts it reports
            (abi.py); the cache folder and file against other local users (cache.py)
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
from pathlib import Path

from pdserve.kernels.native import abi, cache

log = logging.getLogger(__name__)

SRC_DIR = Path(__file__).parent  # the C sources sit beside their wrappers
# -ffp-contract=fast: a * b + c becomes one fused multiply-add (-std=c11 alone forbids it,
# which doubles the kernel's arithmetic instructions)
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast")
FLAGS += ("-std=c11", "-fPIC", "-shared", "-pthread")

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


def build(
    name: str, cache_dir: Path, extra_flags: tuple[str, ...] = (), src_dir: Path | None = None
) -> Path | None:
    """Path of the built library `name` (from <src_dir>/<name>.c, by default this
    package's), building it if needed (cache.py: which files are used as they are).
    `extra_flags` (tests): e.g. -mno-avx512f builds the AVX2 path on an AVX-512 CPU."""
    src_dir = SRC_DIR if src_dir is None else src_dir
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (set CC): native CPU kernel %s not built", name)
        return None
    headers = sorted({*src_dir.glob("*.h"), *SRC_DIR.glob("*.h")})  # what it may include
    src = (src_dir / f"{name}.c").read_bytes() + b"".join(h.read_bytes() for h in headers)
    flags = FLAGS + extra_flags
    folder = cache_dir / "native"
    if not cache.private_dir(folder):
        return None
    cache.clean_stale(folder)
    out = folder / f"{name}-{_key(src, cc, flags)}.so"
    if cache.usable(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    cmd = [cc, *flags, "-I", str(SRC_DIR), "-o", tmp, str(src_dir / f"{name}.c"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("building native CPU kernel %s failed:\n%s", name, proc.stderr[-2000:])
        return None
    os.chmod(tmp, 0o700)  # NOTE: the linker's mode follows the umask, maybe group-writable
    os.replace(tmp, out)  # NOTE: atomic: a concurrent engine start sees all of it or none
    return out


def load(
    name: str, cache_dir: Path, src_dir: Path | None = None, structs: abi.Structs | None = None
) -> ctypes.CDLL | None:
    """The library `name`, built and loaded once per process; None if it cannot be
    (no compiler, a read-only or foreign cache directory, a library that does not load).
    AbiMismatch where the structs it takes (`structs`, else abi.STRUCTS[name]) differ
    from Python's: a library built from sources that do not match this Python."""
    with _lock:
        if name not in _loaded:
            try:
                path = build(name, cache_dir, src_dir=src_dir)
                lib = None if path is None else cache.open_library(path)
            except OSError as e:
                log.warning("native CPU kernel %s unavailable: %s", name, e)
                lib = None
            if lib is not None:
                abi.check(lib, name, abi.STRUCTS.get(name, ()) if structs is None else structs)
            _loaded[name] = lib
        return _loaded[name]
