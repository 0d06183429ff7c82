"""Anthropic Messages bodies, stream events and errors, built from the chat path's answer
(chat_bridge.py's Answer and Pieces).

A message's `content` is its blocks in the order the model wrote them: `thinking` (when
the chat route splits reasoning out, `--reasoning-parser`; its `signature` is empty),
`text`, then a `tool_use` per tool call. Streamed:

    message_start, ping,
    per block: content_block_start,
               content_block_delta (thinking_delta | text_delta | input_json_delta)...,
               content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

`stop_reason`: end_turn, max_tokens, stop_sequence (with the string) or tool_use. Text
that is only whitespace around tool calls opens no text block.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from pdserve.edge.anthropic_errors import anthropic_error_body
from pdserve.server.chat_bridge import Answer, Piece, call_arguments, call_input

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return anthropic_error_body(kind, message)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": call_input(call)}  # fmt: skip


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


class MessageShell:
    def __init__(self, model: str) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model

    def envelope(self, content: list[dict[str, Any]], stop: str | None, stop_sequence: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:  # fmt: skip
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
                "usage": usage}  # fmt: skip

    def message(self, a: Answer) -> dict[str, Any]:
        content = [_thinking(a.reasoning)] if a.reasoning else []
        content += [{"type": "text", "text": a.text}] if a.text.strip() else []
        content += [tool_use(c) for c in a.calls]
        usage = {"input_tokens": a.prompt_tokens, "output_tokens": a.output_tokens}
        return self.envelope(content, stop_reason(a.finish, a.stop_sequence), a.stop_sequence,
                             usage)  # fmt: skip


class MessageEvents:
    """The stream events of one message, fed the answer's pieces in order."""

    def __init__(self, shell: MessageShell) -> None:
        self.shell = shell
        self.blocks = 0  # blocks started so far
        self._open: str | None = None  # the kind of the block being written
        self._space = ""  # whitespace held back until text that opens a block follows

    def start(self, prompt_tokens: int) -> list[str]:
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        msg = self.shell.envelope([], None, None, usage)
        return [event({"type": "message_start", "message": msg}), event({"type": "ping"})]

    def feed(self, p: Piece, output_tokens: int) -> list[str]:
        if p.kind == "reasoning":
            return self._thinking(p.text)
        if p.kind == "text":
            return self._text(p.text)
        if p.kind == "call" and p.call is not None:
            return self._close_block() + self._call(p.call)
        delta = {"stop_reason": stop_reason(p.finish, p.stop_sequence),
                 "stop_sequence": p.stop_sequence}  # fmt: skip
        return self._close_block() + [
            event({"type": "message_delta", "delta": delta,
                   "usage": {"output_tokens": output_tokens}}),
            event({"type": "message_stop"}),
        ]  # fmt: skip

    def _thinking(self, text: str) -> list[str]:
        out = self._close_block() if self._open == "text" else []
        if self._open is None:
            self._open = "thinking"
            out.append(event({"type": "content_block_start", "index": self.blocks,
                              "content_block": _thinking("")}))  # fmt: skip
        out.append(event({"type": "content_block_delta", "index": self.blocks,
                          "delta": {"type": "thinking_delta", "thinking": text}}))  # fmt: skip
        return out

    def _text(self, text: str) -> list[str]:
        out = self._close_block() if self._open == "thinking" else []
        if self._open is None:
            if not (self._space + text).strip():
                self._space += text
                return out
            text, self._space = self._space + text, ""
            self._open = "text"
            out.append(event({"type": "content_block_start", "index": self.blocks,
                              "content_block": {"type": "text", "text": ""}}))  # fmt: skip
        out.append(event({"type": "content_block_delta", "index": self.blocks,
                          "delta": {"type": "text_delta", "text": text}}))  # fmt: skip
        return out

    def _close_block(self) -> list[str]:
        self._space = ""
        if self._open is None:
            return []
        self._open = None
        self.blocks += 1
        return [event({"type": "content_block_stop", "index": self.blocks - 1})]

    def _call(self, call: dict[str, Any]) -> list[str]:
        i = self.blocks
        self.blocks += 1
        start = {**tool_use(call), "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call_arguments(call)}
        return [event({"type": "content_block_start", "index": i, "content_block": start}),
                event({"type": "content_block_delta", "index": i, "delta": delta}),
                event({"type": "content_block_stop", "index": i})]  # fmt: skip

    def error(self, status: int, message: str) -> str:
        return event(error_body(status, message))
