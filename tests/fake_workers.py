"""Recording fake prefill/decode workers for router tests.

A `FakeWorker` is a small FastAPI app served by uvicorn in a thread on a free
loopback port. It records every request it receives (method, path, headers,
JSON body) and answers the worker API the router and sglang-router call.
Behaviour knobs (set before or between requests):

- `fail_status`: answer generation requests with this status and an
  OpenAI-style error body;
- `hold_s`: keep a generation request open this long before answering (polls
  for client disconnect meanwhile and records it in `disconnected`);
- `stream_chunks` / `chunk_delay_s` / `end_delay_s`: shape of an SSE answer;
- `chat_text`: a streamed /v1/chat/completions answers this text in OpenAI chat chunks;
- `stats`: the body of GET /stats (the frontends' console stats, server/app.py).
- `stall_at` / `error_at`: at that event, the stream goes silent (open, nothing sent) or
  sends an error event and [DONE];
- `first_try_only`: `fail_status`, `stall_at` and `error_at` spare a router's retry (a
  rid ending in -m<k>).

Event i of a stream stands for token id 100 + i; with the router's token-ids header each
event comes headed by its `: ids` comment, and a body with `resume_ids` starts at event
len(resume_ids), as a worker resuming a migrated request does.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

GEN_PATHS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """An ASGI app served by uvicorn in a daemon thread on 127.0.0.1."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeWorker:
    role: str  # "prefill" | "decode"
    name: str = ""
    fail_status: int | None = None
    hold_s: float = 0.0
    stream_chunks: int = 3
    chunk_delay_s: float = 0.0
    end_delay_s: float = 0.0  # a stream's pause between its last event and its end
    last_event: bytes = b"data: [DONE]\n\n"  # what ends a stream (a Responses one: its own)
    chat_text: str | None = None
    stats: dict[str, Any] = field(default_factory=lambda: {"engine": {}, "recent": []})
    stall_at: int | None = None  # event index where a stream goes silent
    error_at: int | None = None  # event index where a stream sends an error event instead
    first_try_only: bool = False
    healthy: bool = True
    draining: bool = False  # /health answers 503 {"status": "draining"}
    info_status: int = 200  # status of /server_info and /model_info
    model_info: dict[str, Any] = field(
        default_factory=lambda: {"model_path": "fake", "is_generation": True}
    )
    received: list[Received] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)  # paths whose client went away
    aborted: list[Any] = field(default_factory=list)  # /abort_request bodies
    port: int = 0
    _served: Served | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gen_requests(self, at_least: int = 0, timeout: float = 5.0) -> list[Received]:
        """The generation requests received so far, once there are `at_least` of them
        (or `timeout` passed): a router answers with the decode's response and does not
        wait for the prefill leg, which may still be on its way to this worker."""
        deadline = time.monotonic() + timeout
        while True:
            got = [r for r in self.received if r.path in GEN_PATHS]
            if len(got) >= at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def start(self, port: int | None = None) -> FakeWorker:
        self._served = Served(build_app(self), port)
        self.port = self._served.port
        return self

    def stop(self) -> None:
        assert self._served is not None
        self._served.stop()

    async def wait_or_disconnect(self, request: Request, path: str) -> bool:
        """Sleep `hold_s`; True if the client disconnected meanwhile (recorded)."""
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.disconnected.append(path)
                return True
            await asyncio.sleep(0.01)
        return False


