"""Injected faults on the wire: every request ends exactly once, as a failure, leaving no state."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.base import KVTicket
from pdserve.transfer.faults import Fault, FaultInjector, kill_peer
from pdserve.transfer.loopback import (
    Side,
    gather,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
    wait_until,
)
from pdserve.transfer.messages import Abort, Ack, Ready
from pdserve.transfer.receiving import data
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)
N, CHUNK = 30, 10  # three pieces, each a K chunk and a V chunk: indices 0-5
HB_TIMEOUT = 0.6
PREFILL_SEED, DECODE_SEED = 1, 2  # each side's random pool and page order


class Wire:
    """One test's transfer ends on LAYOUT, each closed after the test (`wire`)."""

    def __init__(self) -> None:
        self.ends: list[KVSender | KVReceiver] = []

    def sender(self, hook: FaultInjector | None = None, **settings: Any) -> KVSender:
        tx = KVSender(LAYOUT, transfer_settings(**settings), fault_hook=hook)
        self.ends.append(tx)
        return tx

    def receiver(self, **settings: Any) -> KVReceiver:
        rx = KVReceiver(LAYOUT, transfer_settings(**settings))
        self.ends.append(rx)
        return rx

    def close(self) -> None:
        for end in self.ends:
            end.close()


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire()
    try:
        yield w
    finally:
        w.close()


def side(seed: int) -> Side:
    """A random pool and the request's N tokens of pages in it, shuffled by `seed`."""
    pool = random_pool(LAYOUT, 64, seed)
    return Side(pool, *reserve(pool, N, seed))


def ticket(rid: str, room: int, tx: KVSender) -> KVTicket:
    """A request of N prompt tokens bound for `tx` (each side takes its own copy)."""
    return make_req(rid, room, N, tx.bootstrap_port)


def assert_same_kv(pre: Side, dec: Side) -> None:
    for k_or_v in (0, 1):
        assert torch.equal(gather(pre.pool, pre.slots)[k_or_v], gather(dec.pool, dec.slots)[k_or_v])


