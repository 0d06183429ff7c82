"""The engine process's loop: how long it waits between steps, and that a message ends
the wait at once however long it is."""

from __future__ import annotations

import threading
import time

import zmq

from pdserve import protocol as P
from pdserve.scheduler import engine_proc
from pdserve.scheduler.engine_proc import EngineLoop


class Stub:
    """An engine that computes nothing; `work` / `unfinished` say what it reports."""

    def __init__(self) -> None:
        self.work = self.unfinished = False
        self.steps = 0
        self.publish = None

    def has_work(self) -> bool:
        return self.work

    def has_unfinished(self) -> bool:
        return self.unfinished

    def step(self) -> list:
        self.steps += 1
        return []

    def stats(self) -> dict[str, float]:
        return {"steps": float(self.steps)}


def test_the_wait_follows_what_the_engine_holds(tmp_path):
    ctx = zmq.Context()
    engine = Stub()
    loop = EngineLoop(engine, ctx, str(tmp_path))
    try:
        assert loop._wait_ms() == engine_proc.EMPTY_POLL_MS  # nothing at all
        engine.unfinished = True  # e.g. a request whose KV is on its way
        assert loop._wait_ms() == engine_proc.IDLE_POLL_MS
        engine.work = True
        assert loop._wait_ms() == 0
    finally:
        ctx.destroy(linger=0)


def test_a_message_ends_a_long_wait_at_once(tmp_path, monkeypatch):
    """An idle engine waits long between steps, yet answers a message at once: the
    message, not the timeout, ends the wait."""
    monkeypatch.setattr(engine_proc, "EMPTY_POLL_MS", 5000)
    ctx = zmq.Context()
    to_engine, from_engine = P.ipc_paths(str(tmp_path))
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(to_engine)
    pull.bind(from_engine)
    engine = Stub()
    loop = EngineLoop(engine, ctx, str(tmp_path))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        time.sleep(0.3)  # the loop is in its 5 s wait by now
        assert engine.steps <= 2
        t0 = time.monotonic()
        push.send(P.encode(P.StatsReq(nonce=7)))
        assert pull.poll(2000), "no answer"
        reply = P.from_engine_decoder.decode(pull.recv())
        assert isinstance(reply, P.Stats) and reply.nonce == 7
        assert time.monotonic() - t0 < 4.0  # not after the loop's 5 s wait
    finally:
        loop.stopping = True
        push.send(P.encode(P.Shutdown()))
        runner.join(timeout=10)
        ctx.destroy(linger=0)
    assert not runner.is_alive()
