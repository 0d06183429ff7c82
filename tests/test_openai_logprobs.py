"""Logprobs through the whole PD path (`pdserve up`: router -> prefill -> KV -> decode) on
SmolLM2, against transformers' log-softmax over the same checkpoint's logits:
`top_logprobs` of completions and chat (streamed too), and `echo` with the prompt's
logprobs (the prefill's head over every prompt position, carried on KVDone), with
`max_tokens: 0` as evaluation harnesses send it. The prefill runs in chunks of 16 tokens,
so a prompt's logprobs are gathered over several steps."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from conftest import _hf_model, greedy_of
from test_e2e_pd import free_port, spawn, stop, wait_healthy

from pdserve.checkpoints.resolve import resolve_model
from pdserve.server.tokenizer import Tokenizer

TOL = 1e-4
PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of "
          "Spain is Madrid. The capital of Germany is")  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--grace-period",
            "5", "--max-total-tokens", "4096", "--max-prefill-tokens", "16"]  # fmt: skip
    proc = spawn(argv, "logprobs-up")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], timeout_s=300.0)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def ref() -> tuple[Any, Tokenizer]:
    path = str(resolve_model("smollm2").path)
    return _hf_model(path), Tokenizer(path)


def log_softmax(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the distribution of the token after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + route, json={"model": "smollm2", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_top(tok: Tokenizer, row: torch.Tensor, top: dict[str, float], k: int) -> None:
    """`top` holds the k most likely tokens' texts (and maybe the chosen one) with the
    reference's values."""
    values, ids = row.topk(k)
    for v, i in zip(values.tolist(), ids.tolist()):
        text = tok.decode([i], skip_special_tokens=False)
        assert abs(top[text] - v) < TOL, (text, top[text], v)
    assert len(top) <= k + 1


def test_completion_top_logprobs_match_transformers(server, ref) -> None:
    model, tok = ref
    prompt = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 5}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    out = greedy_of(model, prompt, 5)
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in out]
    ids = prompt + out
    table = log_softmax(model, ids)
    assert len(lp["token_logprobs"]) == len(out) == 5
    for j, t in enumerate(out):
        row = table[len(prompt) + j - 1]
        assert abs(lp["token_logprobs"][j] - row[t].item()) < TOL
        check_top(tok, row, lp["top_logprobs"][j], 5)
        assert row.argmax().item() == t  # greedy: the chosen token is the top one


def test_chat_top_logprobs_streamed_match_transformers(server, ref) -> None:
    model, tok = ref
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "stream": True}  # fmt: skip
    content: list[dict[str, Any]] = []
    with httpx.stream("POST", server + "/v1/chat/completions",
                      json={"model": "smollm2", **body}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c.get("logprobs"):
                        content += c["logprobs"]["content"]
    text = tok.apply_chat_template(messages, tools=None, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    out = greedy_of(model, prompt, 4)
    assert [c["token"] for c in content] == [
        tok.decode([t], skip_special_tokens=False) for t in out
    ]
    table = log_softmax(model, prompt + out)
    assert len(content) == 4
    for j, c in enumerate(content):
        row = table[len(prompt) + j - 1]
        assert abs(c["logprob"] - row[out[j]].item()) < TOL
        assert len(c["top_logprobs"]) == 3
        values, ids = row.topk(3)
        for alt, v, i in zip(c["top_logprobs"], values.tolist(), ids.tolist()):
            assert alt["token"] == tok.decode([i], skip_special_tokens=False)
            assert abs(alt["logprob"] - v) < TOL


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_prompt_logprobs_match_transformers(server, ref, max_tokens) -> None:
    model, tok = ref
    prompt = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
            "echo": True}  # fmt: skip
    r = post(server, "/v1/completions", body)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and (max_tokens or choice["text"] == PROMPT)
    assert r["usage"]["completion_tokens"] == max_tokens
    assert choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(prompt) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    table = log_softmax(model, prompt)
    for p in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][p] - table[p - 1, prompt[p]].item()) < TOL, p
        check_top(tok, table[p - 1], lp["top_logprobs"][p], 2)
        assert tok.decode([prompt[p]], skip_special_tokens=False) in lp["top_logprobs"][p]


def test_echo_streamed_carries_the_prompt_first(server, ref) -> None:
    _, tok = ref
    body = {"model": "smollm2", "prompt": [PROMPT, "Hello"], "max_tokens": 0, "echo": True,
            "logprobs": 0, "stream": True}  # fmt: skip
    firsts: dict[int, dict[str, Any]] = {}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    firsts.setdefault(c["index"], c)
    assert firsts[0]["text"] == PROMPT and firsts[1]["text"] == "Hello"
    assert len(firsts[0]["logprobs"]["tokens"]) == len(tok.encode(PROMPT))
    assert firsts[1]["logprobs"]["token_logprobs"][0] is None


def test_the_longest_prompt_with_top_20_fits_the_transfer(server) -> None:
    """The bound the frontend enforces (sampling_params.prompt_logprobs_problem) keeps the
    prompt's logprobs inside the KV transfer's header limit, which drops larger ones."""
    ids = [(17 * i) % 4000 + 100 for i in range(350)]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 20}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 350 and all(lp["top_logprobs"][1:])
    # top k by text: tokens of one text (byte pieces shown as U+FFFD) share an entry
    assert max(len(t) for t in lp["top_logprobs"][1:]) >= 20


def test_refusals_name_the_field(server) -> None:
    for body, param in [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "word " * 1000, "echo": True, "logprobs": 20, "max_tokens": 1}, "logprobs"),
    ]:
        r = httpx.post(server + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and param in r.text, r.text
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})  # fmt: skip
    assert r.status_code == 400 and "top_logprobs" in r.text, r.text
