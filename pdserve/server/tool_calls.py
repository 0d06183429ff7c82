"""Tool calls in a model's text, parsed into OpenAI `tool_calls`.

One parser per template family, chosen from the chat template (or `--tool-call-parser`):

    hermes   Qwen2.5 / Hermes / many others:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>

The streaming parser gets the text as it comes and splits it into content (text outside
any call) and whole calls; text that may be the start of an opening tag is held back
until it is known not to be one, so content never shows half a tag. A call whose body
is not a JSON object with a string `name` stays in the content, as the model wrote it.
A call left unclosed at the end (the token budget ran out inside it) is dropped, and so
is a tail that may be the start of a tag: content never holds partial tag text.
`max_calls` (1 with parallel_tool_calls false) keeps the first calls and drops the rest.

Small models of the family (Qwen2.5-Coder-0.5B) often leave the tags out and answer
with the bare object, or with the object in a ```json fence (llama.cpp's Hermes parser
takes these too). An answer that is *only* such objects, each naming one of the
request's tools, is read as those calls; an answer that starts like one (`{"name"`
after an optional fence) is held back to its end to know, any other goes out at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```(?:json|JSON)?[ \t]*\n?(.*?)\n?```", re.DOTALL)


def parser_for_template(template_text: str) -> str | None:
    """The parser a chat template's family needs, or None if it shows no tool calls."""
    return "hermes" if OPEN in template_text else None


def _call(obj: Any, index: int) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip


def _tagged_call(body: str, index: int) -> dict[str, Any] | None:
    try:
        return _call(json.loads(body), index)
    except json.JSONDecodeError:
        return None


def _bare_calls(text: str, names: frozenset[str], first: int) -> list[dict[str, Any]] | None:
    """The calls of an answer made only of bare (or fenced) call objects naming `names`,
    else None."""
    fenced = _FENCE.fullmatch(text.strip())
    text = (fenced.group(1) if fenced else text).strip()
    decoder, at = json.JSONDecoder(), 0
    calls: list[dict[str, Any]] = []
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(obj, first + len(calls))
        if call is None or call["function"]["name"] not in names:
            return None
        calls.append(call)
        at = len(text) - len(text[end:].lstrip())
    return calls or None


def _bare_start(text: str) -> bool | None:
    """Whether `text` (stripped of leading space) starts like a bare call: True, False,
    or None while too short to tell."""
    if text.startswith("```"):
        if "\n" not in text:
            return None if len(text) < 12 else False
        lang, text = text[3:].split("\n", 1)
        if lang.strip() not in ("", "json", "JSON"):
            return False
        text = text.lstrip()
    elif "```".startswith(text):
        return None
    if not text:
        return None
    if text[0] != "{":
        return False
    rest = text[1:].lstrip()
    head = '"name"'
    return True if rest.startswith(head) else (None if head.startswith(rest) else False)


def _held_back(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallStream:
    """Feeds text in, gets (content, calls) out; `calls` carry their `index`. `names`:
    the request's tools, which bare calls must name (empty: only tagged calls)."""

    names: frozenset[str] = frozenset()
    max_calls: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _bare: bool | None = None  # the answer starts like a bare call (None: not known yet)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        if self.names and self._bare is None:
            self._bare = _bare_start(self._buf.lstrip())
        if self._bare is not False and self.names:
            return "", []  # held back to the end (or until it is known not to be a call)
        return self._tagged()

    def _tagged(self) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        new: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return content, new
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._in_call = False
                call = _tagged_call(body, len(self.calls))
                if call is None:  # not a call after all: the text goes out as it was
                    content += OPEN + body + CLOSE
                else:
                    new += self._keep([call])
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

    def _keep(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`calls` up to max_calls in all, recorded."""
        room = len(calls) if self.max_calls is None else self.max_calls - len(self.calls)
        kept = calls[: max(room, 0)]
        self.calls += kept
        return kept

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """The text and calls left at the end (an unclosed call, or a tail that may begin
        a tag, is dropped)."""
        content, new = "", list[dict[str, Any]]()
        if self.names and self._bare is not False:
            calls = _bare_calls(self._buf, self.names, len(self.calls))
            if calls is not None:
                self._buf = ""
                return "", self._keep(calls)
            self._bare = False
            content, new = self._tagged()
        rest = "" if self._in_call else self._buf[: len(self._buf) - _held_back(self._buf)]
        self._buf, self._in_call = "", False
        return content + rest, new


def parse_tool_calls(
    text: str, names: frozenset[str] = frozenset(), max_calls: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a whole answer."""
    s = ToolCallStream(names, max_calls)
    content, calls = s.feed(text)
    rest, more = s.flush()
    return content + rest, calls + more
