"""Every environment variable pdserve reads, in one typed registry (prefix PDSERVE_).

Read them through `ENV.<name>.get()`, never `os.environ` directly, so `pdserve
--help`, the docs and the code agree on what exists. (The one other variable pdserve
touches is Triton's own `TRITON_INTERPRET`, set in `pdserve.kernels` without CUDA.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str

    def get(self, default: str | None = None) -> str | None:
        value = os.environ.get(self.name)
        return value if value not in (None, "") else default


class _Registry:
    CACHE_DIR = EnvVar(
        "PDSERVE_CACHE_DIR", "where default models are made and cached (~/.cache/pdserve)"
    )
    API_KEY = EnvVar(
        "PDSERVE_API_KEY", "bearer key required on generation endpoints (same as --api-key)"
    )
    CURVE_PUBLIC = EnvVar(
        "PDSERVE_CURVE_PUBLIC", "Z85 public key of the KV channel's CURVE keypair"
    )
    CURVE_SECRET = EnvVar(
        "PDSERVE_CURVE_SECRET", "Z85 secret key of the KV channel's CURVE keypair"
    )
    DISABLE_COMPILE = EnvVar(
        "PDSERVE_DISABLE_COMPILE",
        "1: build no native CPU kernels (as --disable-compile)",
    )
    PER_CALL_DECODE = EnvVar(
        "PDSERVE_PER_CALL_DECODE",
        "1: a CPU decode step calls its native kernels one by one from Python instead of "
        "as one native forward (same results; for comparing the two)",
    )
    ENGINE_ENTRY = EnvVar(
        "PDSERVE_ENGINE_ENTRY",
        "a Python file a frontend runs as its engine process instead of "
        "`python -m pdserve.scheduler.engine_proc` (same arguments; the tests' fake engine)",
    )

    def all(self) -> list[EnvVar]:
        return [v for v in vars(type(self)).values() if isinstance(v, EnvVar)]


ENV = _Registry()


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`: made models, native kernel builds."""
    env = ENV.CACHE_DIR.get()
    return Path(env) if env else Path.home() / ".cache" / "pdserve"
