"""A lean HTTP/1.1 client for the router's two legs: a POST, its answer streamed back.

httpx spends about half a millisecond of CPU on each request and answer (a POST with a
short streamed answer over loopback: 0.55-0.61 ms per request with httpx, 0.05 ms with
the same bytes over asyncio streams). The router sends two per client request from one
event loop, so in a burst the last request's prefill leg leaves after every earlier
request's two, and that wait is on its first token (the TTFT breakdown's `router`
stage). This client does only what the legs need; the router's other calls (health,
/server_info, /abort_request) stay on httpx.

    pool = Http1Pool(read_timeout_s, connect_timeout_s)
    resp = await pool.post(url, body, headers)   # returns once status and headers are read
    resp.status_code, resp.headers               # header names lower-case
    async for chunk in resp.aiter_raw(): ...     # the body, de-chunked
    await resp.aread(); resp.json()
    await resp.aclose()                          # always (closes or pools the connection)

Invariants:
- A connection goes back to the pool only after its answer was read to the end and
  neither side asked to close. Anything else (an error, a timeout, a cancel, aclose
  before the end) closes it, so the worker sees the disconnect: the router cancels a
  leg by dropping its connection.
- A request is sent twice only when it went out on a pooled connection that ended (EOF
  or a reset) before any byte of an answer: a worker closes only idle connections (its
  keep-alive timeout), so it closed this one before reading the request.
- Every read waits at most the read timeout; connecting, at most the connect timeout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

MAX_IDLE_PER_ORIGIN = 64
_LINE_LIMIT = 1 << 16  # a status, header or chunk-size line longer than this is an error
_NO_BODY = {204, 304}


class Http1Error(Exception):
    """The leg's connection failed: refused, reset, timed out, or a malformed answer."""


async def _within(aw: Awaitable[T], timeout_s: float) -> T:
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout_s):
                return await aw
        return await asyncio.wait_for(aw, timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise Http1Error(f"no answer within {timeout_s}s") from e


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        """Still open on both ends (as far as this event loop has seen)."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class Http1Pool:
    def __init__(self, read_timeout_s: float, connect_timeout_s: float) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Http1Response:
        """POST `body` (JSON) to `url` (http://host:port/path); Http1Error if it fails."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise Http1Error(f"not an http:// URL: {url!r}")
        origin = (parts.hostname, parts.port or 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]  # as written: an IPv6 host keeps its brackets
        request = _encode(path, host, body, headers)
        conn, pooled = self._take(origin)
        while True:
            if conn is None:
                conn = await self._connect(origin)
            try:
                conn.writer.write(request)
                return await self._answer(origin, conn)
            except _IdleClosed as e:
                conn.close()
                if not pooled:
                    raise Http1Error(f"{url}: connection closed before an answer") from e
                conn, pooled = None, False  # NOTE: the worker closed it idle: it never read this
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def _take(self, origin: tuple[str, int]) -> tuple[_Conn | None, bool]:
        idle = self._idle.get(origin, [])
        while idle:
            c = idle.pop()
            if c.usable():
                return c, True
            c.close()
        return None, False

    def _give_back(self, origin: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < MAX_IDLE_PER_ORIGIN and conn.usable():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, origin: tuple[str, int]) -> _Conn:
        try:
            r, w = await _within(
                asyncio.open_connection(*origin, limit=_LINE_LIMIT), self.connect_timeout_s
            )
        except OSError as e:
            raise Http1Error(f"connect to {origin[0]}:{origin[1]} failed: {e!r}") from e
        return _Conn(r, w)

    async def _answer(self, origin: tuple[str, int], conn: _Conn) -> Http1Response:
        try:
            head = await _within(conn.reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                raise Http1Error("the answer ended inside its headers") from e
            raise _IdleClosed() from e
        except asyncio.LimitOverrunError as e:
            raise Http1Error("answer headers too long") from e
        status, headers = _parse_head(head)
        return Http1Response(self, origin, conn, status, headers)


class _IdleClosed(Exception):
    """EOF or a reset before the first byte of an answer."""


class Http1Response:
    def __init__(
        self,
        pool: Http1Pool,
        origin: tuple[str, int],
        conn: _Conn,
        status: int,
        headers: dict[str, str],
    ) -> None:
        self.status_code, self.headers = status, headers
        self._pool, self._origin, self._conn = pool, origin, conn
        self._content: bytes | None = None
        self._done = False  # the body was read to its end
        self._closed = False
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._length = int(length) if length is not None and length.isdigit() else None
        if status in _NO_BODY or (status < 200):
            self._length, self._chunked = 0, False
        # HTTP/1.1 keeps the connection unless told otherwise; a body delimited by close can't
        delimited = self._chunked or self._length is not None
        self._reusable = delimited and "close" not in headers.get("connection", "").lower()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed)."""
        if self._content is not None:
            yield self._content
            return
        try:
            async for piece in self._body():
                yield piece
            self._done = True
        finally:
            await self.aclose()

    async def aread(self) -> bytes:
        if self._content is None:
            self._content = b"".join([p async for p in self.aiter_raw()])
        return self._content

    def json(self) -> Any:
        if self._content is None:
            raise RuntimeError("json() before aread()")
        return json.loads(self._content)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and self._reusable:
            self._pool._give_back(self._origin, self._conn)
        else:
            self._conn.close()

    def abort(self) -> None:
        """Drop the connection now (the worker sees the disconnect); a read in progress
        ends with Http1Error."""
        self._closed = True
        self._conn.writer.transport.abort()

    async def _body(self) -> AsyncIterator[bytes]:
        read, t = self._conn.reader, self._pool.read_timeout_s
        try:
            if self._chunked:
                while True:
                    line = await _within(read.readuntil(b"\r\n"), t)
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        await _within(read.readuntil(b"\r\n"), t)  # no trailers from our workers
                        return
                    data = await _within(read.readexactly(size + 2), t)
                    if data[-2:] != b"\r\n":
                        raise Http1Error("malformed chunk")
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left:
                    data = await _within(read.read(min(left, 1 << 16)), t)
                    if not data:
                        raise Http1Error(f"the answer ended {left} bytes short")
                    left -= len(data)
                    yield data
            else:
                while data := await _within(read.read(1 << 16), t):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            raise Http1Error(f"the answer broke off: {e!r}") from e
        except ValueError as e:
            raise Http1Error(f"malformed chunk size: {e}") from e


def _encode(path: str, host: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", "content-type: application/json",
             f"content-length: {len(body)}"]  # fmt: skip
    for k, v in headers.items():
        if any(c in k or c in v for c in "\r\n") or ":" in k:
            raise Http1Error(f"header {k!r} not sendable")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Http1Error(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise Http1Error(f"malformed header line {line[:80]!r}")
        key, value = name.strip().lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(parts[1]), headers


def encode_json(body: Any) -> bytes:
    """A leg's body: compact JSON (the router parsed it already: finite numbers only)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
