"""The frontend path goes one way: route -> parse into one request object -> engine ->
format. One completion and one chat completion are traced in-process through the real
app (create_app) with a stub at the engine-client boundary, and every pdserve file must
be visited at most twice.

A visit is a maximal run of consecutive frames in one file along the calls: it starts
where a function of the file is called from a function of another pdserve file (or
from outside pdserve) and lasts while that file's functions call each other. Frames of
the stdlib and third-party code between two pdserve frames are skipped (fastapi calling
a handler, pydantic calling a validator); a return to the caller and the resumption of
a suspended coroutine continue the visit they belong to, and a task continues the visit
of the code that started it. So a handler calling helpers of one file three times
enters that file three times, and A -> B -> A enters A twice.

The stub engine answers with one event, so the per-event loop (which is the design)
runs once; the requests are not streamed (a stream's per-chunk loop likewise).
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from fake_engine import make_model_dir

import pdserve
from pdserve.config import EngineConfig
from pdserve.protocol import EngineRequest, EngineSpec, TokenEvent
from pdserve.server import app as server_app
from pdserve.server.server_config import ServerConfig

PKG = str(Path(pdserve.__file__).resolve().parent) + "/"
MAX_VISITS = 2
# value types whose own small methods (Job.choices, Bootstrap.for_sample, SampleResult.add)
# are reads of the request's data, not steps of its path
VALUE_TYPES = {"server/jobs.py"}


class StubEngine:
    """The EngineClient's interface, answering every request at once: the prompt echoed
    back (at most max_tokens of it) in one finished event."""

    def __init__(self, spec: EngineSpec, **_: Any) -> None:
        self.alive, self.error, self.pid, self.in_flight = True, None, None, 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenEvent]:
        ids = req.input_ids[: req.params.max_tokens]
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        q.put_nowait(TokenEvent(rid=req.rid, token_ids=ids, logprobs=[-0.5] * len(ids),
                                finished=True, finish_reason="length",
                                stages={"arrive": 1.0, "running": 1.5}))  # fmt: skip
        return q

    def abort(self, rid: str, reason: str = "") -> None:
        pass

    def release(self, rid: str) -> None:
        pass


def _pdserve_file(frame: FrameType | None) -> str | None:
    """The file of the nearest pdserve frame from `frame` outwards."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(PKG):
            return frame.f_code.co_filename
        frame = frame.f_back
    return None


class Walk:
    """The visits of one traced request, in order: (file, function)."""

    def __init__(self) -> None:
        self.visits: list[tuple[str, str]] = []
        self._started: dict[int, FrameType] = {}  # frames already running (kept alive)
        self._task_creator: dict[int, str | None] = {}  # coroutine frame -> starting file

    def profile(self, frame: FrameType, event: str, _: Any) -> None:
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(PKG) or id(frame) in self._started:
            return  # not pdserve, not an entry, or a suspended frame resuming
        self._started[id(frame)] = frame
        caller = _pdserve_file(frame.f_back)
        if caller is None:
            caller = self._task_creator.get(id(frame))
        if caller != name:
            self.visits.append((name[len(PKG) :], frame.f_code.co_name))

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> Any:
        frame = getattr(coro, "cr_frame", None)
        if frame is not None:
            self._task_creator[id(frame)] = _pdserve_file(sys._getframe(1))
        return asyncio.Task(coro, loop=loop, **kw)

    def counts(self) -> Counter[str]:
        return Counter(f for f, _ in self.visits)

    def path(self) -> str:
        return " -> ".join(f"{f}:{fn}" for f, fn in self.visits)


def traced(send: Callable[[], Any]) -> Walk:
    walk = Walk()

    async def main() -> None:
        asyncio.get_running_loop().set_task_factory(walk.task_factory)
        sys.setprofile(walk.profile)
        try:
            await send()
        finally:
            sys.setprofile(None)

    asyncio.run(main())
    return walk


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch):
    model = make_model_dir(tmp_path_factory.mktemp("model"))
    monkeypatch_module.setattr(server_app, "EngineClient", StubEngine)
    cfg = ServerConfig(role="decode", model_path=str(model))
    spec = EngineSpec(role="decode", engine=EngineConfig(model_path=str(model)))
    return server_app.create_app(cfg, spec)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def post(app: Any, route: str, body: dict[str, Any]) -> Callable[[], Any]:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(route, json=body)

    return send


def check_walk(app: Any, route: str, body: dict[str, Any]) -> Walk:
    # once untraced: imports and first-use caches are not part of the path
    asyncio.run(post(app, route, body)())
    result: list[httpx.Response] = []

    async def send() -> None:
        result.append(await post(app, route, body)())

    walk = traced(send)
    assert result[0].status_code == 200, result[0].text
    answer = result[0].json()  # the engine's tokens came back formatted
    assert answer["usage"]["completion_tokens"] > 0 and "ttft_breakdown" in answer
    counts = walk.counts()
    bouncing = {f: n for f, n in counts.items() if n > MAX_VISITS and f not in VALUE_TYPES}
    assert not bouncing, f"files entered more than {MAX_VISITS} times: {bouncing}\n{walk.path()}"
    return walk


def test_completion_walks_one_way(app: Any) -> None:
    walk = check_walk(app, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    # the walk saw the whole path: route, parse, engine, detokenizer, format
    for f in ("openai_routes", "openai_parse", "generation", "detokenizer", "openai_format"):
        assert f"server/{f}.py" in walk.counts(), walk.path()


def test_chat_completion_walks_one_way(app: Any) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    walk = check_walk(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    for f in ("openai_routes", "openai_parse", "chat_template", "generation", "openai_format"):
        assert f"server/{f}.py" in walk.counts(), walk.path()
