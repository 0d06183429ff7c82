"""Device streams: one interface for the schedule and forward streams (docs/architecture.md §2).

    CPU                                      CUDA
    schedule = HostStream (calling thread)   schedule = current torch.cuda stream
    forward  = WorkerStream (daemon thread)  forward  = a new torch.cuda.Stream

On CPU the asynchrony is real: `WorkerStream.run` queues `fn` and returns, the
worker thread executes the queue in FIFO order. `HostStream.wait_stream(worker)`
blocks the calling thread until everything issued on the worker so far has run;
that is the fence the overlap scheduler relies on.

A CPU stream whose work raised is *broken*: the error is logged once, later work
is skipped, and every later `Event.wait` / `synchronize` raises StreamError with
the original exception as `__cause__`. Nothing ever waits forever on a broken stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class StreamError(RuntimeError):
    """Work on a stream raised; the stream is broken."""


class Event(Protocol):
    def wait(self, timeout: float | None = None) -> bool:
        """Block the host until the recorded work is done. True if done, False on timeout.
        Raises StreamError if that work (or earlier work on its stream) raised."""
        ...

    def query(self) -> bool:
        """Is the recorded work done? Never blocks."""
        ...


class Stream(Protocol):
    name: str

    def run(self, fn: Callable[[], object]) -> None:
        """Issue `fn` on this stream; returns at once (the host stream runs it inline)."""

    def record(self) -> Event:
        """An event that completes when all work issued so far on this stream is done."""
        ...

    def wait_stream(self, other: Stream) -> None:
        """Work issued on self after this call starts only after all work issued on
        `other` before this call has finished."""

    def synchronize(self) -> None:
        """Host waits for all issued work; raises StreamError if any of it raised."""

    def close(self) -> None:
        """Finish pending work, then stop worker threads. Idempotent."""


# --------------------------------------------------------------------------- CPU


class _CpuEvent:
    """Done when the stream has finished its first `seq` work items."""

    def __init__(self, stream: WorkerStream, seq: int) -> None:
        self._stream = stream
        self._seq = seq

    def wait(self, timeout: float | None = None) -> bool:
        return self._stream._wait_for(self._seq, timeout)

    def query(self) -> bool:
        return self._stream._finished(self._seq)


class _DoneEvent:
    """An event of host work: done when created, unless the host stream is broken."""

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def wait(self, timeout: float | None = None) -> bool:
        if self._error is not None:
            raise StreamError(f"host stream broken: {self._error!r}") from self._error
        return True

    def query(self) -> bool:
        return True


class HostStream:
    """The calling thread as a stream: `run` executes inline, so host work is always done."""

    def __init__(self, name: str = "schedule") -> None:
        self.name = name
        self._error: BaseException | None = None

    def run(self, fn: Callable[[], object]) -> None:
        """Run `fn` now. If it raises, the stream breaks and StreamError is raised at once."""
        self._check()
        try:
            fn()
        except Exception as exc:
            self._error = exc
            log.exception("work on stream %r raised; the stream is broken", self.name)
            raise StreamError(f"work on stream {self.name!r} raised: {exc!r}") from exc

    def record(self) -> Event:
        return _DoneEvent(self._error)

    def wait_stream(self, other: Stream) -> None:
        """Block the calling thread until `other`'s work issued so far is done."""
        if other is not self:
            other.record().wait()

    def synchronize(self) -> None:
        self._check()

    def close(self) -> None:
        pass

    def _check(self) -> None:
        if self._error is not None:
            raise StreamError(f"stream {self.name!r} is broken") from self._error


_STOP = object()  # queue sentinel: the worker exits after everything before it


class WorkerStream:
    """A daemon thread executing issued work in FIFO order.

    Invariant: `_done <= _issued`; work item k (1-based) is done iff `_done >= k`.
    Items after a failure are skipped but still counted, so events complete.
    """

    def __init__(self, name: str = "forward") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._issued = 0
        self._done = 0
        self._error: BaseException | None = None
        self._error_seq = 0  # the item that raised (0: none)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], object]) -> None:
        """Queue `fn`; returns at once. Raises StreamError if the stream is closed."""
        with self._cond:
            if self._closed:
                raise StreamError(f"stream {self.name!r} is closed")
            self._issued += 1
            self._queue.put(fn)

    def record(self) -> Event:
        with self._cond:
            return _CpuEvent(self, self._issued)

    def wait_stream(self, other: Stream) -> None:
        if other is self or isinstance(other, HostStream):
            return  # NOTE: host work is done when issued; FIFO orders our own work
        event = other.record()
        self.run(lambda: event.wait())  # a failure there breaks this stream too

    def synchronize(self) -> None:
        self.record().wait()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            if self._error is None:
                self._execute(item)
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def _execute(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # even SystemExit: a dead worker would hang its waiters
            log.exception("work on stream %r raised; the stream is broken", self.name)
            with self._cond:
                self._error = exc
                self._error_seq = self._done + 1

    def _finished(self, seq: int) -> bool:
        with self._cond:
            return self._done >= seq

    def _wait_for(self, seq: int, timeout: float | None) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done >= seq, timeout):
                return False
            if self._error is not None and self._error_seq <= seq:
                raise StreamError(f"work on stream {self.name!r} raised") from self._error
            return True


# -------------------------------------------------------------------------- CUDA


class _CudaEvent:
    def __init__(self, stream: Any) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            if timeout is None:
                self._event.synchronize()
                return True
            deadline = time.monotonic() + timeout
            while not self._event.query():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(50e-6)
            return True
        except RuntimeError as exc:
            raise StreamError(f"CUDA work failed: {exc}") from exc

    def query(self) -> bool:
        return bool(self._event.query())


class CudaStream:
    """A torch.cuda stream. `run` issues kernels asynchronously from the calling thread."""

    def __init__(self, name: str, stream: Any) -> None:
        self.name = name
        self.stream = stream

    def run(self, fn: Callable[[], object]) -> None:
        try:
            with torch.cuda.stream(self.stream):
                fn()
        except Exception as exc:
            raise StreamError(f"work on stream {self.name!r} raised: {exc!r}") from exc

    def record(self) -> Event:
        return _CudaEvent(self.stream)

    def wait_stream(self, other: Stream) -> None:
        if not isinstance(other, CudaStream):
            raise TypeError(f"cannot order a CUDA stream after {type(other).__name__}")
        if other is not self:
            self.stream.wait_stream(other.stream)

    def synchronize(self) -> None:
        try:
            self.stream.synchronize()
        except RuntimeError as exc:
            raise StreamError(f"CUDA work on {self.name!r} failed: {exc}") from exc

    def close(self) -> None:
        pass


def make_streams(device: str) -> tuple[Stream, Stream]:
    """(schedule_stream, forward_stream) for `device` ("cpu", "cuda" or "cuda:N")."""
    kind = torch.device(device).type
    if kind == "cpu":
        return HostStream("schedule"), WorkerStream("forward")
    if kind == "cuda":
        dev = torch.device(device)
        schedule = CudaStream("schedule", torch.cuda.current_stream(dev))
        return schedule, CudaStream("forward", torch.cuda.Stream(dev))
    raise ValueError(f"no streams for device {device!r} (expected cpu or cuda)")
