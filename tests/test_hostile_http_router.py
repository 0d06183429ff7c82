"""Hostile HTTP at the router (in front of recording fake workers): an abort reaches
only the legs the router leased for exactly that rid, with its key; the key guards
every route but /health; a failing request or health tick does not stop the router,
and a loop that dies anyway makes it unhealthy and ends the process non-zero.

Each test fails on the code before these rules: the router then sent any rid it was
given to every worker (which ended every rid starting with it + "-"), compared keys
with `!=`, served /metrics without the key, let one failing request keep its workers'
in-flight count forever, and lost its health loop for good to one failing tick.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fake_workers import FakeWorker, Served, free_port

from pdserve.router import app as router_app
from pdserve.router import proxy
from pdserve.router.app import RouterConfig, create_app

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def pair():
    p, d = FakeWorker("prefill", "p").start(), FakeWorker("decode", "d").start()
    yield p, d
    p.stop()
    d.stop()


def start(p: FakeWorker, d: FakeWorker, on_fatal=None, **kw) -> Served:
    cfg = RouterConfig(prefill=((p.url, 9000),), decode=(d.url,), **kw)
    return Served(create_app(cfg, on_fatal) if on_fatal else create_app(cfg))


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def post_in_background(url: str, body: dict) -> threading.Thread:
    t = threading.Thread(target=httpx.post, args=(url + "/generate",),
                         kwargs={"json": body, "headers": AUTH, "timeout": 10}, daemon=True)  # fmt: skip
    t.start()
    return t


def test_router_aborts_only_the_legs_it_leased_by_their_exact_rid(pair):
    p, d = pair
    p.hold_s = d.hold_s = 1.5
    router = start(p, d, api_key=KEY)
    try:
        held = [post_in_background(router.url, {"text": "x", "rid": rid})
                for rid in ("pdr-x", "pdr-y")]  # fmt: skip
        assert wait_for(lambda: len(d.gen_requests()) == 2)
        r = httpx.post(router.url + "/abort_request", json={"rid": "pdr"}, headers=AUTH)
        assert r.status_code == 404 and "pdr" in r.json()["error"]["message"]
        r = httpx.post(router.url + "/abort_request", json={"rid": "pdr-x"}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert {w["url"] for w in r.json()["workers"]} == {p.url, d.url}
        for w in (p, d):
            assert w.aborted == [{"rid": "pdr-x"}]
            (sent,) = [x for x in w.received if x.path == "/abort_request"]
            assert sent.headers["authorization"] == f"Bearer {KEY}"  # the workers want it too
        bad = httpx.post(router.url + "/abort_request", json={"rid": ["pdr-x"]}, headers=AUTH)
        assert bad.status_code == 400
        for t in held:
            t.join(10)
    finally:
        router.stop()


def test_every_router_route_but_health_wants_the_key(pair):
    router = start(*pair, api_key=KEY)
    try:
        paths = ("/metrics", "/server_info", "/model_info", "/v1/models", "/health_generate",
                 "/console/state")  # fmt: skip
        for path in paths:  # (the console's static files are open: tests/test_console.py)
            for headers in ({}, {"Authorization": "Bearer no"}, {"Authorization": KEY}):
                assert httpx.get(router.url + path, headers=headers).status_code == 401, path
        header = [(b"authorization", "Bearer ключ".encode())]  # compare_digest on bytes
        assert httpx.get(router.url + "/metrics", headers=header).status_code == 401
        assert httpx.get(router.url + "/metrics", headers=AUTH).status_code == 200
        assert httpx.get(router.url + "/health").status_code == 200
        assert httpx.options(router.url + "/v1/models").status_code == 405  # a preflight passes
    finally:
        router.stop()
    router = start(*pair, api_key=KEY, metrics_public=True)
    try:
        assert httpx.get(router.url + "/metrics").status_code == 200
        assert httpx.get(router.url + "/server_info").status_code == 401
    finally:
        router.stop()


def test_a_failing_request_fails_alone_and_gives_its_lease_back(pair, monkeypatch):
    p, d = pair
    router = start(p, d)
    state = router.server.config.app.state.router
    real = proxy.post_prefill

    async def broken(*args, **kw):
        raise RuntimeError("a bug in the prefill leg")

    try:
        monkeypatch.setattr(proxy, "post_prefill", broken)
        r = httpx.post(router.url + "/generate", json={"text": "x"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "router_error"
        assert wait_for(lambda: all(w.in_flight == 0 for w in state.pool.all))
        monkeypatch.setattr(proxy, "post_prefill", real)
        assert httpx.post(router.url + "/generate", json={"text": "x"}).status_code == 200
        assert httpx.get(router.url + "/health").status_code == 200
    finally:
        router.stop()


def test_the_health_loop_survives_a_failing_tick(pair):
    p, d = pair
    router = start(p, d, health_interval_s=0.05)
    state = router.server.config.app.state.router
    real_get, failures = state.client.get, []

    async def flaky_get(*args, **kw):
        if len(failures) < 3:  # not an httpx error: nothing in check() expects it
            failures.append(1)
            raise RuntimeError("unexpected")
        return await real_get(*args, **kw)

    try:
        state.client.get = flaky_get
        assert wait_for(lambda: len(failures) == 3)
        d.healthy = False  # only a live loop can notice (nobody asks the router's /health)
        (decode,) = state.pool.decode.workers
        assert wait_for(lambda: not decode.healthy), "the health loop died"
        d.healthy = True
        assert wait_for(lambda: decode.healthy)
        assert state.fatal is None
    finally:
        router.stop()


def test_a_dead_loop_makes_the_router_unhealthy(pair, monkeypatch):
    async def dies(state):
        await asyncio.sleep(0.1)
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(router_app, "_health_loop", dies)
    reasons: list[str] = []
    router = start(*pair, on_fatal=reasons.append)
    try:
        assert wait_for(lambda: reasons)
        r = httpx.get(router.url + "/health")
        assert r.status_code == 503 and "a bug in the loop" in r.json()["error"]
        assert reasons == ["the worker health loop stopped: RuntimeError('a bug in the loop')"]
    finally:
        router.stop()


DYING_ROUTER = """
import asyncio, sys
import pdserve.router.app as app
async def dies(state):
    await asyncio.sleep(0.3)
    raise RuntimeError("a bug in the loop")
app._health_loop = dies
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_loop_ends_the_router_process_non_zero():
    argv = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--port", str(free_port())]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", DYING_ROUTER, *argv], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    assert "pdserve router: the worker health loop stopped" in out.stderr


def test_sglang_router_with_a_key_requires_it_and_sends_it_to_the_workers(pair):
    """What deploy/k8s relies on (sglang-router --api-key): clients need the key, the
    workers get it on every call but /health."""
    pytest.importorskip("sglang_router")
    p, d = pair
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--prefill", p.url, "8998", "--decode", d.url, "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(free_port()), "--api-key", KEY]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:

        def registered() -> bool:
            return all("/model_info" in [r.path for r in w.received] for w in pair)

        assert wait_for(registered, timeout=30), "sglang-router did not register the workers"
        assert httpx.post(url + "/generate", json={"text": "x"}, timeout=10).status_code == 401
        r = httpx.post(url + "/generate", json={"text": "x"}, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: p.gen_requests() and d.gen_requests())
        for w in pair:
            for got in w.received:
                want = None if got.path == "/health" else f"Bearer {KEY}"
                assert got.headers.get("authorization") == want, (w.role, got.path)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