def lose_sends(
    monkeypatch: pytest.MonkeyPatch, rx: KVReceiver, lose: Callable[[object, list[object]], bool]
) -> list[object]:
    """The decode's control messages for which lose(msg, lost so far) holds vanish on
    the way to the prefill; returns the list of those lost."""
    lost: list[object] = []
    send = rx._ctl.send

    def lossy(endpoint: str, msg: object) -> bool:
        if lose(msg, lost):
            lost.append(msg)
            return True
        return send(endpoint, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(rx._ctl, "send", lossy)
    return lost


def run_transfer(wire: Wire, faults: list[Fault], kv_timeout_s: float = 3.0):
    """One transfer through a faulty sender; returns (decode events, prefill events, elapsed, sides)."""
    inj = FaultInjector(faults, seed=1)
    tx = wire.sender(inj, kv_timeout_s=3, heartbeat_interval_s=0.1)
    rx = wire.receiver(kv_timeout_s=kv_timeout_s, heartbeat_timeout_s=HB_TIMEOUT)
    pre, dec = side(PREFILL_SEED), side(DECODE_SEED)
    t0 = time.monotonic()
    rx.expect(ticket("f", 3, tx), dec.pool, dec.slots)
    push_prompt(tx, ticket("f", 3, tx), pre, chunk=CHUNK)
    dec_events = wait_for(rx.poll, 1, 8)
    elapsed = time.monotonic() - t0
    pre_events = wait_for(tx.poll, 1, 8)
    time.sleep(0.3)  # anything after the terminal event would show up now
    dec_events += rx.poll()
    pre_events += tx.poll()
    assert wait_until(lambda: not (tx.active_rooms() or rx.active_rooms()), 2)
    assert inj.fired, "the fault never fired"
    return dec_events, pre_events, elapsed, (pre, dec)


@pytest.mark.parametrize(
    "fault, reason",
    [
        (Fault("drop", "KVChunk", prob=1.0), "never arrived"),  # pushed again, lost again
        (Fault("duplicate", "KVChunk", nth=0), "duplicate chunk"),
        (Fault("truncate", "KVChunk", nth=1), "byte count"),
        (Fault("corrupt", "KVChunk", nth=2), "checksum mismatch"),
        (Fault("delay", "KVChunk", nth=0, delay_s=2.0), "silent"),  # no heartbeats meanwhile
    ],
    ids=lambda v: v.action + "-" + v.kind if isinstance(v, Fault) else None,
)
def test_fault_fails_closed_once(wire: Wire, fault: Fault, reason: str) -> None:
    dec_events, pre_events, elapsed, _ = run_transfer(wire, [fault], kv_timeout_s=2.0)
    assert len(dec_events) == 1 and len(pre_events) == 1
    assert not dec_events[0].ok and reason in dec_events[0].reason
    assert not pre_events[0].ok
    assert elapsed < 2.0 + 2.0  # the 2 s timeout, not a later one (slack: a loaded machine)


@pytest.mark.parametrize(
    "fault",
    [Fault("drop", "KVChunk", nth=1), Fault("reorder", "KVChunk", nth=5)],  # (KVDone overtakes it)
    ids=["drop", "reorder"],
)
def test_lost_kv_is_pushed_again(wire: Wire, fault: Fault) -> None:
    """A KVDone whose KV did not all arrive (a chunk lost, or still on its way) asks the
    prefill for all of it again, under a new session: the transfer ends well, with the
    prefill's KV (a chunk of the old session that comes late is refused as stale)."""
    dec_events, pre_events, elapsed, (pre, dec) = run_transfer(wire, [fault], kv_timeout_s=30.0)
    assert [e.ok for e in dec_events] == [True] and [e.ok for e in pre_events] == [True]
    assert_same_kv(pre, dec)
    assert elapsed < 2.0


def test_prefill_pushes_a_room_at_most_max_pushes_times(monkeypatch, wire: Wire) -> None:
    """A decode that keeps asking for the KV again (here: one allowed 10 pushes, every
    chunk lost) gets the room failed by the prefill after MAX_PUSHES (3)."""
    monkeypatch.setattr(data, "MAX_PUSHES", 10)
    dec_events, pre_events, _, _ = run_transfer(wire, [Fault("drop", "KVChunk", prob=1.0)], 30.0)
    assert len(dec_events) == 1 and len(pre_events) == 1
    assert not dec_events[0].ok and "asked for the KV more than 3 times" in dec_events[0].reason
    assert not pre_events[0].ok


@pytest.mark.parametrize("action", ["drop", "corrupt"])
def test_lost_kv_done_is_sent_again(wire: Wire, action: str) -> None:
    """A KVDone that never arrives (or arrives too mangled to decode) is sent again while
    unanswered: the transfer ends once, well before its 30 s timeout; intact KV is
    accepted (a mangled header that still decodes is refused by its digest instead)."""
    dec_events, pre_events, elapsed, (pre, dec) = run_transfer(
        wire, [Fault(action, "KVDone", nth=0)], kv_timeout_s=30.0
    )
    assert len(dec_events) == 1 and len(pre_events) == 1
    assert dec_events[0].ok == pre_events[0].ok
    assert dec_events[0].ok or "KVDone refused" in dec_events[0].reason
    if action == "drop":
        assert dec_events[0].ok
        assert_same_kv(pre, dec)
    assert elapsed < 2.0


@pytest.mark.parametrize("answer", ["ack", "abort"])
def test_lost_answer_to_kv_done_is_given_again(monkeypatch, wire: Wire, answer: str) -> None:
    """The decode's Ack (or its Abort of a refused KVDone) lost on the way back: the
    prefill's repeated KVDone gets the same answer again, so the prefill frees the
    room at once instead of after kv_timeout_s (30 s)."""
    faults = [Fault("drop", "KVChunk", prob=1.0)] if answer == "abort" else []
    tx = wire.sender(FaultInjector(faults, seed=1), kv_timeout_s=30, heartbeat_interval_s=0.1)
    rx = wire.receiver(kv_timeout_s=30)
    lost = lose_sends(monkeypatch, rx, lambda msg, lost: isinstance(msg, Ack | Abort) and not lost)
    pre, dec = side(PREFILL_SEED), side(DECODE_SEED)
    rx.expect(ticket("a", 5, tx), dec.pool, dec.slots)
    push_prompt(tx, ticket("a", 5, tx), pre, chunk=CHUNK)
    [dev] = wait_for(rx.poll, 1, 8)
    assert dev.ok == (answer == "ack")
    t0 = time.monotonic()
    [pev] = wait_for(tx.poll, 1, 8)
    assert pev.ok == dev.ok and len(lost) == 1
    assert time.monotonic() - t0 < 5.0
    assert rx.stats()["repeated_done"] >= 1
    assert wait_until(lambda: not (tx.active_rooms() or rx.active_rooms()), 2)


@pytest.mark.parametrize("lost", ["Ready", "Claim"])
def test_lost_ready_or_claim_is_sent_again(monkeypatch, wire: Wire, lost: str) -> None:
    """The decode's Ready or the prefill's Claim lost on the way: the decode repeats its
    Ready while unclaimed, the prefill answers with the Claim again, and the transfer
    ends well. (Without it: the decode gives up after kv_bootstrap_timeout_s, 1 s here,
    which the prefill's request outlasts before its first chunk.)"""
    faults = [Fault("drop", "Claim", nth=0)] if lost == "Claim" else []
    tx = wire.sender(FaultInjector(faults), heartbeat_interval_s=0.1)
    rx = wire.receiver(heartbeat_interval_s=0.1, kv_bootstrap_timeout_s=1)
    dropped = lose_sends(
        monkeypatch, rx, lambda msg, gone: lost == "Ready" and isinstance(msg, Ready) and not gone
    )
    pre, dec = side(PREFILL_SEED), side(DECODE_SEED)
    req = ticket("c", 6, tx)
    tx.on_queue(req)  # the prefill has the request (it claims once it has the Ready)
    rx.expect(ticket("c", 6, tx), dec.pool, dec.slots)
    time.sleep(1.5)  # queued past the decode's bootstrap timeout, no chunk yet
    assert rx.poll() == [] and rx.active_rooms() == {6}
    push_prompt(tx, req, pre, chunk=CHUNK)
    [dev] = wait_for(rx.poll, 1, 8)
    [pev] = wait_for(tx.poll, 1, 8)
    assert dev.ok and pev.ok, (dev, pev)
    assert lost == "Claim" or dropped


def test_repeated_ready_of_a_room_the_prefill_lacks_opens_nothing(monkeypatch, wire: Wire) -> None:
    """A repeated Ready for a room the prefill has no trace of (it ended there, or its
    Announce and first Ready were both lost) is refused at once: it must not open a room
    that waits `kv_ready_timeout_s` for a request that is gone."""
    tx = wire.sender(heartbeat_interval_s=0.1)
    rx = wire.receiver(heartbeat_interval_s=0.1, kv_bootstrap_timeout_s=30)
    firsts = lose_sends(monkeypatch, rx, lambda msg, _: isinstance(msg, Ready) and not msg.again_of)
    dec = side(DECODE_SEED)
    rx.expect(ticket("g", 7, tx), dec.pool, dec.slots)
    [ev] = wait_for(rx.poll, 1, 5)
    assert not ev.ok and "prefill has no such room" in ev.reason and firsts
    assert tx.active_rooms() == set() and rx.active_rooms() == set()


def test_reordered_chunks_are_harmless(wire: Wire) -> None:
    """Chunks 0 and 1 swapped: the KV is still complete and intact, so it is accepted."""
    dec_events, pre_events, _, (pre, dec) = run_transfer(wire, [Fault("reorder", "KVChunk", nth=0)])
    assert [e.ok for e in dec_events] == [True] and [e.ok for e in pre_events] == [True]
    assert_same_kv(pre, dec)


def test_dead_prefill_fails_within_heartbeat_bound(wire: Wire) -> None:
    tx = wire.sender(heartbeat_interval_s=0.1)
    rx = wire.receiver(kv_timeout_s=30, heartbeat_timeout_s=HB_TIMEOUT)
    pre, dec = side(PREFILL_SEED), side(DECODE_SEED)
    req_p = ticket("k", 4, tx)
    rx.expect(ticket("k", 4, tx), dec.pool, dec.slots)
    tx.on_admit(req_p)
    tx.on_chunk(req_p, pre.pool, pre.slots, 0, CHUNK)  # mid-transfer ...
    time.sleep(0.5)  # ... heartbeats flowing: still alive
    assert rx.poll() == [] and rx.active_rooms() == {4}
    kill_peer(tx)
    t0 = time.monotonic()
    [ev] = wait_for(rx.poll, 1, 5)
    assert not ev.ok and "silent" in ev.reason
    assert time.monotonic() - t0 < HB_TIMEOUT + 2.0  # not kv_timeout_s (30)
    assert rx.active_rooms() == set()


@pytest.mark.parametrize("ready_first", [True, False])
def test_prefill_abort_reaches_decode(wire: Wire, ready_first: bool) -> None:
    tx = wire.sender(heartbeat_interval_s=0.1)
    rx = wire.receiver(kv_timeout_s=30, heartbeat_timeout_s=5)
    dec = side(DECODE_SEED)
    req_p, req_d = ticket("ab", 8, tx), ticket("ab", 8, tx)
    if ready_first:
        rx.expect(req_d, dec.pool, dec.slots)
        assert wait_until(lambda: tx.room_phases() == {8: "wait_admit"}, 2)
    tx.on_admit(req_p)
    tx.on_abort(req_p, "prompt too long")
    [sev] = wait_for(tx.poll, 1, 3)
    assert not sev.ok and "prompt too long" in sev.reason
    if not ready_first:  # the decode's Ready comes after the prefill gave up
        rx.expect(req_d, dec.pool, dec.slots)
    [ev] = wait_for(rx.poll, 1, 3)
    assert not ev.ok and "prompt too long" in ev.reason
    assert wait_until(lambda: not (tx.active_rooms() or rx.active_rooms()), 2)


def test_prefill_without_ready_times_out(wire: Wire) -> None:
    tx = wire.sender(kv_ready_timeout_s=0.3, heartbeat_interval_s=0.1)
    push_prompt(tx, ticket("nr", 9, tx), side(PREFILL_SEED), CHUNK)
    [sev] = wait_for(tx.poll, 1, 3)
    assert not sev.ok and "no Ready" in sev.reason
    assert tx.active_rooms() == set()
