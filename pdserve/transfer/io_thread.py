"""A background I/O thread shared by the sender and the receiver.

The engine thread hands work over with `submit(fn)` (thread-safe, never blocks);
the I/O thread owns every ZeroMQ socket, runs the submitted work in FIFO order,
dispatches readable sockets in turns of at most SLICE_S each, and fires `on_tick`
about every `tick_s`: after the first turn that ends tick_s or more after the last tick
(an idle thread wakes for it). Not after every turn: a tick scans every room or transfer
for its timers (a sender's tick with 4,000 rooms took 0.22 ms here), and a thread that
messages trickle into turns once per message.
Events for the engine go through `emit` and come out of `drain` (thread-safe).

No exception kills the thread: a failing work item, message handler or tick is logged
and the thread goes on (the handlers fail only the room they were handling). Should
the thread die anyway, `drain` raises TransferDead from then on, so the engine's step
fails and its process exits (its frontend's /health turns 503) instead of serving with
no transfer.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

# NOTE: work and each socket get turns of at most SLICE_S, so a big push or a burst
# of chunks never starves heartbeats, acks and timers (no false timeouts)
SLICE_S = 0.05


class TransferDead(RuntimeError):
    """The transfer's I/O thread died: no transfer finishes or times out any more."""


class IOThread:
    def __init__(self, name: str, tick_s: float) -> None:
        self.tick_ms = max(1, int(tick_s * 1000))
        self._work: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()  # wakes the poller when work is submitted
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._readers: dict[zmq.Socket, Callable[[], None]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._rfd, zmq.POLLIN)
        self._stop = threading.Event()
        self._killed = False
        self.died: str | None = None  # why the thread ended while not told to stop
        self.on_tick: Callable[[], None] = lambda: None
        self.on_exit: Callable[[bool], None] = lambda killed: None
        self._next_tick = 0.0  # time.monotonic() when on_tick fires next
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add_reader(self, sock: zmq.Socket, fn: Callable[[], None]) -> None:
        """I/O thread only: call `fn` while `sock` has messages."""
        self._readers[sock] = fn
        self._poller.register(sock, zmq.POLLIN)

    def remove_reader(self, sock: zmq.Socket) -> None:
        """I/O thread only: stop watching `sock` (before it is closed)."""
        if self._readers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def submit(self, fn: Callable[[], object]) -> None:
        self._work.put(fn)
        if self._wfd < 0:
            return  # stopped
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full: the thread is awake anyway

    def emit(self, event: object) -> None:
        self._events.put(event)

    def drain(self) -> list:
        if self.died is not None:
            raise TransferDead(f"transfer I/O thread {self._thread.name} died: {self.died}")
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout_s: float) -> list:
        """drain(), after blocking up to `timeout_s` for the first event ([] if none came)."""
        try:
            first = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self.drain()]

    def stop(self, kill: bool = False) -> None:
        """Stop the thread. `kill`: exit at once without any goodbye (fault injection)."""
        self._killed = kill
        self._stop.set()
        self.submit(lambda: None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
            if not self._thread.is_alive() and self._rfd >= 0:
                os.close(self._rfd)
                os.close(self._wfd)
                self._rfd = self._wfd = -1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = not self._work.empty()  # leftover work: only peek at the sockets
                ready = dict(self._poller.poll(0 if busy else self._ms_to_tick()))
                self._run_work(woken=self._rfd in ready)
                for sock, fn in list(self._readers.items()):
                    # NOTE: a handler may have closed a socket polled readable this turn
                    if ready.get(sock) and sock in self._readers and not self._stop.is_set():
                        self._drain_socket(sock, fn)
                if not self._stop.is_set():
                    self._maybe_tick()
        except BaseException as e:
            self.died = repr(e)
            log.exception("transfer I/O thread crashed")
        finally:
            try:
                self.on_exit(self._killed)
            except Exception:
                log.exception("transfer I/O thread's exit failed")

    def _ms_to_tick(self) -> int:
        return max(0, min(self.tick_ms, math.ceil((self._next_tick - time.monotonic()) * 1e3)))

    def _maybe_tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self.tick_ms / 1000
            try:
                self.on_tick()
            except Exception:  # timers and heartbeats must go on for every other room
                log.exception("transfer tick failed")

    # NOTE: the two below run on most turns, mostly on a core whose caches were taken
    # while the thread slept (several times slower here): no exception raised where
    # nothing is wrong, no call the poll already answered
    def _run_work(self, woken: bool) -> None:
        """`woken`: the poll found the wake-up pipe readable (empty it)."""
        if woken:
            try:
                os.read(self._rfd, 65536)
            except BlockingIOError:  # emptied by an earlier turn
                pass
        end = time.monotonic() + SLICE_S
        # NOTE: this thread is the queue's only consumer: not empty here, not empty below
        while not self._work.empty() and not self._stop.is_set() and time.monotonic() < end:
            fn = self._work.get_nowait()
            try:
                fn()
            except Exception:  # a bug in one work item must not kill every transfer
                log.exception("transfer work item failed")

    @staticmethod
    def _drain_socket(sock: zmq.Socket, fn: Callable[[], None]) -> None:
        """Call `fn` for each message `sock` has (the poll said it has one), for at most
        SLICE_S."""
        end = time.monotonic() + SLICE_S
        more = True  # NOTE: the poll's answer; EVENTS asked only after each message
        while more and time.monotonic() < end:
            try:
                fn()
            except Exception:  # one bad message fails its room at most, never the thread
                log.exception("transfer message handler failed")
            if sock.closed:  # the handler closed it (a failed or idle peer's socket)
                return
            more = bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
