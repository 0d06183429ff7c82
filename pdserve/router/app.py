"""The PD router: one HTTP front for prefill and decode servers (docs/architecture.md §1, §6).

Generation requests go to a (prefill, decode) pair with the bootstrap fields
added (router_proxy.py); the rest of the API is answered from the workers.
`pdserve router` takes the same PD flags as sglang-router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.config import ROUTER_FAULT_FLAGS, RouterFaults
from pdserve.edge.anthropic_errors import anthropic_error_body, is_anthropic
from pdserve.edge.auth import RequireKey
from pdserve.edge.body import BodyError, read_json
from pdserve.edge.errors import error_body
from pdserve.edge.route_errors import add_route_errors
from pdserve.edge.stamps import router_header
from pdserve.envs import ENV
from pdserve.router.body import num_sequences
from pdserve.router.console import ConsoleFeed
from pdserve.router.http1 import Http1Pool
from pdserve.router.loops import every, watch
from pdserve.router.metrics import registry, render
from pdserve.router.proxy import PDProxy
from pdserve.router.webui import OPEN_PATHS, add_web_ui
from pdserve.router.workers import Worker, WorkerPool

log = logging.getLogger("pdserve.router")

GEN_PATHS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
)
WATCH_S = 0.5  # how often the watchdog looks at the attempts in flight (proxy.watchdog)
STATS = ("requests_total", "failed_total", "aborted_total", "migrated_total", "stuck_total",
         "shed_total")  # fmt: skip
HEALTH_PROBE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[tuple[str, int | None], ...]  # (url, bootstrap port or None)
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"  # config.ROUTER_POLICIES
    api_key: str | None = None  # required from clients (all but /health) and sent to workers
    metrics_public: bool = False  # True: /metrics answers without the key
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 3600.0  # longest silence on a leg
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413 (as the workers)
    web_ui: bool = True  # GET / serves the web console (router/webui.py); --no-web-ui
    # RouterFaults' (config.py; docs/reliability.md): migration, health, stalls, shedding
    migration_limit: int = RouterFaults.migration_limit
    stall_timeout_s: float = RouterFaults.stall_timeout_s
    health_interval_s: float = RouterFaults.health_interval_s
    health_timeout_s: float = RouterFaults.health_timeout_s
    max_in_flight: int = RouterFaults.max_in_flight
    retry_after_s: int = RouterFaults.retry_after_s

    @property
    def faults(self) -> RouterFaults:
        return RouterFaults(**{f: getattr(self, f) for f in RouterFaults.__dataclass_fields__})


class RouterState:
    def __init__(self, cfg: RouterConfig, on_fatal: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.fatal: str | None = None  # why a loop died; /health is 503 from then on
        self._on_fatal = on_fatal
        self.pool = WorkerPool.build(
            list(cfg.prefill), list(cfg.decode), cfg.policy, cfg.max_in_flight
        )
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.stats = dict.fromkeys(STATS, 0)
        self.legs = Http1Pool(cfg.request_timeout_s, cfg.connect_timeout_s)
        self.proxy = PDProxy(self.pool, self.client, self.legs, self.stats, cfg.faults)
        self.metrics = registry(self.stats, self.pool)
        self.console = ConsoleFeed(self.client, self.pool, self.stats,
                                   lambda: self.worker_headers(None))  # fmt: skip

    def die(self, reason: str) -> None:
        """A loop the router needs is gone: unhealthy from now on, and `on_fatal` (the
        CLI's: stop the process, which then exits non-zero)."""
        if self.fatal is None:
            self.fatal = reason
            log.error("pdserve router cannot go on: %s", reason)
            if self._on_fatal is not None:
                self._on_fatal(reason)

    def worker_headers(self, request: Request | None) -> dict[str, str]:
        """Headers for a worker: our API key, else the client's own Authorization."""
        if self.cfg.api_key:
            return {"authorization": f"Bearer {self.cfg.api_key}"}
        if request is None:
            return {}
        # the client's own key, in whichever header it sent it (Anthropic's: x-api-key)
        sent = ((k, request.headers.get(k)) for k in ("authorization", "x-api-key"))
        return {k: v for k, v in sent if v}

    async def check(self, w: Worker) -> dict[str, Any]:
        try:
            r = await self.client.get(
                w.url + "/health",
                headers=self.worker_headers(None),
                timeout=self.cfg.health_timeout_s,
            )
            w.healthy, detail = r.status_code == 200, f"HTTP {r.status_code}"
            draining = r.status_code == 503 and b"draining" in r.content
            w.alive, detail = w.healthy or draining, "draining" if draining else detail
        except httpx.HTTPError as e:
            w.healthy, w.alive, detail = False, False, repr(e)
        return {"url": w.url, "role": w.role, "healthy": w.healthy, "in_flight": w.in_flight} | (
            {} if w.healthy else {"error": detail}
        )

    async def check_all(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.check(w) for w in self.pool.all)))

    async def get_json(self, w: Worker, path: str, request: Request) -> dict[str, Any]:
        try:
            r = await self.client.get(w.url + path, headers=self.worker_headers(request))
            return {"url": w.url, "role": w.role, "status": r.status_code, "info": r.json()}
        except (httpx.HTTPError, ValueError) as e:
            return {"url": w.url, "role": w.role, "error": repr(e)}


