"""Reasoning output (--reasoning-parser): `<think>` text split into `reasoning_content`,
unit by unit, and through `pdserve up` on the random tiny-qwen3 preset, whose greedy
answer a regex opens with a thinking block (a random model would not write one)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator

import httpx
import pytest
from test_e2e_pd import free_port, spawn, stop, wait_healthy

from pdserve.server.chat_output import ChatOutput
from pdserve.server.reasoning import ReasoningStream, split_reasoning

THOUGHT = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def test_split_qwen3() -> None:
    assert split_reasoning(THOUGHT) == ("The user greets me.\nI greet back.", "Hello there!")
    assert split_reasoning("Hello there!") == (None, "Hello there!")  # thinking off
    assert split_reasoning("<think>\nhalf a thou") == ("half a thou", "")  # cut by the budget
    assert split_reasoning("<think>\n\n</think>\n\nHi") == ("", "Hi")
    assert split_reasoning("Say <think> later") == (None, "Say <think> later")


def test_split_deepseek_r1() -> None:
    """Its template opens <think> in the prompt: the answer is reasoning up to </think>."""
    assert split_reasoning("Plan.\n</think>\n\nDone.", "deepseek_r1") == ("Plan.", "Done.")
    assert split_reasoning(THOUGHT, "deepseek_r1")[1] == "Hello there!"
    assert split_reasoning("all thought", "deepseek_r1") == ("all thought", "")


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_streamed_in_any_pieces_equals_whole(parser: str) -> None:
    rng = random.Random(0)
    texts = [THOUGHT, "Hello there!", "<think>\nhalf  \n", "a </think> b", "  <thi", "x\n\n"]
    for text in texts:
        for _ in range(20):
            s = ReasoningStream(parser)
            got = [s.feed(p) for p in pieces(text, rng)] + [s.flush()]
            reasoning = "".join(r for r, _ in got)
            content = "".join(c for _, c in got)
            want = split_reasoning(text, parser)
            assert (reasoning if s.saw_reasoning else None, content) == want, (text, got)


def test_reasoning_then_a_tool_call() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    out = ChatOutput(tools=True, reasoning="qwen3")
    parts, thought = out.whole("<think>\nI need f.\n</think>\n\n" + call)
    assert thought and parts.reasoning == "I need f." and parts.content == ""
    assert [c["function"]["name"] for c in parts.calls] == ["f"]


# ---- through `pdserve up` -----------------------------------------------------------------
THINKING = "<think>\n[a-z ]{1,40}\n</think>\n\n[a-z ]{1,20}"  # Qwen3's shape, bounded


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny-qwen3", "--port",
            str(port), "--grace-period", "5", "--reasoning-parser", "qwen3",
            "--heartbeat-timeout", "30"]  # fmt: skip
    proc = spawn(argv, "reasoning")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc])
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def body(**kw) -> dict:  # type: ignore[no-untyped-def]
    return {"messages": [{"role": "user", "content": "Hello, who are you?"}], "temperature": 0,
            "max_tokens": 80, "guided_regex": THINKING, **kw}  # fmt: skip


def chat(url: str, **kw) -> dict:  # type: ignore[no-untyped-def]
    r = httpx.post(url + "/v1/chat/completions", json=body(**kw), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def chat_streamed(url: str, **kw) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    reasoning, content = "", ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body(stream=True, **kw),
                      timeout=120) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


def test_chat_splits_reasoning_streamed_as_whole(server: str) -> None:
    msg = chat(server)
    assert msg["reasoning_content"] == msg["reasoning"] and msg["reasoning_content"]
    assert msg["content"] and "<think>" not in msg["content"] + msg["reasoning_content"]
    assert chat_streamed(server) == (msg["reasoning_content"], msg["content"])
    whole = chat(server, separate_reasoning=False)  # sglang's field: no split
    assert "reasoning_content" not in whole
    assert whole["content"].startswith("<think>\n")
    assert split_reasoning(whole["content"]) == (msg["reasoning"], msg["content"])


def test_enable_thinking_false(server: str) -> None:
    """Thinking off: Qwen3's template closes an empty block in the prompt, and the
    answer (no <think> of its own) is all content; the template kwarg passes through."""
    kw = {"guided_regex": "[a-z ]{1,20}", "chat_template_kwargs": {"enable_thinking": False}}
    msg = chat(server, **kw)
    assert msg["reasoning_content"] is None and msg["content"]
    assert chat_streamed(server, **kw) == ("", msg["content"])


def test_stream_reasoning_false_is_refused_by_name(server: str) -> None:
    r = httpx.post(server + "/v1/chat/completions", json=body(stream_reasoning=False), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_reasoning"
