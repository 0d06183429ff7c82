"""The transfer I/O thread's timer: on_tick about every tick_s, busy or idle."""

from __future__ import annotations

import threading
import time

from pdserve.transfer.io_thread import IOThread


def _thread(tick_s: float) -> tuple[IOThread, list[float]]:
    io = IOThread("test-io", tick_s=tick_s)
    stamps: list[float] = []
    io.on_tick = lambda: stamps.append(time.monotonic())
    io.start()
    return io, stamps


def test_a_busy_thread_ticks_once_per_tick_s_not_once_per_turn() -> None:
    """Work arriving every ~1 ms makes a turn each time; the timers (a scan of every
    room) still run about every tick_s (they ran after every turn before)."""
    io, stamps = _thread(0.05)
    done = threading.Event()
    t0 = time.monotonic()
    for _ in range(300):
        io.submit(lambda: None)
        time.sleep(0.001)
    io.submit(done.set)
    assert done.wait(5)
    elapsed = time.monotonic() - t0
    io.stop()
    turns_at_least = 100  # 300 submits, 1 ms apart, on a loaded machine still > 100 turns
    assert len(stamps) <= elapsed / 0.05 + 2 < turns_at_least, (len(stamps), elapsed)
    assert len(stamps) >= 2


def test_an_idle_thread_still_ticks_on_time() -> None:
    io, stamps = _thread(0.02)
    time.sleep(0.3)
    io.stop()
    assert len(stamps) >= 8, stamps  # ~15 expected; timers must not wait for traffic
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) < 0.2, gaps
