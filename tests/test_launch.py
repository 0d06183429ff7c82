"""`pdserve up` process handling, with fake workers in place of the engine servers.

The real router runs; each prefill/decode child is `tests/fake_workers.py`,
which also starts a grandchild (`sleep`, standing in for the engine process)
so the test can check that nothing is orphaned.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fake_workers import free_port

FAKE = str(Path(__file__).with_name("fake_workers.py"))
LAUNCHER = """
import sys
import pdserve.server.launch as launch

def fake_worker(role, model, host, port, bootstrap_port, extra):
    return [sys.executable, {fake!r}, role, "--port", str(port), "--pid-file", {pids!r}, *extra]

launch.worker_argv = fake_worker
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_up(tmp_path: Path, port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    pids = tmp_path / "grandchildren.pid"
    code = LAUNCHER.format(fake=FAKE, pids=str(pids))
    argv = [sys.executable, "-c", code, "up", "--model", str(tmp_path), "--port", str(port),
            "--grace-period", "3", "--startup-timeout", "30", "--log-dir", str(tmp_path), *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pids


def wait_line(proc: subprocess.Popen, needle: str, timeout: float = 30) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += line
        if needle in line:
            return seen
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {needle!r}; stdout:\n{seen}\nstderr:\n{proc.stderr.read()}")


def port_free(port: int) -> bool:
    """True if a server could listen there again (SO_REUSEADDR, as uvicorn sets it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a reaped-later zombie is dead too


def assert_all_stopped(ports: list[int], pids: Path) -> None:
    grandchildren = [int(x) for x in pids.read_text().split()]
    assert grandchildren and all(gone(pid) for pid in grandchildren)
    deadline = time.monotonic() + 5
    while not all(port_free(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(port_free(p) for p in ports)


def test_up_serves_and_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    proc, pids = start_up(tmp_path, port, "--num-prefill", "2", "--some-engine-flag", "1")
    try:
        out = wait_line(proc, "pdserve is up")
        assert f"http://127.0.0.1:{port}" in out
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        roles = sorted(w["role"] for w in health["workers"] if w["healthy"])
        assert roles == ["decode", "prefill", "prefill"]
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "x"})
        assert r.status_code == 200 and r.json()["text"].startswith("decode:")
        ports = [port] + [int(w["url"].rsplit(":", 1)[1]) for w in health["workers"]]
        assert "--some-engine-flag" in (tmp_path / "decode0.log").read_text()  # passed through
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert_all_stopped(ports, pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def _pids(role: str, tmp_path: Path) -> list[int]:
    """The pids of this test's fake `role` servers (their argv names the script, the role
    and the test's folder)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [FAKE.encode(), role.encode()] and str(tmp_path).encode() in b" ".join(
            argv
        ):
            out.append(int(d.name))
    return out


def _all_healthy(port: int) -> bool:
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
    return all(w["healthy"] for w in health["workers"])


def test_a_worker_that_dies_is_restarted_and_the_rest_serve_on(tmp_path):
    port = free_port()
    proc, pids = start_up(tmp_path, port, "--num-decode", "2", "--restart-backoff", "0.5")
    try:
        wait_line(proc, "pdserve is up")
        victim = _pids("decode", tmp_path)[0]
        os.kill(victim, signal.SIGKILL)
        served, deadline = 0, time.monotonic() + 20
        while time.monotonic() < deadline:  # the other decode answers meanwhile
            r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "x"}, timeout=5)
            served += r.status_code == 200
            decodes = _pids("decode", tmp_path)
            if victim not in decodes and len(decodes) == 2 and _all_healthy(port):
                break
            time.sleep(0.2)
        assert served > 0
        decodes = _pids("decode", tmp_path)
        assert victim not in decodes and len(decodes) == 2, "the dead decode runs again"
        assert proc.poll() is None, "a worker's exit does not stop the stack"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        err = proc.stderr.read()
        assert "exited with -9; restarting it in 0.5s" in err
        assert "restarted (pid" in err
        assert_all_stopped([port], pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_child_that_dies_during_startup_stops_the_stack(tmp_path):
    port = free_port()
    proc, pids = start_up(tmp_path, port, "--die-after", "0")
    try:
        assert proc.wait(timeout=30) == 1
        assert "exited with 3 during startup" in proc.stderr.read()
        assert_all_stopped([port], pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_port_in_use_is_a_clear_error(tmp_path):
    import argparse

    import pytest

    from pdserve.server.launch import run_up

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        args = argparse.Namespace(host="127.0.0.1", port=s.getsockname()[1])
        with pytest.raises(SystemExit, match="in use"):
            run_up(args)  # fails before planning or starting any child
    with pytest.raises(SystemExit, match=r"127.0.0.1:70000: bind\(\): port must be 0-65535"):
        run_up(argparse.Namespace(host="127.0.0.1", port=70000))


def test_a_model_that_is_not_there_fails_before_any_server_starts(tmp_path, capsys, monkeypatch):
    import argparse

    from pdserve.server import launch
    from pdserve.server.launch import run_up

    monkeypatch.setattr(launch, "_Stop", lambda: lambda: False)  # keep pytest's handlers

    args = argparse.Namespace(host="127.0.0.1", port=free_port(), log_dir=str(tmp_path),
                              model=str(tmp_path / "nothing-here"))  # fmt: skip
    assert run_up(args) == 1
    err = capsys.readouterr().err
    assert f"pdserve up: model {tmp_path / 'nothing-here'}: no such folder or GGUF file" in err
    assert not list(tmp_path.glob("*.log")), "no server was started"
