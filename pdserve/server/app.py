"""The FastAPI app of a prefill or decode frontend.

Endpoints (docs/architecture.md §6): generation routes live in native_api / openai_routes;
this module adds health, info, metrics and abort, error handling, and the
lifespan that starts and stops the engine process.

/health_generate per role:
  prefill  a real one-token generation through the engine (no bootstrap room,
           so no transfer is involved);
  decode   a request round trip through the engine loop (stats): a decode
           cannot generate without a prefill, so the full PD check is the
           router's /health_generate.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.edge.auth import RequireKey
from pdserve.edge.route_errors import add_route_errors
from pdserve.protocol import EngineSpec
from pdserve.sampling_params import SamplingParams
from pdserve.server import anthropic_routes, native_api, openai_routes, responses_routes
from pdserve.server.drain import Drain
from pdserve.server.engine_client import EngineClient, EngineDead
from pdserve.server.generation import Frontend, collect, run_sample
from pdserve.server.http_util import ClientGone, check_api_key, error_response, read_json
from pdserve.server.jobs import Bootstrap, RequestError
from pdserve.server.metrics import Metrics
from pdserve.server.server_config import ServerConfig
from pdserve.server.tokenizer import Tokenizer


def max_context(spec: EngineSpec, tok: Tokenizer) -> int:
    """The context the engine serves (ModelRunner.max_context, from the same config)."""
    return spec.engine.cache.context_length(tok.max_position_embeddings)


def create_app(cfg: ServerConfig, spec: EngineSpec) -> FastAPI:
    """The app; the engine process starts with the app's lifespan and stops with it."""
    tok = Tokenizer(cfg.model_path, cfg.chat_template)
    client = EngineClient(spec, start_timeout_s=cfg.engine_start_timeout_s,
                          heartbeat_timeout_s=cfg.engine_heartbeat_timeout_s,
                          log_level=cfg.log_level)  # fmt: skip
    fe = Frontend(cfg.role, client, tok, Metrics(), max_context(spec, tok))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title=f"pdserve {cfg.role}", lifespan=lifespan)
    app.state.frontend = fe
    app.state.drain = drain = Drain(cfg.drain_timeout_s)
    # the key on every route but /health (and /metrics with metrics_public)
    app.add_middleware(RequireKey, api_key=cfg.api_key, metrics_public=cfg.metrics_public)
    # added last, so outermost: a browser's preflight (no key) is answered before the key check
    if cfg.allowed_origins:  # opt-in: browsers may call the API from these origins
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])  # fmt: skip
    app.add_middleware(_DrainMiddleware, drain=drain)  # outermost: counts whole responses
    _add_error_handlers(app)
    native_api.register(app, fe, cfg)
    openai_routes.register(app, fe, cfg)
    responses_routes.register(app, fe, cfg)
    anthropic_routes.register(app, fe, cfg)
    _add_health_routes(app, fe, cfg, drain)
    _add_info_routes(app, fe, cfg, spec)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def on_request_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, RequestError)
        return error_response(e.status, e.message, e.param)

    async def on_engine_dead(_: Request, e: Exception) -> Response:
        return error_response(503, f"engine unavailable: {e}")

    async def on_client_gone(_: Request, e: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it

    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(EngineDead, on_engine_dead)
    app.add_exception_handler(ClientGone, on_client_gone)
    add_route_errors(app)


class _DrainMiddleware:
    def __init__(self, app: Any, drain: Drain) -> None:
        self.asgi = drain.middleware(app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.asgi(scope, receive, send)


def _add_health_routes(app: FastAPI, fe: Frontend, cfg: ServerConfig, drain: Drain) -> None:
    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return JSONResponse({"status": "draining", "in_flight": drain.in_flight}, 503)
        if not fe.client.alive:
            return error_response(503, f"engine unavailable: {fe.client.error}")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await asyncio.wait_for(_probe(fe), cfg.health_generate_timeout_s)
        except (EngineDead, RuntimeError, TimeoutError) as e:
            return error_response(503, f"health generation failed: {e or type(e).__name__}")
        return Response(status_code=200)


async def _probe(fe: Frontend) -> None:
    """One real generation (prefill) or one engine round trip (decode); raises on failure."""
    if fe.role == "decode":
        await fe.client.stats()
        return
    ids = fe.tokenizer.encode("ping")[:8] or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    (req,) = fe.build_requests(ids, params, 1, "health-" + fe.new_rid(), Bootstrap())
    (res,) = await collect(run_sample(fe, req, 0), 1)
    if res.error or not res.output_ids:
        raise RuntimeError(res.error or "no token generated")


def _add_info_routes(app: FastAPI, fe: Frontend, cfg: ServerConfig, spec: EngineSpec) -> None:
    async def engine_stats() -> dict[str, float]:
        try:
            return await fe.client.stats() if fe.client.alive else {}
        except (EngineDead, TimeoutError):
            return {}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        stats = await engine_stats()
        info: dict[str, Any] = {
            "role": cfg.role,
            "disaggregation_mode": cfg.role,
            "host": cfg.host,
            "port": cfg.port,
            "bootstrap_port": spec.transfer.bootstrap_port if cfg.role == "prefill" else None,
            "model_path": cfg.model_path,
            "served_model_name": cfg.model_name,
            "max_context_length": fe.max_context,
            "engine_alive": fe.client.alive,
            "engine_error": fe.client.error,
            "engine_pid": fe.client.pid,
            "in_flight": fe.client.in_flight,
            "engine_config": msgspec.to_builtins(spec.engine),
            "transfer_config": msgspec.to_builtins(spec.transfer),
            "server_config": {**dataclasses.asdict(cfg), "api_key": bool(cfg.api_key)},
            "stats": stats,
        }
        return JSONResponse({**stats, **info})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        mc = fe.tokenizer.model_config
        return JSONResponse({
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "is_generation": True,
            "served_model_name": cfg.model_name,
            "max_context_length": fe.max_context,
            "vocab_size": fe.tokenizer.vocab_size,
            "eos_token_ids": fe.tokenizer.eos_token_ids,
            "model_type": mc.get("model_type"),
            "architectures": mc.get("architectures"),
        })  # fmt: skip

    @app.get("/stats")
    async def stats() -> Response:
        # the router's console polls this (router/console.py): small, JSON, no config
        return JSONResponse({
            "role": cfg.role,
            "engine_alive": fe.client.alive,
            "in_flight": fe.client.in_flight,
            "engine": await engine_stats(),
            **fe.activity.as_dict(),
        })  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        body = fe.metrics.render(await engine_stats())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        check_api_key(request, cfg.api_key)
        body = await read_json(request, cfg.max_body_bytes)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            raise RequestError("rid (a string) is required", "rid")
        # exactly this request, or the n > 1 samples submitted under it (never a prefix)
        rids = fe.client.rids_of(rid)
        for r in rids or [rid]:
            fe.client.abort(r, "aborted by /abort_request")
        return JSONResponse({"success": True, "rid": rid, "aborted": rids})
