"""The router's web console without a browser: its routes, key rules and /console/state
(tests/test_console_browser.py drives the page in Chromium)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from fake_workers import FakeWorker, Served

from pdserve.router import console
from pdserve.router.app import RouterConfig, create_app
from pdserve.router.webui import CSP, FILES, page_bytes
from pdserve.server.activity import Activity, console_stages

KEY = "console-test-key"
STAMPS = {  # one request's stamps (edge/stamps.py), seconds
    "router_at": 100.0, "prefill_http": 100.01, "prefill_arrive": 100.02, "arrive": 100.02,
    "reserved": 100.03, "prefill_start": 100.05, "prefill_end": 100.25, "kv_done": 100.3,
    "running": 100.31,
}  # fmt: skip


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[FakeWorker, FakeWorker]]:
    p, d = FakeWorker("prefill", "P").start(), FakeWorker("decode", "D").start()
    yield p, d
    p.stop()
    d.stop()


def router(workers: tuple[FakeWorker, FakeWorker], **kw: object) -> Served:
    p, d = workers
    return Served(create_app(RouterConfig(prefill=((p.url, 9001),), decode=(d.url,), **kw)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def open_router(workers) -> Iterator[str]:
    r = router(workers)
    yield r.url
    r.stop()


@pytest.fixture(scope="module")
def keyed_router(workers) -> Iterator[str]:
    r = router(workers, api_key=KEY)
    yield r.url
    r.stop()


def test_page_and_its_files_are_served_with_a_strict_policy(open_router):
    for path in FILES:
        r = httpx.get(open_router + path)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(open_router + "/").text
    assert 'content="none"' in page and "/console/app.js" in page
    assert "script-src 'self'" in CSP and "unsafe" not in CSP
    assert 10_000 < page_bytes() < 100_000  # docs/console.md states the size


def test_no_html_from_strings_in_the_page_scripts():
    """Model text reaches the DOM only as text: no innerHTML & co. anywhere in the page."""
    from importlib import resources

    web = resources.files("pdserve.router") / "web"
    for name, _ in FILES.values():
        text = (web / name).read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, (name, sink)


def test_state_aggregates_the_workers(workers, open_router):
    p, d = workers
    p.stats = {"engine": {"running": 1, "queued": 2, "free_kv_pages": 30, "total_kv_pages": 40,
                          "free_rows": 7, "total_rows": 8}, "recent": [{"done_at": 1, "stages": {}}]}  # fmt: skip
    recent = [{"done_at": t, "prompt_tokens": 3, "output_tokens": 4, "stages": {"prefill": 0.1}}
              for t in (5.0, 7.0)]  # fmt: skip
    d.stats = {"engine": {"kv_transfer_bytes": 1000}, "output_tokens": 9, "finished": 2,
               "recent": recent}  # fmt: skip
    s = httpx.get(open_router + "/console/state").json()
    by_role = {w["role"]: w for w in s["workers"]}
    assert by_role["prefill"]["running"] == 1 and by_role["prefill"]["queued"] == 2
    assert by_role["prefill"]["kv_pages"] == [10, 40] and by_role["prefill"]["rows"] == [1, 8]
    assert by_role["decode"]["kv_bytes"] == 1000 and by_role["decode"]["finished"] == 2
    # the decodes' requests only (theirs carry every stage), newest first
    assert [r["done_at"] for r in s["recent"]] == [7.0, 5.0]
    assert s["recent"][0]["worker"] == d.url
    assert set(s["router"]) >= {"requests_total", "requests_per_s"}


def test_an_unreachable_worker_is_shown_not_fatal(workers, open_router):
    p, _ = workers
    p.info_status = 500
    try:
        time.sleep(console.CACHE_S + 0.1)  # past the answer cached a moment ago
        s = httpx.get(open_router + "/console/state").json()
    finally:
        p.info_status = 200
    prefill = next(w for w in s["workers"] if w["role"] == "prefill")
    assert prefill["reachable"] is False and prefill["error"] == "HTTP 500"


def test_rates_from_successive_samples():
    r = console.Rates(window_s=5.0)
    assert r.rate("k", 0.0, 100) == 0.0
    assert r.rate("k", 1.0, 300) == 200.0
    assert r.rate("k", 2.0, 300) == 100.0  # averaged over the window
    assert r.rate("k", 9.0, 1000) == pytest.approx(700 / 7)  # old samples leave it
    assert r.rate("k", 10.0, 5) == 0.0  # a counter that went down (a restart) starts over


def test_key_rules(keyed_router):
    for path in FILES:  # the static page holds no secret
        assert httpx.get(keyed_router + path).status_code == 200, path
    assert 'content="required"' in httpx.get(keyed_router + "/").text
    assert httpx.get(keyed_router + "/console/state").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed_router + "/console/state", headers=auth).status_code == 200
    # nothing else opened: other paths under /console/ and the API still need the key
    assert httpx.get(keyed_router + "/console/nope.js").status_code == 401
    assert httpx.get(keyed_router + "/v1/models").status_code == 401


def test_no_web_ui(workers):
    r = router(workers, web_ui=False, api_key=KEY)
    try:
        assert httpx.get(r.url + "/").status_code == 401  # no longer an open path
        auth = {"Authorization": f"Bearer {KEY}"}
        for path in ("/", "/console/app.js", "/console/state"):
            assert httpx.get(r.url + path, headers=auth).status_code == 404, path
    finally:
        r.stop()


def test_no_web_ui_flags():
    import argparse

    from pdserve.router import cli as router_cli
    from pdserve.router.app import config_from_args
    from pdserve.server import launch

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    router_cli.add_cli(sub)
    launch.add_cli(sub)
    base = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_args(parser.parse_args(base)).web_ui is True
    assert config_from_args(parser.parse_args([*base, "--no-web-ui"])).web_ui is False
    up = parser.parse_args(["up", "--no-web-ui"])
    assert up.no_web_ui and up.engine_args == []  # up's own flag, not passed to the workers
    assert "--no-web-ui" in launch.router_argv(up, [], [])
    assert "--no-web-ui" not in launch.router_argv(parser.parse_args(["up"]), [], [])


def test_activity_keeps_the_last_requests_stages():
    assert console_stages(STAMPS) == pytest.approx(
        {"queue": 0.05, "prefill": 0.2, "transfer": 0.05, "first_decode": 0.01}, abs=1e-6
    )
    a = Activity(size=2)
    a.tokens(3)
    a.finish(5, 3, "length", {})  # no stages: counted, not listed
    for _ in range(3):
        a.finish(5, 3, "stop", STAMPS)
    d = a.as_dict()
    assert d["finished"] == 4 and d["output_tokens"] == 3 and len(d["recent"]) == 2
    assert d["recent"][0]["stages"]["prefill"] == pytest.approx(0.2)


def test_concurrent_polls_share_one_fan_out(workers, monkeypatch):
    """However many pages poll, each worker gets at most one /stats per CACHE_S."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(console, "CACHE_S", 60.0)  # all polls below fall in one period
    r = router(workers)
    stats_gets = [lambda w=w: sum(x.path == "/stats" for x in w.received) for w in workers]
    before = [f() for f in stats_gets]
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.get(r.url + "/console/state").status_code,
                                  range(8)))  # fmt: skip
    finally:
        r.stop()
    assert codes == [200] * 8
    assert [f() - b for f, b in zip(stats_gets, before)] == [1, 1]
