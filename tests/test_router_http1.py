"""router/http1.py, the router's leg client, against a scripted HTTP/1.1 server: body
framings, keep-alive reuse, the one retry (a pooled connection the server closed idle),
timeouts, and that every early end (aclose, cancel, error) closes the connection, which
is how the router cancels a leg at its worker."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router.http1 import Http1Error, Http1Pool, encode_json

SSE = b"data: 1\n\n", b"data: 2\n\n"


class Script:
    """A server whose answer depends on the request's path; counts connections,
    requests, and connections that ended (EOF) on the client's side."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, bytes]] = []
        self.client_closed = 0
        self.dropped = 0
        self.heads: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        drop_next = False
        try:
            while True:
                try:
                    head = await r.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.client_closed += 1
                    return
                self.heads.append(head.decode())
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                n = next(
                    int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")
                )
                body = await r.readexactly(n)
                if drop_next:  # as a keep-alive timeout racing the request: no answer
                    self.dropped += 1
                    return
                self.requests.append((path, body))
                drop_next = path == "/drop-next"
                if path == "/drop-next":
                    path = "/len"
                if not await self._answer(path, r, w):
                    return
        except ConnectionError:  # the client went while this wrote
            self.client_closed += 1
        finally:
            w.close()

    async def _answer(self, path: str, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Write the answer; False: close the connection after it."""
        if path == "/len":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nx-request-id: a\r\n\r\nhello world")
        elif path == "/chunked":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in SSE:
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await w.drain()
                await asyncio.sleep(0.01)
            w.write(b"0\r\n\r\n")
        elif path == "/close":  # no length: the body ends with the connection
            w.write(b"HTTP/1.1 503 Busy\r\ncontent-type: application/json\r\n\r\n")
            w.write(json.dumps({"error": {"message": "busy"}}).encode())
            await w.drain()
            return False
        elif path == "/idle-close":  # answers, then closes while the client pools it
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            await asyncio.sleep(0.05)
            return False
        elif path == "/truncated":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n")
            await w.drain()
            return False
        elif path == "/garbage":
            w.write(b"SMTP ready\r\n\r\n")
            await w.drain()
            return False
        elif path == "/drop":  # reads the request, closes without an answer
            return False
        elif path == "/silent":  # never answers; waits for the client to go
            if await r.read(1) == b"":
                self.client_closed += 1
            return False
        await w.drain()
        return True

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


def run(body, read_timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """`await body(srv, base_url, pool)` against a fresh Script server and Http1Pool."""

    async def go() -> None:
        srv = Script()
        base = await srv.start()
        pool = Http1Pool(read_timeout_s, 1.0)
        try:
            await body(srv, base, pool)
        finally:
            pool.close()
            srv.close()

    asyncio.run(go())


async def _until(cond, timeout_s: float = 2.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


def test_framings_and_keep_alive() -> None:
    async def go(srv: Script, base: str, pool: Http1Pool) -> None:
        resp = await pool.post(base + "/len", encode_json({"a": [1, 2]}), {"x-k": "v"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "a"
        assert await resp.aread() == b"hello world"
        await resp.aclose()
        resp = await pool.post(base + "/chunked", b"{}", {})
        assert [c async for c in resp.aiter_raw()] == list(SSE)
        assert srv.connections == 1  # both on one kept-alive connection
        assert srv.requests[0] == ("/len", b'{"a":[1,2]}')
        assert f"host: {base.split('//')[1]}" in srv.heads[0]
        resp = await pool.post(base + "/close", b"{}", {})
        assert resp.status_code == 503 and json.loads(await resp.aread())["error"]
        assert resp.json()["error"]["message"] == "busy"
        resp = await pool.post(base + "/len", b"{}", {})  # the closed one is not reused
        await resp.aread()
        assert srv.connections == 2

    run(go)


def test_a_pooled_connection_closed_idle_is_replaced_and_the_request_sent_once() -> None:
    async def go(srv: Script, base: str, pool: Http1Pool) -> None:
        resp = await pool.post(base + "/idle-close", b"{}", {})
        assert await resp.aread() == b"ok"  # pooled: the server closes it 50 ms later
        await asyncio.sleep(0.2)
        resp = await pool.post(base + "/len", b"{}", {})
        assert await resp.aread() == b"hello world"
        assert [p for p, _ in srv.requests] == ["/idle-close", "/len"]
        assert srv.connections == 2

    run(go)


def test_a_pooled_connection_that_ends_before_an_answer_is_retried_once() -> None:
    """The server closes the kept-alive connection as the next request arrives (its
    keep-alive timeout racing the request): sent again, on a new connection."""

    async def go(srv: Script, base: str, pool: Http1Pool) -> None:
        resp = await pool.post(base + "/drop-next", b"{}", {})
        assert await resp.aread() == b"hello world"
        resp = await pool.post(base + "/len", b"{}", {})  # dropped once, then answered
        assert await resp.aread() == b"hello world"
        assert srv.dropped == 1 and [p for p, _ in srv.requests] == ["/drop-next", "/len"]
        assert srv.connections == 2

    run(go)


def test_failures_are_http1_errors() -> None:
    async def go(srv: Script, base: str, pool: Http1Pool) -> None:
        resp = await pool.post(base + "/truncated", b"{}", {})
        with pytest.raises(Http1Error, match="broke off"):
            await resp.aread()
        with pytest.raises(Http1Error, match="closed before an answer"):
            await pool.post(base + "/drop", b"{}", {})  # a new connection: no retry
        assert [p for p, _ in srv.requests].count("/drop") == 1
        with pytest.raises(Http1Error, match="status line"):
            await pool.post(base + "/garbage", b"{}", {})
        with pytest.raises(Http1Error, match="within 0.3s"):
            await pool.post(base + "/silent", b"{}", {})
        assert await _until(lambda: srv.client_closed == 1)  # the timed-out leg was dropped
        with pytest.raises(Http1Error, match="not sendable"):
            await pool.post(base + "/len", b"{}", {"x-evil": "a\r\nx-injected: 1"})
        srv.close()
        await srv.server.wait_closed()  # type: ignore[union-attr]
        with pytest.raises(Http1Error, match="connect"):
            await pool.post(base + "/len", b"{}", {})

    run(go, read_timeout_s=0.3)


def test_every_early_end_closes_the_connection() -> None:
    """aclose before the body's end, and a cancelled request: the server sees its
    client go (the router's way of cancelling a leg), and the connection is not reused."""

    async def go(srv: Script, base: str, pool: Http1Pool) -> None:
        resp = await pool.post(base + "/chunked", b"{}", {})
        it = resp.aiter_raw().__aiter__()
        assert await it.__anext__() == SSE[0]
        await resp.aclose()
        assert await _until(lambda: srv.client_closed == 1)  # the server saw it go
        task = asyncio.ensure_future(pool.post(base + "/silent", b"{}", {}))
        assert await _until(lambda: len(srv.requests) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _until(lambda: srv.client_closed == 2)  # and the cancelled one
        resp = await pool.post(base + "/len", b"{}", {})
        assert await resp.aread() == b"hello world"
        assert srv.connections == 3  # neither early-ended connection came back

    run(go)
