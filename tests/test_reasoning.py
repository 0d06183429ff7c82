"""Reasoning output (--reasoning-parser): `<think>` text split into `reasoning_content`,
unit by unit, and through a frontend serving the tiny-qwen3 preset (its tokenizer and
config; the fake engine echoes the prompt, so the "model" writes what the template
renders: a Qwen3-style thinking answer)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest
from fake_engine import ServerProc

from pdserve.model.make import default_model_path
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


# ---- through a frontend ------------------------------------------------------------------
# Qwen3's shape: thinking on by default; enable_thinking false closes an empty block in
# the prompt. The echo then "answers" with the last message's text.
TEMPLATE = (
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{{ messages[-1]['content'] }}"
)
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = default_model_path("tiny-qwen3")  # made once, cached (other tests share it)
    template = tmp_path_factory.mktemp("tpl") / "t.jinja"
    template.write_text(TEMPLATE)
    s = ServerProc(model, "decode", "--chat-template", str(template),
                   "--reasoning-parser", "qwen3")  # fmt: skip
    try:
        yield s.wait_healthy(60.0).url
    finally:
        s.stop()


def chat(url: str, text: str, **kw) -> dict:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": text + EOS}], "max_tokens": 200, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_streamed(url: str, text: str, **kw) -> tuple[str, str, str | None]:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": text + EOS}], "max_tokens": 200,
            "stream": True, **kw}  # fmt: skip
    reasoning, content, finish = "", "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_chat_splits_reasoning_streamed_as_whole(server: str) -> None:
    msg = chat(server, THOUGHT)["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "The user greets me.\nI greet back."
    assert msg["content"] == "Hello there!"
    assert chat_streamed(server, THOUGHT) == (msg["reasoning_content"], msg["content"], "stop")


def test_enable_thinking_false_and_separate_reasoning_false(server: str) -> None:
    """Thinking off: the template closes an empty block in the prompt (the echo writes it
    back, as Qwen3 would not: its reasoning is empty). separate_reasoning false (sglang's
    field) leaves the text whole."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = chat(server, "Hi!", **off)["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("", "Hi!")
    assert chat_streamed(server, "Hi!", **off)[:2] == ("", "Hi!")
    msg = chat(server, "Hi!")["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "Hi!")
    msg = chat(server, THOUGHT, separate_reasoning=False)["choices"][0]["message"]
    assert msg["content"] == THOUGHT and "reasoning_content" not in msg


def test_stream_reasoning_false_is_refused_by_name(server: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream_reasoning": False}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_reasoning"
