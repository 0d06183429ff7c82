"""One PD request through the router: two legs, one answer, on another pair if need be.

    client ─▶ router ─┬─ POST prefill (read fully; matters only if it fails)
                      └─ POST decode  (its status, headers and body go to the client)

Invariants: both legs carry the same body, including the bootstrap fields; a failure
of either leg (connect error, non-2xx, a decode tripped by the watchdog) cancels the
other and aborts the attempt's rid on both workers; it becomes the answer unless the
request can go on with another pair (attempt.Run.retry: up to `migration_limit`
times; a stream resumes after the tokens its client has). A client that goes away
cancels both legs and sends `/abort_request {"rid"}` to both workers. When every worker
of a kind is unhealthy or full, the request is shed: 503 with Retry-After. Any other
error in a request is logged and becomes that request's 500: the lease is released and
the router goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.config import RouterFaults
from pdserve.edge.errors import ClientGone, error_body
from pdserve.router.attempt import Attempt, Run
from pdserve.router.body import with_bootstrap
from pdserve.router.http1 import Http1Pool, Http1Response, encode_json
from pdserve.router.legs import LegError, open_decode, post_prefill, read_decode, sse_error
from pdserve.router.relay import TOKEN_IDS_HEADER, events
from pdserve.router.workers import NoWorker, WorkerPool

log = logging.getLogger(__name__)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race(main: asyncio.Future, a: Attempt, gone: asyncio.Future) -> Any:
    """Result of `main`, unless the prefill fails (LegError), the attempt is tripped
    (LegError) or the client goes first (ClientGone)."""
    prefill = a.tasks[0]
    watch = {main, gone, a.trip_fut} | ({prefill} if not prefill.done() else set())
    if prefill.done():
        prefill.result()
    while True:
        done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        if gone in done:
            raise ClientGone
        if a.trip_fut in done:
            a.trip_fut.result()
        if prefill in done:
            prefill.result()
            watch.discard(prefill)
        if main in done:
            return main.result()


def _forward_headers(resp: Http1Response) -> dict[str, str]:
    keep = ("content-type", "cache-control", "x-request-id")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


class PDProxy:
    """Sends requests through (prefill, decode) pairs of `pool`."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, legs: Http1Pool,
                 stats: dict[str, int], settings: RouterFaults = RouterFaults()) -> None:  # fmt: skip
        self.pool = pool
        self.client = client  # /abort_request
        self.legs = legs  # the two legs of every request (http1.py: why not httpx)
        self.stats = stats  # router counters, shown on /metrics
        self.settings = settings
        self._background: set[asyncio.Task] = set()
        self.in_flight: dict[str, list[Attempt]] = {}  # client rid -> its attempts (abort)
        self.live: set[Attempt] = set()  # attempts the watchdog looks after

    def spawn(self, coro: Any) -> None:
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
        for a in list(live):
            results += await a.abort_workers(headers)
        return results

    async def watchdog(self) -> None:
        """Trip each attempt whose decode stopped answering its health checks (a draining
        one answers: its requests finish there), unless its stream still moves (a slow
        /health on a busy box is no fault), or whose stream made no progress for
        `stall_timeout_s` (one pass; app.py runs it often)."""
        now = time.monotonic()
        quiet = self.settings.health_timeout_s  # silence that, with a failed /health, is stuck
        for a in list(self.live):
            if not a.decode.alive and (not a.stream or now - a.progress > quiet):
                reason = f"decode {a.decode.url} stopped answering its health checks"
            elif a.stream and now - a.progress > self.settings.stall_timeout_s:
                reason = f"decode {a.decode.url} made no progress for {now - a.progress:.0f}s"
            else:
                continue
            self.stats["stuck_total"] += 1
            log.warning("giving up on %s there: %s", a.rid, reason)
            a.trip(reason)

    async def forward(
        self, path: str, body: dict, headers: dict, request: Request | None, migrate: bool = True
    ) -> Response:
        """Precondition: `body` is the client's parsed JSON object. With `request`
        None (the router's own probes) nobody watches for a client disconnect; with
        `migrate` False one pair answers, whatever happens (a probe of that pair)."""
        self.stats["requests_total"] += 1
        run = Run(path, body, headers, self.settings.migration_limit if migrate else 0)
        gone: asyncio.Future = (
            asyncio.ensure_future(wait_disconnect(request))
            if request is not None
            else asyncio.get_running_loop().create_future()  # never done
        )
        try:
            return await self._forward(run, gone)
        except Exception:  # NOTE: a bug or an unforeseen error ends this request only
            log.exception("request through the router failed")
            self.stats["failed_total"] += 1
            return JSONResponse(error_body("internal router error", "router_error", None, 500), 500)
        finally:
            gone.cancel()  # a stream's relay watches the client itself (StreamingResponse)

    async def _forward(self, run: Run, gone: asyncio.Future) -> Response:
        while True:
            a: Attempt | None = None
            try:
                a = self._start(run)
                await self._open(a, gone)
                assert a.decode_resp is not None
                resp = a.decode_resp
                if run.stream:
                    gone.cancel()  # StreamingResponse watches the client from here on
                    return StreamingResponse(self._relay(run, a), resp.status_code,
                                             _forward_headers(resp))  # fmt: skip
                data = await race(asyncio.ensure_future(read_decode(resp)), a, gone)
                # NOTE: the decode's complete answer means the prefill's KV arrived intact
                # (checksums and digest checked before a token was made), so a prefill that
                # has not answered yet does not hold the response; one that already failed
                # still turns it into its error. The prefill leg settles in the background.
                if a.tasks[0].done():
                    a.tasks[0].result()
                a.finish(ok=True)
                return Response(data, resp.status_code, _forward_headers(resp))
            except LegError as e:
                if a is not None:
                    a.finish(ok=False, abort=True)  # the surviving leg's worker drops the rid
                if not self._again(run, a, e):
                    self.stats["failed_total"] += 1
                    log.warning("request failed: %s", e)
                    return JSONResponse(e.body, e.status)
            except NoWorker as e:
                return self._shed(e)
            except ClientGone:
                if a is not None:
                    a.finish(ok=False, abort=True)
                return Response(status_code=499)
            except BaseException:  # cancelled, or a bug (forward's 500)
                if a is not None:
                    a.finish(ok=False, abort=True)
                raise

    def _again(self, run: Run, a: Attempt | None, e: LegError) -> bool:
        """After a failed attempt: mark an unreachable worker down, and say whether the
        run goes on with another pair (counted as a migration)."""
        if a is not None and e.down:
            down = a.prefill if e.prefill else a.decode
            down.healthy = down.alive = False  # until its next /health
        if not run.retry(e, a) or not self._elsewhere(run, e):
            return False
        self.stats["migrated_total"] += 1
        log.warning("moving request %s to another pair (%d of %d, %d tokens sent): %s",
                    run.body.get("rid"), run.attempts, run.limit, len(run.ids), e)  # fmt: skip
        return True

    def _elsewhere(self, run: Run, e: LegError) -> bool:
        """Whether a healthy worker this run has not failed on is left for the failed
        leg's role (another pair: retrying on the same one is no migration)."""
        sel = self.pool.prefill if e.prefill else self.pool.decode
        return any(w.healthy and w not in run.avoid for w in sel.workers)

    def _shed(self, e: NoWorker) -> Response:
        self.stats["shed_total"] += 1
        status = 503
        r = JSONResponse(error_body(str(e), "overloaded_error", None, status), status)
        r.headers["Retry-After"] = str(self.settings.retry_after_s)
        return r

    def _start(self, run: Run) -> Attempt:
        """A new attempt, its two legs posted. Raises NoWorker."""
        prefill, decode = self.pool.pick_pair(run.path, run.body, run.avoid)
        body = with_bootstrap(run.path, run.attempt_body(run.body.get("rid")), prefill)
        if run.attempts == 0 and "rid" not in run.body and "rid" in body:
            run.body = {**run.body, "rid": body["rid"]}  # its name from now on (abort)
        headers = {**run.headers, TOKEN_IDS_HEADER: "1"} if run.stream else run.headers
        lease = self.pool.lease(prefill, decode)
        lease.__enter__()
        a = Attempt(self, prefill, decode, body, lease, run.headers, run.body.get("rid"))
        raw = encode_json(body)  # once for both legs
        p_task = asyncio.ensure_future(
            post_prefill(self.legs, prefill.url + run.path, raw, headers)
        )
        d_task = asyncio.ensure_future(open_decode(self.legs, decode.url + run.path, raw, headers))
        a.tasks = [p_task, d_task]
        return a

    async def _open(self, a: Attempt, gone: asyncio.Future | None) -> None:
        """Wait for the decode's answer to open (2xx). Raises LegError, ClientGone."""
        never = asyncio.get_running_loop().create_future()
        try:
            a.decode_resp = await race(a.tasks[1], a, gone if gone is not None else never)
        finally:
            never.cancel()

    async def _relay(self, run: Run, first: Attempt) -> AsyncIterator[bytes]:
        """The client's stream: the decode's events (relay.events), and when an attempt
        fails, those of the next one (resumed after the tokens sent) while the run may
        go on; otherwise one error event ends it."""
        a: Attempt | None = first
        ok = False
        try:
            while True:
                try:
                    if a is None:
                        a = self._start(run)
                        await self._open(a, None)
                    async for event in events(run, a):
                        yield event
                    ok = True
                    return
                except LegError as e:
                    if a is not None:
                        a.finish(ok=False, abort=True)
                    if not self._again(run, a, e):
                        self.stats["failed_total"] += 1
                        log.warning("stream failed: %s", e)
                        yield sse_error(e) + (b"data: [DONE]\n\n" if e.from_worker else b"")
                        return
                    a = None
                except NoWorker as e:
                    self.stats["failed_total"] += 1
                    yield sse_error(LegError(503, str(e)))
                    return
        except Exception:  # NOTE: an error event ends the stream, never a cut mid-body
            self.stats["failed_total"] += 1
            log.exception("stream through the router failed")
            yield sse_error(LegError(500, "internal router error"))
        finally:
            if a is not None:
                a.finish(ok=ok, abort=not ok)
