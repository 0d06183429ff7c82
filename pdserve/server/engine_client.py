"""Frontend side of the engine link: spawns the engine process and routes its events.

One `EngineClient` per frontend. Each in-flight request owns an asyncio queue
of TokenEvents keyed by rid; the reader task fills it. Invariant: once the
engine is found dead (exit, EngineError, or heartbeat silence), every queue
receives a terminal error event and new submissions raise `EngineDead`, so no
request waits forever on an engine that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from pdserve import protocol as P
from pdserve.edge.listen import StartupRefused
from pdserve.envs import ENV, engine_env
from pdserve.protocol import EngineRequest, EngineSpec, TokenEvent

log = logging.getLogger("pdserve.engine_client")

# The engine process's entry point; started by name: the frontend never imports it.
ENGINE_MODULE = "pdserve.scheduler.engine_proc"

WATCH_S = 0.2  # how often the child's liveness is checked


class EngineDead(RuntimeError):
    """The engine process is gone; the message says why."""


class EngineClient:
    def __init__(
        self,
        spec: EngineSpec,
        *,
        start_timeout_s: float = 600.0,
        heartbeat_timeout_s: float = 60.0,
        log_level: str = "info",
    ) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.log_level = log_level
        self.error: str | None = None  # set once the engine is dead
        self.pid: int | None = None
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._group_of: dict[str, str] = {}  # in-flight sample rid -> its request's rid (n > 1)
        self._stats_waiters: dict[int, asyncio.Future[dict[str, float]]] = {}
        self._nonce = 0
        self._last_beat = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self.error is None

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def in_flight_rids(self) -> list[str]:
        return list(self._queues)

    def rids_of(self, rid: str) -> list[str]:
        """The in-flight engine rids a client's `rid` names: the request itself (n = 1)
        and the samples submitted under it as their group (n > 1). Exact names only: a
        rid is never matched by prefix, so one client cannot end another's requests."""
        own = [rid] if rid in self._queues else []
        return own + sorted(r for r, g in self._group_of.items() if g == rid)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine and wait for EngineReady. Raises RuntimeError if it never comes."""
        self._dir = tempfile.mkdtemp(prefix="pdserve-ipc-")
        to_engine, from_engine = P.ipc_paths(self._dir)
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(to_engine)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(from_engine)
        self._proc = subprocess.Popen(self._argv(), env=engine_env(os.environ))
        self.pid = self._proc.pid
        await self._wait_ready()
        self._last_beat = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._watch_loop()),
        ]

    def _argv(self) -> list[str]:
        entry = ENV.ENGINE_ENTRY.get()
        program = [entry] if entry else ["-m", ENGINE_MODULE]
        return [
            sys.executable,
            *program,
            "--ipc-dir",
            self._dir,
            "--parent-pid",
            str(os.getpid()),
            "--config-json",
            msgspec.json.encode(self.spec).decode(),
            "--log-level",
            self.log_level,
        ]

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if await self._pull.poll(200):
                msg = P.from_engine_decoder.decode(await self._pull.recv())
                if isinstance(msg, P.EngineReady):
                    log.info("engine ready (role=%s, pid=%d)", msg.role, msg.pid)
                    return
                if isinstance(msg, P.EngineError):
                    raise StartupRefused(msg.message)
            elif self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                raise StartupRefused(f"engine process exited with code {code} while starting")
        raise StartupRefused(f"engine not ready after {self.start_timeout_s:.0f}s")

    async def close(self) -> None:
        """Stop the engine (Shutdown, then SIGTERM, then SIGKILL) and release everything."""
        for t in self._tasks:
            t.cancel()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # NOBLOCK: when the engine died first (SIGTERM to the whole process group)
            # the PUSH socket has no peer and a blocking send would wait forever.
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(P.encode(P.Shutdown()), flags=zmq.NOBLOCK)
            if not await _wait_exit(proc, 3.0):
                proc.terminate()
                if not await _wait_exit(proc, 2.0):
                    proc.kill()
                    proc.wait()
        self._fail("server shutting down")
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenEvent]:
        """Send `req` to the engine; its events arrive on the returned queue.
        Precondition: `req.rid` is not in flight. Call `release(rid)` when done."""
        if not self.alive:
            raise EngineDead(self.error or "engine not started")
        if req.rid in self._queues:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        # NOTE: register only once encoded and sent: a request that fails here (one
        # bounds.py should have refused) must not stay "in flight" forever. No event can
        # arrive in between: the read loop runs on this event loop.
        self._push.send(P.encode(P.GenerateReq(req=req)))
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[req.rid] = q
        if req.group is not None:
            self._group_of[req.rid] = req.group
        return q

    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        if self.alive:
            self._send(P.Abort(rid=rid, reason=reason))

    def release(self, rid: str) -> None:
        """Forget `rid`: later events for it are dropped."""
        self._queues.pop(rid, None)
        self._group_of.pop(rid, None)

    async def stats(self, timeout_s: float = 2.0) -> dict[str, float]:
        if not self.alive:
            raise EngineDead(self.error or "engine not started")
        self._nonce += 1
        fut: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[self._nonce] = fut
        self._send(P.StatsReq(nonce=self._nonce))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._stats_waiters.pop(self._nonce, None)

    def _send(self, msg: P._Msg) -> None:
        # SNDHWM=0 on an ipc PUSH: send never blocks, so the un-awaited future completes at once
        self._push.send(P.encode(msg))

    # ---- background tasks ----------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            msg = P.from_engine_decoder.decode(await self._pull.recv())
            if isinstance(msg, P.Events):
                for ev in msg.events:
                    q = self._queues.get(ev.rid)
                    if q is not None:
                        q.put_nowait(ev)
            elif isinstance(msg, P.Heartbeat):
                self._last_beat = time.monotonic()
            elif isinstance(msg, P.Stats):
                fut = self._stats_waiters.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)
            elif isinstance(msg, P.EngineError):
                self._fail(msg.message)

    async def _watch_loop(self) -> None:
        while self.error is None:
            await asyncio.sleep(WATCH_S)
            assert self._proc is not None
            code = self._proc.poll()
            if code is not None:
                self._fail(f"engine process exited unexpectedly ({exit_status(code)})")
            elif time.monotonic() - self._last_beat > self.heartbeat_timeout_s:
                self._fail(f"engine unresponsive for {self.heartbeat_timeout_s:.0f}s")

    def _fail(self, message: str) -> None:
        """Mark the engine dead and end every in-flight request with `message`."""
        if self.error is None:
            if message != "server shutting down":
                log.error("%s", message)
            self.error = message
        for rid, q in self._queues.items():
            q.put_nowait(TokenEvent(rid=rid, finished=True, error=self.error))
        self._queues.clear()
        self._group_of.clear()
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDead(self.error))


def exit_status(code: int) -> str:
    """'code -9, SIGKILL' for a process a signal ended; 'code 0: ...' for one stopped
    cleanly by a SIGTERM its frontend did not send (a whole process group signalled)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code}, {signal.Signals(-code).name}"
    if code == 0:
        return "code 0: stopped by a signal from outside its server"
    return f"code {code}"


async def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
