"""Long multipart messages at the transfer's ports.

libzmq holds a multipart message until its last frame has come, and bounds neither its
frame count nor its total size (ZMQ_MAXMSGSIZE is per frame; the high-water marks count
whole messages): an unfinished message whose frames keep coming is buffered unseen, with
poll() reporting nothing. What bounds it is who may connect: with CURVE (ZAP), a peer
without the cluster secret never gets past the handshake, so its frames are never read
(docs/security.md, ZeroMQ ports). A complete message with more frames or bytes than the protocol
ever sends is dropped unread, counted, and logged.

The attacker runs in its own process: its own send queue must not count in our RSS.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import zmq
from hostile_wire import LAYOUT, N, pair, raw, rss_mib, serves

from pdserve.transfer.loopback import (
    Side,
    gather,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    wait_for,
    wait_until,
)
from pdserve.transfer.messages import Heartbeat, encode
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender
from pdserve.transfer.zmq_io import CurveKeys

pytestmark = pytest.mark.timeout(120)

PARTS, PART_BYTES = 150, 1 << 20  # the finding: 150 "more" frames of 1 MiB
RSS_BOUND_MIB = 20

# A raw ZMTP 3.0 peer (NULL mechanism, a PUSH): libzmq itself would queue an unfinished
# message in the sender and put nothing on the wire before its last frame.
ATTACKER = """
import socket, struct, sys, time
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host.replace("tcp://", ""), int(port)))
s.sendall(b"\\xff" + b"\\0" * 8 + b"\\x7f" + b"\\x03\\x00" + b"NULL".ljust(20, b"\\0") + b"\\0" * 32)
prop = b"\\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
body = b"\\x05READY" + prop
s.sendall(bytes([0x04, len(body)]) + body)
s.settimeout(2)
try:
    s.recv(64 + 64)  # the server's greeting (and READY, or its ERROR)
except OSError:
    pass
part = b"x" * int(sys.argv[3])
try:
    for _ in range(int(sys.argv[2])):
        s.sendall(bytes([0x03]) + struct.pack(">Q", len(part)) + part)  # MORE | LONG
except OSError:
    pass  # refused: the handshake failed and the server hung up
print("sent", flush=True)
time.sleep(30)
"""


def _attack(endpoint: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", ATTACKER, endpoint, str(PARTS), str(PART_BYTES)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_endless_multipart_from_a_peer_without_the_cluster_key_holds_nothing() -> None:
    keys = CurveKeys.generate()
    tx = KVSender("127.0.0.1", 0, LAYOUT, heartbeat_s=0.1, curve=keys)
    rx = KVReceiver(LAYOUT, kv_timeout_s=10, heartbeat_timeout_s=1.0, curve=keys)
    before = rss_mib()
    attacker = _attack(f"tcp://127.0.0.1:{rx.data_port}")
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "sent"
        time.sleep(1.0)  # whatever libzmq would read of it, it has read by now
        grown = rss_mib() - before
        assert grown < RSS_BOUND_MIB, f"RSS grew {grown:.0f} MiB"
        pp, dp = random_pool(LAYOUT, 64, 1), random_pool(LAYOUT, 64, 2)
        pre, dec = Side(pp, *reserve(pp, N, 1)), Side(dp, *reserve(dp, N, 2))
        req = make_req("curve", 3, N, tx.bootstrap_port)
        rx.expect(req, dec.pool, dec.slots)
        push_prompt(tx, req, pre, chunk=8)
        [ev] = wait_for(rx.poll, 1, 10)
        assert ev.ok, ev.reason
        assert gather(pre.pool, pre.slots)[0].equal(gather(dec.pool, dec.slots)[0])
    finally:
        attacker.kill()
        attacker.wait(5)
        tx.close()
        rx.close()


def test_a_message_with_more_frames_than_the_protocol_sends_is_dropped() -> None:
    with pair() as p:
        dealer = raw(zmq.DEALER, f"tcp://127.0.0.1:{p.tx.bootstrap_port}")
        try:
            hb = encode(Heartbeat(sender="x", seq=1))
            dealer.send_multipart([hb, *[b"y" * 100] * 1000])
            assert wait_until(lambda: p.tx.stats()["oversized"] >= 1, 3), p.tx.stats()
        finally:
            dealer.close()
        serves(p)


def test_a_socket_bound_beyond_loopback_without_curve_warns(caplog) -> None:  # type: ignore[no-untyped-def]
    def warned() -> bool:
        return any("without CURVE" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="pdserve.transfer.zmq_io"):
        KVReceiver(LAYOUT, host="0.0.0.0").close()
        assert warned()
        caplog.clear()
        KVReceiver(LAYOUT, host="0.0.0.0", curve=CurveKeys.generate()).close()
        KVReceiver(LAYOUT).close()  # loopback
        assert not warned()
