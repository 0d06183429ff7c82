"""Request models (pydantic; unknown fields ignored) and OpenAI / sglang wire formatting."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import SamplingParams
from pdserve.server.generation import Bootstrap, Delta, SampleResult, ttft_breakdown
from pdserve.server.tokenizer import Tokenizer


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _PD(_In):
    """The fields a PD router adds (sglang-router's names)."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    def bootstrap(self) -> Bootstrap:
        return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)


class StreamOptions(_In):
    include_usage: bool = False


class _Sampling(_PD):
    """OpenAI sampling fields plus the sglang extras both OpenAI routes accept."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=64)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=as_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionIn(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(_In):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatIn(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class NativeSampling(_In):
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=64)


class GenerateIn(_PD):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None


def as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---- OpenAI formatting -------------------------------------------------------------------
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
    """Builds response bodies and stream chunks of one OpenAI request."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, tok: Tokenizer) -> None:
        self.kind = kind
        self.model = model
        self.tok = tok
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + _short_id()
        self.created = int(time.time())
        self._text_pos: dict[int, int] = {}  # per choice: characters streamed so far

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def response(self, results: list[SampleResult], prompt_tokens: int, logprobs: bool) -> dict:
        choices = [self._choice(r, logprobs) for r in results]
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        body = self._envelope(obj, choices)
        body["usage"] = usage(prompt_tokens * len(results), sum(len(r.output_ids) for r in results))
        staged = next((r for r in results if r.stages), None)
        if staged is not None:  # the first sample's stages (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(staged.stages)
        return body

    def _choice(self, r: SampleResult, logprobs: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": r.index, "finish_reason": finish_reason(r.finish_reason)}
        lp = None
        if self.kind == "completion":
            c["text"] = r.text
            if logprobs:
                lp = completion_logprobs(self.tok, r.output_ids, r.logprobs, 0)
        else:
            c["message"] = {"role": "assistant", "content": r.text}
            if logprobs:
                lp = chat_logprobs(self.tok, r.output_ids, r.logprobs)
        c["logprobs"] = lp
        return c

    def chunk(self, d: Delta, logprobs: bool, first: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": d.index, "finish_reason": finish_reason(d.finish_reason)}
        lp = None
        if self.kind == "completion":
            c["text"] = d.text
            if logprobs:
                pos = self._text_pos.get(d.index, 0)
                lp = completion_logprobs(self.tok, d.token_ids, d.logprobs, pos)
                self._text_pos[d.index] = pos + len(d.text)
        else:
            c["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": d.text} if d.text or not d.finished else {}
            )
            if logprobs:
                lp = chat_logprobs(self.tok, d.token_ids, d.logprobs)
        c["logprobs"] = lp
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [c])
        if d.finished and d.stages:  # a choice's final chunk (pdserve extension, read by bench)
            body["ttft_breakdown"] = ttft_breakdown(d.stages)
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body


# ---- sglang native formatting ------------------------------------------------------------
def native_meta(rid: str, r: SampleResult, prompt_tokens: int, e2e: float, logprob: bool) -> dict:
    fr: dict[str, Any] | None = None
    if r.finish_reason is not None:
        fr = {"type": r.finish_reason}
        if r.matched is not None:
            fr["matched"] = r.matched
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(r.output_ids),
        "finish_reason": fr,
        "e2e_latency": e2e,
    }
    if r.stages:
        meta["ttft_breakdown"] = ttft_breakdown(r.stages)
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(r.output_ids, r.logprobs)]
    return meta


def _short_id() -> str:
    return uuid.uuid4().hex[:24]
