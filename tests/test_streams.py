"""Device streams: FIFO order, the wait_stream fence, events, broken streams, close."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch

from pdserve.kernels.stream import (
    HostStream,
    StreamError,
    WorkerStream,
    make_streams,
)


@pytest.fixture
def worker() -> Iterator[WorkerStream]:
    stream = WorkerStream("forward")
    yield stream
    stream.close()


def _held(stream: WorkerStream) -> threading.Event:
    """Block `stream` on a gate; returns the gate (set it to release the stream)."""
    gate = threading.Event()
    stream.run(lambda: gate.wait(10))
    return gate


def _after(delay: float, fn: Callable[[], object]) -> Callable[[], None]:
    """Work that sleeps `delay` seconds, then calls `fn`."""

    def work() -> None:
        time.sleep(delay)
        fn()

    return work


def _boom() -> None:
    raise KeyError("boom")


def test_worker_runs_in_fifo_order_on_its_own_thread(worker: WorkerStream) -> None:
    seen: list[tuple[int, str]] = []

    def note(i: int) -> None:
        seen.append((i, threading.current_thread().name))

    for i in range(50):
        worker.run(partial(note, i))
    worker.synchronize()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"stream-forward"}


def test_run_returns_before_the_work_runs(worker: WorkerStream) -> None:
    gate = _held(worker)
    ran = threading.Event()
    worker.run(ran.set)
    time.sleep(0.05)
    assert not ran.is_set()  # queued behind the gate, yet run() returned
    gate.set()
    worker.synchronize()
    assert ran.is_set()


def test_event_query_false_while_held_then_true(worker: WorkerStream) -> None:
    gate = _held(worker)
    event = worker.record()
    assert not event.query()
    assert event.wait(timeout=0.05) is False
    gate.set()
    assert event.wait(timeout=5) is True
    assert event.query()


def test_event_covers_only_work_issued_before_record(worker: WorkerStream) -> None:
    first = _held(worker)
    event = worker.record()
    second = _held(worker)  # issued after record: the event must not wait for it
    first.set()
    assert event.wait(timeout=5)
    assert not worker.record().query()
    second.set()
    worker.synchronize()


def test_host_wait_stream_blocks_until_earlier_worker_work_is_done(worker: WorkerStream) -> None:
    host = HostStream("schedule")
    log: list[str] = []
    worker.run(_after(0.2, lambda: log.append("forward")))
    host.wait_stream(worker)
    host.run(lambda: log.append("schedule"))
    assert log == ["forward", "schedule"]


def test_host_wait_stream_holds_the_caller_while_the_worker_is_held(worker: WorkerStream) -> None:
    gate = _held(worker)
    releaser = threading.Timer(0.2, gate.set)
    releaser.start()
    HostStream("schedule").wait_stream(worker)
    assert gate.is_set()  # the fence returned only after the worker was released
    releaser.join()


def test_worker_wait_stream_orders_after_other_worker(worker: WorkerStream) -> None:
    other = WorkerStream("copy")
    try:
        stamps: dict[str, float] = {}
        other.run(_after(0.2, lambda: stamps.__setitem__("other", time.monotonic())))
        worker.wait_stream(other)
        worker.run(lambda: stamps.__setitem__("mine", time.monotonic()))
        worker.synchronize()
        assert stamps["other"] <= stamps["mine"]
    finally:
        other.close()


def test_worker_wait_stream_on_host_is_free(worker: WorkerStream) -> None:
    host = HostStream()
    worker.wait_stream(host)
    assert worker.record().wait(timeout=5)


def test_host_stream_runs_inline_and_its_events_are_done() -> None:
    host = HostStream()
    where: list[str] = []
    host.run(lambda: where.append(threading.current_thread().name))
    assert where == [threading.current_thread().name]
    assert host.record().query() and host.record().wait(timeout=0)
    host.synchronize()


def test_worker_error_breaks_the_stream_without_hanging(worker: WorkerStream) -> None:
    before = worker.record()
    worker.run(_boom)
    skipped = threading.Event()
    worker.run(skipped.set)
    assert before.wait(timeout=5)  # work before the failure completed fine
    with pytest.raises(StreamError) as info:
        worker.synchronize()
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(StreamError):
        worker.record().wait(timeout=5)
    assert not skipped.is_set()


def test_error_reaches_the_host_fence_and_dependent_workers(worker: WorkerStream) -> None:
    worker.run(_boom)
    with pytest.raises(StreamError):
        HostStream().wait_stream(worker)
    other = WorkerStream("copy")
    try:
        other.wait_stream(worker)
        with pytest.raises(StreamError):
            other.synchronize()
    finally:
        other.close()


def test_host_error_raises_at_once_and_breaks_the_stream() -> None:
    host = HostStream()
    with pytest.raises(StreamError) as info:
        host.run(_boom)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(StreamError):
        host.synchronize()
    with pytest.raises(StreamError):
        host.record().wait()


def test_close_finishes_pending_work_and_joins() -> None:
    stream = WorkerStream("forward")
    done: list[int] = []
    stream.run(_after(0.1, lambda: done.append(1)))
    stream.close()
    assert done == [1]
    assert not stream._thread.is_alive()
    stream.close()  # idempotent
    with pytest.raises(StreamError):
        stream.run(lambda: None)


def test_make_streams_cpu() -> None:
    schedule, forward = make_streams("cpu")
    try:
        assert isinstance(schedule, HostStream) and isinstance(forward, WorkerStream)
    finally:
        forward.close()
    with pytest.raises(ValueError):
        make_streams("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_order_and_events() -> None:
    schedule, forward = make_streams("cuda")
    x = torch.zeros(1 << 22, device="cuda")
    forward.wait_stream(schedule)  # x was zeroed on the schedule stream
    forward.run(lambda: [x.add_(1) for _ in range(20)])
    event = forward.record()
    schedule.wait_stream(forward)
    out: list[torch.Tensor] = []
    schedule.run(lambda: out.append(x.sum()))
    assert event.wait(timeout=30)
    schedule.synchronize()
    assert out[0].item() == 20 * (1 << 22)
    assert event.query()
