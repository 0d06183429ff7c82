"""Unmodified sglang-router (PD mode) in front of real `pdserve prefill` + `pdserve decode`.

    client ─▶ sglang_router.launch_router ─┬─▶ pdserve prefill (+ bootstrap port) ─┐ ZeroMQ KV
                                           └─▶ pdserve decode  ◀──────────────────┘

Greedy tokens are checked against `transformers`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from conftest import hf_greedy, model_path
from test_e2e_pd import chat_ids, pool_args, spawn, stop, wait_healthy
from tokenizers import Tokenizer

pytest.importorskip("sglang_router")

NEW = 8
PROMPT = "Disaggregated serving splits prefill and decode across two servers because"
CHAT = [{"role": "user", "content": "Say hello."}]


@dataclass
class Setup:
    url: str  # sglang-router
    tok: Tokenizer
    ids: list[int]  # PROMPT's token ids
    want: list[int]  # transformers' greedy continuation of ids
    chat_want: str  # transformers' greedy continuation of CHAT, as text
    name: str  # the served model name, from the decode's /v1/models


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(role: str, port: int, boot: int | None, model: Path) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.cli", role, "--model", str(model), "--port", str(port)]
    return argv + (["--bootstrap-port", str(boot)] if boot else []) + pool_args()


def wait_router(url: str, proc) -> None:  # type: ignore[no-untyped-def]
    """sglang-router answers /health before its workers registered; wait for both."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "sglang-router exited"
        try:
            if httpx.get(url + "/workers", timeout=2).json().get("total") == 2:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError("sglang-router did not register the workers")


@pytest.fixture(scope="module")
def sgl():
    model = model_path("tiny")
    pp, boot, dp, rp = free_port(), free_port(), free_port(), free_port()
    procs = [spawn(worker("prefill", pp, boot, model), "sgl-prefill"),
             spawn(worker("decode", dp, None, model), "sgl-decode")]  # fmt: skip
    try:
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        ids = tok.encode(PROMPT, add_special_tokens=False).ids
        want = hf_greedy(model, ids, NEW)  # while the servers start
        chat_want = tok.decode(hf_greedy(model, chat_ids(model, CHAT), NEW))
        for port in (pp, dp):
            wait_healthy(f"http://127.0.0.1:{port}", procs)
        router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                  "--prefill", f"http://127.0.0.1:{pp}", str(boot),
                  "--decode", f"http://127.0.0.1:{dp}", "--host", "127.0.0.1",
                  "--port", str(rp)]  # fmt: skip
        procs.append(spawn(router, "sgl-router"))
        url = f"http://127.0.0.1:{rp}"
        wait_router(url, procs[-1])
        name = httpx.get(f"http://127.0.0.1:{dp}/v1/models", timeout=5).json()["data"][0]["id"]
        yield Setup(url, tok, ids, want, chat_want, name)
    finally:
        stop(*procs, grace_s=10)


def test_generate_input_ids(sgl):
    body = {"input_ids": sgl.ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
    r = httpx.post(sgl.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == sgl.want
    with httpx.stream("POST", sgl.url + "/generate", json={**body, "stream": True},
                      timeout=120) as s:  # fmt: skip
        assert s.status_code == 200
        data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["output_ids"] == sgl.want
    breakdown = last["meta_info"]["ttft_breakdown"]
    assert breakdown["kv_transfer"] >= 0 and breakdown["frontend"] >= 0
    assert "router" not in breakdown  # sglang-router sends no pdserve stamp


def test_completions(sgl):
    c = openai.OpenAI(base_url=sgl.url + "/v1", api_key="none", max_retries=0)
    want = sgl.tok.decode(sgl.want, skip_special_tokens=True)
    r = c.completions.create(model=sgl.name, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    chunks = list(c.completions.create(model=sgl.name, prompt=PROMPT, max_tokens=NEW,
                                       temperature=0, stream=True))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


def test_chat(sgl):
    c = openai.OpenAI(base_url=sgl.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=sgl.name, messages=CHAT, max_tokens=NEW,  # type: ignore[arg-type]
                                  temperature=0)  # fmt: skip
    text = r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == NEW
    assert text == sgl.chat_want
    chunks = list(c.chat.completions.create(model=sgl.name, messages=CHAT,  # type: ignore[arg-type]
                                            max_tokens=NEW, temperature=0, stream=True))  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"
