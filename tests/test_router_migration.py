"""The router's migration, watchdog and shedding, against fake workers (no model).

One router in front of one prefill and two decodes; each test sets the decodes' faults
(fake_workers.py: `stall_at`, `error_at`, `fail_status`) and resets them after. Event i
of a fake stream stands for token 100 + i, so a stream the client reads as i = 0, 1, ...
with nothing repeated or skipped across the two decodes is one continued stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fake_workers import FakeWorker, Served
from fault_proxy import FaultProxy

from pdserve.router.app import RouterConfig, create_app

CHUNKS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[FakeWorker, list[FakeWorker], str]]:
    p = FakeWorker("prefill", "P").start()
    ds = [FakeWorker("decode", f"D{i}", stream_chunks=CHUNKS, first_try_only=True).start()
          for i in range(2)]  # fmt: skip
    cfg = RouterConfig(prefill=((p.url, 9001),), decode=tuple(d.url for d in ds),
                       stall_timeout_s=0.5, health_interval_s=60.0)  # fmt: skip
    router = Served(create_app(cfg))
    yield p, ds, router.url
    router.stop()
    for w in (p, *ds):
        w.stop()


@pytest.fixture
def decodes(cluster) -> Iterator[list[FakeWorker]]:
    _, ds, _ = cluster
    yield ds
    for d in ds:
        d.stall_at = d.error_at = d.fail_status = None
        d.received.clear()


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/generate", json=body | {"stream": True}, timeout=10) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    assert ": ids" not in raw, "the router strips the token-id comments"
    return [json.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: {")]


def _tried(decodes: list[FakeWorker]) -> tuple[FakeWorker, FakeWorker]:
    """(the decode that got the first try, the other one)."""
    first = [
        d for d in decodes if any("-m" not in r.body["rid"] for r in d.gen_requests(timeout=0))
    ]
    assert len(first) == 1
    return first[0], next(d for d in decodes if d is not first[0])


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f"pdserve:router_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} counter")


@pytest.mark.parametrize("fault", ["stall", "error"])
def test_a_stream_continues_on_the_other_decode_after_the_tokens_sent(cluster, decodes, fault):
    _, _, url = cluster
    for d in decodes:
        setattr(d, f"{fault}_at", 3)
    moved, stuck = _counter(url, "migrated"), _counter(url, "stuck")
    t0 = time.monotonic()
    events = _stream(url, {"text": "x", "sampling_params": {"max_new_tokens": CHUNKS}})
    bad, good = _tried(decodes)
    assert [e["i"] for e in events] == list(range(CHUNKS))  # nothing lost, nothing twice
    assert [e["worker"] for e in events] == [bad.name] * 3 + [good.name] * 3
    (resumed,) = good.gen_requests(1)
    assert resumed.body["resume_ids"] == [100, 101, 102]
    assert resumed.body["rid"] == bad.gen_requests(1)[0].body["rid"] + "-m1"
    assert _counter(url, "migrated") == moved + 1
    assert _counter(url, "stuck") == stuck + (fault == "stall")
    assert time.monotonic() - t0 < 5.0  # the stall timeout (0.5 s), not the request's


def test_a_stream_that_cannot_be_continued_ends_with_one_error(cluster, decodes):
    _, _, url = cluster
    for d in decodes:
        d.error_at = 2
    body = {"text": "x", "sampling_params": {"max_new_tokens": CHUNKS, "seed": 7}}
    events = _stream(url, body)
    _, good = _tried(decodes)
    assert [e.get("i") for e in events] == [0, 1, None] and "error" in events[-1]
    assert good.gen_requests(timeout=0.3) == []


def test_a_failed_request_runs_again_on_the_other_decode(cluster, decodes):
    _, _, url = cluster
    for d in decodes:
        d.fail_status = 503
    r = httpx.post(
        url + "/generate", json={"text": "x", "sampling_params": {"seed": 1}}, timeout=10
    )
    _, good = _tried(decodes)
    assert r.status_code == 200 and r.json()["text"].startswith(good.name)
    assert "resume_ids" not in good.gen_requests(1)[0].body


def test_with_every_decode_failing_the_client_gets_the_last_error(cluster, decodes):
    _, _, url = cluster
    for d in decodes:
        d.fail_status, d.first_try_only = 503, False
    r = httpx.post(url + "/generate", json={"text": "x"}, timeout=10)
    for d in decodes:
        d.first_try_only = True
    assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
    assert [len(d.gen_requests(1)) for d in decodes] == [1, 1]  # each tried once


# ---- network faults: the link to one decode through a fault proxy ---------------------------


@pytest.fixture(scope="module")
def linked() -> Iterator[tuple[FaultProxy, list[FakeWorker], str]]:
    """A router whose first decode sits behind a FaultProxy; its streams are slow enough
    (20 events, 30 ms apart) for a fault to land mid-stream."""
    p = FakeWorker("prefill", "P").start()
    ds = [FakeWorker("decode", f"L{i}", stream_chunks=20, chunk_delay_s=0.03).start()
          for i in range(2)]  # fmt: skip
    proxy = FaultProxy(ds[0].port)
    cfg = RouterConfig(prefill=((p.url, 9001),), decode=(proxy.url, ds[1].url),
                       stall_timeout_s=0.5, health_interval_s=60.0, health_timeout_s=0.5)  # fmt: skip
    router = Served(create_app(cfg))
    yield proxy, ds, router.url
    router.stop()
    proxy.close()
    for w in (p, *ds):
        w.stop()


def _through_proxy_then(url: str, ds: list[FakeWorker], fault: Callable[[], None]) -> list[dict]:
    """A stream that starts on the proxied decode (the other one looks unhealthy until
    the stream has 3 events); then the other is healthy again and `fault()` runs."""
    ds[1].healthy = False
    httpx.get(url + "/health", timeout=5)  # the router marks it
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 20}}
    events: list[dict] = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    ds[1].healthy = True
                    httpx.get(url + "/health", timeout=5)
                    fault()
    return events


@pytest.mark.parametrize("fault", ["stall", "cut"])
def test_a_broken_link_to_the_decode_moves_the_stream(linked, fault):
    proxy, ds, url = linked
    t0 = time.monotonic()

    def act() -> None:
        if fault == "stall":
            proxy.mode = "stall"
        else:
            proxy.cut()

    try:
        events = _through_proxy_then(url, ds, act)
    finally:
        proxy.mode = "pass"
    assert [e["i"] for e in events] == list(range(20))
    assert events[0]["worker"] == "L0" and events[-1]["worker"] == "L1"
    assert time.monotonic() - t0 < 8.0
    # the link restored, the proxied decode is used again
    httpx.get(url + "/health", timeout=5)
    n = len(ds[0].gen_requests(timeout=0))
    for _ in range(2):
        assert httpx.post(url + "/generate", json={"text": "x"}, timeout=10).status_code == 200
    assert len(ds[0].gen_requests(n + 1)) == n + 1


def test_a_slow_link_is_not_a_fault(linked):
    proxy, ds, url = linked
    proxy.mode, proxy.delay_s = "slow", 0.02
    try:
        events = _through_proxy_then(url, ds, lambda: None)
    finally:
        proxy.mode = "pass"
    assert [e["worker"] for e in events] == ["L0"] * 20


@pytest.mark.parametrize(
    ("path", "body", "ok"),
    [
        ("/v1/chat/completions", {"messages": [], "stream": True, "seed": None, "n": 1}, True),
        ("/v1/chat/completions", {"messages": [], "temperature": 0.7, "stop": ["x"]}, True),
        ("/v1/chat/completions", {"messages": [], "seed": 3}, False),
        ("/v1/chat/completions", {"messages": [], "logprobs": True}, False),
        (
            "/v1/chat/completions",
            {"messages": [], "response_format": {"type": "json_object"}},
            False,
        ),
        ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 0.5}, False),
        ("/v1/completions", {"prompt": ["a", "b"]}, False),
        ("/generate", {"text": "x", "sampling_params": {"frequency_penalty": 0.0}}, True),
        ("/generate", {"text": "x", "sampling_params": {"n": 2}}, False),
        ("/generate", {"input_ids": [[1], [2]]}, False),
        ("/generate", {"text": "x", "some_new_field": 1}, False),
    ],
)
def test_which_streams_may_resume(path, body, ok):
    from pdserve.router.attempt import resumable

    assert resumable(path, body) is ok


def test_a_draining_prefill_gets_no_new_work_and_its_refusal_goes_elsewhere():
    ps = [FakeWorker("prefill", f"P{i}").start() for i in range(2)]
    # the decode answers after the prefill's refusal (a real one waits for the KV)
    d = FakeWorker("decode", "D", hold_s=0.3).start()
    cfg = RouterConfig(prefill=tuple((p.url, 9001 + i) for i, p in enumerate(ps)),
                       decode=(d.url,), health_interval_s=60.0)  # fmt: skip
    router = Served(create_app(cfg))
    try:
        ps[0].fail_status = 503  # refuses as a draining frontend does, before /health says so
        for _ in range(2):  # whichever prefill the round robin starts at
            r = httpx.post(router.url + "/generate", json={"text": "x"}, timeout=10)
            assert r.status_code == 200
        assert len(ps[1].gen_requests(2)) == 2
        state = router.server.config.app.state.router  # type: ignore[attr-defined]
        assert state.stats["failed_total"] == 0
    finally:
        router.stop()
        for w in (*ps, d):
            w.stop()


def test_a_draining_decode_keeps_its_stream_and_gets_no_new_one(linked):
    proxy, ds, url = linked

    def drain() -> None:
        ds[0].draining = True
        httpx.get(url + "/health", timeout=5)  # the router sees it

    try:
        events = _through_proxy_then(url, ds, drain)
        time.sleep(1.0)  # two watchdog passes, past the stall timeout of a silent stream
        r = httpx.post(url + "/generate", json={"text": "x"}, timeout=10)
    finally:
        ds[0].draining = False
        httpx.get(url + "/health", timeout=5)
    assert [e["worker"] for e in events] == ["L0"] * 20  # finished where it ran
    assert r.status_code == 200 and r.json()["text"].startswith("L1")


def test_a_rid_that_is_no_string_is_the_workers_to_refuse(cluster, decodes):
    _, _, url = cluster
    r = httpx.post(url + "/generate", json={"text": "x", "rid": []}, timeout=10)
    assert r.status_code == 200  # the fake workers take it; a real one answers 400
