"""Real processes, real faults: kill -9 and SIGSTOP of a prefill engine under load.

One cluster (short transfer timeouts, see benchmarks/soak.FAST_TRANSFER) per test module:
starting servers costs tens of seconds on a shared CPU.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.soak import FAST_TRANSFER, Cluster, engine_signal, wait_quiet  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOUND_S = FAST_TRANSFER["kv_timeout_s"] + FAST_TRANSFER["heartbeat_timeout_s"] + 10.0


async def _load(
    url: str, n: int, max_tokens: int = 40, plen: int = 440
) -> list[tuple[int, str, float]]:
    """n concurrent streams; (status, last line, seconds) each."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, float]:
        t0, last = time.monotonic(), ""
        body = {"input_ids": [5 + (j * 7 + i) % 4000 for j in range(plen)], "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip
        async with c.stream("POST", url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                last = line or last
        return r.status_code, last, time.monotonic() - t0

    async with httpx.AsyncClient(timeout=BOUND_S + 30) as c:
        return await asyncio.gather(*(one(c, i) for i in range(n)))


def _fault_during_load(url: str, fault, n: int = 8) -> list[tuple[int, str, float]]:
    async def go():
        task = asyncio.ensure_future(_load(url, n))
        await asyncio.sleep(0.3)  # prefills of 440-token prompts still queued
        fault()
        return await task

    return asyncio.run(go())


def _failed(res: tuple[int, str, float]) -> bool:
    status, last, _ = res
    return status >= 400 or "error" in last


def test_prefill_engine_faults() -> None:
    cluster = Cluster()
    try:
        p, d, r = cluster.start()
        assert not any(map(_failed, asyncio.run(_load(r.url, 1, 4))))
        # kill -9 of the prefill engine: in-flight requests fail promptly with an error
        res = _fault_during_load(r.url, lambda: engine_signal(p.url, signal.SIGKILL))
        assert any(map(_failed, res)), res
        assert all(s < BOUND_S + 5 for *_, s in res), res
        assert not wait_quiet([d.url], timeout_s=BOUND_S), cluster.logs()
        # a new prefill behind a fresh router serves again
        p2 = cluster.worker("prefill")
        cluster.launch([p2])
        r2 = cluster.router([p2], [d])
        cluster.launch([r2])
        assert not any(map(_failed, asyncio.run(_load(r2.url, 2, 8)))), cluster.logs()
        # SIGSTOP of the new prefill's engine: timeouts fire, the decode frees everything
        pid = 0

        def stop() -> None:
            nonlocal pid
            pid = engine_signal(p2.url, signal.SIGSTOP)

        try:
            res = _fault_during_load(r2.url, stop)
            assert any(map(_failed, res)), res
            assert all(s < BOUND_S + 5 for *_, s in res), res
            assert not wait_quiet([d.url], timeout_s=BOUND_S), cluster.logs()
        finally:
            if pid:
                import os

                os.kill(pid, signal.SIGCONT)
    finally:
        cluster.stop()
