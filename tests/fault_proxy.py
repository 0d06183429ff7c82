"""A loopback TCP proxy for fault tests: it forwards 127.0.0.1:port to a target and can
stall, cut or slow every connection through it, mid-transfer. It relays bytes, so it
sits on any TCP link: HTTP, or the ZeroMQ sockets of the KV transfer.

    pass   bytes flow both ways
    stall  bytes are accepted and held, nothing is forwarded (a paused peer, a black hole)
    slow   each chunk waits `delay_s` before it is forwarded
    cut()  every open connection is reset at once; new ones are served (in the mode set)

It runs its own event loop in a daemon thread, so a test drives it from plain code.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class FaultProxy:
    def __init__(
        self,
        target_port: int,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        """Listens on `listen_host:listen_port` (0: a free port, then in `self.port`); any
        127.0.0.0/8 address works on Linux, so a hop can keep its target's port number."""
        self.target = (target_host, target_port)
        self.host = listen_host
        self.mode = "pass"  # "pass" | "stall" | "slow"
        self.delay_s = 0.0
        self.connections = 0  # accepted so far (a test checks its traffic went through)
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind((listen_host, listen_port))
        self.port = int(sock.getsockname()[1])
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, ready), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cut(self) -> None:
        """Reset every connection open now."""

        def reset() -> None:
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(reset)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self, sock: socket.socket, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=sock))
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                while self.mode == "stall" and not writer.is_closing():
                    await asyncio.sleep(0.01)
                if self.mode == "slow":
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
