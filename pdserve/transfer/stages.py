"""Where the time of a KV transfer goes, per process: seconds spent in each stage.

Stages (sender)   gather   pool slots -> staging buffer (the buffer ZeroMQ sends from)
                  checksum hashing the gathered frames
                  prepare  hashing frames before the decode's Ready came (sending/push.py:
                           Pusher.prepare), outside the transfer's wall time
                  send     queueing frames to libzmq, and waiting for a free staging
                           buffer (backpressure: the wire is behind)
Stages (receiver) receive  taking a message from libzmq (recv_multipart)
                  verify   header checks and hashing the received frames
                  scatter  frame buffer -> the reserved pool slots
Always on (two perf_counter calls per stage per chunk); read by benchmarks/kv_transfer.py.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_seconds: dict[str, float] = {}


def add(stage: str, seconds: float) -> None:
    with _lock:
        _seconds[stage] = _seconds.get(stage, 0.0) + seconds


class timed:
    """`with timed(stage):` adds the block's seconds to `stage`, raised or not.
    NOTE: a plain class, not contextlib's generator: the receiver's I/O thread runs three
    per chunk, mostly with its caches cold, where contextlib's machinery cost about 20 us
    each here (a chunk's header checks about 70)."""

    __slots__ = ("stage", "t0")

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        add(self.stage, time.perf_counter() - self.t0)


def snapshot() -> dict[str, float]:
    with _lock:
        return dict(_seconds)


def reset() -> None:
    with _lock:
        _seconds.clear()
