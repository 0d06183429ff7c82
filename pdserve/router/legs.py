"""The two legs of a PD request, each a POST through the router's HTTP/1.1 pool.

    post_prefill   the prefill's whole answer is read; it matters only if it fails
    open_decode    the decode's answer, open once its status and headers arrived
    chunks         the decode's body, cut short by a prefill failure (LegError)

Every failure of a leg is a LegError carrying what the client gets (status, body).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pdserve.edge.errors import error_body
from pdserve.router.http1 import Http1Error, Http1Pool, Http1Response


class LegError(Exception):
    """A leg failed; `status` and `body` are what the client gets. `retryable`: another
    pair may serve it (a 5xx or a broken leg, not a client error); `prefill`: the prefill
    leg failed; `down`: the worker could not be reached at all."""

    def __init__(
        self,
        status: int,
        message: str,
        body: Any = None,
        *,
        retryable: bool | None = None,
        prefill: bool = False,
        down: bool = False,
        from_worker: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = status >= 500 if retryable is None else retryable
        self.prefill, self.down = prefill, down
        self.from_worker = from_worker  # a worker's own error event (a [DONE] follows it)
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
    message = f"{leg} {url} answered {resp.status_code}: {text}"
    return LegError(resp.status_code, message, body, prefill=leg == "prefill")


def _unreachable(e: Http1Error) -> bool:
    return str(e).startswith("connect to")


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
        raise LegError(502, f"prefill {url} failed: {e!r}", prefill=True,
                       down=_unreachable(e)) from e  # fmt: skip


async def open_decode(legs: Http1Pool, url: str, body: bytes, headers: dict) -> Http1Response:
    """Post the decode leg; return the open response once its headers arrived (2xx only)."""
    try:
        resp = await legs.post(url, body, headers)
    except Http1Error as e:
        raise LegError(502, f"decode {url} failed: {e!r}", down=_unreachable(e)) from e
    if resp.status_code >= 300:
        try:
            raise await _error_from(resp, "decode", url)
        except Http1Error as e:
            raise LegError(502, f"decode {url} failed: {e!r}") from e
        finally:
            await resp.aclose()
    return resp


def sse_error(e: LegError) -> bytes:
    return b"data: " + json.dumps(e.body).encode() + b"\n\n"


async def read_decode(resp: Http1Response) -> bytes:
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


async def chunks(resp: Http1Response, prefill: asyncio.Future) -> AsyncIterator[bytes]:
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
