"""Router selection policies, /health, API key and the info endpoints."""

from __future__ import annotations

import threading

import httpx
import pytest
from fake_workers import FakeWorker, Served, free_port
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.app import RouterConfig, create_app
from pdserve.router.body import with_bootstrap
from pdserve.router.workers import Worker, parse_prefill_args


def start_router(prefills: list[FakeWorker], decodes: list[FakeWorker], **kw) -> Served:
    cfg = RouterConfig(
        prefill=tuple((p.url, 9000 + i) for i, p in enumerate(prefills)),
        decode=tuple(d.url for d in decodes),
        **kw,
    )
    return Served(create_app(cfg))


@pytest.fixture
def workers():
    ws = [FakeWorker(r, f"{r[0]}{i}").start() for r in ("prefill", "decode") for i in (0, 1)]
    yield ws[:2], ws[2:]
    for w in ws:
        w.stop()


def served_by(ws: list[FakeWorker]) -> list[int]:
    """How many generation requests each worker got."""
    return [len(w.gen_requests()) for w in ws]


def test_round_robin_alternates(workers):
    prefills, decodes = workers
    router = start_router(prefills, decodes)
    try:
        for i in range(4):
            httpx.post(router.url + "/generate", json={"text": "x"})
            want = [i // 2 + 1, (i + 1) // 2]
            # the answer is the decode's: the prefill leg may still be on its way
            assert _wait(lambda w=want: served_by(prefills) == served_by(decodes) == w)
    finally:
        router.stop()


def test_least_load_avoids_the_busy_worker(workers):
    prefills, decodes = workers
    prefills[0].hold_s = decodes[0].hold_s = 1.5
    router = start_router(prefills, decodes, policy="least_load")
    try:
        slow = threading.Thread(
            target=httpx.post,
            args=(router.url + "/generate",),
            kwargs={"json": {"text": "x"}, "timeout": 10},
        )
        slow.start()
        assert _wait(lambda: served_by(decodes) == [1, 0])
        for _ in range(2):  # round robin would send the second one to worker 0
            assert httpx.post(router.url + "/generate", json={"text": "x"}).status_code == 200
        assert _wait(lambda: served_by(prefills) == served_by(decodes) == [1, 2])
        slow.join()
    finally:
        router.stop()


def _wait(cond, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_health_reports_each_worker(workers):
    prefills, decodes = workers
    router = start_router(prefills, decodes)
    try:
        prefills[1].healthy = False
        r = httpx.get(router.url + "/health")
        assert r.status_code == 200
        health = {w["url"]: w["healthy"] for w in r.json()["workers"]}
        assert health == {w.url: w is not prefills[1] for w in prefills + decodes}
        prefills[0].healthy = False
        assert httpx.get(router.url + "/health").status_code == 503
        # no healthy prefill: the request is shed at once, with Retry-After
        r = httpx.post(router.url + "/generate", json={"text": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "every prefill worker is unhealthy" in r.json()["error"]["message"]
        assert served_by(decodes) == [0, 0]
        # the router routes around the unhealthy decode while a healthy one is left
        prefills[0].healthy = True
        decodes[0].healthy = False
        httpx.get(router.url + "/health")
        for _ in range(2):
            httpx.post(router.url + "/generate", json={"text": "x"})
        assert served_by(decodes) == [0, 2]
        metrics = httpx.get(router.url + "/metrics").text
        assert "pdserve:router_shed_total 1.0" in metrics
    finally:
        router.stop()


def test_dead_worker_is_unhealthy():
    p = FakeWorker("prefill").start()
    dead = f"http://127.0.0.1:{free_port()}"
    router = Served(create_app(RouterConfig(prefill=((p.url, 1),), decode=(dead,))))
    try:
        r = httpx.get(router.url + "/health")
        assert r.status_code == 503
        (d,) = [w for w in r.json()["workers"] if w["role"] == "decode"]
        assert d["healthy"] is False and "Connect" in d["error"]
    finally:
        router.stop()
        p.stop()


def test_api_key_checked_and_forwarded(workers):
    prefills, decodes = workers
    router = start_router(prefills[:1], decodes[:1], api_key="sk-test")
    try:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        bad = {"Authorization": "Bearer nope"}
        assert httpx.post(router.url + "/generate", json={}, headers=bad).status_code == 401
        assert decodes[0].gen_requests() == []
        good = {"Authorization": "Bearer sk-test"}
        assert httpx.post(router.url + "/generate", json={}, headers=good).status_code == 200
        for w in (prefills[0], decodes[0]):
            assert w.gen_requests(1)[0].headers["authorization"] == "Bearer sk-test"
        assert httpx.get(router.url + "/health").status_code == 200  # open for probes
    finally:
        router.stop()


def test_bad_json_is_a_400(workers):
    router = start_router(*workers)
    try:
        r = httpx.post(router.url + "/generate", content=b"{nope")
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        assert httpx.post(router.url + "/generate", json=[1]).status_code == 400
    finally:
        router.stop()


def test_info_endpoints_and_abort_of_an_unknown_rid(workers):
    prefills, decodes = workers
    router = start_router(prefills, decodes)
    try:
        info = httpx.get(router.url + "/server_info").json()
        assert sorted(w["info"]["name"] for w in info["workers"]) == ["d0", "d1", "p0", "p1"]
        assert httpx.get(router.url + "/model_info").json()["model_path"] == "fake"
        assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "fake"
        assert httpx.get(router.url + "/health_generate").status_code == 200
        probe = decodes[0].gen_requests()[0].body
        assert probe["sampling_params"]["max_new_tokens"] == 1 and "bootstrap_room" in probe
        # a rid no request through this router has: nothing to abort, no worker asked
        # (tests/test_hostile_http_router.py aborts a live one)
        assert httpx.post(router.url + "/abort_request", json={"rid": "r1"}).status_code == 404
        assert all(w.aborted == [] for w in prefills + decodes)
        assert scrape(router)[("pdserve:router_requests_total", ())] == 1
        decodes[1].fail_status = 500  # the next probe goes to decode 1
        assert httpx.get(router.url + "/health_generate").status_code == 503
    finally:
        router.stop()


def scrape(router: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed by prometheus_client's own text parser: {(sample, labels): value}."""
    r = httpx.get(router.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_metrics_keep_their_names_and_labels(workers):
    """The samples dashboards read: the three counters and two per-worker gauges, with
    exactly the names and labels the router has always exported."""
    prefills, decodes = workers
    router = start_router(prefills, decodes)
    try:
        for _ in range(3):
            r = httpx.post(router.url + "/generate", json={"text": "hi", "stream": False})
            assert r.status_code == 200
        got = scrape(router)
    finally:
        router.stop()
    counters = {f"pdserve:router_{k}_total": v for k, v in
                [("requests", 3.0), ("failed", 0.0), ("aborted", 0.0), ("migrated", 0.0),
                 ("stuck", 0.0), ("shed", 0.0)]}  # fmt: skip
    gauges = {
        (f"pdserve:router_{g}", (("role", w.role), ("worker", w.url)))
        for g in ("in_flight", "worker_healthy")
        for w in prefills + decodes
    }
    assert set(got) == {(n, ()) for n in counters} | gauges
    assert {n: got[(n, ())] for n in counters} == counters
    assert all(got[k] == 0 for k in gauges if k[0].endswith("in_flight"))


def test_parse_prefill_args_like_sglang_router():
    got = parse_prefill_args([["http://a:1", "8998"], ["http://b:2", "none"], ["http://c:3"]])
    assert got == [("http://a:1", 8998), ("http://b:2", None), ("http://c:3", None)]
    with pytest.raises(ValueError):
        parse_prefill_args([["http://a:1", "x"]])
    # "host:port" means http, as sglang-router takes it
    assert parse_prefill_args([["localhost:30000"]]) == [("http://localhost:30000", None)]


@pytest.mark.parametrize(
    ("argv", "why"),
    [(["--prefill", "ftp://a:1"], "--prefill 'ftp://a:1': not an http(s) URL"),
     (["--prefill", "http://a:1", "70000"], "bad bootstrap port 70000 for http://a:1"),
     (["--decode", "http://a:99999"], "--decode 'http://a:99999': Port out of range"),
     (["--decode", "http://:5"], "--decode 'http://:5': not an http(s) URL")],
)  # fmt: skip
def test_the_router_refuses_a_worker_address_that_cannot_work(argv, why):
    """A router started on a bad address would serve nothing but errors: refused by name."""
    import subprocess
    import sys

    flags = {"--prefill": ["http://127.0.0.1:1"], "--decode": ["http://127.0.0.1:2"]}
    flags[argv[0]] = argv[1:]
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", "0"]
    for flag, value in flags.items():
        cmd += [flag, *value]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert why in out.stderr and "Traceback" not in out.stderr


def test_with_bootstrap_does_not_touch_the_clients_body():
    body = {"prompt": "x", "n": 1}
    out = with_bootstrap("/v1/completions", body, Worker("http://10.0.0.7:5", "prefill", None))
    assert body == {"prompt": "x", "n": 1}
    assert out["bootstrap_host"] == "10.0.0.7" and out["bootstrap_port"] is None
    assert isinstance(out["bootstrap_room"], int)


def test_unknown_route_and_wrong_method_in_the_openai_shape(workers, caplog):
    prefills, decodes = workers
    router = start_router(prefills, decodes)
    try:
        with caplog.at_level("WARNING", logger="pdserve.http"):
            r = httpx.post(router.url + "/v1/nowhere", json={"input": "hi"})
        logged = [m for m in caplog.messages if "POST /v1/nowhere" in m]
        assert len(logged) == 1, caplog.messages  # once
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == 404 and err["type"] == "invalid_request_error"
        assert "POST /v1/nowhere" in err["message"]
        r = httpx.get(router.url + "/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        assert "/v1/chat/completions" in r.json()["error"]["message"]
        assert "POST" in r.headers["allow"]
    finally:
        router.stop()
