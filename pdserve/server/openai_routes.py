"""`/v1/completions` and `/v1/chat/completions` handlers (OpenAI wire format).

Each handler goes one way: parse the body (openai_api.py) -> a Job (prompt ids and
SamplingParams) -> Frontend.start (generation.py) -> OpenAIFormatter (openai_format.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import error_body
from pdserve.edge.stamps import arrival_stamps
from pdserve.protocol import QUEUE_FULL
from pdserve.server import tokenize_routes
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import (
    OVERLOADED_RETRY_AFTER_S,
    Frontend,
    Job,
    RequestError,
    SampleResult,
    collect,
)
from pdserve.server.http_util import (
    check_api_key,
    error_response,
    read_json,
    stream_until_disconnect,
    until_disconnect,
)
from pdserve.server.openai_api import ChatIn, CompletionIn
from pdserve.server.openai_format import SSE_DONE, OpenAIFormatter, sse
from pdserve.server.openai_parse import chat_prompt_ids, check_model, completion_prompts, parse_body
from pdserve.server.server_config import ServerConfig
from pdserve.server.structured import request_grammar
from pdserve.server.tool_calls import parser_for_template

MAX_CHOICES = 256  # prompts × n of one request


def make_job(fe: Frontend, body: CompletionIn | ChatIn, prompts: list[list[int]],
             wanted: int | None, logprobs: bool, stamps: dict[str, float]) -> Job:  # fmt: skip
    if len(prompts) * body.n > MAX_CHOICES:
        raise RequestError(f"a request may make at most {MAX_CHOICES} choices (prompts × n)", "n")
    # one max_tokens for the batch: the smallest any prompt allows when none is given
    max_tokens = min(fe.check_prompt(ids, wanted) for ids in prompts)
    params = body.params(max_tokens, logprobs)
    grammar = request_grammar(body, fe.tokenizer)
    if grammar is not None:
        params = msgspec.structs.replace(params, grammar=grammar)
    return Job(prompts, params, body.n, body.rid, body.bootstrap(), stamps)


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
        check_api_key(request, cfg.api_key)
        body = parse_body(CompletionIn, await read_json(request, cfg.max_body_bytes), cfg)
        check_model(body.model, cfg)
        logprobs = body.logprobs is not None
        job = make_job(fe, body, completion_prompts(fe, body.prompt), body.max_tokens, logprobs,
                       stamps)  # fmt: skip
        fmt = OpenAIFormatter("completion", cfg.model_name, fe.tokenizer, job, logprobs)
        return await respond(request, fe, fmt, job, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        check_api_key(request, cfg.api_key)
        body = parse_body(ChatIn, await read_json(request, cfg.max_body_bytes), cfg)
        check_model(body.model, cfg)
        tools = body.parse_tools(parser)
        job = make_job(fe, body, [chat_prompt_ids(fe, body)], body.max_output, body.logprobs,
                       stamps)  # fmt: skip
        fmt = OpenAIFormatter("chat", cfg.model_name, fe.tokenizer, job, body.logprobs, tools,
                              body.tool_names)  # fmt: skip
        return await respond(request, fe, fmt, job, body.stream, body.include_usage)

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


async def respond(request: Request, fe: Frontend, fmt: OpenAIFormatter, job: Job,
                  stream: bool, include_usage: bool) -> Response:  # fmt: skip
    _, gen = fe.start(job)
    if stream:
        chunks = _sse(fe, fmt, gen, include_usage)
        return StreamingResponse(
            stream_until_disconnect(request, chunks), media_type="text/event-stream"
        )
    results: list[SampleResult] = await until_disconnect(request, collect(gen, job.choices))
    failed = next((r for r in results if r.error), None)
    if failed is not None:
        return engine_error_response(fe, failed.error or "engine error")
    return JSONResponse(fmt.response(results))


async def _sse(
    fe: Frontend, fmt: OpenAIFormatter, gen: AsyncIterator[Any], include_usage: bool
) -> AsyncIterator[str]:
    try:
        async for d in gen:
            if d.error:
                yield sse(error_body(d.error, "server_error", None, engine_error_status(fe, d.error)))  # fmt: skip
                yield SSE_DONE
                return
            chunk = fmt.chunk(d)
            if chunk is not None:
                yield sse(chunk)
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
