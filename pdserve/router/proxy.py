"""One PD request through the router: two legs, one answer.

    client ─▶ router ─┬─ POST prefill (read fully; matters only if it fails)
                      └─ POST decode  (its status, headers and body go to the client)

Invariants: both legs carry the same body, including the bootstrap fields; a
failure of either leg (connect error, non-2xx) cancels the other and becomes
the answer; a client that goes away cancels both legs and sends
`/abort_request {"rid"}` (that exact rid, with the router's key) to both workers.
Any other error in a request is logged and becomes that request's 500: the lease is
released and the router goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.errors import ClientGone, error_body
from pdserve.router.body import with_bootstrap
from pdserve.router.http1 import Http1Pool, Http1Response, encode_json
from pdserve.router.legs import LegError, chunks, open_decode, post_prefill, read_decode, sse_error
from pdserve.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

PREFILL_GRACE_S = 30.0  # after the decode finished, the lease waits this long for the prefill


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
        self.in_flight: dict[str, list[_Legs]] = {}  # rid -> its live requests (abort)

    def _spawn(self, coro: Any) -> None:
        # cleanup runs detached: inside a cancelled request task every await is cancelled again
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("request cleanup failed", exc_info=task.exception())

    async def abort(self, rid: str, headers: dict) -> list[dict[str, Any]] | None:
        """Abort the legs of the requests in flight under exactly `rid` (None: none is)."""
        live = self.in_flight.get(rid)
        if not live:
            return None
        results: list[dict[str, Any]] = []
        for legs in list(live):
            results += await legs.abort_workers(headers)
        return results

    async def forward(
        self, path: str, body: dict, headers: dict, request: Request | None
    ) -> Response:
        """Precondition: `body` is the client's parsed JSON object. With `request`
        None (the router's own probes) nobody watches for a client disconnect."""
        prefill, decode = self.pool.pick_pair()
        body = with_bootstrap(path, body, prefill)
        self.stats["requests_total"] += 1
        lease = self.pool.lease(prefill, decode)
        lease.__enter__()
        legs = _Legs(self, prefill, decode, body, lease, headers)
        try:
            return await self._forward(legs, path, headers, request)
        except Exception:  # NOTE: a bug or an unforeseen error ends this request only
            log.exception("request through %s and %s failed", prefill.url, decode.url)
            legs.finish(ok=False, abort=True)
            self.stats["failed_total"] += 1
            return JSONResponse(error_body("internal router error", "router_error", None, 500), 500)

    async def _forward(
        self, legs: _Legs, path: str, headers: dict, request: Request | None
    ) -> Response:
        prefill, decode, body = legs.prefill, legs.decode, legs.body
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
            data = await race(asyncio.ensure_future(read_decode(resp)), p_task, gone)
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


def _drain(task: asyncio.Future) -> None:
    """Cancel `task`, or mark its exception as seen so asyncio does not log it."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


class _Legs:
    """The live state of one forwarded request; `finish` releases everything once."""

    def __init__(
        self, proxy: PDProxy, prefill: Worker, decode: Worker, body: dict, lease: Any, headers: dict
    ) -> None:
        self.proxy, self.prefill, self.decode, self.body, self.lease = (
            proxy,
            prefill,
            decode,
            body,
            lease,
        )
        self.headers = headers  # the legs' own (the key a worker wants for the abort, too)
        self.tasks: list[asyncio.Future] = []
        self.decode_resp: Http1Response | None = None
        self._finished = False
        rid = body.get("rid")
        self.rid = rid if isinstance(rid, str) else None
        if self.rid is not None:
            proxy.in_flight.setdefault(self.rid, []).append(self)

    def finish(self, ok: bool, abort: bool = False) -> None:
        if not self._finished:
            self._finished = True
            self.proxy._spawn(self._cleanup(ok, abort))

    async def relay(self, prefill: asyncio.Task) -> AsyncIterator[bytes]:
        """Stream the decode's body unchanged; a prefill failure ends it with an error event."""
        assert self.decode_resp is not None
        ok = False
        try:
            async for chunk in chunks(self.decode_resp, prefill):
                yield chunk
            ok = True
        except LegError as e:
            self.proxy.stats["failed_total"] += 1
            log.warning("stream failed: %s", e)
            yield sse_error(e)
        except Exception:  # NOTE: an error event ends the stream, never a cut mid-body
            self.proxy.stats["failed_total"] += 1
            log.exception("stream through %s failed", self.decode.url)
            yield sse_error(LegError(500, "internal router error"))
        finally:
            self.finish(ok=ok, abort=not ok)

    async def _cleanup(self, ok: bool, abort: bool) -> None:
        try:
            if self.tasks:
                await self._settle(ok)
            if abort:
                self.proxy.stats["aborted_total"] += 1
                await self.abort_workers(self.headers)
        finally:  # NOTE: whatever failed above, the lease and the rid are given back
            self._forget()
            self.lease.__exit__(None, None, None)

    async def _settle(self, ok: bool) -> None:
        prefill_task = self.tasks[0]
        if ok and not prefill_task.done():
            await asyncio.wait({prefill_task}, timeout=PREFILL_GRACE_S)
        for task in self.tasks:
            _drain(task)
        decode_task = self.tasks[1]
        if decode_task.done() and not decode_task.cancelled() and not decode_task.exception():
            await decode_task.result().aclose()

    def _forget(self) -> None:
        live = self.proxy.in_flight.get(self.rid) if self.rid is not None else None
        if live is not None and self in live:
            live.remove(self)
            if not live:
                del self.proxy.in_flight[self.rid]  # type: ignore[arg-type]

    async def abort_workers(self, headers: dict) -> list[dict[str, Any]]:
        """`/abort_request {"rid"}` to this request's two workers, by its exact rid."""
        if self.rid is None:
            return []  # legs were cancelled; the workers see the disconnect
        out: list[dict[str, Any]] = []
        for w in (self.prefill, self.decode):
            try:
                r = await self.proxy.client.post(w.url + "/abort_request", json={"rid": self.rid},
                                                 headers=_auth_only(headers), timeout=2.0)  # fmt: skip
                out.append({"url": w.url, "status": r.status_code})
            except httpx.HTTPError as e:
                log.info("abort_request to %s failed: %r", w.url, e)
                out.append({"url": w.url, "error": repr(e)})
        return out


def _auth_only(headers: dict) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}
