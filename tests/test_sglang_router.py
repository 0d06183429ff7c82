"""sglang-router (PD mode, unmodified) in front of recording fake workers: what it sends.

This pins the contract pdserve's prefill/decode servers must meet for it; the
end-to-end test with the real servers lives with them.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from fake_workers import FakeWorker, free_port

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def sgl():
    p, d = FakeWorker("prefill", "P").start(), FakeWorker("decode", "D").start()
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--prefill", p.url, "8998", "--decode", d.url, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield p, d, url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        p.stop()
        d.stop()


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "sglang-router exited"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                # the router answers /health before the workers registered; wait for them
                if httpx.get(url + "/workers", timeout=1).json().get("total") == 2:
                    return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("sglang-router did not become ready")


def test_registration_calls(sgl):
    p, d, _ = sgl
    for w in (p, d):
        paths = [r.path for r in w.received if r.method == "GET"]
        assert {"/health", "/server_info", "/model_info"} <= set(paths)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_legs_share_room_and_decode_answers(sgl, path, body):
    p, d, url = sgl
    r = httpx.post(url + path, json=body, timeout=10)
    assert r.status_code == 200
    pr, dr = p.gen_requests()[-1], d.gen_requests()[-1]
    assert pr.path == dr.path == path
    assert pr.body["bootstrap_room"] == dr.body["bootstrap_room"]
    assert pr.body["bootstrap_host"] == "127.0.0.1" and pr.body["bootstrap_port"] == 8998
    assert f"D:{dr.body['bootstrap_room']}" in r.text  # the decode's answer


def test_batch_gets_lists_and_openai_n_one_room(sgl):
    p, d, url = sgl
    httpx.post(url + "/generate", json={"input_ids": [[1, 2], [3]]}, timeout=10)
    body = p.gen_requests()[-1].body
    assert len(set(body["bootstrap_room"])) == 2 and body["bootstrap_port"] == [8998, 8998]
    httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "n": 2}, timeout=10)
    # sglang-router sends ONE room for n > 1: the worker must derive one per sample
    assert isinstance(d.gen_requests()[-1].body["bootstrap_room"], int)


def test_stream_relayed(sgl):
    p, d, url = sgl
    body = {"model": "m", "prompt": "x", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        raw = b"".join(r.iter_raw())
    assert raw.count(b"data: ") == d.stream_chunks + 1 and raw.endswith(b"data: [DONE]\n\n")


def test_worker_error_status_is_passed_on(sgl):
    p, d, url = sgl
    d.fail_status = 400
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    finally:
        d.fail_status = None
    assert r.status_code == 400 and r.json()["error"]["message"] == "D failed"
