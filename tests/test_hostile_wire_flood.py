"""Floods of the prefill's bootstrap port: what one peer can make the prefill keep is
bounded (rooms per peer, refusal text, header fields), and the pair still serves after.

On the code before these bounds, each Ready for an unknown room with a 60 KiB layout
string became a room, then a refusal keeping that text for ready_timeout_s (about 90 MiB
for 1,500 of them), and a peer could open rooms without limit.
"""

from __future__ import annotations

import time

import pytest
import zmq
from hostile_wire import LAYOUT, N, pair, raw, rss_mib, send, serves

from pdserve.transfer.loopback import transfer_settings, wait_until
from pdserve.transfer.messages import Abort, Decoder, Ready
from pdserve.transfer.sending.sender import KVSender

pytestmark = pytest.mark.timeout(120)

FLOOD = 1500
LONG_TEXT = "L" * (60 * 1024)  # under the 64 KiB header limit: parsed, not dropped unread
RSS_BOUND_MIB = 30  # what the flood may add to this process (both sides live in it)


def _ready(room: int, layout: str = LAYOUT.fingerprint(), session: int = 7) -> Ready:
    return Ready(room=room, session=session, data_endpoint="tcp://127.0.0.1:9",
                 layout=layout, num_tokens=N, decode_id="flood")  # fmt: skip


def test_ready_flood_with_long_layout_strings_keeps_nothing() -> None:
    with pair() as p:
        dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{p.tx.bootstrap_port}")
        try:
            before = rss_mib()
            for i in range(FLOOD):
                send(dealer, _ready(1000 + i, layout=LONG_TEXT))
            handled = wait_until(lambda: p.tx.stats().get("malformed", 0) >= FLOOD, 10)
            grown = rss_mib() - before
            assert grown < RSS_BOUND_MIB, f"RSS grew {grown:.0f} MiB"
            assert handled, p.tx.stats()
            assert not p.tx.active_rooms()
        finally:
            dealer.close()
        serves(p)


def test_one_peer_opens_at_most_its_share_of_rooms() -> None:
    cap = 100
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), max_rooms_per_peer=cap)
    dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{tx.bootstrap_port}")
    try:
        for i in range(3 * cap):
            send(dealer, _ready(2000 + i))
        refused = _count_aborts(dealer, 2 * cap)
        assert refused == 2 * cap, refused
        assert len(tx.active_rooms()) == cap
        assert tx.stats()["refused_rooms"] == 2 * cap
    finally:
        dealer.close()
        tx.close()


def test_announce_flood_is_capped_and_rooms_end_with_their_peer() -> None:
    from pdserve.transfer.messages import Announce

    cap = 50
    tx = KVSender(
        LAYOUT,
        transfer_settings(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5),
        max_rooms_per_peer=cap,
    )
    dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{tx.bootstrap_port}")
    try:
        for i in range(4 * cap):
            send(dealer, Announce(room=3000 + i, decode_id="flood"))
        assert wait_until(lambda: tx.stats()["refused_rooms"] == 3 * cap, 5), tx.stats()
        assert len(tx.active_rooms()) == cap
        # the peer never heartbeats: its rooms go with its silence, not at ready_timeout_s
        assert wait_until(lambda: not tx.active_rooms(), 3.0)
    finally:
        dealer.close()
        tx.close()


def _count_aborts(dealer: zmq.Socket, n: int, timeout_s: float = 5.0) -> int:
    dec, seen = Decoder(), 0
    end = time.monotonic() + timeout_s
    while seen < n and time.monotonic() < end:
        if dealer.poll(100):
            msg = dec.decode(dealer.recv())
            seen += isinstance(msg, Abort) and "too many rooms" in msg.reason
    return seen


def test_refusals_are_bounded_in_number_and_text() -> None:
    from pdserve.transfer.sending.peers import Refusals

    r = Refusals(ttl_s=300, max_rooms=10)
    for room in range(1, 30):
        r.add(room, "x" * 100_000)
    assert r.get(1) is None and r.get(29) is not None
    assert len(r.get(29) or "") < 300
