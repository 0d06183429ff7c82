"""`pdserve up` for a benchmark script: started on a free port, healthy before use,
stopped (the whole process group) however the script leaves."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

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


@dataclass
class Streamed:
    tokens: int  # the completion tokens its usage counted
    tpot: float | None  # seconds a token after the first one; None below two tokens


async def stream_timed(
    client: httpx.AsyncClient, url: str, body: dict, on_choice: Callable[[dict], None]
) -> Streamed:
    """POST one streamed request (`body` asks for `include_usage`) to `url`, handing each
    choice of each event to `on_choice`; its clock starts at the response's headers, so
    a request's queueing before them is not counted in its TPOT."""
    first = 0.0
    tokens = 0
    async with client.stream("POST", url, json=body, timeout=600) as r:
        t0 = time.perf_counter()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for c in ev["choices"]:
                on_choice(c)
                first = first or time.perf_counter()
        end = time.perf_counter()
    tpot = (end - (first or t0)) / (tokens - 1) if tokens > 1 else None
    return Streamed(tokens, tpot)


async def timed_gather(n: int, one: Callable[[httpx.AsyncClient, int], Awaitable[None]]) -> float:
    """Runs `one(client, i)` for i < n at once on one client; the wall seconds it took."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    return time.perf_counter() - t0
