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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import error_body
from pdserve.edge.stamps import arrival_stamps
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import (
    Frontend,
    RequestError,
    SampleResult,
    collect,
    merge,
    run_sample,
)
from pdserve.server.http_util import (
    check_api_key,
    error_response,
    parse,
    read_json,
    stream_until_disconnect,
    until_disconnect,
)
from pdserve.server.openai_api import SSE_DONE, GenerateIn, as_list, native_meta, sse
from pdserve.server.openai_routes import engine_error_status, stream_failure
from pdserve.server.server_config import ServerConfig


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
    return SamplingParams(
        max_tokens=fe.check_prompt(ids, wanted),
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed,
        stop=as_list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos,
        logprobs=body.return_logprob,
    )


class _Native:
    def __init__(self, fe: Frontend, reqs: list[EngineRequest], logprob: bool) -> None:
        self.fe = fe
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
                if d.text or d.finished or d.token_ids:
                    yield sse(self.body(acc[d.index]))
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
        ids = _prompt_ids(fe, body)
        params = _params(fe, body, ids, cfg.default_max_new_tokens)
        n = body.sampling_params.n
        reqs = fe.build_requests(ids, params, n, body.rid, body.bootstrap(), stamps)
        if not fe.client.alive:
            return error_response(503, f"engine unavailable: {fe.client.error}")
        fe.metrics.prompt_tokens.inc(len(ids) * n)
        native = _Native(fe, reqs, body.return_logprob)
        gen = merge([run_sample(fe, r, i) for i, r in enumerate(reqs)])
        if body.stream:
            chunks = stream_until_disconnect(request, native.stream(gen))
            return StreamingResponse(chunks, media_type="text/event-stream")
        results = await until_disconnect(request, collect(gen, n))
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            return error_response(engine_error_status(fe), failed.error or "engine error")
        bodies = [native.body(r) for r in results]
        return JSONResponse(bodies[0] if n == 1 else bodies)
