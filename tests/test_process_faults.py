"""Real processes, real faults: SIGSTOP and kill -9 of an engine while transfers are in flight.

One module-wide set of servers (short transfer timeouts, `TIMEOUTS`); the tests run in file
order and each leaves a serving stack behind for the next:

    stall prefill (SIGSTOP/SIGCONT)  ->  kill prefill, new prefill  ->  kill decode, new decode

The prefills run 2-token prefill chunks so that prompts of a few hundred tokens are still
being prefilled when the fault lands (at 8-token steps and 240-token prompts all four
could finish before a kill landed; at 2 and 240, before a loaded box's poll saw them).
Requests are greedy: every 200 must carry exactly transformers' tokens (a 200 built from
damaged KV would not), every other outcome must be an error.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from benchmarks.soak import Cluster, server_info, wait_quiet
from pdserve.server.launch_children import Child
from tests.conftest import hf_greedy, model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
# kv_timeout (10 s) outlasts a slow prefill of the faulted load on a loaded CPU. What must fire
# for a dead or stalled prefill is the heartbeat timeout (or the engine-exit watch).
TIMEOUTS = {"kv_ready_timeout_s": 10.0, "kv_timeout_s": 10.0, "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 2.0}  # fmt: skip
SLACK_S = 8.0  # HTTP hops, process polls and a loaded 2-core box
BOUND_S = TIMEOUTS["heartbeat_timeout_s"] + SLACK_S
SLOW_PREFILL = ["--max-prefill-tokens", "2"]  # 4 prompts of PROMPT_LEN: ~960 steps, ~2 s
PROMPT_LEN = 480  # under the cluster's --max-context 512 with NEW_TOKENS
NEW_TOKENS = 6
Result = tuple[int, list[str], float, list[int]]  # (status, body lines, seconds, prompt ids)


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    cluster = Cluster(transfer=dict(TIMEOUTS))
    try:
        p, d = cluster.worker("prefill", SLOW_PREFILL), cluster.worker("decode")
        cluster.launch([p, d])
        r = cluster.router([p], [d])
        cluster.launch([r])
        _MODEL["path"] = httpx.get(p.url + "/model_info", timeout=5).json()["model_path"]
        yield {"cluster": cluster, "p": p, "d": d, "r": r}
    finally:
        cluster.stop()


async def _one(c: httpx.AsyncClient, url: str, i: int, plen: int, stream: bool) -> Result:
    ids = [5 + (j * 7 + i * 13) % 3000 for j in range(plen)]
    body = {"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    t0 = time.monotonic()
    async with c.stream("POST", url + "/generate", json=body) as r:
        lines = [ln async for ln in r.aiter_lines() if ln]
    return r.status_code, lines, time.monotonic() - t0, ids


async def _load(url: str, n: int, plen: int) -> list[Result]:
    async with httpx.AsyncClient(timeout=BOUND_S + 60) as c:
        return list(await asyncio.gather(*(_one(c, url, i, plen, i % 2 == 1) for i in range(n))))


def _busy(url: str) -> bool:
    info = server_info(url)
    return info.get("running", 0) + info.get("queued", 0) > 0


def _fault_during_load(url: str, busy_url: str, fault: Callable[[], None]) -> list[Result]:
    """4 requests (2 streamed); `fault()` once `busy_url` reports them in flight.
    Precondition: none of them can finish before that (slow prefill), and `fault` is quick
    (a signal to a pid looked up before the load: no HTTP call between seeing the requests
    in flight and the fault)."""

    async def go() -> list[Result]:
        task = asyncio.ensure_future(_load(url, 4, PROMPT_LEN))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(_busy, busy_url):
            assert time.monotonic() < deadline and not task.done(), "requests never in flight"
            await asyncio.sleep(0.01)
        fault()
        return await task

    return asyncio.run(go())


def _failed_cleanly(res: Result) -> bool:
    """An HTTP error with an error body, or a stream that ends in an error event after
    zero or more token events whose tokens are a prefix of the reference's (a request
    already decoding when its decode died streamed those before the error)."""
    status, lines, _, ids = res
    if status >= 500:
        return "error" in "".join(lines)
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    if status != 200 or not events or "error" not in events[-1]:
        return False
    if any("error" in e for e in events[:-1]):
        return False
    got = list(events[-2].get("output_ids", [])) if len(events) > 1 else []
    return got == hf_greedy(_MODEL["path"], ids, NEW_TOKENS)[: len(got)]


def _completed(res: Result) -> bool:
    """A 200 without any error event whose tokens are the reference's: its KV was fully
    transferred and validated before the fault (on a quiet machine one can get through)."""
    status, lines, _, ids = res
    if status != 200 or any("error" in ln for ln in lines):
        return False
    return _output_ids(lines) == hf_greedy(_MODEL["path"], ids, NEW_TOKENS)


_MODEL: dict[str, str] = {}  # the served checkpoint (filled by the fixture from /model_info)


def _output_ids(lines: list[str]) -> list[int]:
    """Tokens of a non-streamed body, or of a stream's last event (they are cumulative)."""
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    body = events[-1] if events else json.loads("".join(lines))
    return list(body.get("output_ids", []))


