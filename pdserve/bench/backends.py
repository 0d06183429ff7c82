"""One streamed request against a server, timed chunk by chunk.

Wire formats (all SSE, `data: <json>` lines ending with `data: [DONE]`):
  native       POST /generate             {"text": cumulative, "output_ids", "meta_info"}
  openai       POST /v1/completions       {"choices": [{"text": delta}], "usage"?}
  openai-chat  POST /v1/chat/completions  {"choices": [{"delta": {"content"}}], "usage"?}
A request never raises: failures end up as `RequestRecord.error` (a short reason).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.datasets import BenchRequest

PATHS = {"native": "/generate", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
BREAKDOWN_KEYS = (
    "router",
    "frontend",
    "queue",
    "prefill_queue",
    "prefill",
    "kv_transfer",
    "decode_admission",
)


@dataclass
class RequestRecord:
    """Timing of one request. Times are seconds; `start` is since the run began,
    `ttft`/`latency` since this request was sent; `itl` holds the gaps between
    successive content chunks. Meaningful only when `error is None`."""

    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    error: str | None = None  # http_<status> | timeout | disconnect | connect_error | ...
    error_detail: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ttft_breakdown: dict[str, float] | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class StreamFailed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass
class _Stream:
    """What the chunks said so far. Token counts from the server (usage or
    meta_info) win over counting chunks."""

    chunks: int = 0  # content chunks
    server_tokens: int | None = None
    ids_tokens: int = 0  # native: from output_ids
    last_ids: list[int] = field(default_factory=list)
    ids_cumulative: bool | None = None  # None: not known yet
    last_text: str = ""
    prompt_tokens: int | None = None
    breakdown: dict[str, float] | None = None

    def output_tokens(self) -> int:
        if self.server_tokens is not None:
            return self.server_tokens
        return self.ids_tokens or self.chunks


def build_payload(backend: str, req: BenchRequest, model: str | None, temperature: float) -> dict:
    if backend == "native":
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        params = {"max_new_tokens": req.output_len, "temperature": temperature, "ignore_eos": True}
        return {key: req.prompt, "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "ignore_eos": True,  # not OpenAI's; vLLM, sglang and pdserve accept it
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _parse_native(obj: dict, st: _Stream) -> bool:
    """Update `st` from one native chunk; True when it carried new output."""
    before = st.output_tokens()
    meta = obj.get("meta_info") or {}
    if isinstance(meta.get("completion_tokens"), int):
        st.server_tokens = meta["completion_tokens"]
    if isinstance(meta.get("prompt_tokens"), int):
        st.prompt_tokens = meta["prompt_tokens"]
    if isinstance(meta.get("ttft_breakdown"), dict):
        st.breakdown = meta["ttft_breakdown"]
    ids = obj.get("output_ids")
    if isinstance(ids, list):
        _count_ids(ids, st)
    text = obj.get("text") or ""
    new_text = bool(text) and text != st.last_text
    st.last_text = text
    return new_text or st.output_tokens() > before


def _count_ids(ids: list[int], st: _Stream) -> None:
    # Servers send output_ids either cumulatively or per chunk. The second
    # non-empty list decides, once: one that extends the first is cumulative.
    if not ids:
        return
    if st.ids_cumulative is None and st.last_ids:
        st.ids_cumulative = len(ids) > len(st.last_ids) and ids[: len(st.last_ids)] == st.last_ids
    st.ids_tokens = len(ids) if st.ids_cumulative else st.ids_tokens + len(ids)
    st.last_ids = ids


def _parse_openai(obj: dict, st: _Stream) -> bool:
    """Update `st` from one completions or chat chunk; True when it carried content."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            st.server_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            st.prompt_tokens = usage["prompt_tokens"]
    if isinstance(obj.get("ttft_breakdown"), dict):
        st.breakdown = obj["ttft_breakdown"]
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _decode_sse(line: str) -> dict | None:
    """The JSON object of a `data:` line; None for other lines; raises at [DONE]."""
    if not line.startswith("data:"):
        return None  # blank keep-alive, comment or event line
    data = line[5:].strip()
    if data == "[DONE]":
        raise _Done
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamFailed("bad_stream", f"not JSON: {data[:80]!r}") from e
    if not isinstance(obj, dict):
        raise StreamFailed("bad_stream", f"not an object: {data[:80]!r}")
    if "error" in obj:
        raise StreamFailed("stream_error", str(obj["error"])[:200])
    return obj


class _Done(Exception):
    pass


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict, rec: RequestRecord, native: bool
) -> None:
    st = _Stream()
    sent = time.perf_counter()
    last = sent
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:200]
            raise StreamFailed(f"http_{resp.status_code}", detail)
        try:
            async for line in resp.aiter_lines():
                obj = _decode_sse(line)
                if obj is None or not (_parse_native if native else _parse_openai)(obj, st):
                    continue
                now = time.perf_counter()
                if st.chunks == 0:
                    rec.ttft = now - sent
                else:
                    rec.itl.append(now - last)
                st.chunks, last = st.chunks + 1, now
        except _Done:
            pass
        else:
            raise StreamFailed("incomplete_stream", "the stream ended without [DONE]")
    rec.latency = time.perf_counter() - sent
    _finish(rec, st)


def _finish(rec: RequestRecord, st: _Stream) -> None:
    rec.output_tokens = st.output_tokens()
    if rec.output_tokens < 1 or st.chunks == 0:
        raise StreamFailed("empty_stream", "no output tokens")
    if st.prompt_tokens is not None:
        rec.prompt_len = st.prompt_tokens
    if st.breakdown is not None:
        rec.ttft_breakdown = {
            k: float(v) for k, v in st.breakdown.items() if isinstance(v, (int, float))
        }


async def send_request(
    client: httpx.AsyncClient,
    backend: str,
    base_url: str,
    req: BenchRequest,
    *,
    model: str | None,
    temperature: float,
    timeout: float,
    headers: dict[str, str],
) -> RequestRecord:
    """Send `req`, stream its answer and time it. Never raises (except on cancellation)."""
    rec = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len)
    body = build_payload(backend, req, model, temperature)
    url = base_url.rstrip("/") + PATHS[backend]
    try:
        await asyncio.wait_for(
            _stream(client, url, body, headers, rec, backend == "native"), timeout
        )
    except StreamFailed as e:
        rec.error, rec.error_detail = e.reason, e.detail
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.error, rec.error_detail = "timeout", f"no complete answer within {timeout:g}s"
    except httpx.ConnectError as e:
        rec.error, rec.error_detail = "connect_error", str(e)[:200]
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        rec.error, rec.error_detail = "disconnect", str(e)[:200] or type(e).__name__
    except httpx.HTTPError as e:
        rec.error, rec.error_detail = "http_error", f"{type(e).__name__}: {e}"[:200]
    return rec
