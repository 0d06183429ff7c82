"""Responses API bodies and stream events, built from the chat path's answer
(chat_bridge.py's Answer and Pieces).

A response's `output` is a list of items in the order the model wrote them: a
`reasoning` item with one `reasoning_text` part (when the chat route splits reasoning
out, `--reasoning-parser`), a `message` with one `output_text` part for its text, a
`function_call` per tool call. Streamed, each item goes out as

    response.output_item.added
      reasoning:      response.reasoning_text.delta..., response.reasoning_text.done
      message:        response.content_part.added, response.output_text.delta...,
                      response.output_text.done, response.content_part.done
      function_call:  response.function_call_arguments.delta, ...arguments.done
    response.output_item.done

between `response.created` + `response.in_progress` and `response.completed` (or
`response.incomplete` when max_output_tokens cut the answer, as OpenAI). Text that is
only whitespace between or around tool calls opens no message item.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pdserve.server.chat_bridge import Answer, Piece, call_arguments
from pdserve.server.responses_api import ResponsesIn


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call_arguments(call) if status == "completed" else "",
            "status": status}  # fmt: skip


class ResponseShell:
    """The response object of one request, the fields it echoes from the request."""

    def __init__(self, body: ResponsesIn, model: str) -> None:
        self.id = _id("resp")
        self.created = int(time.time())
        self.body = body
        self.model = model

    def envelope(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_logprobs": 0, "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }  # fmt: skip

    def response(self, a: Answer) -> dict[str, Any]:
        output = [reasoning_item(_id("rs"), a.reasoning)] if a.reasoning else []
        output += [message_item(_id("msg"), a.text)] if a.text.strip() else []
        output += [call_item(c) for c in a.calls]
        status = "incomplete" if a.finish == "length" else "completed"
        return self.envelope(status, output, _usage(a.prompt_tokens, a.output_tokens), a.finish)


class ResponseEvents:
    """The stream events of one response, fed the answer's pieces in order."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._msg: dict[str, Any] | None = None  # the message or reasoning item being written
        self._text = ""  # its text so far
        self._space = ""  # whitespace held back until text that opens a message follows

    def _ev(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(obj)

    def start(self) -> list[str]:
        snap = self.shell.envelope("in_progress", [], None)
        return [self._ev("response.created", response=snap),
                self._ev("response.in_progress", response=snap)]  # fmt: skip

    def feed(self, p: Piece, prompt_tokens: int, output_tokens: int) -> list[str]:
        if p.kind == "reasoning":
            return self._reasoning(p.text)
        if p.kind == "text":
            return self._text_piece(p.text)
        if p.kind == "call" and p.call is not None:
            return self._close_message() + self._call(p.call)
        out = self._close_message()
        status = "incomplete" if p.finish == "length" else "completed"
        usage = _usage(prompt_tokens, output_tokens)
        final = self.shell.envelope(status, self.output, usage, p.finish)
        return out + [self._ev(f"response.{status}", response=final)]

    def _reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        if self._msg is not None and self._msg["type"] != "reasoning":
            out += self._close_message()
        if self._msg is None:
            self._msg, self._text = reasoning_item(_id("rs"), "", "in_progress"), ""
            out.append(self._ev("response.output_item.added", output_index=len(self.output),
                                item=self._msg))  # fmt: skip
        self._text += text
        out.append(self._ev("response.reasoning_text.delta", item_id=self._msg_id,
                            output_index=len(self.output), content_index=0, delta=text))  # fmt: skip
        return out

    def _text_piece(self, text: str) -> list[str]:
        out: list[str] = []
        if self._msg is not None and self._msg["type"] == "reasoning":
            out += self._close_message()
        if self._msg is None:
            if not (self._space + text).strip():
                self._space += text
                return out
            text, self._space = self._space + text, ""
            out += self._open_message()
        self._text += text
        out.append(self._ev("response.output_text.delta", item_id=self._msg_id,
                            output_index=len(self.output), content_index=0, delta=text,
                            logprobs=[]))  # fmt: skip
        return out

    @property
    def _msg_id(self) -> str:
        assert self._msg is not None
        return str(self._msg["id"])

    def _open_message(self) -> list[str]:
        self._msg, self._text = message_item(_id("msg"), "", "in_progress"), ""
        where = {"output_index": len(self.output)}
        return [self._ev("response.output_item.added", item=self._msg, **where),
                self._ev("response.content_part.added", item_id=self._msg_id, content_index=0,
                         part=_text_part(""), **where)]  # fmt: skip

    def _close_message(self) -> list[str]:
        self._space = ""
        if self._msg is None:
            return []
        where = {"item_id": self._msg_id, "output_index": len(self.output), "content_index": 0}
        if self._msg["type"] == "reasoning":
            done = reasoning_item(self._msg_id, self._text)
            self.output.append(done)
            self._msg = None
            return [self._ev("response.reasoning_text.done", text=done["content"][0]["text"],
                             **where),
                    self._ev("response.output_item.done", output_index=where["output_index"],
                             item=done)]  # fmt: skip
        done = message_item(self._msg_id, self._text)
        out = [self._ev("response.output_text.done", text=self._text, logprobs=[], **where),
               self._ev("response.content_part.done", part=_text_part(self._text), **where),
               self._ev("response.output_item.done", output_index=len(self.output), item=done)]  # fmt: skip
        self.output.append(done)
        self._msg = None
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        item = call_item(call, "in_progress")
        index = len(self.output)
        args = call_arguments(call)
        done = {**item, "arguments": args, "status": "completed"}
        self.output.append(done)
        where = {"item_id": item["id"], "output_index": index}
        return [self._ev("response.output_item.added", output_index=index, item=item),
                self._ev("response.function_call_arguments.delta", delta=args, **where),
                self._ev("response.function_call_arguments.done", arguments=args,
                         name=item["name"], **where),
                self._ev("response.output_item.done", output_index=index, item=done)]  # fmt: skip

    def error(self, message: str, status: int) -> list[str]:
        """The events that end a stream the engine failed: `error`, then `response.failed`."""
        code = "server_error" if status >= 500 else "invalid_request"
        failed = self.shell.envelope("failed", self.output, None)
        failed["error"] = {"code": code, "message": message}
        return [self._ev("error", code=code, message=message, param=None),
                self._ev("response.failed", response=failed)]  # fmt: skip
