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
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import ClientGone, error_body
from pdserve.router.body import with_bootstrap
from pdserve.router.http1 import Http1Error, Http1Pool, Http1Response, encode_json
from pdserve.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

PREFILL_GRACE_S = 30.0  # after the decode finished, the lease waits this long for the prefill


class LegError(Exception):
    """A leg failed; `status` and `body` are what the client gets."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = (
            body
            if isinstance(body, dict) and "error" in body
            else error_body(message, "router_error")
        )


async def _error_from(resp: Http1Response, leg: str, url: str) -> LegError:
    raw = await resp.aread()
    try:
        body = resp.json() if raw else None
    except ValueError:
        body = None
    text = raw.decode(errors="replace")[:500]
    return LegError(resp.status_code, f"{leg} {url} answered {resp.status_code}: {text}", body)


async def post_prefill(legs: Http1Pool, url: str, body: bytes, headers: dict) -> None:
    """Post the prefill leg and read its whole answer; raise LegError on failure."""
    try:
        resp = await legs.post(url, body, headers)
        try:
            if resp.status_code >= 300:
                raise await _error_from(resp, "prefill", url)
            async for _ in resp.aiter_raw():
                pass
        finally:
            await resp.aclose()
    except Http1Error as e:
        raise LegError(502, f"prefill {url} failed: {e!r}") from e


async def open_decode(legs: Http1Pool, url: str, body: bytes, headers: dict) -> Http1Response:
    """Post the decode leg; return the open response once its headers arrived (2xx only)."""
    try:
        resp = await legs.post(url, body, headers)
    except Http1Error as e:
        raise LegError(502, f"decode {url} failed: {e!r}") from e
    if resp.status_code >= 300:
        try:
            raise await _error_from(resp, "decode", url)
        except Http1Error as e:
            raise LegError(502, f"decode {url} failed: {e!r}") from e
        finally:
            await resp.aclose()
    return resp


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race(main: asyncio.Future, prefill: asyncio.Future, gone: asyncio.Future) -> Any:
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


def _forward_headers(resp: Http1Response) -> dict[str, str]:
    keep = ("content-type", "cache-control", "x-request-id")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


class PDProxy:
    """Sends requests through a (prefill, decode) pair of `pool`."""

    def __init__(
        self, pool: WorkerPool, client: httpx.AsyncClient, legs: Http1Pool, stats: dict[str, int]
    ):
        self.pool = pool
        self.client = client  # /abort_request
        self.legs = legs  # the two legs of every request (http1.py: why not httpx)
        self.stats = stats  # router counters, shown on /metrics
        self._background: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        # cleanup runs detached: inside a cancelled request task every await is cancelled again
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def forward(
        self, path: str, body: dict, headers: dict, request: Request | None
    ) -> Response:
        """Precondition: `body` is the client's parsed JSON object. With `request`
        None (the router's own probes) nobody watches for a client disconnect."""
        prefill, decode = self.pool.pick_pair(path, body)
        body = with_bootstrap(path, body, prefill)
        self.stats["requests_total"] += 1
        lease = self.pool.lease(prefill, decode)
        lease.__enter__()
        legs = _Legs(self, prefill, decode, body, lease)
        raw = encode_json(body)  # once for both legs
        p_task = asyncio.ensure_future(post_prefill(self.legs, prefill.url + path, raw, headers))
        d_task = asyncio.ensure_future(open_decode(self.legs, decode.url + path, raw, headers))
        gone: asyncio.Future = (
            asyncio.ensure_future(wait_disconnect(request))
            if request is not None
            else asyncio.get_running_loop().create_future()  # never done
        )
        legs.tasks = [p_task, d_task, gone]
        try:
            resp: Http1Response = await race(d_task, p_task, gone)
            legs.decode_resp = resp
            if body.get("stream"):
                gone.cancel()  # StreamingResponse watches the client from here on
                return StreamingResponse(
                    legs.relay(p_task), resp.status_code, _forward_headers(resp)
                )
            data = await race(asyncio.ensure_future(_read_decode(resp)), p_task, gone)
            # NOTE: the decode's complete answer means the prefill's KV arrived intact
            # (checksums and digest checked before a token was made), so a prefill that has
            # not answered yet (stalled, slow to report) does not hold the response; one
            # that already failed still turns it into its error. The prefill leg settles
            # in the background (_cleanup, at most PREFILL_GRACE_S).
            if p_task.done():
                p_task.result()
            legs.finish(ok=True)
            return Response(data, resp.status_code, _forward_headers(resp))
        except LegError as e:
            legs.finish(ok=False, abort=True)  # the surviving leg's worker drops the rid too
            self.stats["failed_total"] += 1
            log.warning("request failed: %s", e)
            return JSONResponse(e.body, e.status)
        except ClientGone:
            legs.finish(ok=False, abort=True)
            return Response(status_code=499)
        except asyncio.CancelledError:
            legs.finish(ok=False, abort=True)
            raise


def _sse_error(e: LegError) -> bytes:
    return b"data: " + json.dumps(e.body).encode() + b"\n\n"


async def _read_decode(resp: Http1Response) -> bytes:
    try:
        return await resp.aread()
    except Http1Error as e:
        raise LegError(502, f"decode answer broke off: {e}") from e


async def _decode_body(resp: Http1Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except Http1Error as e:
        raise LegError(502, f"decode stream broke off: {e}") from e


async def _chunks(resp: Http1Response, prefill: asyncio.Task) -> AsyncIterator[bytes]:
    """The decode's raw body chunks; raises the prefill's LegError as soon as it fails."""
    it = _decode_body(resp).__aiter__()
    while not (prefill.done() and prefill.exception() is None):
        nxt = asyncio.ensure_future(it.__anext__())
        try:
            await asyncio.wait(
                {nxt} | ({prefill} if not prefill.done() else set()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if prefill.done() and prefill.exception() is not None:
                nxt.cancel()
                prefill.result()
            if not nxt.done():  # the prefill succeeded; the chunk is all left to wait for
                await asyncio.wait({nxt})
        except asyncio.CancelledError:
            nxt.cancel()
            raise
        # NOTE: the stream's end comes out of `nxt` as StopAsyncIteration. Raised inside
        # this generator (an `await nxt`) it becomes a RuntimeError and the client's
        # stream is cut mid-body; it must be caught here.
        try:
            chunk = nxt.result()
        except StopAsyncIteration:
            return
        yield chunk
    # NOTE: the prefill leg ended well (it usually has by the first token): nothing left
    # to race, so the chunks pass straight through, without a task and a wait per token
    async for chunk in it:
        yield chunk


def _drain(task: asyncio.Future) -> None:
    """Cancel `task`, or mark its exception as seen so asyncio does not log it."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


class _Legs:
    """The live state of one forwarded request; `finish` releases everything once."""

    def __init__(self, proxy: PDProxy, prefill: Worker, decode: Worker, body: dict, lease: Any):
        self.proxy, self.prefill, self.decode, self.body, self.lease = (
            proxy,
            prefill,
            decode,
            body,
            lease,
        )
        self.tasks: list[asyncio.Future] = []
        self.decode_resp: Http1Response | None = None
        self._finished = False

    def finish(self, ok: bool, abort: bool = False) -> None:
        if not self._finished:
            self._finished = True
            self.proxy._spawn(self._cleanup(ok, abort))

    async def relay(self, prefill: asyncio.Task) -> AsyncIterator[bytes]:
        """Stream the decode's body unchanged; a prefill failure ends it with an error event."""
        assert self.decode_resp is not None
        ok = False
        try:
            async for chunk in _chunks(self.decode_resp, prefill):
                yield chunk
            ok = True
        except LegError as e:
            self.proxy.stats["failed_total"] += 1
            log.warning("stream failed: %s", e)
            yield _sse_error(e)
        finally:
            self.finish(ok=ok, abort=not ok)

    async def _cleanup(self, ok: bool, abort: bool) -> None:
        prefill_task = self.tasks[0]
        if ok and not prefill_task.done():
            await asyncio.wait({prefill_task}, timeout=PREFILL_GRACE_S)
        for task in self.tasks:
            _drain(task)
        decode_task = self.tasks[1]
        if decode_task.done() and not decode_task.cancelled() and not decode_task.exception():
            await decode_task.result().aclose()
        if abort:
            self.proxy.stats["aborted_total"] += 1
            await self._abort()
        self.lease.__exit__(None, None, None)

    async def _abort(self) -> None:
        rid = self.body.get("rid")
        if rid is None:
            return  # legs were cancelled; the workers see the disconnect
        for w in (self.prefill, self.decode):
            try:
                await self.proxy.client.post(
                    w.url + "/abort_request", json={"rid": rid}, timeout=2.0
                )
            except httpx.HTTPError as e:
                log.info("abort_request to %s failed: %r", w.url, e)
