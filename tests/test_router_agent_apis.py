"""The router forwards `/v1/responses` and `/v1/messages` through both PD legs as it
does chat (same body and bootstrap fields, aborts on hang-up), answers its own errors
on the Messages routes in Anthropic's shape, and passes an `x-api-key` on. Against
recording fake workers over real HTTP (tests/fake_workers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_workers import FakeWorker, Served
from test_router import wait_for

from pdserve.router.app import RouterConfig, create_app

ROUTES = ("/v1/responses", "/v1/messages")


@pytest.fixture
def pd() -> Iterator[tuple[FakeWorker, FakeWorker, str]]:
    p, d = FakeWorker("prefill", "P").start(), FakeWorker("decode", "D").start()
    router = Served(create_app(RouterConfig(prefill=((p.url, 9001),), decode=(d.url,))))
    yield p, d, router.url
    router.stop()
    p.stop()
    d.stop()


@pytest.mark.parametrize("path", ROUTES)
def test_both_legs_get_the_body_and_the_bootstrap_fields(pd, path) -> None:
    p, d, url = pd
    body = {"input": "hi", "max_tokens": 2, "messages": []}
    r = httpx.post(url + path, json=body, headers={"x-api-key": "k"}, timeout=10)
    assert r.status_code == 200
    (pr,), (dr,) = p.gen_requests(1), d.gen_requests(1)
    assert pr.body == dr.body and pr.path == dr.path == path
    assert pr.body["bootstrap_port"] == 9001 and isinstance(pr.body["bootstrap_room"], int)
    assert isinstance(pr.body["rid"], str) and pr.body["input"] == "hi"
    assert pr.headers["x-api-key"] == dr.headers["x-api-key"] == "k"
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "pdserve:router_requests_total 1.0" in metrics


@pytest.mark.parametrize("path", ROUTES)
def test_client_disconnect_mid_stream_aborts_both_legs(pd, path) -> None:
    p, d, url = pd
    p.hold_s, d.stream_chunks, d.chunk_delay_s = 5.0, 50, 0.1
    with httpx.stream("POST", url + path, json={"stream": True}, timeout=10) as r:
        assert next(r.iter_raw()).startswith(b"data: ")
    assert wait_for(lambda: path in d.disconnected and path in p.disconnected)
    rid = d.gen_requests()[0].body["rid"]
    assert wait_for(lambda: p.aborted == [{"rid": rid}] and d.aborted == [{"rid": rid}])


LAST_EVENTS = {
    "/v1/responses": b'event: response.completed\ndata: {"type": "response.completed"}\n\n',
    "/v1/messages": b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
}


@pytest.mark.parametrize("path", ROUTES)
def test_a_stream_ends_at_its_routes_last_event(pd, path) -> None:
    """These streams have no [DONE]: their last event ends them, not a router error."""
    _, d, url = pd
    d.last_event = LAST_EVENTS[path]
    with httpx.stream("POST", url + path, json={"stream": True}, timeout=10) as r:
        body = b"".join(r.iter_raw())
    assert body.endswith(LAST_EVENTS[path]), body[-300:]
    assert b"error" not in body and body.count(b"data: ") == d.stream_chunks + 1
    assert "pdserve:router_failed_total 0.0" in httpx.get(url + "/metrics", timeout=10).text


def test_router_errors_on_the_messages_route_have_anthropics_shape(pd) -> None:
    _, _, url = pd
    r = httpx.post(url + "/v1/messages", content=b"[1, 2]", timeout=10)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "the body must be a JSON object"}}  # fmt: skip
    r = httpx.post(url + "/v1/responses", content=b"[1, 2]", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
