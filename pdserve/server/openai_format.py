"""OpenAI response bodies and stream chunks, built from a Job's Deltas / SampleResults."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pdserve.edge.stamps import ttft_breakdown
from pdserve.server.generation import Delta, Job, SampleResult
from pdserve.server.tokenizer import Tokenizer
from pdserve.server.tool_calls import ToolCallStream, parse_tool_calls


def _unindexed(call: dict[str, Any]) -> dict[str, Any]:
    """A call as a message holds it (the stream's `index` is only for deltas)."""
    return {k: v for k, v in call.items() if k != "index"}


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an abort is reported as "stop"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], offset: int) -> dict:
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(texts, lps)],
        "text_offset": offsets,
    }


def chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[float]) -> dict:
    content = []
    for t, lp in zip(ids, lps):
        s = tok.decode([t], skip_special_tokens=False)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return {"content": content}


class OpenAIFormatter:
    """Builds the response body or the stream chunks of one OpenAI request."""

    def __init__(
        self, kind: Literal["completion", "chat"], model: str, tok: Tokenizer, job: Job,
        logprobs: bool, tools: bool = False,
    ) -> None:  # fmt: skip
        self.kind = kind
        self.model = model
        self.tok = tok
        self.job = job
        self.logprobs = logprobs
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._text_pos: dict[int, int] = {}  # per choice: characters streamed so far
        self._started: set[int] = set()  # choices whose first chunk went out
        # usage's prompt_tokens: each prompt counted once, whatever n (as OpenAI does)
        self.prompt_tokens = sum(len(p) for p in job.prompts)
        self.completion_tokens = 0
        self.tools = tools  # parse tool calls out of the chat answers (tool_calls.py)
        self._calls: dict[int, ToolCallStream] = {}  # per choice, when streaming

    @property
    def _obj(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def response(self, results: list[SampleResult]) -> dict:
        choices = [self._choice(r) for r in results]
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        body = self._envelope(obj, choices)
        body["usage"] = usage(self.prompt_tokens, sum(len(r.output_ids) for r in results))
        staged = next((r for r in results if r.stages), None)
        if staged is not None:  # the first sample's stages (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(staged.stages)
        return body

    def _choice(self, r: SampleResult) -> dict[str, Any]:
        c: dict[str, Any] = {"index": r.index, "finish_reason": finish_reason(r.finish_reason)}
        lp = None
        if self.kind == "completion":
            c["text"] = r.text
            if self.logprobs:
                lp = completion_logprobs(self.tok, r.output_ids, r.logprobs, 0)
        else:
            c["message"] = {"role": "assistant", "content": r.text}
            if self.tools:
                content, calls = parse_tool_calls(r.text)
                if calls:
                    c["message"] = {"role": "assistant", "content": content.strip() or None,
                                    "tool_calls": [_unindexed(x) for x in calls]}  # fmt: skip
                    c["finish_reason"] = "tool_calls"
            if self.logprobs:
                lp = chat_logprobs(self.tok, r.output_ids, r.logprobs)
        c["logprobs"] = lp
        return c

    def chunk(self, d: Delta) -> dict[str, Any] | None:
        """The stream chunk of a Delta, or None when it carries nothing to send."""
        self.completion_tokens += len(d.token_ids)
        first = d.index not in self._started
        if not (d.text or d.finished or (self.logprobs and d.token_ids) or first):
            return None
        self._started.add(d.index)
        c: dict[str, Any] = {"index": d.index, "finish_reason": finish_reason(d.finish_reason)}
        lp = None
        if self.kind == "completion":
            c["text"] = d.text
            if self.logprobs:
                pos = self._text_pos.get(d.index, 0)
                lp = completion_logprobs(self.tok, d.token_ids, d.logprobs, pos)
                self._text_pos[d.index] = pos + len(d.text)
        else:
            c["delta"] = self._delta(d, first)
            if self.tools and d.finished and self._calls[d.index].calls:
                c["finish_reason"] = "tool_calls"
            if self.logprobs:
                lp = chat_logprobs(self.tok, d.token_ids, d.logprobs)
        c["logprobs"] = lp
        body = self._envelope(self._obj, [c])
        if d.finished and d.stages:  # a choice's final chunk (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(d.stages)
        return body

    def _delta(self, d: Delta, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        text = d.text
        calls: list[dict[str, Any]] = []
        if self.tools:
            stream = self._calls.setdefault(d.index, ToolCallStream())
            text, calls = stream.feed(d.text)
            if d.finished:
                text += stream.flush()
        if text or not (d.finished or calls):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return delta

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(self._obj, [])
        body["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return body
