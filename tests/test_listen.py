"""Every listener: a loud warning when exposed without a key; health polls not logged."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from pdserve.edge import listen
from pdserve.edge.listen import QuietPolls, exposure_warning, is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
     ("10.1.2.3", False), ("prefill", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposure_warning_only_beyond_loopback_without_key():
    assert exposure_warning("127.0.0.1", None, "x") is None
    assert exposure_warning("0.0.0.0", "secret", "x") is None
    text = exposure_warning("0.0.0.0", None, "pdserve router")
    assert text and "pdserve router listens on 0.0.0.0 WITHOUT an API key" in text
    assert "PDSERVE_API_KEY" in text


def access_record(path: str, status: int) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    args = ("10.0.0.9:5123", "GET", path, "1.1", status)
    return logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None
    )


def test_quiet_polls_drops_successful_polls_only():
    f = QuietPolls()
    assert not f.filter(access_record("/health", 200))
    assert not f.filter(access_record("/health_generate", 200))
    assert not f.filter(access_record("/metrics?x=1", 200))
    assert f.filter(access_record("/health", 503)), "a failing poll is news"
    assert f.filter(access_record("/v1/chat/completions", 200))
    assert f.filter(access_record("/healthz", 200))
    access = logging.getLogger(listen.ACCESS_LOGGER)
    old = access.level
    access.setLevel(logging.DEBUG)
    try:
        assert f.filter(access_record("/health", 200)), "at DEBUG every poll is logged"
    finally:
        access.setLevel(old)


def test_serve_warns_and_installs_the_filter(monkeypatch, caplog):
    """serve() is the one way pdserve listens: check what it does before uvicorn runs."""
    seen = {}

    def run(app, sock, what, **kw):
        seen.update(kw, bound=sock.getsockname()[0])
        return True

    monkeypatch.setattr(listen, "run", run)
    with caplog.at_level(logging.WARNING, logger="pdserve.listen"):
        listen.serve(FastAPI(), host="0.0.0.0", port=0, api_key=None, what="pdserve decode",
                     log_level="info")  # fmt: skip
    assert "pdserve decode listens on 0.0.0.0 WITHOUT an API key" in caplog.text
    assert seen == {"host": "0.0.0.0", "port": 0, "log_level": "info", "bound": "0.0.0.0",
                    "stop_when": None, "on_sigterm": None}  # fmt: skip
    assert any(isinstance(f, QuietPolls) for f in logging.getLogger("uvicorn.access").filters)
    caplog.clear()
    listen.serve(FastAPI(), host="127.0.0.1", port=0, api_key=None, what="x")
    listen.serve(FastAPI(), host="0.0.0.0", port=0, api_key="k", what="x")
    assert "WITHOUT" not in caplog.text


def test_a_taken_port_fails_before_anything_starts(monkeypatch):
    """The port is bound before uvicorn runs the app's start-up (which loads the model):
    a taken port ends the server at once, naming the port and the reason."""
    import socket

    ran = []
    monkeypatch.setattr(listen, "run", lambda *a, **kw: ran.append(1) or True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            listen.serve(FastAPI(), host="127.0.0.1", port=port, api_key=None, what="pdserve x")
    assert f"pdserve x: cannot listen on 127.0.0.1:{port}: Address already in use" in str(e.value)
    assert not ran


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [("127.0.0.1", 70000, "port must be 0-65535"), ("nosuch.invalid", 0, "cannot listen on"),
     ("192.0.2.1", 0, "Cannot assign requested address")],
)  # fmt: skip
def test_a_port_or_host_that_cannot_be_bound_is_named(host, port, why):
    with pytest.raises(SystemExit) as e:
        listen.bind(host, port, "pdserve router")
    assert f"pdserve router: cannot listen on {host}:{port}" in str(e.value)
    assert why in str(e.value)


def test_a_failed_start_up_exits_3_and_frees_the_port(capfd):
    """An app whose start-up fails (an engine that could not start) exits as uvicorn
    does, and its bound port is free again."""
    import socket
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("engine did not start")
        yield

    sock = listen.bind("127.0.0.1", 0, "x")
    port = sock.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        listen.serve(FastAPI(lifespan=lifespan), host="127.0.0.1", port=port, api_key=None,
                     what="x", sock=sock, log_level="info")  # fmt: skip
    assert e.value.code == 3
    assert "engine did not start" in capfd.readouterr().err
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize("refused", [True, False])
def test_a_refused_start_up_is_one_line_a_bug_keeps_its_traceback(capfd, refused):
    """StartupRefused (an engine that refused its flags, or died while loading: its own
    log has the details) is logged as its message alone; any other error in the start-up
    keeps uvicorn's traceback."""
    from contextlib import asynccontextmanager

    kind = listen.StartupRefused if refused else RuntimeError

    @asynccontextmanager
    async def lifespan(app):
        raise kind("engine refused to start: --device cuda: no CUDA here")
        yield

    sock = listen.bind("127.0.0.1", 0, "x")
    with pytest.raises(SystemExit):
        listen.serve(FastAPI(lifespan=lifespan), host="127.0.0.1", port=0, api_key=None,
                     what="x", sock=sock, log_level="info")  # fmt: skip
    err = capfd.readouterr().err
    line = "engine refused to start: --device cuda: no CUDA here\n"
    if refused:
        assert f"ERROR:    {line}" in err and "Traceback" not in err
    else:
        assert "Traceback" in err and f"RuntimeError: {line}" in err


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a CUDA device is there: cuda would start"
)
def test_device_cuda_without_cuda_is_refused_in_one_line(tmp_path):
    """`--device cuda` where torch has no CUDA: the engine refuses it before the model
    loads, and the server exits saying so, without a traceback."""
    import subprocess
    import sys

    from tests.fake_workers import free_port

    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--model", "tiny", "--device", "cuda",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "engine refused to start: --device cuda: this torch" in out.stderr
    assert "use --device cpu" in out.stderr and "Traceback" not in out.stderr


def test_a_server_binds_its_port_before_it_looks_at_the_model(tmp_path):
    """`pdserve decode` with a taken port fails on the port, before resolving (possibly
    converting) its model: here a model that does not exist."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "pdserve.server.serve_cli", "decode",
               "--model", str(tmp_path / "no-such-model"), "--port", str(port)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "no-such-model" not in out.stderr


def test_frontend_and_router_start_through_serve():
    """Both uvicorn entry points go through listen.serve (no second, unchecked listener)."""
    import inspect

    from pdserve.router import cli as router_cli
    from pdserve.server import serve_cli

    for fn in (serve_cli.run_server, router_cli._run_router):
        src = inspect.getsource(fn)
        assert "serve(" in src and "uvicorn.run" not in src, fn.__name__


def test_access_log_of_a_real_server_skips_polls(capfd):
    """A real uvicorn server on loopback: /health leaves no line, a 404 does."""
    import socket
    import threading
    import time

    import uvicorn

    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen.quiet_polls()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert httpx.get(base + "/nothing-here", timeout=5).status_code == 404
    finally:
        server.should_exit = True
        t.join(timeout=10)
    cap = capfd.readouterr()
    logged = cap.out + cap.err  # uvicorn's access lines go to stdout
    assert '"GET /nothing-here HTTP/1.1" 404' in logged
    assert '"GET /health HTTP/1.1"' not in logged
