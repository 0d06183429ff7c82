"""Smoke run of `pdserve bench` against a real `pdserve up` with the tiny model.

The whole path runs: bench client -> router -> prefill + decode servers and
their engines. A few short requests; the JSON line must show no error, every
requested output token (ignore_eos makes lengths exact) and sane latencies.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import build_requests
from pdserve.cli import main

WORKLOAD = BenchConfig(
    num_prompts=6, max_concurrency=3, random_input_len=(8, 24), random_output_len=(4, 12), seed=7
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 45) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"pdserve up exited:\n{log.read_text()[-2000:]}"
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"pdserve up not healthy in {timeout}s:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `pdserve up` on a free port; stopped (with its children) at the end."""
    logs = tmp_path_factory.mktemp("up")
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(tiny_model),
            "--port", str(port), "--log-dir", str(logs), "--grace-period", "5"]  # fmt: skip
    with open(logs / "up.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, logs / "up.log")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # `up` stops every child before it exits
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_bench(url: str, backend: str, out: Path) -> dict:
    w = WORKLOAD
    rc = main(["bench", "--base-url", url, "--backend", backend,
               "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.max_concurrency),
               "--random-input-len", "{}:{}".format(*w.random_input_len),
               "--random-output-len", "{}:{}".format(*w.random_output_len),
               "--seed", str(w.seed), "--timeout", "30", "--disable-progress",
               "--details", "--output", str(out)])  # fmt: skip
    assert rc == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def expected_output_tokens() -> int:
    return sum(r.output_len for r in build_requests(WORKLOAD))


@pytest.mark.parametrize("backend", ["openai", "native"])
def test_bench_smoke(server: str, backend: str, tmp_path: Path) -> None:
    record = run_bench(server, backend, tmp_path / "runs.jsonl")
    m = record["metrics"]
    assert m["failed"] == 0 and m["errors"] == {}, m["errors"]
    assert m["completed"] == WORKLOAD.num_prompts
    assert m["total_output_tokens"] == expected_output_tokens()
    assert m["total_input_tokens"] > 0
    assert m["duration_s"] > 0 and m["output_throughput"] > 0
    assert 0 < m["ttft_ms"]["median"] <= m["e2e_ms"]["median"]
    assert m["ttft_ms"]["p99"] <= m["e2e_ms"]["p99"] < 30_000
    assert m["tpot_ms"]["count"] > 0 and m["tpot_ms"]["mean"] > 0
    assert m["itl_ms"]["count"] > 0 and m["itl_ms"]["mean"] > 0
    for r in record["details"]:
        assert r["success"] and r["output_tokens"] == r["output_len"]
        assert 0 < r["ttft"] <= r["latency"]


def test_bench_reports_unreachable_server(tmp_path: Path) -> None:
    """No server: every request fails with connect_error, and the command says so."""
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "runs.jsonl"
    rc = main(["bench", "--base-url", url, "--model", "m", "--num-prompts", "2",
               "--random-input-len", "4", "--random-output-len", "2", "--timeout", "5",
               "--disable-progress", "--output", str(out)])  # fmt: skip
    assert rc == 1
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 0 and m["errors"] == {"connect_error": 2}