def _assert_failed(results: list[Result]) -> None:
    """Every request either fails cleanly or had completed its transfer; at least one fails."""
    assert all(_failed_cleanly(r) or _completed(r) for r in results), results
    assert any(map(_failed_cleanly, results)), f"the fault hit no request: {results}"
    slowest = max(r[2] for r in results)
    assert slowest < BOUND_S, results
    print(f"slowest failed request: {slowest:.2f}s")  # figures (pytest -s)


def _assert_quiet(urls: list[str], bound_s: float, logs: str = "") -> None:
    t0 = time.monotonic()
    assert not wait_quiet(urls, timeout_s=bound_s), logs
    print(f"pools free after {time.monotonic() - t0:.2f}s: {urls}")


def _serves(url: str, model: str = "") -> None:
    """Two requests answered 200 with the reference tokens of `model` (default: the stack's)."""
    results = asyncio.run(_load(url, 2, 20))
    served = _MODEL["path"]
    try:
        _MODEL["path"] = model or served
        assert all(map(_completed, results)), results
    finally:
        _MODEL["path"] = served


def test_stalled_prefill_fails_requests_and_recovers(stack: dict[str, Any]) -> None:
    p, d, r = stack["p"], stack["d"], stack["r"]
    _serves(r.url)
    engine = int(server_info(p.url)["engine_pid"])
    stopped = False

    def stop() -> None:
        nonlocal stopped
        os.kill(engine, signal.SIGSTOP)
        stopped = True

    try:
        _assert_failed(_fault_during_load(r.url, p.url, stop))
        _assert_quiet([d.url], BOUND_S, stack["cluster"].logs())
    finally:
        if stopped:
            os.kill(engine, signal.SIGCONT)
    # the prefill drops its stale rooms (aborted by the router, or timed out) and serves again
    _assert_quiet([p.url], TIMEOUTS["kv_ready_timeout_s"] + SLACK_S)
    _serves(r.url)


def test_killed_prefill_fails_requests_decode_survives(stack: dict[str, Any]) -> None:
    cluster: Cluster = stack["cluster"]
    p, d, r = stack["p"], stack["d"], stack["r"]
    _assert_failed(_fault_during_load(r.url, p.url, _killer(p)))
    assert httpx.get(d.url + "/health", timeout=5).status_code == 200
    _assert_quiet([d.url], BOUND_S, cluster.logs())
    p2 = cluster.worker("prefill", SLOW_PREFILL)
    cluster.launch([p2])
    r2 = cluster.router([p2], [d])
    cluster.launch([r2])
    _serves(r2.url)
    stack.update(p=p2, r=r2)


def test_killed_decode_fails_requests_prefill_frees_kv(stack: dict[str, Any]) -> None:
    cluster: Cluster = stack["cluster"]
    p, d, r = stack["p"], stack["d"], stack["r"]
    _assert_failed(_fault_during_load(r.url, p.url, _killer(d)))
    # the prefill finds the dead decode by its missing heartbeats and frees what it held
    _assert_quiet([p.url], BOUND_S, cluster.logs())
    d2 = cluster.worker("decode")
    cluster.launch([d2])
    r3 = cluster.router([p], [d2])
    cluster.launch([r3])
    _serves(r3.url)
    stack.update(d=d2, r=r3)


def test_different_models_refuse_each_other_and_both_serve_their_own(stack) -> None:  # type: ignore[no-untyped-def]
    """A decode serving another model (same architecture, vocab and KV layout as the
    stack's tiny model; only the rope config differs) behind the stack's prefill: the
    request fails naming the mismatch, and both engines then serve their own model."""
    cluster: Cluster = stack["cluster"]
    p, r = stack["p"], stack["r"]
    other = str(model_path("tiny-llama3"))
    pm, dm = (cluster.worker(role, ["--model", other]) for role in ("prefill", "decode"))
    cluster.launch([pm, dm])
    r_bad, r_own = cluster.router([p], [dm]), cluster.router([pm], [dm])
    cluster.launch([r_bad, r_own])
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    bad = httpx.post(r_bad.url + "/generate", json=body, timeout=BOUND_S + 30)
    assert bad.status_code >= 500 and "model mismatch" in bad.text and "config" in bad.text, (
        bad.text
    )
    for w in (p, dm):
        assert httpx.get(w.url + "/health", timeout=5).status_code == 200, w.name
    _serves(r.url)  # the stack's prefill with its own decode
    _serves(r_own.url, other)  # the other decode with a prefill of its model
    _assert_quiet([p.url, dm.url, pm.url], BOUND_S, cluster.logs())


def _killer(worker: Child) -> Callable[[], None]:
    """kill -9 of `worker`'s engine, its pid looked up now."""
    pid = int(server_info(worker.url)["engine_pid"])
    return lambda: os.kill(pid, signal.SIGKILL)
