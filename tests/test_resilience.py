"""Streams that survive a worker, through `pdserve up` with one prefill and two decodes.

One stack for the module (the tiny model; short router timeouts: `ROUTER`); the tests run
in file order and each leaves a serving stack behind:

    resume  ->  SIGSTOP decode0  ->  kill -9 decode0 (pdserve up restarts it)  ->  SIGTERM
    decode1 and the prefill while decode0 starts again (the drain alone must carry the
    streams)

Each fault lands while every stream of the load has some tokens and none has all. A
stream must then end exactly as it did undisturbed (the reference run, same stack): the
router moves it to the other decode after the tokens its client has (migration), so no
token is lost or repeated, and `usage` counts all. Afterwards no worker holds a row or a
page, and the router counted what it did.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.soak import wait_quiet
from tests.conftest import model_path
from tests.test_e2e_pd import free_port, spawn, stop, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROUTER = ["--health-interval", "0.5", "--stall-timeout", "5"]
WORKERS = ["--max-total-tokens", "8192", "--max-running-requests", "8", "--drain-timeout", "30"]
NEW = 480  # tokens per stream: a fault lands mid-stream even when the client polls late
# (a quiet run saw streams at 50-90 tokens when the last one had its 3rd)
STREAMS = 6  # /generate streams (token ids compared); plus CHATS chat streams (text, usage)
CHATS = 2
BOUND_S = 90.0  # a client gives up after this: any hang fails the test


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    port = free_port()
    logs = tempfile.mkdtemp(prefix="pdserve-resilience-")
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--grace-period", "5",
            "--model", str(model_path("tiny")), "--num-decode", "2", "--restart-backoff", "0.5",
            "--log-dir", logs, *ROUTER, *WORKERS]  # fmt: skip
    proc = spawn(argv, "resilience")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        info = httpx.get(url + "/server_info", timeout=5).json()["router"]
        st = {"url": url, "proc": proc, "logs": Path(logs), "decodes": info["decode"],
              "workers": [info["prefill"][0][0], *info["decode"]]}  # fmt: skip
        st["ref"] = _load(url)
        assert all(isinstance(r, list) and len(r) == NEW for r in st["ref"][:STREAMS])
        yield st
    finally:
        stop(proc)


def _load(url: str, progress: dict[int, int] | None = None) -> list[Any]:
    """The load's outcomes in order: each /generate stream's output ids, then each chat
    stream's (text, usage); an error event or a status other than 200 as ("error", ...)."""

    async def run() -> list[Any]:
        async with httpx.AsyncClient(timeout=BOUND_S) as c:
            gens = [_generate(c, url, i, progress) for i in range(STREAMS)]
            chats = [_chat(c, url, i, progress) for i in range(STREAMS, STREAMS + CHATS)]
            return list(await asyncio.gather(*gens, *chats))

    return asyncio.run(run())


async def _generate(c: httpx.AsyncClient, url: str, i: int, progress: dict | None) -> Any:
    ids = [5 + (j * 7 + i * 13) % 300 for j in range(20 + 3 * i)]
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": NEW, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    out: list[int] = []
    async with c.stream("POST", url + "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event or r.status_code != 200:
                return ("error", r.status_code, event)
            assert event["output_ids"][: len(out)] == out, "cumulative ids never change"
            out = event["output_ids"]
            if progress is not None:
                progress[i] = len(out)
    return out


async def _chat(c: httpx.AsyncClient, url: str, i: int, progress: dict | None) -> Any:
    body = {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": NEW,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # fmt: skip
    text, usage, roles = "", None, 0
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event or r.status_code != 200:
                return ("error", r.status_code, event)
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                roles += "role" in choice["delta"]
                text += choice["delta"].get("content") or ""
                if progress is not None:
                    progress[i] = progress.get(i, 0) + 1
    return (text, usage, roles)


def _pid_on(url: str) -> int:
    """The pid of the server process listening at `url` (its argv names the port)."""
    port = url.rsplit(":", 1)[1]
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pdserve.cli" in argv and b"--port" in argv and port.encode() in argv:
            if b"up" not in argv:
                return int(d.name)
    raise AssertionError(f"no server on {url}")


def _under_fault(st: dict[str, Any], fault: Callable[[], None]) -> list[Any]:
    """The load, with `fault()` once every stream has tokens (the tests check that some
    were still running on the faulted decode: the router's migration counter)."""
    progress: dict[int, int] = {}
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.extend(_load(st["url"], progress)))
    t.start()
    deadline = time.monotonic() + BOUND_S
    while len(progress) < STREAMS + CHATS or min(progress.values()) < 3:
        assert t.is_alive() and time.monotonic() < deadline, f"no load to fault: {progress}"
        time.sleep(0.005)
    assert max(progress.values()) < NEW, f"a stream ended before the fault: {progress}"
    fault()
    t.join(BOUND_S + 10)
    assert not t.is_alive()
    return out


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f"pdserve:router_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(name)


def _healthy(url: str, worker: str) -> bool:
    health = httpx.get(url + "/health", timeout=5).json()
    return any(w["url"] == worker and w["healthy"] for w in health["workers"])


def _wait(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _check(st: dict[str, Any], out: list[Any], *gone: str) -> None:
    """The load's outcomes equal the undisturbed run's; no worker holds anything (but
    those `gone`: exited, or restarted and not yet serving)."""
    for got, want in zip(out, st["ref"], strict=True):
        assert got == want
    assert all(r[2] == 1 for r in out[STREAMS:]), "one role delta per chat stream"
    workers = [w for w in st["workers"] if w not in gone]
    assert wait_quiet(workers, 15.0) == {}, "a worker still holds rows or pages"


def test_a_stream_resumed_after_some_tokens_sends_the_rest_only(stack):
    """The workers' side of a migration (resume_ids): the text after the tokens given,
    no role delta again, usage counting them all."""
    url, k, n = stack["url"], 5, 24
    prompt = [5 + (j * 11) % 300 for j in range(30)]
    gen = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True,
                                                    "temperature": 0}}  # fmt: skip
    full = httpx.post(url + "/generate", json=gen, timeout=BOUND_S).json()
    head = httpx.post(url + "/generate", json=gen | {"sampling_params": {
        **gen["sampling_params"], "max_new_tokens": k}}, timeout=BOUND_S).json()  # fmt: skip
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "resume_ids": full["output_ids"][:k]}  # fmt: skip
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=BOUND_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event["choices"])
                usage = event.get("usage") or usage
    assert head["text"] + text == full["text"]
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "total_tokens": len(prompt) + n}  # fmt: skip
    gen |= {"stream": True, "resume_ids": full["output_ids"][:k]}
    with httpx.stream("POST", url + "/generate", json=gen, timeout=BOUND_S) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert all(e["output_ids"][:k] == full["output_ids"][:k] for e in events)
    assert events[-1]["output_ids"] == full["output_ids"] and events[-1]["text"] == full["text"]
    assert len(events[0]["output_ids"]) > k, "the resumed tokens are not sent alone"


