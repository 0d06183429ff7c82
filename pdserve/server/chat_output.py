"""A chat answer's text split into its parts: reasoning (reasoning.py), then, in the
rest, content and tool calls (tool_calls.py); whole, or piece by piece as it streams,
with the same result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve.server.reasoning import ReasoningStream
from pdserve.server.tool_calls import ToolCallStream


class AnswerParts(NamedTuple):
    reasoning: str  # "" where there is none (or no reasoning parser)
    content: str
    calls: list[dict[str, Any]]


@dataclass(frozen=True)
class ChatOutput:
    """How a request's chat answers are read (from the request and the server flags)."""

    tools: bool = False  # parse tool calls out of the answer
    tool_names: frozenset[str] = frozenset()  # the request's tools (untagged calls name one)
    max_calls: int | None = None  # 1: parallel_tool_calls false
    reasoning: str | None = None  # a reasoning parser's name (reasoning.py), or None

    def stream(self) -> AnswerStream:
        return AnswerStream(self)

    def whole(self, text: str) -> tuple[AnswerParts, bool]:
        """The parts of a whole answer, and whether it held a reasoning part."""
        s = self.stream()
        a, b = s.feed(text), s.flush()
        return AnswerParts(a.reasoning + b.reasoning, a.content + b.content,
                           a.calls + b.calls), s.saw_reasoning  # fmt: skip


@dataclass
class AnswerStream:
    out: ChatOutput
    _think: ReasoningStream | None = None
    _tools: ToolCallStream | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.out.reasoning is not None:
            self._think = ReasoningStream(self.out.reasoning)
        if self.out.tools:
            self._tools = ToolCallStream(self.out.tool_names, self.out.max_calls)

    @property
    def saw_reasoning(self) -> bool:
        return self._think is not None and self._think.saw_reasoning

    def feed(self, text: str) -> AnswerParts:
        reasoning, text = self._think.feed(text) if self._think else ("", text)
        return self._content(reasoning, text, end=False)

    def flush(self) -> AnswerParts:
        reasoning, text = self._think.flush() if self._think else ("", "")
        return self._content(reasoning, text, end=True)

    def _content(self, reasoning: str, text: str, end: bool) -> AnswerParts:
        if self._tools is None:
            return AnswerParts(reasoning, text, [])
        content, calls = self._tools.feed(text)
        if end:
            rest, more = self._tools.flush()
            content, calls = content + rest, calls + more
        self.calls += calls
        return AnswerParts(reasoning, content, calls)
