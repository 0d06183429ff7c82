"""Tool calls in a model's text, parsed into OpenAI `tool_calls`.

One parser per template family, chosen from the chat template (or `--tool-call-parser`):

    hermes   Qwen2.5 / Hermes / many others:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>

The streaming parser gets the text as it comes and splits it into content (text outside
any call) and whole calls; text that may be the start of an opening tag is held back
until it is known not to be one, so content never shows half a tag. A call whose body
is not a JSON object with a string `name` stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parser_for_template(template_text: str) -> str | None:
    """The parser a chat template's family needs, or None if it shows no tool calls."""
    return "hermes" if OPEN in template_text else None


def _call(body: str, index: int) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip


def _held_back(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallStream:
    """Feeds text in, gets (content, calls) out; `calls` carry their `index`."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        content = ""
        new: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return content, new
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._in_call = False
                call = _call(body, len(self.calls))
                if call is None:  # not a call after all: the text goes out as it was
                    content += OPEN + body + CLOSE
                else:
                    self.calls.append(call)
                    new.append(call)
                continue
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _held_back(self._buf)
                cut = len(self._buf) - keep
                content, self._buf = content + self._buf[:cut], self._buf[cut:]
                return content, new
            content += self._buf[:start]
            self._buf = self._buf[start + len(OPEN) :]
            self._in_call = True

    def flush(self) -> str:
        """The text left at the end (an unclosed call stays content, as written)."""
        rest = (OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return rest


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a whole answer."""
    s = ToolCallStream()
    content, calls = s.feed(text)
    return content + s.flush(), calls
