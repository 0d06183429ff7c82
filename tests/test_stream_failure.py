"""A stream that something unexpected breaks ends with an error event and [DONE]: the
client is never left with a response cut mid-body (a broken connection, no reason)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.server import native_api, openai_routes
from pdserve.server.openai_format import SSE_DONE


async def broken() -> AsyncIterator[Any]:
    raise RuntimeError("boom")
    yield  # an async generator


def events(chunks: list[str]) -> list[Any]:
    return [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]


async def drain(gen: AsyncIterator[str]) -> list[str]:
    return [c async for c in gen]


def test_openai_stream_ends_with_an_error_event() -> None:
    chunks = asyncio.run(drain(openai_routes._sse(None, None, broken(), True)))  # type: ignore[arg-type]
    [event] = events(chunks)
    assert "RuntimeError: boom" in event["error"]["message"] and event["error"]["code"] == 500
    assert chunks[-1] == SSE_DONE


def test_native_stream_ends_with_an_error_event() -> None:
    req = EngineRequest(rid="r", input_ids=[1, 2], params=SamplingParams())
    native = native_api._Native(None, [req], False)  # type: ignore[arg-type]
    chunks = asyncio.run(drain(native.stream(broken())))
    [event] = events(chunks)
    assert "RuntimeError: boom" in event["error"]["message"]
    assert chunks[-1] == SSE_DONE
