"""`/v1/completions` and `/v1/chat/completions` handlers (OpenAI wire format)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import error_body
from pdserve.edge.stamps import arrival_stamps
from pdserve.protocol import EngineRequest
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import Frontend, RequestError, collect, merge, run_sample
from pdserve.server.http_util import (
    check_api_key,
    error_response,
    parse,
    read_json,
    stream_until_disconnect,
    until_disconnect,
)
from pdserve.server.openai_api import (
    SSE_DONE,
    ChatIn,
    CompletionIn,
    OpenAIFormatter,
    sse,
)
from pdserve.server.server_config import ServerConfig
from pdserve.server.tokenizer import ChatTemplateError


def check_model(model: str | None, cfg: ServerConfig) -> None:
    """A request naming a model must name ours (served name or path); 404 otherwise."""
    if model is not None and model not in (cfg.model_name, cfg.model_path):
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{cfg.model_name!r}", "model", status=404)  # fmt: skip


def completion_prompt_ids(fe: Frontend, prompt: Any) -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError("batched prompts are not supported; send one prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return fe.tokenizer.encode(prompt)
    return list(prompt)


def chat_prompt_ids(fe: Frontend, body: ChatIn) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = fe.tokenizer.apply_chat_template(messages)
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from e
    return fe.tokenizer.encode(text, add_special_tokens=False)


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        check_api_key(request, cfg.api_key)
        body = parse(CompletionIn, await read_json(request, cfg.max_body_bytes))
        check_model(body.model, cfg)
        if body.echo:
            raise RequestError("echo is not supported", "echo")
        ids = completion_prompt_ids(fe, body.prompt)
        max_tokens = fe.check_prompt(ids, body.max_tokens)
        logprobs = body.logprobs is not None
        reqs = fe.build_requests(ids, body.params(max_tokens, logprobs), body.n, None,
                                 body.bootstrap(), stamps)  # fmt: skip
        fmt = OpenAIFormatter("completion", cfg.model_name, fe.tokenizer)
        return await respond(request, fe, fmt, reqs, body.stream, body.include_usage, logprobs)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        check_api_key(request, cfg.api_key)
        body = parse(ChatIn, await read_json(request, cfg.max_body_bytes))
        check_model(body.model, cfg)
        ids = chat_prompt_ids(fe, body)
        wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens  # fmt: skip
        max_tokens = fe.check_prompt(ids, wanted)
        reqs = fe.build_requests(ids, body.params(max_tokens, body.logprobs), body.n, None,
                                 body.bootstrap(), stamps)  # fmt: skip
        fmt = OpenAIFormatter("chat", cfg.model_name, fe.tokenizer)
        return await respond(request, fe, fmt, reqs, body.stream, body.include_usage, body.logprobs)

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


def engine_error_status(fe: Frontend) -> int:
    return 503 if not fe.client.alive else 500


async def respond(
    request: Request,
    fe: Frontend,
    fmt: OpenAIFormatter,
    reqs: list[EngineRequest],
    stream: bool,
    include_usage: bool,
    logprobs: bool,
) -> Response:
    if not fe.client.alive:
        return error_response(503, f"engine unavailable: {fe.client.error}")
    fe.metrics.prompt_tokens.inc(len(reqs[0].input_ids) * len(reqs))
    gen = merge([run_sample(fe, r, i) for i, r in enumerate(reqs)])
    prompt_tokens = len(reqs[0].input_ids)
    if stream:
        chunks = _sse(fe, fmt, gen, prompt_tokens * len(reqs), include_usage, logprobs)
        return StreamingResponse(
            stream_until_disconnect(request, chunks), media_type="text/event-stream"
        )
    results = await until_disconnect(request, collect(gen, len(reqs)))
    failed = next((r for r in results if r.error), None)
    if failed is not None:
        return error_response(engine_error_status(fe), failed.error or "engine error")
    return JSONResponse(fmt.response(results, prompt_tokens, logprobs))


async def _sse(
    fe: Frontend,
    fmt: OpenAIFormatter,
    gen: AsyncIterator[Any],
    prompt_tokens: int,
    include_usage: bool,
    logprobs: bool,
) -> AsyncIterator[str]:
    started: set[int] = set()
    completion_tokens = 0
    try:
        async for d in gen:
            if d.error:
                yield sse(error_body(d.error, "server_error", None, engine_error_status(fe)))
                yield SSE_DONE
                return
            completion_tokens += len(d.token_ids)
            if d.text or d.finished or (logprobs and d.token_ids) or d.index not in started:
                yield sse(fmt.chunk(d, logprobs, first=d.index not in started))
                started.add(d.index)
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
        yield sse(fmt.usage_chunk(prompt_tokens, completion_tokens))
    yield SSE_DONE
