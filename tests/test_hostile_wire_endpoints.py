"""Hostile endpoints: what a client or a peer names as an address is checked before
anything connects to it, and the sockets opened for them stay bounded.

Each attack is followed by a real transfer through the same pair (`serves`). On the code
before these checks, the bad host killed the receiver's I/O thread (its heartbeat's
connect raised in an unguarded tick), 1,100 distinct prefills exhausted libzmq's socket
limit, and a Ready naming a non-TCP data endpoint was kept as a room.
"""

from __future__ import annotations

import time

import pytest
import zmq
from hostile_wire import LAYOUT, N, pair, raw, send, serves

from pdserve.transfer.base import KVTicket
from pdserve.transfer.loopback import random_pool, reserve, transfer_settings, wait_for, wait_until
from pdserve.transfer.messages import Abort, Decoder, Ready

pytestmark = pytest.mark.timeout(120)

BAD = [
    ("x y", 5000, "bootstrap_host"),
    ("*", 5000, "bootstrap_host"),
    ("ipc:///tmp/pdserve-x", 5000, "bootstrap_host"),
    ("1.2.3.4:5", 5000, "bootstrap_host"),
    ("-dash.example", 5000, "bootstrap_host"),
    ("h" * 300, 5000, "bootstrap_host"),
    ("fe80::1%eth0", 5000, "bootstrap_host"),
    ("127.0.0.1", 0, "bootstrap_port"),
    ("127.0.0.1", 70000, "bootstrap_port"),
]


def test_bad_bootstrap_addresses_are_refused_by_name_and_the_receiver_goes_on() -> None:
    with pair() as p:
        pool = random_pool(LAYOUT, 64 * len(BAD), 3)
        for i, (host, port, field) in enumerate(BAD):
            _, slots = reserve(pool, N, i)
            req = KVTicket(f"bad-{i}", 100 + i, N, host, port)
            p.rx.reject(req, "refused")  # an Abort to that address: must not connect
            p.rx.expect(req, pool, slots)
            [ev] = wait_for(p.rx.poll, 1, 5)
            assert not ev.ok and field in ev.reason, (host, port, ev.reason)
        time.sleep(0.5)  # heartbeats and timers run over whatever was kept
        serves(p)


def test_thousands_of_distinct_prefills_keep_the_control_sockets_bounded() -> None:
    with pair() as p:
        for i in range(1100):  # more than libzmq's default socket limit (1023)
            p.rx.reject(KVTicket(f"r{i}", 1 + i, N, "127.0.0.1", 20000 + i), "gone")
        serves(p)
        stats = p.rx.stats()
        assert stats["control_sockets"] <= 256, stats


def test_control_sockets_no_room_needs_are_closed_when_idle() -> None:
    with pair() as p:
        p.rx._ctl.idle_s = 0.2
        for i in range(10):
            p.rx.reject(KVTicket(f"r{i}", 1 + i, N, "127.0.0.1", 20000 + i), "gone")
        assert wait_until(lambda: p.rx.stats()["control_sockets"] == 10, 2)
        assert wait_until(lambda: p.rx.stats()["control_sockets"] == 0, 3)
        assert not p.rx._ctl.last_seen
        serves(p)


def test_ready_naming_a_bad_data_endpoint_is_refused() -> None:
    with pair() as p:
        dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{p.tx.bootstrap_port}")
        try:
            bad = ["ipc:///tmp/pdserve-x", "tcp://x y:5", "tcp://*:5", "tcp://127.0.0.1:0",
                   "inproc://x", "tcp://127.0.0.1"]  # fmt: skip
            for i, endpoint in enumerate(bad):
                send(dealer, Ready(room=500 + i, session=7, data_endpoint=endpoint,
                                   layout=LAYOUT.fingerprint(), num_tokens=N, decode_id="x"))  # fmt: skip
            got = _aborts(dealer, len(bad))
            assert sorted(got) == [500 + i for i in range(len(bad))], got
            assert all("data_endpoint" in r or "tcp://" in r for r in got.values()), got
            assert not p.tx.active_rooms()
        finally:
            dealer.close()
        serves(p)


def _aborts(dealer: zmq.Socket, n: int, timeout_s: float = 3.0) -> dict[int, str]:
    dec, out = Decoder(), {}
    end = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < end:
        if dealer.poll(100):
            msg = dec.decode(dealer.recv())
            if isinstance(msg, Abort):
                out[msg.room] = msg.reason
    return out


def test_the_http_edge_names_the_bad_field() -> None:
    from pdserve.server.jobs import Bootstrap, RequestError

    for host, port, field in BAD:
        with pytest.raises(RequestError) as e:
            Bootstrap(host, port, 5).for_sample(0, 1)
        assert e.value.param == field and e.value.status == 400, e.value.message
    assert Bootstrap("prefill-0.svc", 8998, 5).for_sample(0, 1) == (5, "prefill-0.svc", 8998)
    assert Bootstrap("::1", 8998, 5).for_sample(0, 1) == (5, "::1", 8998)
    assert Bootstrap().for_sample(0, 1) == (0, None, None)


def test_decodes_coming_and_going_keep_the_prefills_data_sockets_bounded() -> None:
    """Each restarted decode has a new data endpoint: the prefill reuses a PUSH per
    endpoint, and past its cap closes the least recently used one no room needs."""
    from pdserve.transfer.receiving.receiver import KVReceiver

    with pair() as p:
        p.tx._data.max_sockets = 2
        for i in range(4):  # four decodes, one after another, each on its own port
            rx = KVReceiver(
                LAYOUT,
                transfer_settings(
                    kv_timeout_s=10, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0
                ),
            )
            try:
                serves(type(p)(p.tx, rx), room=7000 + i)
            finally:
                rx.close()
            assert len(p.tx._data) <= 2
        serves(p)


def test_an_announced_request_refused_at_expect_frees_its_room_on_both_sides() -> None:
    with pair() as p:
        pool = random_pool(LAYOUT, 64, 1)
        _, slots = reserve(pool, N, 1)
        req = KVTicket("short", 61, N, "127.0.0.1", p.tx.bootstrap_port)
        p.rx.announce(req)
        assert wait_until(lambda: 61 in p.tx.active_rooms(), 2)
        p.rx.expect(req, pool, slots[:-1])  # one slot short: refused before any Ready
        [ev] = wait_for(p.rx.poll, 1, 2)
        assert not ev.ok and "slots" in ev.reason
        assert wait_until(lambda: not p.tx.active_rooms(), 2)
        assert wait_until(lambda: not p.rx._ctl.announced, 2)
        serves(p)
