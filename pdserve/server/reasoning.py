"""Reasoning output: the `<think>...</think>` text of a thinking model, split from the answer
(chat's `reasoning_content`, which vLLM also names `reasoning`).

    qwen3        reasoning only where the answer opens with <think> (Qwen3 writes it; with
                 enable_thinking false its template closes an empty one in the prompt,
                 and the answer is all content)
    deepseek_r1  reasoning from the start (its template opens <think> in the prompt; one
                 the model writes itself is skipped) up to </think>; all of it where
                 </think> never comes

Leading whitespace of each part and trailing whitespace of the reasoning are left out
(the model writes newlines around the tags). `ReasoningStream` takes the text as it
comes; text that may be part of a tag (or whitespace that may precede </think>) is held
back until known, so the pieces it gives join into exactly what `split_reasoning` gives
for the whole text, however the text is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK, END = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningStream:
    """Feeds text in, gets (reasoning, content) pieces out; `saw_reasoning`: whether the
    answer holds a reasoning part (None for `reasoning` in split_reasoning otherwise)."""

    parser: str = "qwen3"
    saw_reasoning: bool = False
    _buf: str = ""
    _state: Literal["start", "reasoning", "content"] = "start"
    _fresh: bool = True  # nothing of the present part given out yet: strip its leading space

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}")

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            self._open()
        if self._state == "reasoning":
            reasoning = self._reasoning()
        if self._state == "content":
            content = self._give(self._buf)
            self._buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The pieces left at the end."""
        if self._state == "start":  # too short to tell: no tag
            self._begin("reasoning" if self.parser == "deepseek_r1" else "content")
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return self._give(rest.rstrip()), ""
        return "", self._give(rest)

    def _open(self) -> None:
        """Decide, once the start is known, whether the answer opens with reasoning."""
        head = self._buf.lstrip()
        if head.startswith(THINK):
            self._buf = head[len(THINK) :]
            self._begin("reasoning")
        elif not head or (THINK.startswith(head)):
            return  # still may be the tag
        else:
            self._begin("reasoning" if self.parser == "deepseek_r1" else "content")

    def _begin(self, state: Literal["reasoning", "content"]) -> None:
        self._state, self._fresh = state, True
        self.saw_reasoning |= state == "reasoning"

    def _reasoning(self) -> str:
        end = self._buf.find(END)
        if end >= 0:
            piece = self._give(self._buf[:end].rstrip())
            self._buf = self._buf[end + len(END) :]
            self._begin("content")
            return piece
        cut = len(self._buf) - _partial_tail(self._buf, END)
        while cut > 0 and self._buf[cut - 1].isspace():  # may precede </think>: held
            cut -= 1
        piece, self._buf = self._buf[:cut], self._buf[cut:]
        return self._give(piece)

    def _give(self, piece: str) -> str:
        if self._fresh:
            piece = piece.lstrip()
            self._fresh = not piece
        return piece


def split_reasoning(text: str, parser: str = "qwen3") -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None where it has none."""
    s = ReasoningStream(parser)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2 if s.saw_reasoning else None), c1 + c2
