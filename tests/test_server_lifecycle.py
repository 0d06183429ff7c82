"""Process lifecycle and security of a frontend: API key, the prefill role, engine death,
and no orphan engine when the frontend goes away."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import ServerProc, free_port, make_model_dir

from pdserve.server.serve_cli import ENGINE_DEATH_GRACE_S


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


def engine_pid(server: ServerProc) -> int:
    return int(httpx.get(server.url + "/server_info").json()["engine_pid"])


def process_gone(pid: int, timeout_s: float) -> bool:
    """True once `pid` has exited (a zombie nobody reaped counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_prefill_role_with_api_key(model):
    boot = free_port()
    s = ServerProc(model, "prefill", "--api-key", "sesame", "--bootstrap-port", str(boot))
    try:
        s.wait_healthy()
        body = {"prompt": "Hello", "max_tokens": 4}
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        r = httpx.post(s.url + "/v1/completions", json=body, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(s.url + "/abort_request", json={"rid": "x"}).status_code == 401
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        # a PD request on the prefill: the bootstrap fields ride in the OpenAI body
        r = good.completions.create(model=good.models.list().data[0].id,
                                    prompt="Hello", max_tokens=4,
                                    extra_body={"bootstrap_host": "127.0.0.1",
                                                "bootstrap_port": boot,
                                                "bootstrap_room": 12345})  # fmt: skip
        assert r.usage.completion_tokens == 1  # the prefill only makes the first token
        key = {"Authorization": "Bearer sesame"}
        assert httpx.get(s.url + "/server_info").status_code == 401
        info = httpx.get(s.url + "/server_info", headers=key).json()
        assert info["role"] == "prefill" and info["bootstrap_port"] == boot
        assert info["server_config"]["api_key"] is True  # never the key itself
        assert "sesame" not in json.dumps(info)
        assert httpx.get(s.url + "/health_generate").status_code == 401
        assert httpx.get(s.url + "/health_generate", headers=key).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_engine_death_fails_requests_fast_and_health_goes_503(model):
    s = ServerProc(model, "decode", PDSERVE_FAKE_STEP_S="0.05").wait_healthy()
    try:
        pid = engine_pid(s)
        body = {"prompt": "long", "max_tokens": 200, "stream": True}  # 10 s of steps
        t0 = time.monotonic()
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - t0 < 6.0  # not after the 200 steps
        message = json.loads(rest[-2][len("data: ") :])["error"]["message"]
        assert message == "engine process exited unexpectedly (code -9, SIGKILL)"
        assert rest[-1] == "data: [DONE]"
        assert httpx.get(s.url + "/health").status_code == 503
        r2 = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        assert r2.status_code == 503
        assert httpx.get(s.url + "/health_generate").status_code == 503
        # then the frontend exits non-zero, so a supervisor restarts the pair
        assert s.proc.wait(ENGINE_DEATH_GRACE_S + 10) == 1
    finally:
        s.stop()


def test_ctrl_c_stops_frontend_and_engine_without_a_traceback(model, capfd):
    """Ctrl+C in a terminal sends SIGINT to every process of the group: both end, cleanly."""
    s = ServerProc(model, "decode").wait_healthy()
    pid = engine_pid(s)
    for p in (pid, s.proc.pid):
        os.kill(p, signal.SIGINT)
    try:
        assert s.proc.wait(15) == 0
    finally:
        s.stop()
    assert process_gone(pid, 5.0)
    out = capfd.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "KeyboardInterrupt" not in out.out + out.err


def test_engine_exits_with_its_frontend(model):
    s = ServerProc(model, "decode").wait_healthy()
    pid = engine_pid(s)
    s.stop()  # SIGTERM: clean shutdown stops the engine
    assert process_gone(pid, 5.0)
    s = ServerProc(model, "decode").wait_healthy()
    pid = engine_pid(s)
    s.proc.kill()  # SIGKILL: no cleanup code runs; the engine notices its parent is gone
    s.proc.wait()
    assert process_gone(pid, 5.0)