def test_a_frozen_decode_is_given_up_on_and_rejoins(stack):
    st, decode = stack, stack["decodes"][0]
    pid = _pid_on(decode)
    stuck, moved = _counter(st["url"], "stuck"), _counter(st["url"], "migrated")
    try:
        out = _under_fault(st, lambda: os.killpg(pid, signal.SIGSTOP))
        assert not _healthy(st["url"], decode)
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert _counter(st["url"], "stuck") > stuck and _counter(st["url"], "migrated") > moved
    assert _wait(lambda: _healthy(st["url"], decode), 30.0), "it rejoins after SIGCONT"
    _check(st, out)


def test_kill_9_on_a_decode_loses_no_token_and_it_is_restarted(stack):
    st, decode = stack, stack["decodes"][0]
    pid = _pid_on(decode)
    moved = _counter(st["url"], "migrated")
    out = _under_fault(st, lambda: os.killpg(pid, signal.SIGKILL))
    assert _counter(st["url"], "migrated") > moved
    _check(st, out, decode)
    # NOTE: its start (a model load) is not waited for: the next test needs one decode
    assert _wait(lambda: _pid_on_or_none(decode) not in (None, pid), 30.0), "restarted"
    assert "decode0 restarted" in _up_log(st)


def test_sigterm_on_a_decode_and_the_prefill_drains_them_without_a_failed_request(stack):
    """Both at once, the streams past their prefill: the decode finishes its streams, the
    prefill its legs, and each exits 0 (and is restarted)."""
    st, decode, prefill = stack, stack["decodes"][1], stack["workers"][0]
    pids = {decode: _pid_on(decode), prefill: _pid_on(prefill)}
    # the last test's streams all moved to decode1: a health check it missed meanwhile
    # would send this load to decode0 alone, leaving decode1 nothing to drain
    assert _wait(lambda: _healthy(st["url"], decode), 30.0), "decode1 serves"

    def sigterm() -> None:
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)

    out = _under_fault(st, sigterm)
    _check(st, out, decode, prefill, st["decodes"][0])
    log = (st["logs"] / "decode1.log").read_text()
    drained = re.search(r"SIGTERM: draining \((\d+) requests in flight", log)
    assert drained and int(drained.group(1)) > 0, "it had streams to finish"
    assert "SIGTERM: draining" in (st["logs"] / "prefill0.log").read_text()
    for name in ("decode1", "prefill0"):
        assert _wait(lambda n=name: f"{n} exited with 0" in _up_log(st), 60.0), "drained: 0"


def _pid_on_or_none(url: str) -> int | None:
    try:
        return _pid_on(url)
    except AssertionError:
        return None


def _up_log(st: dict[str, Any]) -> str:
    path = Path(tempfile.gettempdir()) / f"pdserve-e2e-resilience-{os.getpid()}.log"
    return path.read_text() if path.exists() else ""
