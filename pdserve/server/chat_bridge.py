"""The chat path as the Responses and Messages routes use it: they build a ChatIn, run it
through the same parse, engine and chat formatter as `/v1/chat/completions`, and read
the answer back as neutral pieces (text, tool calls, the end) that their own formats
turn into their wire shapes (responses_format.py, anthropic_format.py).

    ChatIn ── chat_request ──▶ Job ── Frontend.start ──▶ Deltas ── OpenAIFormatter ──▶ pieces
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pdserve.protocol import QUEUE_FULL
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import Frontend
from pdserve.server.http_util import until_disconnect
from pdserve.server.jobs import Delta, RequestError, SampleResult
from pdserve.server.openai_api import ChatIn
from pdserve.server.openai_format import OpenAIFormatter
from pdserve.server.openai_parse import OpenAIRequest, chat_request, parse_body
from pdserve.server.server_config import ServerConfig

log = logging.getLogger(__name__)


class AnswerFailed(RequestError):
    """The engine failed the request (503: gone or overloaded, the client may retry)."""

    def __init__(self, message: str, status: int, overloaded: bool = False) -> None:
        super().__init__(message, None, status)
        self.overloaded = overloaded


@dataclass
class Piece:
    """One step of an answer: `reasoning` text (what the chat route returns as
    reasoning_content), `text`, a whole tool `call` (OpenAI's shape), or the `end`."""

    kind: str  # "reasoning" | "text" | "call" | "end"
    text: str = ""
    call: dict[str, Any] | None = None
    finish: str | None = None  # at the end: "stop" | "length" | "tool_calls"
    stop_sequence: str | None = None  # at the end: the stop string that ended it


@dataclass
class Answer:
    """A whole answer, as the non-streaming routes return it."""

    text: str  # the content ("" when the answer is only tool calls)
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    reasoning: str = ""  # the chat route's reasoning_content


@dataclass
class ChatRun:
    """A parsed chat request and its formatter, ready to run."""

    req: OpenAIRequest
    fmt: OpenAIFormatter
    stop: list[str]

    @property
    def prompt_tokens(self) -> int:
        return self.fmt.prompt_tokens


def prepare(fe: Frontend, cfg: ServerConfig, chat: dict[str, Any], stamps: dict[str, float],
            parser: str | None, renames: dict[str, str]) -> ChatRun:  # fmt: skip
    """The chat body `chat` checked and parsed as `/v1/chat/completions` would; a refusal
    names the field as the client sent it (`renames`: chat field -> the client's)."""
    try:
        body = parse_body(ChatIn, chat, cfg)
        req = chat_request(fe, cfg, body, stamps, parser)
    except RequestError as e:
        old = next(
            (k for k in renames if e.param is not None and (e.param + ".").startswith(k + ".")),
            None,
        )
        if old is None or e.param is None:
            raise
        name = renames[old] + e.param[len(old) :]
        raise RequestError(e.message.replace(old, renames[old], 1), name, e.status) from e
    fmt = OpenAIFormatter("chat", cfg.model_name, fe.tokenizer, req.job, False, req.out)
    return ChatRun(req, fmt, list(req.job.params.stop))


def _stop_string(matched: int | str | None, stop: list[str]) -> str | None:
    return matched if isinstance(matched, str) and matched in stop else None


def _failed(fe: Frontend, error: str) -> AnswerFailed:
    busy = error == QUEUE_FULL
    return AnswerFailed(error, 503 if busy or not fe.client.alive else 500, busy)


async def answer(request: Request, fe: Frontend, run: ChatRun) -> Answer:
    """The whole answer; AnswerFailed when the engine failed it."""
    results: list[SampleResult] = await until_disconnect(request, fe.complete(run.req.job))
    (r,) = results
    if r.error:
        raise _failed(fe, r.error)
    choice = run.fmt.response(results)["choices"][0]
    msg = choice["message"]
    return Answer(msg.get("content") or "", list(msg.get("tool_calls") or []),
                  choice["finish_reason"], _stop_string(r.matched, run.stop),
                  run.prompt_tokens, len(r.output_ids), msg.get("reasoning_content") or "")  # fmt: skip


def start(fe: Frontend, run: ChatRun) -> AsyncIterator[Delta]:
    """The request submitted, before a stream's headers go out: RequestError for bad
    parameters, EngineDead when the engine is gone (the route's 4xx / 503)."""
    return fe.start(run.req.job)[1]


async def pieces(fe: Frontend, run: ChatRun, gen: AsyncIterator[Delta]) -> AsyncIterator[Piece]:
    """The answer of a started request (`start`) as it comes; raises AnswerFailed when the
    engine fails it (the route's stream ends with its error event). Closing it closes
    `gen`, which aborts the engine request."""
    try:
        async for d in gen:
            if d.error:
                raise _failed(fe, d.error)
            chunk = run.fmt.chunk(d)
            if chunk is None:
                continue
            c = chunk["choices"][0]
            delta = c["delta"]
            if delta.get("reasoning_content"):
                yield Piece("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield Piece("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                yield Piece("call", call=call)
            if d.finished:
                stop = _stop_string(d.matched, run.stop)
                yield Piece("end", finish=c["finish_reason"], stop_sequence=stop)
    except EngineDead as e:  # died between the liveness check and submission
        raise AnswerFailed(f"engine unavailable: {e}", 503) from e
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


def call_arguments(call: dict[str, Any]) -> str:
    """A tool call's arguments as JSON text."""
    return str(call["function"].get("arguments") or "{}")


def call_input(call: dict[str, Any]) -> Any:
    """A tool call's arguments as the object they encode ({} when they are not JSON)."""
    try:
        return json.loads(call_arguments(call))
    except json.JSONDecodeError:
        return {}
