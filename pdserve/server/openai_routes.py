"""`/v1/completions` and `/v1/chat/completions` handlers (OpenAI wire format).

Each handler goes one way: read and parse the request into one OpenAIRequest (a Job of
prompt ids and SamplingParams, and how to answer; openai_parse.py) -> the engine
(Frontend.start / complete, generation.py) -> OpenAIFormatter (openai_format.py).
tests/test_walk_completion.py traces that path and fails when it bounces.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import error_body
from pdserve.edge.stamps import arrival_stamps
from pdserve.protocol import QUEUE_FULL
from pdserve.server import tokenize_routes
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import Frontend
from pdserve.server.http_util import (
    check_api_key,
    error_response,
    stream_until_disconnect,
    until_disconnect,
)
from pdserve.server.jobs import OVERLOADED_RETRY_AFTER_S
from pdserve.server.openai_format import (
    SSE_DONE,
    TOKEN_IDS_HEADER,
    OpenAIFormatter,
    sse,
    with_ids,
)
from pdserve.server.openai_parse import OpenAIRequest, read_chat, read_completion
from pdserve.server.server_config import ServerConfig
from pdserve.server.tool_calls import parser_for_template


def tool_parser(fe: Frontend, cfg: ServerConfig) -> str | None:
    if cfg.tool_call_parser != "auto":
        return None if cfg.tool_call_parser == "none" else cfg.tool_call_parser
    t = fe.tokenizer.chat_templates
    return parser_for_template(t if isinstance(t, str) else "\n".join(t.values()))


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    parser = tool_parser(fe, cfg)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        req = await read_completion(request, fe, cfg, stamps)
        fmt = OpenAIFormatter("completion", cfg.model_name, fe.tokenizer, req.job, req.logprobs,
                              echo=req.echo, drop_output=req.drop_output)  # fmt: skip
        return await respond(request, fe, fmt, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        req = await read_chat(request, fe, cfg, stamps, parser)
        fmt = OpenAIFormatter("chat", cfg.model_name, fe.tokenizer, req.job, req.logprobs, req.out)
        return await respond(request, fe, fmt, req)

    tokenize_routes.register(app, fe, cfg)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request, cfg.api_key)
        card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": cfg.model_path, "max_model_len": fe.max_context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})


log = logging.getLogger(__name__)


def stream_failure(e: Exception) -> str:
    """The SSE error event that ends a stream something unexpected broke; call it inside
    the `except` (it logs the traceback). Without it the server would cut the response
    mid-body: the client sees a broken connection, not an error."""
    log.exception("stream failed")
    return sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error", None, 500))


def engine_error_status(fe: Frontend, error: str | None = None) -> int:
    """503 for an engine that is gone or a full queue (the client may retry), else 500."""
    return 503 if not fe.client.alive or error == QUEUE_FULL else 500


def engine_error_response(fe: Frontend, error: str) -> Response:
    status = engine_error_status(fe, error)
    r = error_response(status, error)
    if error == QUEUE_FULL:
        r.headers["Retry-After"] = str(OVERLOADED_RETRY_AFTER_S)
    return r


async def respond(request: Request, fe: Frontend, fmt: OpenAIFormatter,
                  req: OpenAIRequest) -> Response:  # fmt: skip
    if req.stream:
        _, gen = fe.start(req.job)
        ids = TOKEN_IDS_HEADER in request.headers
        chunks = _sse(fe, fmt, gen, req.include_usage, ids)
        return StreamingResponse(
            stream_until_disconnect(request, chunks), media_type="text/event-stream"
        )
    results = await until_disconnect(request, fe.complete(req.job))
    failed = next((r for r in results if r.error), None)
    if failed is not None:
        return engine_error_response(fe, failed.error or "engine error")
    return JSONResponse(fmt.response(results))


async def _sse(
    fe: Frontend, fmt: OpenAIFormatter, gen: AsyncIterator[Any], include_usage: bool,
    token_ids: bool = False,
) -> AsyncIterator[str]:  # fmt: skip
    """`token_ids`: head each event with its tokens' ids (openai_format.ids_comment)."""
    try:
        async for d in gen:
            if d.error:
                yield sse(error_body(d.error, "server_error", None, engine_error_status(fe, d.error)))  # fmt: skip
                yield SSE_DONE
                return
            chunk = fmt.chunk(d)  # a replayed Delta too: the formatter counts what it holds
            block = with_ids(
                None if chunk is None else sse(chunk), d.token_ids if token_ids else None
            )
            if block is not None and not d.replayed:
                yield block
    except EngineDead as e:  # died between the liveness check and submission
        yield sse(error_body(str(e), "server_error", None, 503))
        yield SSE_DONE
        return
    except Exception as e:  # NOTE: never a stream cut mid-body (cancellation passes)
        yield stream_failure(e)
        yield SSE_DONE
        return
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
    if include_usage:
        yield sse(fmt.usage_chunk())
    yield SSE_DONE
