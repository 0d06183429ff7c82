"""`make container-test`: the compose stack in real containers, end to end.

Builds the image with podman (or docker, whichever works), starts the default
services of docker-compose.yml (deploy/compose_run.py), waits on their
depends_on conditions, then checks:
  - a chat completion through the router on 127.0.0.1 (the answer is printed);
  - every healthcheck passes, and the model service exited 0;
  - every published port is bound to 127.0.0.1 (`ENGINE port`);
  - health polls left no access-log line; the exposure warning was logged;
  - the venv's bytecode was compiled at build time;
and tears everything down (containers, network, volumes), then checks that the
engine lists no volume the stack made. Traffic goes to 127.0.0.1 only.

Offline sources (docs/deploy.md): PDSERVE_BASE_IMAGE names a local base image;
TORCH_WHEEL_DIR a folder holding the torch wheel, served to the build on
127.0.0.1 as TORCH_INDEX_URL. Without them: a base made with mmdebstrap when it is
installed (podman), and the CPU torch wheel from pip's find-links when one holds it.
PDSERVE_MODEL picks the model (default: compose's).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import compose_run
from engine import Engine, build_image, ensure_base, find_engine, local_torch_wheels, serve_wheels

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
PROJECT = f"pdserve-ct-{os.getpid()}"
HEALTH_TIMEOUT_S = 600.0
QUESTION = "What is the capital of France?"
TORCH_VERSION = "2.13.0"  # the Dockerfile's TORCH_VERSION


def log(msg: str) -> None:
    print(f"[container-test] {msg}", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    eng = find_engine(ROOT)
    log(f"engine: {eng.describe()}")
    env = dict(os.environ)
    env.setdefault("PDSERVE_PORT", str(free_port()))
    env.setdefault("PDSERVE_IMAGE", "localhost/pdserve:container-test")
    ensure_base(eng, env, log)
    if not env.get("TORCH_WHEEL_DIR") and not env.get("TORCH_INDEX_URL"):
        env["TORCH_WHEEL_DIR"] = local_torch_wheels(env, TORCH_VERSION) or ""
    stop_wheels = serve_wheels(env, log)
    try:
        build_image(eng, ROOT, env, log)
    finally:
        stop_wheels()
    services = compose_run.load(COMPOSE, env)
    volumes_before = set(eng.lines("volume", "ls", "--format", "{{.Name}}"))
    try:
        up(eng, services, env)
        check(eng, services, env)
        made = set(eng.lines("volume", "ls", "--format", "{{.Name}}")) - volumes_before
        named = {f"{PROJECT}_{v}" for v in compose_run.named_volumes(COMPOSE)}
        assert made == named, f"volumes while up: {sorted(made)}, expected only {sorted(named)}"
        log(f"volumes while up: {sorted(made)} (no anonymous volume)")
    finally:
        down(eng, services)
    left = set(eng.lines("volume", "ls", "--format", "{{.Name}}")) - volumes_before
    assert not left, f"volumes left behind: {sorted(left)}"
    log(f"after down: `{eng.name} volume ls` lists no volume made by the stack")
    log("PASS")
    return 0


def up(eng: Engine, services: list[compose_run.Service], env: dict[str, str]) -> None:
    label = f"pdserve.container-test={PROJECT}"
    eng.run("network", "create", "--label", label, f"{PROJECT}_default")
    for vol in compose_run.named_volumes(COMPOSE):
        eng.run("volume", "create", "--label", label, f"{PROJECT}_{vol}")
    for svc in services:
        for dep, cond in svc.depends_on.items():
            wait_condition(eng, dep, cond)
        log(f"start {svc.name}: {' '.join(svc.command)}")
        eng.run(*compose_run.run_argv(eng.name, PROJECT, svc, env)[1:])
    for svc in services:  # what `up --wait` waits for: every service with a healthcheck
        if svc.healthcheck:
            wait_healthy(eng, f"{PROJECT}_{svc.name}")


def wait_condition(eng: Engine, svc: str, cond: str) -> None:
    name = f"{PROJECT}_{svc}"
    if cond == "service_completed_successfully":
        code = eng.lines("wait", name)[-1]
        if code != "0":
            raise RuntimeError(f"{svc} exited {code}:\n{eng.logs(name)}")
    elif cond == "service_healthy":
        wait_healthy(eng, name)
    log(f"{svc}: {cond}")


def wait_healthy(eng: Engine, name: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if eng.healthy(name):
            return
        if eng.state(name) not in ("running", "created", "configured"):
            raise RuntimeError(f"{name} is {eng.state(name)}:\n{eng.logs(name)}")
        time.sleep(3)
    raise TimeoutError(f"{name} not healthy in {HEALTH_TIMEOUT_S:.0f}s:\n{eng.logs(name)}")


def check(eng: Engine, services: list[compose_run.Service], env: dict[str, str]) -> None:
    answer = chat(int(env["PDSERVE_PORT"]))
    log(f"Q: {QUESTION}")
    log(f"A: {answer!r}")
    publish_host = env.get("PDSERVE_PUBLISH_HOST") or "127.0.0.1"
    for svc in services:
        name = f"{PROJECT}_{svc.name}"
        if svc.healthcheck:
            assert eng.healthy(name), f"{svc.name}: healthcheck fails"
            log(f"{svc.name}: healthcheck passes")
        for line in eng.lines("port", name):
            host = line.rsplit("-> ", 1)[1].rsplit(":", 1)[0]
            assert host == publish_host, f"{svc.name} publishes {line}, not on {publish_host}"
            log(f"{svc.name}: published {line}")
        if svc.name in ("prefill", "decode", "router"):
            check_logs(eng.logs(name), svc.name, access_log=svc.name != "router")
    check_bytecode(eng, f"{PROJECT}_router")


def chat(port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.load(r)
    assert out["usage"]["completion_tokens"] > 0, out
    return str(out["choices"][0]["message"]["content"])


def check_logs(text: str, svc: str, access_log: bool) -> None:
    polls = [ln for ln in text.splitlines() if '"GET /health' in ln or '"GET /metrics' in ln]
    assert not polls, f"{svc} logged health polls: {polls[:3]}"
    if access_log:  # the workers log access at INFO: the router's request is there
        assert '"POST /v1/chat/completions' in text, f"{svc}: no access line for the request"
    assert "WITHOUT an API key" in text, f"{svc} bound 0.0.0.0 without a key but did not warn"
    log(f"{svc}: no health-poll access lines; exposure warning logged")


def check_bytecode(eng: Engine, name: str) -> None:
    """Every module of pdserve has its .pyc in the image (the runtime user cannot write one)."""
    probe = (
        "import importlib.util as u, pathlib, pdserve; "
        "root = pathlib.Path(pdserve.__file__).parent; "
        "m = [p for p in root.rglob('*.py') if not pathlib.Path(u.cache_from_source(p)).exists()]; "
        "print(len(list(root.rglob('*.py'))), 'modules;', len(m), 'without .pyc', m[:3])"
    )
    out = eng.lines("exec", name, "python", "-c", probe)[-1]
    assert " 0 without .pyc" in out, out
    log(f"bytecode: {out}")


def down(eng: Engine, services: list[compose_run.Service]) -> None:
    for svc in reversed(services):
        eng.run("rm", "-f", "-v", "-t", "5", f"{PROJECT}_{svc.name}", check=False)
    eng.run("network", "rm", f"{PROJECT}_default", check=False)
    for vol in compose_run.named_volumes(COMPOSE):
        eng.run("volume", "rm", f"{PROJECT}_{vol}", check=False)
    log("down: containers, network and volumes removed")


if __name__ == "__main__":
    sys.exit(main())
