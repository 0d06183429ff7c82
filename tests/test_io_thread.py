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


def test_each_message_read_once_and_the_work_run_in_order() -> None:
    """Messages queued before the thread looks are each handed to the reader once, no
    call more (EVENTS asked after each message, not assumed), and work runs in order."""
    import zmq

    from pdserve.transfer.zmq_io import context

    pull, push = context().socket(zmq.PULL), context().socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    for i in range(5):
        push.send(b"%d" % i)
    time.sleep(0.2)  # all five queued at the PULL before the thread polls
    io, _ = _thread(0.05)
    got: list[bytes] = []
    calls: list[int] = []

    def read() -> None:
        calls.append(1)
        try:
            got.append(pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass

    order: list[int] = []
    done = threading.Event()
    io.submit(lambda: io.add_reader(pull, read))
    for i in range(3):
        io.submit(lambda i=i: order.append(i))
    io.submit(done.set)
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while len(got) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    io.stop()
    pull.close(linger=0)
    push.close(linger=0)
    assert got == [b"%d" % i for i in range(5)] and len(calls) == 5, (got, len(calls))
    assert order == [0, 1, 2]


def test_a_handler_never_waits_on_an_empty_socket() -> None:
    """recv(block=False), as every handler calls it: an empty socket answers at once
    (a blocking recv would hold the I/O thread until its receive timeout)."""
    import zmq

    from pdserve.transfer.messages import Decoder
    from pdserve.transfer.zmq_io import MsgSocket, context

    pull = context().socket(zmq.PULL)
    pull.bind_to_random_port("tcp://127.0.0.1")
    pull.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        t0 = time.monotonic()
        assert MsgSocket(pull, Decoder()).recv(block=False) == (None, None, [])
        assert time.monotonic() - t0 < 2.5  # not RCVTIMEO's 3 s
    finally:
        pull.close(linger=0)
