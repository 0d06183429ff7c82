"""Hostile HTTP at a frontend (a real server process with the fake engine): an abort
names exactly one request, and the API key guards every route but /health.

Each test here fails on the code before these rules: `/abort_request` then ended every
rid starting with the given rid + "-" (`{"rid": "pdr"}` ended all router traffic), and
/server_info, /model_info, /metrics and /health_generate answered without the key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_engine import ServerProc, make_model_dir

KEY = "sesame-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerProc]:
    s = ServerProc(model, "decode", "--api-key", KEY, PDSERVE_FAKE_STEP_S="0.01")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


class Stream(threading.Thread):
    """A streamed /generate whose final events are kept; `started` once the first arrives."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.last: dict[int, dict] = {}  # sample index -> its last event

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/generate", json=self.body, headers=AUTH,
                          timeout=30) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    self.last[event.get("index", 0)] = event
                    self.started.set()

    def reasons(self) -> list[str]:
        return [self.last[i]["meta_info"]["finish_reason"]["type"] for i in sorted(self.last)]


def abort(server: ServerProc, rid: str) -> dict:
    r = httpx.post(server.url + "/abort_request", json={"rid": rid}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_abort_names_exactly_one_request_or_its_samples(server):
    tokens = 150  # 1.5 s at 10 ms a step: the aborts land long before the end
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    alone = Stream(server.url, {"text": "a b", "rid": "pdr-a", "stream": True,
                                "sampling_params": params})  # fmt: skip
    pair = Stream(server.url, {"text": "c d", "rid": "pdr-b", "stream": True,
                               "sampling_params": {**params, "n": 2}})  # fmt: skip
    for s in (alone, pair):
        s.start()
        assert s.started.wait(10)
    # neither a prefix of the rids nor a prefix with its dash is a rid
    prefixes = [abort(server, rid).get("aborted") for rid in ("pdr", "pdr-", "pdr-b-")]
    # the client's rid of an n = 2 request names its two samples, by the explicit group
    group = abort(server, "pdr-b").get("aborted")
    for s in (alone, pair):
        s.join(20)
    assert alone.reasons() == ["length"]
    assert len(alone.last[0]["output_ids"]) == tokens
    assert pair.reasons() == ["abort", "abort"]
    assert prefixes == [[], [], []]
    assert group == ["pdr-b-0", "pdr-b-1"]


KEYED_GETS = ["/server_info", "/get_server_info", "/model_info", "/get_model_info",
              "/metrics", "/stats", "/health_generate", "/v1/models", "/openapi.json", "/docs",
              "/no-such-route"]  # fmt: skip
KEYED_POSTS = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
WRONG = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
         {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}]  # fmt: skip


@pytest.mark.parametrize("headers", WRONG, ids=["none", "wrong", "basic", "bare", "longer"])
def test_every_route_but_health_wants_the_key(server, headers):
    for path in KEYED_GETS:
        r = httpx.get(server.url + path, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["type"] == "authentication_error"
    for path in KEYED_POSTS:
        r = httpx.post(server.url + path, json={"rid": "x", "text": "x"}, headers=headers)
        assert r.status_code == 401, (path, r.status_code)
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200


def test_the_key_opens_the_info_routes(server):
    for path in ("/server_info", "/model_info", "/metrics", "/health_generate", "/v1/models"):
        assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code == 200, path
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.get(server.url + "/server_info", headers={"authorization": f"bearer  {KEY}"})
    assert ok.status_code == 200  # the scheme in any case, spaces around the key


def test_a_non_ascii_key_header_is_a_401_not_a_500(server):
    """hmac.compare_digest raises on non-ASCII str: the comparison runs on bytes."""
    header = [(b"authorization", "Bearer sésame-ключ".encode())]
    for path in ("/v1/models", "/server_info"):
        r = httpx.get(server.url + path, headers=header)
        assert r.status_code == 401, (path, r.status_code, r.text)


def test_metrics_public_opens_only_metrics(model):
    s = ServerProc(model, "decode", "--api-key", KEY, "--metrics-public").wait_healthy()
    try:
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.url + "/server_info").status_code == 401
        assert httpx.get(s.url + "/health_generate").status_code == 401
    finally:
        s.stop()
