"""The KV link under network faults: stalled, then cut, then restored, mid-transfer.

One stack for the module (router, prefill, decode: real processes, the `tiny` model) whose
prefill <-> decode ZeroMQ link runs through two FaultProxy hops, as a TCP hop between two
hosts would:

    control  decode DEALER ──▶ CTL proxy 127.0.0.1:c  ──▶ prefill bootstrap ROUTER 127.0.0.1:b
             (the router names the proxy's port as the prefill's bootstrap port)
    data     prefill PUSH  ──▶ DATA proxy 127.0.0.2:d ──▶ decode data PULL 127.0.0.1:d
             (the decode binds 127.0.0.1 and advertises 127.0.0.2: --advertise-host)

What docs/reliability.md promises, checked here: a stall shorter than
`heartbeat_timeout_s` is ridden out (the requests finish with transformers' greedy
tokens); a cut loses what was on the wire, and the transfers it caught get their KV
pushed again once the link is back: each request finishes once, with transformers'
tokens, soon after, not after a timeout (`kv_timeout_s` is 60 s here); afterwards
nothing is held and the link serves exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fault_proxy import FaultProxy

from benchmarks.soak import Cluster, server_info, wait_quiet
from pdserve.server.launch_children import free_port
from tests.conftest import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STALL_S = 5.0
# The heartbeat timeout outlasts the stall (which is then ridden out), and every timeout is
# beyond the bound a faulted request must end within (BOUND_S): what ends a request the
# cut caught is the transfer's own recovery, never a request left to a timeout.
TIMEOUTS = {"kv_ready_timeout_s": 60.0, "kv_timeout_s": 60.0, "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 20.0}  # fmt: skip
# HTTP hops, process polls, the repeated KVDone's back-off (1 s at most here) and the
# push again, on a loaded 2-core box
SLACK_S = 7.0
BOUND_S = STALL_S + SLACK_S  # slowest request of a faulted load
# prompts are prefilled 4 tokens a step and their KV sent as it is made, so a load of
# 4 x 400 tokens is mid-transfer for about a second
PROMPT_LEN, NEW_TOKENS, LOAD = 400, 6, 4
Result = tuple[int, list[str], float, list[int]]  # (status, body lines, seconds, prompt)
_SALT = [0]  # a fresh prompt per request: the prefix cache must not skip a transfer


@dataclasses.dataclass
class Stack:
    cluster: Cluster
    prefill: str
    decode: str
    router: str
    ctl: FaultProxy
    data: FaultProxy
    model: str

    def faults(self, mode: str) -> None:
        self.ctl.mode = self.data.mode = mode

    def cut(self) -> None:
        self.ctl.cut()
        self.data.cut()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cluster = Cluster(transfer=dict(TIMEOUTS))
    data_port = free_port()
    p = cluster.worker("prefill", ["--max-prefill-tokens", "4"])
    d = cluster.worker("decode", ["--data-port", str(data_port), "--advertise-host", "127.0.0.2"])
    assert p.bootstrap_port is not None
    ctl = FaultProxy(p.bootstrap_port)
    data = FaultProxy(data_port, listen_host="127.0.0.2", listen_port=data_port)
    try:
        cluster.launch([p, d])
        r = cluster.router([dataclasses.replace(p, bootstrap_port=ctl.port)], [d])
        cluster.launch([r])
        model = httpx.get(p.url + "/model_info", timeout=5).json()["model_path"]
        s = Stack(cluster, p.url, d.url, r.url, ctl, data, model)
        _assert_exact(s, _load(s, 2))
        assert ctl.connections and data.connections, "the KV link bypassed the proxies"
        yield s
    finally:
        cluster.stop()
        ctl.close()
        data.close()


async def _one(c: httpx.AsyncClient, url: str, stream: bool) -> Result:
    _SALT[0] += 1
    ids = [5 + (j * 7 + _SALT[0] * 131) % 3000 for j in range(PROMPT_LEN)]
    body = {"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    t0 = time.monotonic()
    try:
        async with c.stream("POST", url + "/generate", json=body) as r:
            lines = [ln async for ln in r.aiter_lines() if ln]
        return r.status_code, lines, time.monotonic() - t0, ids
    except httpx.TimeoutException:  # a hang: no terminal state within the bound
        return 0, ["client timeout"], time.monotonic() - t0, ids


async def _load_async(s: Stack, n: int) -> list[Result]:
    async with httpx.AsyncClient(timeout=BOUND_S + 5) as c:
        return list(await asyncio.gather(*(_one(c, s.router, i % 2 == 1) for i in range(n))))


def _load(s: Stack, n: int) -> list[Result]:
    return asyncio.run(_load_async(s, n))


def _mid_transfer(s: Stack) -> bool:
    """The prefill computes, and the decode waits for the KV of two requests or more it
    has reserved pages for (the others may be anywhere before: the fault holds or loses
    their Ready and Claim as well)."""
    return server_info(s.prefill).get("running", 0) > 0 and server_info(s.decode)["transfer"] >= 2


def _faulted(s: Stack, fault: Any) -> list[Result]:
    """LOAD requests (every other one streamed); `await fault()` once they are mid-transfer."""

    async def go() -> list[Result]:
        task = asyncio.ensure_future(_load_async(s, LOAD))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(_mid_transfer, s):
            assert time.monotonic() < deadline and not task.done(), "never mid-transfer"
            await asyncio.sleep(0.01)
        try:
            await fault()
        finally:
            s.faults("pass")
        return await task

    return asyncio.run(go())


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]


def _output_ids(res: Result) -> list[int] | None:
    """The tokens of a request that ended well, None for one that ended in an error."""
    status, lines, _, _ = res
    if status != 200:
        return None
    events = _events(lines)
    if not events:  # not streamed: one JSON body
        body = json.loads("".join(lines))
        return None if "error" in body else list(body["output_ids"])
    if any("error" in e for e in events):
        return None
    assert lines[-1] == "data: [DONE]", lines
    return list(events[-1]["output_ids"])  # cumulative


def _assert_exact(s: Stack, results: list[Result]) -> None:
    for res in results:
        assert _output_ids(res) == hf_greedy(s.model, res[3], NEW_TOKENS), res[:3]


def _assert_quiet(s: Stack) -> None:
    """Rows, pages and transfer rooms all free on both workers."""
    held = wait_quiet([s.prefill, s.decode], timeout_s=SLACK_S)
    assert not held, (held, s.cluster.logs())
    for url in (s.prefill, s.decode):
        info = server_info(url)
        assert info.get("transfer_active_rooms", 0) == 0, (url, info)


def _recoveries(s: Stack) -> dict[str, float]:
    """The counters of the three ways a cut link recovers (docs/reliability.md): what the
    cut held decides which moves (KV on the wire: pushed again; a KVDone or its answer:
    the prefill repeats the KVDone; a Ready or the Claim: the decode repeats the Ready),
    and which the stall caught depends on the moment, so the test asks for any of them."""
    p, d = server_info(s.prefill), server_info(s.decode)
    return {"pushed_again": p.get("transfer_pushed_again", 0),
            "repeated_done": d.get("transfer_repeated_done", 0),
            "ready_sent_again": d.get("transfer_ready_sent_again", 0)}  # fmt: skip


def test_stalled_link_is_ridden_out(stack: Stack) -> None:
    async def stall() -> None:
        stack.faults("stall")
        await asyncio.sleep(STALL_S)

    results = _faulted(stack, stall)
    _assert_exact(stack, results)
    slowest = max(r[2] for r in results)
    assert slowest >= STALL_S - 0.5, f"the stall held no request: {results}"
    assert slowest < BOUND_S, results
    print(f"stall {STALL_S}s: slowest request {slowest:.2f}s")  # figures (pytest -s)
    _assert_quiet(stack)


def test_stalled_then_cut_link_loses_no_request(stack: Stack) -> None:
    async def stall_then_cut() -> None:
        stack.faults("stall")
        await asyncio.sleep(STALL_S)
        stack.cut()  # what the stalled connections held is lost with them

    before = _recoveries(stack)
    results = _faulted(stack, stall_then_cut)
    _assert_exact(stack, results)
    slowest = max(r[2] for r in results)
    assert slowest >= STALL_S - 0.5, f"the fault caught no request: {results}"
    assert slowest < BOUND_S, results  # not kv_timeout_s
    after = _recoveries(stack)
    moved = {k: after[k] - before[k] for k in after if after[k] > before[k]}
    assert moved, f"the cut lost nothing that had to be sent again: {after}"
    print(f"stall {STALL_S}s + cut: slowest request {slowest:.2f}s, recovered by {moved}")
    _assert_quiet(stack)
    # the link restored: requests through it are exact again
    _assert_exact(stack, _load(stack, 2))
    _assert_quiet(stack)
