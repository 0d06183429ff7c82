"""The router's two-leg forwarding, against recording fake workers over real HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fake_workers import FakeWorker, Served, free_port

from pdserve.router.app import RouterConfig, create_app


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def pd() -> Iterator[tuple[FakeWorker, FakeWorker, str]]:
    p, d = FakeWorker("prefill", "P").start(), FakeWorker("decode", "D").start()
    cfg = RouterConfig(prefill=((p.url, 9001),), decode=(d.url,))
    router = Served(create_app(cfg))
    yield p, d, router.url
    router.stop()
    p.stop()
    d.stop()


def test_both_legs_get_same_room_and_bootstrap_fields(pd):
    p, d, url = pd
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "extra_field": [7]}
    r = httpx.post(url + "/generate", json=body)
    assert r.status_code == 200
    (pr,), (dr,) = p.gen_requests(1), d.gen_requests(1)
    assert pr.body == dr.body  # identical legs
    room = pr.body["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert pr.body["bootstrap_host"] == "127.0.0.1" and pr.body["bootstrap_port"] == 9001
    assert pr.body["extra_field"] == [7] and pr.body["text"] == "hi"
    assert isinstance(pr.body["rid"], str)
    assert r.json()["text"] == f"D:{room}"  # the decode's answer is the client's
    r2 = httpx.post(url + "/v1/chat/completions", json={"messages": [], "rid": "mine"})
    assert r2.status_code == 200
    rooms = [w.gen_requests(2)[1].body["bootstrap_room"] for w in (p, d)]
    assert rooms[0] == rooms[1] != room  # a fresh room per request
    assert d.gen_requests()[1].body["rid"] == "mine"  # the client's rid is kept


def test_n_samples_and_batches_get_distinct_rooms(pd):
    p, d, url = pd
    httpx.post(url + "/v1/completions", json={"prompt": "a", "n": 2})
    httpx.post(url + "/generate", json={"text": ["a", "b", "c"], "sampling_params": {"n": 2}})
    for i, count in enumerate((2, 6)):
        rooms = p.gen_requests(2)[i].body["bootstrap_room"]
        assert rooms == d.gen_requests()[i].body["bootstrap_room"]
        assert isinstance(rooms, list) and len(set(rooms)) == count
    # n samples of one prompt share the request's rid (a frontend names them rid-0, rid-1,
    # ...); a batch's prompts would need one each, so it gets none
    assert p.gen_requests()[0].body["rid"] == d.gen_requests()[0].body["rid"]
    assert "rid" not in p.gen_requests()[1].body


def test_stream_relayed_intact(pd):
    p, d, url = pd
    d.stream_chunks, d.chunk_delay_s = 5, 0.02
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    room = d.gen_requests()[0].body["bootstrap_room"]
    events = [{"i": i, "worker": "D", "room": room} for i in range(5)]
    expected = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    assert raw == expected + b"data: [DONE]\n\n"


def test_prefill_answering_between_the_last_event_and_the_streams_end(pd):
    """The prefill leg's answer lands while the router waits for the decode stream's end:
    the stream still ends whole (it was cut, 'incomplete chunked read', when the wait for
    that end raised StopAsyncIteration inside the relay)."""
    p, d, url = pd
    d.stream_chunks, d.chunk_delay_s, d.end_delay_s = 2, 0.02, 0.6
    p.hold_s = 0.25  # answers after the decode's [DONE], before its stream ends
    with httpx.stream("POST", url + "/generate", json={"text": "x", "stream": True}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == 3, raw


@pytest.mark.parametrize("stream", [False, True])
def test_failing_prefill_returns_its_error_and_cancels_decode(pd, stream):
    p, d, url = pd
    p.fail_status, d.hold_s = 500, 15.0
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json={"text": "x", "stream": stream}, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["message"] == "P failed"
    assert time.monotonic() - t0 < 8.0  # did not wait for the held decode (15 s)
    assert wait_for(lambda: d.disconnected == ["/generate"])
    rid = d.gen_requests()[0].body["rid"]
    assert wait_for(lambda: d.aborted == [{"rid": rid}] and p.aborted == [{"rid": rid}])


@pytest.mark.parametrize("stream", [False, True])
def test_decode_answer_is_not_held_by_a_stalled_prefill(pd, stream):
    """The decode's complete answer proves the KV arrived; a prefill that has not answered
    (a stopped engine) must not hold it (it did, 30 s, for non-streamed requests)."""
    p, d, url = pd
    p.hold_s = 20.0
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json={"text": "x", "stream": stream}, timeout=30)
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["text"].startswith("D:")
    assert time.monotonic() - t0 < 10.0  # not held by the prefill's 20 s


def test_failing_decode_returns_its_error_and_cancels_prefill(pd):
    p, d, url = pd
    d.fail_status, p.hold_s = 400, 5.0
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "fake_error"
    assert wait_for(lambda: p.disconnected == ["/v1/completions"])


def test_unreachable_decode_is_a_502():
    p = FakeWorker("prefill").start()
    dead = f"http://127.0.0.1:{free_port()}"
    router = Served(create_app(RouterConfig(prefill=((p.url, None),), decode=(dead,))))
    try:
        r = httpx.post(router.url + "/generate", json={"text": "x"})
        assert r.status_code == 502 and dead in r.json()["error"]["message"]
    finally:
        router.stop()
        p.stop()


def test_client_disconnect_aborts_both_legs(pd):
    p, d, url = pd
    p.hold_s = d.hold_s = 5.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json={"text": "x"}, timeout=0.5)
    assert wait_for(lambda: sorted(p.disconnected + d.disconnected) == ["/generate"] * 2)
    rid = d.gen_requests()[0].body["rid"]
    assert wait_for(lambda: p.aborted == [{"rid": rid}] and d.aborted == [{"rid": rid}])


def test_client_disconnect_mid_stream_aborts_both_legs(pd):
    p, d, url = pd
    p.hold_s, d.stream_chunks, d.chunk_delay_s = 5.0, 50, 0.1
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        first = next(r.iter_raw())
        assert first.startswith(b"data: ")
    assert wait_for(lambda: "/v1/completions" in d.disconnected)
    assert wait_for(lambda: "/v1/completions" in p.disconnected)
    rid = d.gen_requests()[0].body["rid"]
    assert wait_for(lambda: p.aborted == [{"rid": rid}] and d.aborted == [{"rid": rid}])
