"""HTTP plumbing shared by the handlers: bounded JSON bodies, validation, auth,
OpenAI-style errors, and watching for a client that goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pdserve.edge import body
from pdserve.edge.auth import key_matches
from pdserve.edge.errors import ClientGone, error_body
from pdserve.server.jobs import RequestError

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


async def read_json(request: Request, limit: int) -> Any:
    """The JSON body, read by the edge's one reader (the router's too): RequestError 413
    past `limit` bytes, 400 if not JSON or a number is out of bounds (edge/bounds.py)."""
    try:
        return await body.read_json(request, limit)
    except body.BodyError as e:
        raise RequestError(e.message, e.param, status=e.status) from e


def parse(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ()))
        raise RequestError(f"{param}: {err.get('msg')}" if param else str(e), param or None) from e


async def read_model(request: Request, model: type[M], api_key: str | None, limit: int) -> M:
    """The key checked (check_api_key), the JSON body read (read_json) and validated
    as `model` (parse): a handler's first step in one call."""
    check_api_key(request, api_key)
    return parse(model, await read_json(request, limit))


def check_api_key(request: Request, api_key: str | None) -> None:
    """RequestError 401 unless `Authorization: Bearer <api_key>` (when a key is set).
    The app's RequireKey (edge/auth.py) checks every route already; this stays as the
    handlers' own guard."""
    if api_key and not key_matches(request.headers.get("authorization"), api_key):
        raise RequestError("invalid or missing API key", status=401)


async def _wait_disconnect(request: Request) -> None:
    # Precondition: the body was read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


async def stream_until_disconnect(request: Request, gen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Relay `gen`; when the client goes away (noticed here or by the server cancelling
    us), cancel it mid-await, so its cleanup aborts the engine requests even while it
    is not producing anything."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    nxt: asyncio.Future[T] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(gen.__anext__())
            await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return  # client gone
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await aclose()
