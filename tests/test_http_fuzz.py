"""Hypothesis-generated bodies against a worker (fake engine) and the router in front of two.

Every answer must come back within the client timeout and never be a 5xx; afterwards the
servers are healthy and hold nothing. Bodies larger than the limit get 413 on both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import ServerProc, free_port, make_model_dir
from fake_workers import Served
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from benchmarks.soak import leaks, server_info
from pdserve.router.app import RouterConfig, create_app

pytestmark = pytest.mark.timeout(180)
LIMIT = 64 * 1024  # --max-body-bytes of the worker, max_body_bytes of the router
CLIENT_TIMEOUT_S = 8.0
EXAMPLES = 60
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")

# values: mostly plausible, sometimes absurd
small_int = st.integers(-3, 300) | st.sampled_from([0, 2**31, 2**63, -(2**63), 10**30])
number = small_int | st.floats(allow_nan=True, allow_infinity=True)
text = st.text(max_size=40) | st.sampled_from(["", "\x00", "\ud7ff", "<|im_end|>"])
scalar = st.none() | st.booleans() | number | text
anything = st.recursive(scalar, lambda v: st.lists(v, max_size=4) | st.dictionaries(text, v, max_size=4), max_leaves=12)  # fmt: skip
token_ids = st.lists(st.integers(-5, 5000), max_size=20) | st.lists(st.lists(small_int, max_size=4), max_size=3)  # fmt: skip
stop = st.none() | text | st.lists(text, max_size=5) | anything
message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | anything, "content": text | anything, "name": text})  # fmt: skip

COMMON = {"stream": st.booleans() | anything, "temperature": number | anything,
          "top_p": number, "top_k": small_int, "seed": small_int | anything, "n": small_int,
          "stop": stop, "logprobs": st.booleans() | small_int | anything,
          "stream_options": anything, "ignore_eos": st.booleans() | anything,
          "bootstrap_room": small_int | anything, "rid": text | anything}  # fmt: skip
FIELDS = {
    "/v1/completions": COMMON | {"model": text, "prompt": text | token_ids | anything,
                                 "max_tokens": small_int | anything, "echo": anything},
    "/v1/chat/completions": COMMON | {"model": text, "max_tokens": small_int | anything,
                                      "messages": st.lists(message, max_size=3) | anything,
                                      "top_logprobs": small_int, "max_completion_tokens": small_int},
    "/generate": {"text": text | st.lists(text, max_size=3) | anything,
                  "input_ids": token_ids | anything, "stream": st.booleans() | anything,
                  "rid": text | anything, "bootstrap_room": small_int | anything,
                  "sampling_params": st.fixed_dictionaries({}, optional=COMMON | {
                      "max_new_tokens": small_int | anything, "stop_token_ids": token_ids})
                  | anything},
}  # fmt: skip


def _obj(path: str) -> st.SearchStrategy[Any]:
    known = st.fixed_dictionaries({}, optional=FIELDS[path])
    extra = st.dictionaries(text, anything, max_size=3)
    return st.builds(lambda k, e: {**e, **k}, known, extra) | anything


def bodies(path: str) -> st.SearchStrategy[bytes]:
    as_json = _obj(path).map(lambda o: json.dumps(o, allow_nan=True).encode())
    return as_json | st.binary(max_size=200) | st.sampled_from([b"", b"{", b"[]", b"nul"])


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    model = make_model_dir(tmp_path_factory.mktemp("model"), max_positions=256)
    limit, boot = ["--max-body-bytes", str(LIMIT)], free_port()
    procs = [ServerProc(model, "decode", *limit), ServerProc(model, "decode", *limit),
             ServerProc(model, "prefill", "--bootstrap-port", str(boot), *limit)]  # fmt: skip
    router = None
    try:
        worker, dec, pre = (p.wait_healthy() for p in procs)
        cfg = RouterConfig(prefill=((pre.url, boot),), decode=(dec.url,),
                           max_body_bytes=LIMIT)  # fmt: skip
        router = Served(create_app(cfg))
        yield {"worker": worker.url, "router": router.url, "pre": pre.url, "dec": dec.url}
    finally:
        if router is not None:
            router.stop()
        for p in procs:
            p.stop()


def _post(url: str, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=raw, headers=headers, timeout=CLIENT_TIMEOUT_S)


def _fuzz(base: str, path: str, raw: bytes) -> None:
    try:
        r = _post(base + path, raw)
    except httpx.TimeoutException as e:
        raise AssertionError(f"no answer in {CLIENT_TIMEOUT_S}s to {raw[:300]!r}") from e
    assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json(), r.text[:300]


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("path", PATHS)
def test_random_bodies_never_5xx(targets: dict[str, str], target: str, path: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(raw=bodies(path))
    def run(raw: bytes) -> None:
        _fuzz(targets[target], path, raw)

    run()


@pytest.mark.parametrize("target", ["worker", "router"])
def test_oversized_body_is_413(targets: dict[str, str], target: str) -> None:
    body = {"prompt": "x" * (LIMIT + 1), "max_tokens": 1, "model": "m"}
    r = _post(targets[target] + "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["message"].startswith("request body larger than")
    chunks = (b"x" * 4096 for _ in range(LIMIT // 4096 + 2))  # no content-length: chunked
    r = httpx.post(targets[target] + "/generate", content=chunks, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 413, r.text[:300]


def test_servers_healthy_and_idle_afterwards(targets: dict[str, str]) -> None:
    for name in ("worker", "pre", "dec", "router"):
        assert httpx.get(targets[name] + "/health", timeout=5).status_code == 200, name
    deadline = time.monotonic() + 10  # streams the client dropped finish or abort
    while any(leaks(server_info(targets[n])) for n in ("worker", "pre", "dec")):
        assert time.monotonic() < deadline, [server_info(targets[n]) for n in ("worker", "dec")]
        time.sleep(0.2)
    ok = httpx.post(targets["router"] + "/generate", timeout=CLIENT_TIMEOUT_S,
                    json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["output_ids"] == [5, 6, 7], ok.text


# ---- numeric bounds (pdserve/edge/bounds.py): one bad value in an otherwise valid body ----
BAD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", str(2**63), str(2**64),
               str(-(2**63) - 1), str(10**30)]  # fmt: skip
VALID = {
    "/generate": '{"input_ids": [5, 6, 7], "rid": "%(rid)s", "sampling_params": '
    '{"max_new_tokens": 2, "temperature": %(temperature)s, "top_k": %(top_k)s, '
    '"top_p": %(top_p)s, "seed": %(seed)s}, "bootstrap_room": %(bootstrap_room)s}',
    "/v1/completions": '{"prompt": [5, 6, 7], "max_tokens": 2, "temperature": %(temperature)s, '
    '"top_k": %(top_k)s, "top_p": %(top_p)s, "seed": %(seed)s, "bootstrap_room": %(bootstrap_room)s}',
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    '"temperature": %(temperature)s, "top_k": %(top_k)s, "top_p": %(top_p)s, "seed": %(seed)s, '
    '"bootstrap_room": %(bootstrap_room)s}',
}  # fmt: skip
DEFAULTS = {"temperature": "0", "top_k": "-1", "top_p": "1.0", "seed": "1",
            "bootstrap_room": "12345"}  # fmt: skip


def _in_flight(url: str) -> int:
    return int(server_info(url).get("in_flight", 0))


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("path", PATHS)
def test_out_of_bounds_numbers_are_4xx_and_release(targets, target: str, path: str) -> None:
    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(field=st.sampled_from(sorted(DEFAULTS)),
           bad=st.sampled_from([*BAD_NUMBERS, '"x"', "{}"]))  # fmt: skip
    def run(field: str, bad: str) -> None:
        # the router replaces the bootstrap fields with its own; only the numbers are its concern
        assume(not (target == "router" and field == "bootstrap_room" and bad not in BAD_NUMBERS))
        rid = f"bounds-{field}-{BAD_NUMBERS.index(bad) if bad in BAD_NUMBERS else len(bad)}"
        raw = (VALID[path] % {**DEFAULTS, field: bad, "rid": rid}).encode()
        r = _post(targets[target] + path, raw)
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text[:300])
        assert "error" in r.json(), r.text[:300]
        # the same rid is not stuck "in flight": a valid request with it is served
        ok = _post(targets[target] + path, (VALID[path] % {**DEFAULTS, "rid": rid}).encode())
        assert ok.status_code == 200, (raw, ok.text[:300])

    run()
    for name in ("worker", "pre", "dec"):
        assert _in_flight(targets[name]) == 0, (name, server_info(targets[name]))
    workers = httpx.get(targets["router"] + "/health", timeout=5).json()["workers"]
    assert all(w["in_flight"] == 0 for w in workers), workers  # the router's own leases