def create_app(cfg: RouterConfig, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """Precondition: cfg names at least one prefill and one decode. `on_fatal(reason)`
    runs once if a background loop dies (router/loops.py)."""
    state = RouterState(cfg, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        poll = asyncio.create_task(_health_loop(state))
        watch(poll, "the worker health loop", state.die)
        dog = asyncio.create_task(every(WATCH_S, state.proxy.watchdog, "the stuck-decode watch"))
        watch(dog, "the stuck-decode watch", state.die)
        yield
        poll.cancel()
        dog.cancel()
        await state.client.aclose()
        state.legs.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.router = state
    open_paths = OPEN_PATHS if cfg.web_ui else frozenset()  # the page, never its state
    app.add_middleware(RequireKey, api_key=cfg.api_key, metrics_public=cfg.metrics_public,
                       open_paths=open_paths)  # fmt: skip
    add_route_errors(app)
    _add_generation(app, state)
    _add_info(app, state)
    if cfg.web_ui:
        add_web_ui(app, state.console, key_required=bool(cfg.api_key))
    return app


async def _health_loop(state: RouterState) -> None:
    await every(state.cfg.health_interval_s, state.check_all, "the worker health poll")


def _add_generation(app: FastAPI, state: RouterState) -> None:
    async def generation(request: Request) -> Response:
        stamp = router_header()  # the TTFT breakdown's `router` stage starts here
        path = request.url.path
        try:  # the frontends' reader and rules: size, JSON, finite floats, int64, rooms
            body = await read_json(request, state.cfg.max_body_bytes)
        except BodyError as e:
            return _refused(path, e.status, e.message, e.param)
        if not isinstance(body, dict):
            return _refused(path, 400, "the body must be a JSON object")
        try:
            num_sequences(path, body)
        except ValueError as e:
            return _refused(path, 400, str(e))
        headers = {**state.worker_headers(request), **stamp}
        return await state.proxy.forward(request.url.path, body, headers, request)

    for path in GEN_PATHS:
        app.add_api_route(path, generation, methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        # renders the prompt only: one worker answers it (a decode's, as /v1/models)
        w = next((w for w in state.pool.decode.workers if w.healthy), state.pool.decode.workers[0])
        try:
            r = await state.client.post(w.url + "/v1/messages/count_tokens",
                                        content=await request.body(),
                                        headers={**state.worker_headers(request),
                                                 "content-type": "application/json"})  # fmt: skip
        except httpx.HTTPError as e:
            return _refused("/v1/messages", 502, f"decode {w.url} unreachable: {e!r}")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        resp = await state.proxy.forward(
            "/generate", dict(HEALTH_PROBE), state.worker_headers(None), None, migrate=False
        )
        return Response(status_code=200 if resp.status_code == 200 else 503)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = await read_json(request, state.cfg.max_body_bytes)
        except BodyError as e:
            return JSONResponse(error_body(e.message, param=e.param, code=e.status), e.status)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            return JSONResponse(error_body("rid (a string) is required", param="rid"), 400)
        # NOTE: only the legs this router leased for exactly this rid: never a fan-out to
        # every worker, never a prefix
        results = await state.proxy.abort(rid, state.worker_headers(request))
        if results is None:
            message = f"no request with rid {rid!r} is in flight through this router"
            return JSONResponse(error_body(message, param="rid", code=404), 404)
        return JSONResponse({"success": True, "rid": rid, "workers": results})


def _refused(path: str, status: int, message: str, param: str | None = None) -> Response:
    """An error the router answers itself, in the route's API's shape."""
    if is_anthropic(path):
        kind = "invalid_request_error" if status < 500 else "api_error"
        return JSONResponse(anthropic_error_body(kind, message), status)
    kind = "invalid_request_error" if status < 500 else "router_error"
    return JSONResponse(error_body(message, kind, param, status), status)


def _add_info(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.fatal is not None:
            return JSONResponse({"status": "unhealthy", "error": state.fatal}, status_code=503)
        workers = await state.check_all()
        ok = all(
            any(w["healthy"] for w in workers if w["role"] == r) for r in ("prefill", "decode")
        )
        body = {"status": "ok" if ok else "unhealthy", "workers": workers}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        infos = await asyncio.gather(
            *(state.get_json(w, "/server_info", request) for w in state.pool.all)
        )
        router = asdict(state.cfg) | {"api_key": bool(state.cfg.api_key), "stats": state.stats}
        return {"role": "router", "router": router, "workers": list(infos)}

    async def first_decode(request: Request, path: str) -> Response:
        w = next((w for w in state.pool.decode.workers if w.healthy), state.pool.decode.workers[0])
        try:
            r = await state.client.get(w.url + path, headers=state.worker_headers(request))
        except httpx.HTTPError as e:
            return JSONResponse(
                error_body(f"decode {w.url} unreachable: {e!r}", "router_error", code=502), 502
            )
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await first_decode(request, "/model_info")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await first_decode(request, "/v1/models")

    @app.get("/v1/responses/{response_id}")
    async def response(request: Request, response_id: str) -> Response:
        return await first_decode(request, request.url.path)  # no worker stores them: a 404

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(state.metrics), media_type=CONTENT_TYPE_LATEST)


def config_from_args(args: Any) -> RouterConfig:
    """Raises ValueError naming a flag whose value cannot work."""
    from pdserve.router.workers import parse_prefill_args, worker_url

    decode = (d[0] if isinstance(d, list) else d for d in (args.decode or []))
    return RouterConfig(
        prefill=tuple(parse_prefill_args(args.prefill or [])),
        decode=tuple(worker_url(d, "--decode") for d in decode),
        host=args.host,
        port=args.port,
        policy=args.policy,
        api_key=args.api_key or ENV.API_KEY.get(),
        metrics_public=getattr(args, "metrics_public", False) or ENV.METRICS_PUBLIC.get() == "1",
        max_body_bytes=getattr(args, "max_body_bytes", None) or RouterConfig.max_body_bytes,
        web_ui=not getattr(args, "no_web_ui", False),
        **{
            k: getattr(args, k)
            for k, _ in ROUTER_FAULT_FLAGS.values()
            if getattr(args, k, None) is not None
        },  # fmt: skip
    )
