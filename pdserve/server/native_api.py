"""`POST /generate`, sglang's native API.

Request: `text` or `input_ids`, `sampling_params` (max_new_tokens, temperature, top_p,
top_k, min_p, stop, stop_token_ids, ignore_eos, seed, n), `stream`, `return_logprob`,
`rid`, and the PD fields `bootstrap_host` / `bootstrap_port` / `bootstrap_room`.
Response: `{"text", "output_ids", "meta_info"}` (a list of those when n > 1);
streaming sends the same objects with cumulative text and ids, then `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from pdserve.edge.errors import error_body
from pdserve.edge.stamps import arrival_stamps, ttft_breakdown
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import Frontend, collect
from pdserve.server.http_util import (
    check_api_key,
    parse,
    read_json,
    stream_until_disconnect,
    until_disconnect,
)
from pdserve.server.jobs import Bootstrap, Job, RequestError, SampleResult
from pdserve.server.openai_format import SSE_DONE, TOKEN_IDS_HEADER, sse, with_ids
from pdserve.server.openai_routes import (
    engine_error_response,
    engine_error_status,
    stream_failure,
)
from pdserve.server.request_fields import N_FIELD, Body, FieldRefused, SamplingKnobs
from pdserve.server.server_config import ServerConfig
from pdserve.server.structured import request_grammar


class NativeSampling(SamplingKnobs):
    """sglang's `sampling_params`: the shared knobs plus its own names."""

    max_new_tokens: int | None = None
    n: int = N_FIELD
    min_new_tokens: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    no_stop_trim: Any = None
    custom_params: Any = None
    stream_interval: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingKnobs.NOT_IMPLEMENTED,
        "min_new_tokens": (0,),
        "structural_tag": (),
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
        "no_stop_trim": (False,),
        "custom_params": (),
        "stream_interval": (),
    }


class GenerateIn(Body):
    """The body: every field known, implemented or refused by name, as in the OpenAI
    routes (sglang-router writes its own fields into every body, at their defaults)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    resume_ids: list[int] | None = None  # the router's, for a migrated request (Job.resume)
    model: str | None = None  # one model per server: a name changes nothing
    # sglang's; log_metrics and no_logs steer only the server's own logs
    log_metrics: Any = None
    no_logs: Any = None
    return_text_in_logprobs: Any = None
    return_hidden_states: Any = None
    return_bytes: Any = None
    return_entropy: Any = None
    background: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "log_metrics": (True, False),
        "no_logs": (True, False),
        "return_text_in_logprobs": (False,),
        "return_hidden_states": (False,),
        "return_bytes": (False,),
        "return_entropy": (False,),
        "background": (False,),
    }

    def bootstrap(self) -> Bootstrap:
        return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)


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


def _prompt_ids(fe: Frontend, body: GenerateIn) -> list[int]:
    if body.input_ids is not None:
        return list(body.input_ids)
    if body.text is None:
        raise RequestError("either text or input_ids is required", "text")
    return fe.tokenizer.encode(body.text)


def _params(fe: Frontend, body: GenerateIn, ids: list[int], default_max: int) -> SamplingParams:
    sp = body.sampling_params
    wanted = sp.max_new_tokens
    if wanted is None:
        wanted = min(default_max, fe.check_prompt(ids, None))
    params = sp.params(fe.check_prompt(ids, wanted), body.return_logprob)
    grammar = request_grammar(sp)  # sglang's json_schema / regex / ebnf
    return params if grammar is None else msgspec.structs.replace(params, grammar=grammar)


class _Native:
    def __init__(
        self, fe: Frontend, reqs: list[EngineRequest], logprob: bool, token_ids: bool = False
    ) -> None:
        self.fe = fe
        self.token_ids = token_ids  # head each event with its ids (openai_format.with_ids)
        self.reqs = reqs
        self.logprob = logprob
        self.arrival = time.time()
        self.prompt_tokens = len(reqs[0].input_ids)

    def body(self, r: SampleResult) -> dict[str, Any]:
        meta = native_meta(self.reqs[r.index].rid, r, self.prompt_tokens,
                           time.time() - self.arrival, self.logprob)  # fmt: skip
        out: dict[str, Any] = {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}
        if len(self.reqs) > 1:
            out["index"] = r.index
        return out

    async def stream(self, gen: AsyncIterator[Any]) -> AsyncIterator[str]:
        acc = [SampleResult(i) for i in range(len(self.reqs))]
        try:
            async for d in gen:
                if d.error:
                    yield sse(
                        error_body(d.error, "server_error", None, engine_error_status(self.fe))
                    )
                    break
                acc[d.index].add(d)
                if (d.text or d.finished or d.token_ids) and not d.replayed:
                    yield with_ids(sse(self.body(acc[d.index])),
                                   d.token_ids if self.token_ids else None) or ""  # fmt: skip
        except EngineDead as e:
            yield sse(error_body(str(e), "server_error", None, 503))
        except Exception as e:  # NOTE: never a stream cut mid-body (cancellation passes)
            yield stream_failure(e)
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        check_api_key(request, cfg.api_key)
        body = parse(GenerateIn, await read_json(request, cfg.max_body_bytes))
        try:
            body.check_fields(cfg.unknown_fields)
        except FieldRefused as e:
            raise RequestError(str(e), e.param) from e
        ids = _prompt_ids(fe, body)
        params = _params(fe, body, ids, cfg.default_max_new_tokens)
        n = body.sampling_params.n
        job = Job([ids], params, n, body.rid, body.bootstrap(), stamps,
                  list(body.resume_ids or ()))  # fmt: skip
        reqs, gen = fe.start(job)
        native = _Native(fe, reqs, body.return_logprob, TOKEN_IDS_HEADER in request.headers)
        if body.stream:
            chunks = stream_until_disconnect(request, native.stream(gen))
            return StreamingResponse(chunks, media_type="text/event-stream")
        results = await until_disconnect(request, collect(gen, n))
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            return engine_error_response(fe, failed.error or "engine error")
        bodies = [native.body(r) for r in results]
        return JSONResponse(bodies[0] if n == 1 else bodies)