def _answer(worker: FakeWorker, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A deterministic non-streaming answer naming the worker and the room."""
    text = f"{worker.name or worker.role}:{body.get('bootstrap_room')}"
    if path == "/generate":
        return {"text": text, "output_ids": [1, 2], "meta_info": {"id": "x"}}
    if path == "/v1/chat/completions":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        return {"object": "chat.completion", "choices": [choice | {"finish_reason": "length"}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def _faulty(worker: FakeWorker, body: dict[str, Any]) -> bool:
    """Whether this request gets the worker's faults (a retry may be spared)."""
    return not (worker.first_try_only and "-m" in str(body.get("rid")))


def _sse(worker: FakeWorker, path: str, body: dict[str, Any], ids: bool = False):
    faulty = _faulty(worker, body)

    async def gen():
        try:
            for i in range(len(body.get("resume_ids") or ()), worker.stream_chunks):
                if i == worker.stall_at and faulty:
                    await asyncio.sleep(3600)
                if i == worker.error_at and faulty:
                    err = {"error": {"message": "engine died", "type": "server_error", "code": 503}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                    return
                payload = {"i": i, "worker": worker.name, "room": body.get("bootstrap_room")}
                head = f": ids {100 + i}\n" if ids else ""
                yield f"{head}data: {json.dumps(payload)}\n\n".encode()
                await asyncio.sleep(worker.chunk_delay_s)
            yield worker.last_event
            await asyncio.sleep(worker.end_delay_s)
        except (asyncio.CancelledError, GeneratorExit):
            worker.disconnected.append(path)
            raise

    return StreamingResponse(gen(), media_type="text/event-stream")


def _chat_sse(text: str, delay_s: float) -> StreamingResponse:
    """`text` as an OpenAI chat stream: a few characters a chunk, then usage."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"object": "chat.completion.chunk", "choices": [choice], **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    async def gen():
        yield chunk({"role": "assistant", "content": ""})
        for i in range(0, len(text), 7):
            yield chunk({"content": text[i : i + 7]})
            await asyncio.sleep(delay_s)
        yield chunk({}, "stop")
        usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def build_app(worker: FakeWorker) -> FastAPI:
    app = FastAPI()

    async def generation(request: Request):
        body = await request.json()
        path = request.url.path
        worker.received.append(Received("POST", path, dict(request.headers), body))
        if await worker.wait_or_disconnect(request, path):
            return JSONResponse({}, status_code=499)
        if worker.fail_status is not None and _faulty(worker, body):
            err = {"message": f"{worker.name} failed", "type": "fake_error"}
            return JSONResponse({"error": err}, status_code=worker.fail_status)
        if body.get("stream") and worker.chat_text is not None and path == GEN_PATHS[2]:
            return _chat_sse(worker.chat_text, worker.chunk_delay_s)
        if body.get("stream"):
            return _sse(worker, path, body, "x-pdserve-token-ids" in request.headers)
        return JSONResponse(_answer(worker, path, body))

    for p in GEN_PATHS:
        app.add_api_route(p, generation, methods=["POST"])

    async def record_get(request: Request) -> None:
        worker.received.append(Received("GET", request.url.path, dict(request.headers), None))

    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request):
        await record_get(request)
        if worker.draining:  # as a frontend after SIGTERM (server/drain.py)
            return JSONResponse({"status": "draining"}, status_code=503)
        return PlainTextResponse("", status_code=200 if worker.healthy else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request):
        await record_get(request)
        info = {"role": worker.role, "name": worker.name, "disaggregation_mode": worker.role}
        return JSONResponse(info, status_code=worker.info_status)

    @app.get("/stats")
    async def stats(request: Request):
        await record_get(request)
        return JSONResponse({"role": worker.role, **worker.stats}, status_code=worker.info_status)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request):
        await record_get(request)
        return JSONResponse(worker.model_info, status_code=worker.info_status)

    @app.get("/v1/models")
    async def models(request: Request):
        await record_get(request)
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/abort_request")
    async def abort(request: Request):
        body = await request.json()
        worker.received.append(Received("POST", "/abort_request", dict(request.headers), body))
        worker.aborted.append(body)
        return {}

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unknown(request: Request):
        body = (await request.body()).decode(errors="replace")
        worker.received.append(Received(request.method, request.url.path, {}, body))
        return JSONResponse({"error": {"message": "not found"}}, status_code=404)

    return app


def main() -> None:
    """`python tests/fake_workers.py ROLE --port N [--bootstrap-port M] [--pid-file F]`:
    a blocking fake server for process tests. With --pid-file it also starts a
    grandchild (`sleep`, like an engine process) and writes its pid there."""
    import argparse
    import subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("role")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid-file", default=None)
    ap.add_argument("--die-after", type=float, default=None, help="exit 3 after this many s")
    args, _ = ap.parse_known_args()
    print("argv:", sys.argv[1:], flush=True)
    if args.pid_file:
        grandchild = subprocess.Popen(["sleep", "300"])
        with open(args.pid_file, "a") as f:
            f.write(f"{grandchild.pid}\n")
    worker = FakeWorker(args.role, args.role)
    config = uvicorn.Config(
        build_app(worker), host="127.0.0.1", port=args.port, log_level="warning"
    )
    server = uvicorn.Server(config)
    if args.die_after is not None:
        threading.Timer(args.die_after, lambda: os._exit(3)).start()
    server.run()


if __name__ == "__main__":
    main()
