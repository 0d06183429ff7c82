"""A decode killed (kill -9, its whole process group) behind unmodified sglang-router with
16 long requests in flight, as a new user would run it (default timeouts):

    every prefill row and page free within 15 s     (the decode announced each room when the
                                                     request reached it: its heartbeat covers
                                                     the room, so its silence frees it; a room
                                                     no decode announced, such as the router's
                                                     retries, goes after the bootstrap timeout)
    every client has a status within 20 s
    a decode restarted on the same port serves again, token-exact

Before rooms were tied to their decode from the start, 15 s after such a kill the prefill
still held a row and 94 pages, and a client waited out its whole timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx
import pytest
from conftest import hf_greedy, model_path
from test_e2e_pd import free_port, spawn, stop, wait_healthy
from test_e2e_sglang_router import wait_router, worker

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N_REQUESTS = 16
PROMPT_LEN = 200
LONG = 400  # new tokens per request: still decoding when the kill lands
KILL_AFTER_S = 0.6  # after the requests went out (as the issue reported it)
FREE_WITHIN_S = 15.0
STATUS_WITHIN_S = 20.0


def _ids(i: int) -> list[int]:
    return [5 + (j * 7 + i * 13) % 3000 for j in range(PROMPT_LEN)]


async def _one(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, float]:
    body = {"input_ids": _ids(i), "sampling_params": {
        "max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    try:
        r = await c.post(url + "/generate", json=body)
        status = r.status_code
    except httpx.HTTPError:  # a connection the router dropped is an answer too
        status = -1
    return status, time.monotonic()


def _info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=5).json()


def _all_free(info: dict) -> bool:
    return (
        info["free_rows"] == info["total_rows"]
        and info["free_kv_pages"] == info["total_kv_pages"]
        and info["running"] == 0
        and info.get("queued", 0) == 0
        and info.get("holding", 0) == 0
    )


async def _kill_under_load(url: str, prefill: str, decode: str, proc) -> tuple[list, float, float]:  # type: ignore[no-untyped-def]
    """(client results, kill time, when the prefill was all free) with the decode killed
    while the requests decode."""
    async with httpx.AsyncClient(timeout=STATUS_WITHIN_S + 40) as c:
        tasks = [asyncio.create_task(_one(c, url, i)) for i in range(N_REQUESTS)]
        await asyncio.sleep(KILL_AFTER_S)
        os.killpg(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        free_at = float("inf")
        while time.monotonic() - killed < STATUS_WITHIN_S + 5:
            if free_at == float("inf") and _all_free(_info(prefill)):
                free_at = time.monotonic()
            if free_at < float("inf") and all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.2)
        results = await asyncio.gather(*tasks)
    return results, killed, free_at


def test_decode_killed_behind_sglang_router_frees_the_prefill():
    model = model_path("tiny")
    pp, boot, dp, rp = free_port(), free_port(), free_port(), free_port()
    prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    procs = [spawn(worker("prefill", pp, boot, model), "kill-prefill"),
             spawn(worker("decode", dp, None, model), "kill-decode")]  # fmt: skip
    try:
        want = hf_greedy(model, _ids(99), 8)  # while the servers start
        for u in (prefill, decode):
            wait_healthy(u, procs)
        router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                  "--prefill", prefill, str(boot), "--decode", decode,
                  "--host", "127.0.0.1", "--port", str(rp)]  # fmt: skip
        procs.append(spawn(router, "kill-router"))
        url = f"http://127.0.0.1:{rp}"
        wait_router(url, procs[-1])

        results, killed, free_at = asyncio.run(_kill_under_load(url, prefill, decode, procs[1]))
        procs[1].wait(timeout=10)
        print(
            f"prefill free {free_at - killed:.1f} s after the kill; statuses "
            f"{sorted(st for st, _ in results)}, last at {max(t for _, t in results) - killed:.1f} s"
        )
        late = [round(t - killed, 1) for _, t in results if t - killed > STATUS_WITHIN_S]
        assert not late, f"clients answered {late} s after the kill"
        assert free_at - killed <= FREE_WITHIN_S, (free_at - killed, _info(prefill))

        # The restarted decode on the same port, behind a fresh router: the first one keeps
        # its circuit breakers open for its default 60 s after these failures
        procs[1] = spawn(worker("decode", dp, None, model), "kill-decode2")
        wait_healthy(decode, procs)
        procs[2].terminate()
        procs[2].wait(timeout=10)
        rp2 = free_port()
        procs[2] = spawn([*router[:-1], str(rp2)], "kill-router2")
        url = f"http://127.0.0.1:{rp2}"
        wait_router(url, procs[2])
        body = {"input_ids": _ids(99), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        assert _all_free(_info(prefill)) and _all_free(_info(decode))
    finally:
        stop(*procs, grace_s=10)
