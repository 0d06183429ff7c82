"""One PD request through the router: two legs, one answer.

    client ─▶ router ─┬─ POST prefill (read fully; matters only if it fails)
                      └─ POST decode  (its status, headers and body go to the client)

Invariants: both legs carry the same body, including the bootstrap fields; a
failure of either leg (connect error, non-2xx) cancels the other and becomes
the answer; a client that goes away cancels both legs and sends
`/abort_request {"rid"}` to both workers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.server.router_workers import Worker, WorkerPool

log = logging.getLogger(__name__)

PREFILL_GRACE_S = 30.0  # after the decode finished, wait this long for the prefill's answer


class LegError(Exception):
    """A leg failed; `status` and `body` are what the client gets."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body if isinstance(body, dict) and "error" in body else error_body(message)


class ClientGone(Exception):
    pass


def error_body(message: str, type_: str = "router_error", code: int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def num_sequences(path: str, body: dict[str, Any]) -> int | None:
    """Sequences one request makes (batch × n), or None for a single one (scalar room)."""
    n = body.get("n", 1) if path.startswith("/v1/") else _sampling_n(body)
    batch = _batch_size(body) if path == "/generate" else None
    count = (batch or 1) * (n if isinstance(n, int) and n > 1 else 1)
    return count if batch is not None or count > 1 else None


def _sampling_n(body: dict[str, Any]) -> Any:
    params = body.get("sampling_params")
    return params.get("n", 1) if isinstance(params, dict) else 1


def _batch_size(body: dict[str, Any]) -> int | None:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def with_bootstrap(path: str, body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    """A copy of `body` with the bootstrap fields and a `rid` (kept if the client set one).

    `bootstrap_room` is a fresh random 63-bit int, or a list of distinct ones when
    the request makes several sequences (batch and/or n > 1), one per sequence.
    """
    out = dict(body)
    count = num_sequences(path, body)
    if count is None:
        out["bootstrap_room"] = secrets.randbits(63)
    else:
        out["bootstrap_room"] = _distinct_rooms(count)
    out["bootstrap_host"] = prefill.host
    out["bootstrap_port"] = prefill.bootstrap_port
    if "rid" not in out and count is None:
        out["rid"] = f"pdr-{uuid.uuid4().hex}"
    return out


def _distinct_rooms(count: int) -> list[int]:
    rooms: set[int] = set()
    while len(rooms) < count:
        rooms.add(secrets.randbits(63))
    return list(rooms)


async def _error_from(resp: httpx.Response, leg: str, url: str) -> LegError:
    raw = await resp.aread()
    try:
        body = resp.json() if raw else None
    except ValueError:
        body = None
    text = raw.decode(errors="replace")[:500]
    return LegError(resp.status_code, f"{leg} {url} answered {resp.status_code}: {text}", body)


async def post_prefill(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> None:
    """Post the prefill leg and read its whole answer; raise LegError on failure."""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code >= 300:
                raise await _error_from(resp, "prefill", url)
            async for _ in resp.aiter_raw():
                pass
    except httpx.HTTPError as e:
        raise LegError(502, f"prefill {url} failed: {e!r}") from e


async def open_decode(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict
) -> httpx.Response:
    """Post the decode leg; return the open response once its headers arrived (2xx only)."""
    try:
        resp = await client.send(
            client.build_request("POST", url, json=body, headers=headers), stream=True
        )
    except httpx.HTTPError as e:
        raise LegError(502, f"decode {url} failed: {e!r}") from e
    if resp.status_code >= 300:
        try:
            raise await _error_from(resp, "decode", url)
        finally:
            await resp.aclose()
    return resp


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race(main: asyncio.Future, prefill: asyncio.Task, gone: asyncio.Task) -> Any:
    """Result of `main`, unless the prefill fails (LegError) or the client goes first."""
    watch = {main, gone} | ({prefill} if not prefill.done() else set())
    if prefill.done():
        prefill.result()
    while True:
        done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        if gone in done:
            raise ClientGone
        if prefill in done:
            prefill.result()
            watch.discard(prefill)
        if main in done:
            return main.result()


def _forward_headers(resp: httpx.Response) -> dict[str, str]:
    keep = ("content-type", "cache-control", "x-request-id")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


class PDProxy:
    """Sends requests through a (prefill, decode) pair of `pool`."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, stats: dict[str, int]):
        self.pool = pool
        self.client = client
        self.stats = stats  # router counters, shown on /metrics
        self._background: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        # cleanup runs detached: inside a cancelled request task every await is cancelled again
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def forward(self, path: str, body: dict, headers: dict, request: Request) -> Response:
        """Precondition: `body` is the client's parsed JSON object."""
        prefill, decode = self.pool.pick_pair()
        body = with_bootstrap(path, body, prefill)
        self.stats["requests_total"] += 1
        lease = self.pool.lease(prefill, decode)
        lease.__enter__()
        legs = _Legs(self, prefill, decode, body, lease)
        p_task = asyncio.ensure_future(post_prefill(self.client, prefill.url + path, body, headers))
        d_task = asyncio.ensure_future(open_decode(self.client, decode.url + path, body, headers))
        gone = asyncio.ensure_future(wait_disconnect(request))
        legs.tasks = [p_task, d_task, gone]
        try:
            resp: httpx.Response = await race(d_task, p_task, gone)
            legs.decode_resp = resp
            if body.get("stream"):
                gone.cancel()  # StreamingResponse watches the client from here on
                return StreamingResponse(
                    legs.relay(p_task), resp.status_code, _forward_headers(resp)
                )
            data = await race(asyncio.ensure_future(resp.aread()), p_task, gone)
            await race(p_task, p_task, gone)
            legs.finish(ok=True)
            return Response(data, resp.status_code, _forward_headers(resp))
        except LegError as e:
            legs.finish(ok=False)
            self.stats["failed_total"] += 1
            log.warning("request failed: %s", e)
            return JSONResponse(e.body, e.status)
        except (ClientGone, asyncio.CancelledError):
            legs.finish(ok=False, abort=True)
            raise
