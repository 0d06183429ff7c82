"""Every environment variable pdserve reads, in one typed registry (prefix PDSERVE_).

Read them through `ENV.<name>.get()`, never `os.environ` directly, so `pdserve
--help`, the docs and the code agree on what exists. (Two others pdserve touches:
Triton's own `TRITON_INTERPRET`, set in `pdserve.kernels` without CUDA, and OpenMP's
`OMP_WAIT_POLICY`, given to engine processes: `engine_env`.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
        "PDSERVE_API_KEY", "bearer key required on every HTTP route but /health (as --api-key)"
    )
    METRICS_PUBLIC = EnvVar(
        "PDSERVE_METRICS_PUBLIC", "1: /metrics answers without the API key (as --metrics-public)"
    )
    CURVE_PUBLIC = EnvVar(
        "PDSERVE_CURVE_PUBLIC", "Z85 public key of the KV channel's CURVE keypair"
    )
    CURVE_SECRET = EnvVar(
        "PDSERVE_CURVE_SECRET", "Z85 secret key of the KV channel's CURVE keypair"
    )
    # Kept: the offline LLM has no --disable-compile, and its tests run the portable
    # paths (eager attention, torch norms) through it.
    DISABLE_COMPILE = EnvVar(
        "PDSERVE_DISABLE_COMPILE",
        "1: build no native CPU kernels (as --disable-compile)",
    )
    # Kept: the per-call path is the fallback for a model the one-call forward does not
    # fit; this runs it on one that fits, for the tests that compare the two and
    # benchmarks/decode_step.py --paths per-call.
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


def engine_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment an engine process starts with: `base`, plus OMP_WAIT_POLICY=PASSIVE
    unless `base` sets a policy. OpenMP's threads then sleep when a parallel region ends,
    instead of spinning on a core for a while (libgomp reads the variable once, when torch
    loads it, so it is set before the process starts).

    Why: an engine's threads are more than torch's. The decode's overlap scheduler runs
    its schedule thread beside the forward; the KV transfer has an I/O thread; `pdserve
    up` puts a prefill and a decode on the same cores. After the sampler's torch ops the
    OpenMP threads spun on the cores those needed, and the next step's input ids took
    many times longer to resolve (`benchmarks/decode_overlap.py` shows it)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **base}
