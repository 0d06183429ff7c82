"""OpenAI response bodies and stream chunks, built from a Job's Deltas / SampleResults."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pdserve.edge.stamps import ttft_breakdown
from pdserve.protocol import PromptLogprobs
from pdserve.server.chat_output import AnswerParts, AnswerStream, ChatOutput
from pdserve.server.jobs import Delta, Job, SampleResult
from pdserve.server.openai_logprobs import chat_logprobs, completion_logprobs
from pdserve.server.tokenizer import Tokenizer


def _unindexed(call: dict[str, Any]) -> dict[str, Any]:
    """A call as a message holds it (the stream's `index` is only for deltas)."""
    return {k: v for k, v in call.items() if k != "index"}


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

# A router that may migrate a stream asks for each event's token ids with this header;
# they come as an SSE comment line at the head of the event's block (`ids_comment`), or
# as a block of their own when the tokens made no event yet (text held back). Clients
# ignore comments; the router strips them.
TOKEN_IDS_HEADER = "x-pdserve-token-ids"


def ids_comment(token_ids: list[int]) -> str:
    return ": ids " + ",".join(map(str, token_ids)) + "\n" if token_ids else ""


def with_ids(event: str | None, token_ids: list[int] | None) -> str | None:
    """An SSE block: `event` headed by its tokens' ids comment (`token_ids` None: not
    asked); None when there is nothing to send."""
    head = ids_comment(token_ids) if token_ids is not None else ""
    if event is not None:
        return head + event
    return head + "\n" if head else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an abort is reported as "stop"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


class OpenAIFormatter:
    """Builds the response body or the stream chunks of one OpenAI request."""

    def __init__(
        self, kind: Literal["completion", "chat"], model: str, tok: Tokenizer, job: Job,
        logprobs: bool, out: ChatOutput = ChatOutput(), echo: list[str] | None = None,
        drop_output: bool = False,
    ) -> None:  # fmt: skip
        """`out`: how chat answers are split (reasoning, content, tool calls); `echo`:
        each prompt's text, put before its choices' text (and with `logprobs`, the
        prompt's tokens before theirs); `drop_output`: max_tokens 0 (the engines sample
        one token, which the response leaves out)."""
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
        self.out = out
        self._answers: dict[int, AnswerStream] = {}  # per choice, when streaming
        self.echo = echo
        self.drop_output = drop_output

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
        out = 0 if self.drop_output else sum(len(r.output_ids) for r in results)
        body["usage"] = usage(self.prompt_tokens, out)
        staged = next((r for r in results if r.stages), None)
        if staged is not None:  # the first sample's stages (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(staged.stages)
        return body

    def _choice(self, r: SampleResult) -> dict[str, Any]:
        c: dict[str, Any] = {"index": r.index, "finish_reason": finish_reason(r.finish_reason)}
        lp = None
        if self.kind == "completion":
            if self.drop_output:
                r = SampleResult(r.index, prompt_logprobs=r.prompt_logprobs, finish_reason="length")
                c["finish_reason"] = "length"
            c["text"] = self._echo_text(r.index) + r.text
            if self.logprobs:
                lp = completion_logprobs(self.tok, r.output_ids, r.logprobs, r.top_logprobs, 0,
                                         self._echo_logprobs(r.index, r.prompt_logprobs))  # fmt: skip
        else:
            parts, thought = self.out.whole(r.text)
            c["message"] = self._message(parts, thought)
            if parts.calls and c["finish_reason"] == "stop":  # cut by the budget: "length"
                c["finish_reason"] = "tool_calls"
            if self.logprobs:
                lp = chat_logprobs(self.tok, r.output_ids, r.logprobs, r.top_logprobs)
        c["logprobs"] = lp
        return c

    def chunk(self, d: Delta) -> dict[str, Any] | None:
        """The stream chunk of a Delta, or None when it carries nothing to send."""
        if self.drop_output:
            d = Delta(d.index, prompt_logprobs=d.prompt_logprobs, finished=d.finished,
                      finish_reason=d.finish_reason and "length", error=d.error, stages=d.stages)  # fmt: skip
        self.completion_tokens += len(d.token_ids)
        first = d.index not in self._started
        if not (d.text or d.finished or (self.logprobs and d.token_ids) or first):
            return None
        self._started.add(d.index)
        c: dict[str, Any] = {"index": d.index, "finish_reason": finish_reason(d.finish_reason)}
        lp = None
        if self.kind == "completion":
            c["text"] = (self._echo_text(d.index) if first else "") + d.text
            if self.logprobs:
                pos = self._text_pos.get(d.index, 0)
                echoed = self._echo_logprobs(d.index, d.prompt_logprobs) if first else None
                lp = completion_logprobs(self.tok, d.token_ids, d.logprobs, d.top_logprobs, pos,
                                         echoed)  # fmt: skip
                self._text_pos[d.index] = pos + len(c["text"])
        else:
            c["delta"] = self._delta(d, first)
            if d.finished and self._answers[d.index].calls and c["finish_reason"] == "stop":
                c["finish_reason"] = "tool_calls"
            if self.logprobs:
                lp = chat_logprobs(self.tok, d.token_ids, d.logprobs, d.top_logprobs)
        c["logprobs"] = lp
        body = self._envelope(self._obj, [c])
        if d.finished and d.stages:  # a choice's final chunk (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(d.stages)
        return body

    def _echo_text(self, index: int) -> str:
        return self.echo[index // self.job.n] if self.echo is not None else ""

    def _echo_logprobs(
        self, index: int, prompt: PromptLogprobs | None
    ) -> tuple[list[int], PromptLogprobs | None] | None:
        return None if self.echo is None else (self.job.prompt_of(index), prompt)

    def _message(self, parts: AnswerParts, thought: bool) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": parts.content}
        if self.out.reasoning is not None:  # as vLLM: both names, null without reasoning
            msg["reasoning_content"] = msg["reasoning"] = parts.reasoning if thought else None
        if parts.calls:
            msg["content"] = parts.content.strip() or None
            msg["tool_calls"] = [_unindexed(x) for x in parts.calls]
        return msg

    def _delta(self, d: Delta, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        stream = self._answers.setdefault(d.index, self.out.stream())
        parts = stream.feed(d.text)
        if d.finished:
            more = stream.flush()
            parts = AnswerParts(parts.reasoning + more.reasoning, parts.content + more.content,
                                parts.calls + more.calls)  # fmt: skip
        if parts.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parts.reasoning
        if parts.content or not (d.finished or parts.calls or parts.reasoning):
            delta["content"] = parts.content
        if parts.calls:
            delta["tool_calls"] = parts.calls
        return delta

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(self._obj, [])
        body["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return body
