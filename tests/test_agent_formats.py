"""The Responses and Messages formats against the clients' own pydantic models: every
body and stream event the server builds from an answer's pieces (reasoning, text, a
tool call, the end) validates as the installed `openai` / `anthropic` package's type,
in the order the APIs define. No server: the formats are fed pieces directly."""

from __future__ import annotations

import json
import typing
from typing import Any

import anthropic.types as at
import openai.types.responses as ot
from pydantic import BaseModel

from pdserve.server.anthropic_format import MessageEvents, MessageShell
from pdserve.server.chat_bridge import Answer, Piece
from pdserve.server.responses_api import ResponsesIn
from pdserve.server.responses_format import ResponseEvents, ResponseShell
from pdserve.server.responses_items import chat_messages

CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
PIECES = [Piece("reasoning", "Let me"), Piece("reasoning", " think."), Piece("text", "Checking"), Piece("text", " now."), Piece("call", call=CALL),
          Piece("text", "\n"), Piece("end", finish="tool_calls")]  # fmt: skip
ANSWER = Answer("Checking now.", [CALL], "tool_calls", None, 7, 9, "Let me think.")


def validated(union: Any, obj: dict[str, Any]) -> Any:
    """`obj` as the union's member its `type` names (a clear error when it does not fit)."""
    members = typing.get_args(typing.get_args(union)[0])
    (cls,) = [
        c for c in members if c.model_fields["type"].annotation == typing.Literal[obj["type"]]
    ]
    assert issubclass(cls, BaseModel)
    return cls.model_validate(obj)


def sse_data(events: list[str]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        name, data = e.split("\n")[:2]
        obj = json.loads(data.removeprefix("data: "))
        assert name == "event: " + obj["type"]
        out.append(obj)
    return out


def test_responses_stream_and_body_are_the_sdks_types() -> None:
    shell = ResponseShell(ResponsesIn(input="hi"), "m")
    ev = ResponseEvents(shell)
    events = sse_data(ev.start() + [e for p in PIECES for e in ev.feed(p, 7, 9)])
    parsed = [validated(ot.ResponseStreamEvent, e) for e in events]
    assert [p.type for p in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = parsed[-1].response  # type: ignore[union-attr]
    body = ot.Response.model_validate(shell.response(ANSWER))
    for r in (final, body):
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
        assert r.output[0].content[0].text == "Let me think."  # type: ignore[union-attr]
        assert r.output_text == "Checking now."
        assert r.output[2].arguments == CALL["function"]["arguments"]  # type: ignore[union-attr]
    assert body.usage is not None and body.usage.output_tokens == 9


def test_messages_stream_and_body_are_the_sdks_types() -> None:
    shell = MessageShell("m")
    ev = MessageEvents(shell)
    events = sse_data(ev.start(7) + [e for p in PIECES for e in ev.feed(p, 9)])
    parsed = [validated(at.RawMessageStreamEvent, e) for e in events
              if e["type"] != "ping"]  # fmt: skip
    assert [(p.type, getattr(p, "index", None)) for p in parsed] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert parsed[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
    body = at.Message.model_validate(shell.message(ANSWER))
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use"]
    assert body.content[2].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert body.stop_reason == "tool_use" and body.usage.output_tokens == 9


def test_responses_input_items_regroup_into_assistant_turns() -> None:
    body = ResponsesIn(input=[
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ], instructions="Be brief")  # fmt: skip
    body.check_fields()
    msgs = chat_messages(body.instructions, body.items())
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    turn = msgs[2]
    assert (turn["content"], turn["reasoning_content"]) == ("Checking.", "Look it up.")
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
