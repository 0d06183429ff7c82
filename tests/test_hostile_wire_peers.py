"""Peers that lie or vanish: each ends only its own rooms, in seconds, and the same
receiver and sender serve a transfer byte-exact afterwards.

On the code before: a prefill that only heartbeats held the decode's reservation until
kv_timeout_s; a KVDone with an int64-overflowing first_token made struct.pack raise in the
handler, so the transfer hung until kv_timeout_s; a room whose decode vanished before its
Ready (or never had the request) was held for ready_timeout_s; a raising tick killed the
I/O thread, and a dead I/O thread went unnoticed.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from hostile_wire import LAYOUT, N, pair, raw, send, serves

from pdserve.transfer.loopback import (
    Side,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
)
from pdserve.transfer.messages import Heartbeat, KVDone, encode
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender

pytestmark = pytest.mark.timeout(120)

BOOT_S = 1.0  # the pairs' bootstrap timeout
SLACK_S = 2.0


def test_a_prefill_that_only_heartbeats_holds_no_pages() -> None:
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=60, heartbeat_interval_s=0.1,
                    heartbeat_timeout_s=1.0, kv_bootstrap_timeout_s=BOOT_S))  # fmt: skip
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def heartbeat_only() -> None:
        peers: set[bytes] = set()
        while not stop.is_set():
            while fake.poll(0):
                peers.add(fake.recv_multipart()[0])
            for peer in peers:
                fake.send_multipart([peer, encode(Heartbeat(sender="fake", seq=1))])
            time.sleep(0.1)

    t = threading.Thread(target=heartbeat_only, daemon=True)
    t.start()
    try:
        pool = random_pool(LAYOUT, 64, 1)
        _, slots = reserve(pool, N, 1)
        t0 = time.monotonic()
        rx.expect(make_req("hb", 1, N, port), pool, slots)
        [ev] = wait_for(rx.poll, 1, BOOT_S + SLACK_S)
        assert not ev.ok and "claim" in ev.reason, ev
        assert time.monotonic() - t0 < BOOT_S + SLACK_S
    finally:
        stop.set()
        t.join(2)
        fake.close(linger=0)
        rx.close()


def _overflowing_done(kind: str, frames: list) -> list[list]:
    """A fault hook: the KVDone goes out with a first_token no int64 holds."""
    if kind == "KVDone":
        done = msgspec.msgpack.decode(bytes(frames[0]), type=KVDone)
        frames = [encode(msgspec.structs.replace(done, first_token=2**64 - 1)), *frames[1:]]
    return [list(frames)]


def test_kvdone_with_out_of_range_fields_is_refused() -> None:
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), fault_hook=_overflowing_done)
    with pair() as p:
        pp, dp = random_pool(LAYOUT, 64, 1), random_pool(LAYOUT, 64, 2)
        pre, dec = Side(pp, *reserve(pp, N, 1)), Side(dp, *reserve(dp, N, 2))
        req = make_req("big", 5, N, tx.bootstrap_port)
        p.rx.expect(req, dec.pool, dec.slots)
        push_prompt(tx, req, pre, chunk=8)
        [ev] = wait_for(p.rx.poll, 1, SLACK_S)
        assert not ev.ok and "first_token" in ev.reason, ev
        tx.close()
        serves(p)


def test_a_room_whose_decode_announced_then_vanished_is_freed_by_its_silence() -> None:
    from pdserve.transfer.messages import Announce

    with pair(peer=1.0, bootstrap_timeout_s=30.0) as p:
        dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{p.tx.bootstrap_port}")
        send(dealer, Announce(room=77, decode_id="doomed"))
        pool = random_pool(LAYOUT, 64, 1)
        side = Side(pool, *reserve(pool, N, 1))
        req = make_req("doomed", 77, N, p.tx.bootstrap_port)
        p.tx.on_queue(req)
        push_prompt(p.tx, req, side, chunk=8)  # computed; no Ready will ever come
        # the decode dies: no heartbeat from now on (its Announce delivered first: with
        # linger 0 a close before the connection is up would drop it)
        dealer.close(linger=1000)
        [ev] = wait_for(p.tx.poll, 1, 1.0 + SLACK_S)
        assert not ev.ok and "silent" in ev.reason, ev
        serves(p)


def test_a_room_no_decode_announces_is_freed_after_the_bootstrap_timeout() -> None:
    with pair(bootstrap_timeout_s=BOOT_S) as p:
        pool = random_pool(LAYOUT, 64, 1)
        side = Side(pool, *reserve(pool, N, 1))
        queued = make_req("queued", 41, N, p.tx.bootstrap_port)
        admitted = make_req("admitted", 42, N, p.tx.bootstrap_port)
        getattr(p.tx, "on_queue", lambda r: None)(queued)  # waits in the prefill's queue
        push_prompt(p.tx, admitted, side, chunk=8)
        evs = wait_for(p.tx.poll, 2, BOOT_S + SLACK_S)
        assert {(e.rid, e.room) for e in evs} == {("", 41), ("admitted", 0)}, evs
        assert all(not e.ok and "announce" in e.reason for e in evs), evs
        serves(p)


def test_a_raising_tick_does_not_kill_the_io_thread() -> None:
    with pair() as p:
        real, calls = p.rx._heartbeat, []

        def once(endpoints: set[str]) -> None:
            if not calls:
                calls.append(1)
                raise RuntimeError("injected")
            real(endpoints)

        p.rx._heartbeat = once  # type: ignore[method-assign]
        time.sleep(0.5)
        assert calls
        serves(p)


def test_a_dead_io_thread_is_reported_to_the_engine() -> None:
    from pdserve.transfer.io_thread import TransferDead

    with pair() as p:

        def broken(*_: object) -> list:
            raise RuntimeError("injected")

        p.rx._io._poller.poll = broken  # type: ignore[method-assign]
        p.rx._io.submit(lambda: None)  # wake it
        deadline = time.monotonic() + 3
        with pytest.raises(TransferDead):
            while time.monotonic() < deadline:
                p.rx.poll()
                time.sleep(0.01)


def test_a_request_that_raises_in_the_engine_ends_alone(tmp_path) -> None:
    """The schedule thread (the engine loop) answers a request whose add_request raised
    with its error, and goes on; on the code before, the loop (and the engine) ended."""
    from pdserve import protocol as P
    from pdserve.sampling_params import SamplingParams
    from pdserve.scheduler.engine_proc import EngineLoop

    class Raising:
        publish = None

        def add_request(self, req: object) -> None:
            raise KeyError("injected")

    ctx = zmq.Context()
    to_engine, from_engine = P.ipc_paths(str(tmp_path))
    pull = ctx.socket(zmq.PULL)
    pull.bind(from_engine)
    ctx.socket(zmq.PUSH).bind(to_engine)
    try:
        loop = EngineLoop(Raising(), ctx, str(tmp_path))  # type: ignore[arg-type]
        req = P.EngineRequest(rid="r1", input_ids=[1], params=SamplingParams(max_tokens=1))
        loop._handle(P.GenerateReq(req=req))
        assert pull.poll(2000)
        msg = P.from_engine_decoder.decode(pull.recv())
        assert isinstance(msg, P.Events)
        [ev] = msg.events
        assert ev.rid == "r1" and ev.finished and "injected" in (ev.error or "")
    finally:
        ctx.destroy(linger=0)
