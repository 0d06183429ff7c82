"""Where the time of a KV transfer goes, per process: seconds spent in each stage.

Stages (sender)   gather   pool slots -> staging buffer (the buffer ZeroMQ sends from)
                  checksum hashing the gathered frames
                  prepare  hashing frames before the decode's Ready came (push.py:
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
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_seconds: dict[str, float] = {}


def add(stage: str, seconds: float) -> None:
    with _lock:
        _seconds[stage] = _seconds.get(stage, 0.0) + seconds


@contextmanager
def timed(stage: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(stage, time.perf_counter() - t0)


def snapshot() -> dict[str, float]:
    with _lock:
        return dict(_seconds)


def reset() -> None:
    with _lock:
        _seconds.clear()
