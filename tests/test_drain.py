"""A frontend's drain on SIGTERM (server/drain.py), with a stand-in app (no model).

The process test serves, through edge/listen.serve as `pdserve prefill|decode` does, an
app whose /generate streams slowly: SIGTERM while one stream runs must refuse a new
request (503, Retry-After), let the running one finish whole, then exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import httpx
from fake_workers import free_port

from pdserve.server.drain import Drain

APP = textwrap.dedent(
    """
    import asyncio, sys
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from pdserve.edge.listen import serve
    from pdserve.server.drain import Drain

    drain = Drain(timeout_s=float(sys.argv[2]))
    app = FastAPI()

    @app.post("/generate")
    async def generate():
        async def events():
            for i in range(10):
                yield f"data: {i}\\n\\n"
                await asyncio.sleep(0.1)
        return StreamingResponse(events(), media_type="text/event-stream")

    serve(drain.middleware(app), host="127.0.0.1", port=int(sys.argv[1]), api_key=None,
          what="drain test", stop_when=drain.done, on_sigterm=drain.start,
          log_level="warning")
    """
)


def test_the_middleware_counts_refuses_and_ends():
    sent: list[dict] = []

    async def app(scope, receive, send):
        await asyncio.sleep(0.05)

    async def send(message):
        sent.append(message)

    async def main() -> None:
        drain = Drain(timeout_s=5.0)
        asgi = drain.middleware(app)
        scope = {"type": "http", "path": "/v1/completions"}
        running = asyncio.ensure_future(asgi(scope, None, send))
        await asyncio.sleep(0.01)
        assert drain.in_flight == 1 and not drain.done()
        drain.start()
        await asgi(scope, None, send)  # a new one during the drain
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        assert not drain.done()
        await running
        assert drain.in_flight == 0 and drain.done()
        await asgi({"type": "http", "path": "/health"}, None, send)  # other routes pass

    asyncio.run(main())


def test_the_deadline_ends_a_drain_with_requests_in_flight():
    drain = Drain(timeout_s=0.05)
    drain.in_flight = 1
    drain.start()
    assert not drain.done()
    time.sleep(0.06)
    assert drain.done()


def test_sigterm_lets_a_running_stream_finish_refuses_new_ones_and_exits_0():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", APP, str(port), "30"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/docs", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        with httpx.stream("POST", url + "/generate", timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines) == "data: 0"
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            late = httpx.post(url + "/generate", timeout=5)
            assert late.status_code == 503 and late.headers["retry-after"] == "1"
            rest = [ln for ln in lines if ln]
        assert rest == [f"data: {i}" for i in range(1, 10)]
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
