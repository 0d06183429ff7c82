"""`pdserve up` for a benchmark script: started on a free port, healthy before use,
stopped (the whole process group) however the script leaves."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_e2e_pd import free_port, spawn, stop, wait_healthy  # noqa: E402


@contextmanager
def pdserve_up(name: str, model: str | None = None, args: tuple[str, ...] = ()) -> Iterator[str]:
    """The router's base URL of a fresh `pdserve up` (its logs named `name`; `args`: more
    flags for it)."""
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--grace-period", "5"]
    if model:
        argv += ["--model", model]
    argv += args
    proc: subprocess.Popen = spawn(argv, name)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], timeout_s=300.0)
        yield url
    finally:
        stop(proc)
