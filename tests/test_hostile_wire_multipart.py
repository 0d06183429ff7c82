"""Long multipart messages at the transfer's ports.

libzmq holds a multipart message until its last frame has come, and bounds neither its
frame count nor its total size (ZMQ_MAXMSGSIZE is per frame; the high-water marks count
whole messages): an unfinished message whose frames keep coming is buffered unseen, with
poll() reporting nothing. With CURVE (ZAP), a peer without the cluster secret never gets
past the handshake, so its frames are never read; without it, peer_guard.py hangs up on a
connection holding more than one whole message of its socket unread (docs/security.md,
ZeroMQ ports). A complete message with more frames or bytes than the protocol
ever sends is dropped unread, counted, and logged.

The attacker runs in its own process: its own send queue must not count in our RSS.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
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
    transfer_settings,
    wait_for,
    wait_until,
)
from pdserve.transfer.messages import Decoder, Heartbeat, encode
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.receiving.data import data_limits
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.peers import DataSockets
from pdserve.transfer.sending.sender import KVSender
from pdserve.transfer.zmq_io import CONTROL_LIMITS, CurveKeys

pytestmark = pytest.mark.timeout(120)

PARTS, PART_BYTES = 150, 1 << 20  # the finding: 150 "more" frames of 1 MiB
RSS_BOUND_MIB = 20

# A raw ZMTP 3.0 peer (NULL mechanism) of socket type argv[4]: libzmq itself would queue an
# unfinished message in the sender and put nothing on the wire before its last frame.
# argv[5] "listen": it is the server (a fake prefill a request names), and takes one peer.
# Prints "sent N" once it has sent N frames, or "dropped N" where it was hung up on.
ATTACKER = """
import socket, struct, sys, time
host, port = sys.argv[1].replace("tcp://", "").rsplit(":", 1)
if sys.argv[5] == "listen":
    srv = socket.create_server((host, int(port)))
    print("listening", flush=True)
    srv.settimeout(10)
    s = srv.accept()[0]
else:
    s = socket.create_connection((host, int(port)), timeout=10)
s.settimeout(10)  # never blocks without end: a send the peer does not take fails
s.sendall(b"\\xff" + b"\\0" * 8 + b"\\x7f" + b"\\x03\\x00" + b"NULL".ljust(20, b"\\0") + b"\\0" * 32)
kind = sys.argv[4].encode()
body = b"\\x05READY" + b"\\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind
s.sendall(bytes([0x04, len(body)]) + body)
s.settimeout(2)
got = b""  # the server's greeting and READY: a frame sent before it fails the handshake
try:
    while len(got) < 66 or len(got) < 66 + got[65]:
        more = s.recv(4096)
        if not more:
            break
        got += more
except OSError:
    pass  # refused (CURVE): sent anyway, into a connection the server is closing
s.settimeout(10)
part, n = b"x" * int(sys.argv[3]), 0
try:
    for n in range(int(sys.argv[2])):
        s.sendall(bytes([0x03]) + struct.pack(">Q", len(part)) + part)  # MORE | LONG
    print("sent", n + 1, flush=True)
except OSError:
    print("dropped", n, flush=True)  # hung up on (or refused at the handshake)
time.sleep(30)
"""


def _attack(
    endpoint: str, parts: int = PARTS, kind: str = "PUSH", mode: str = "connect"
) -> subprocess.Popen:
    argv = [sys.executable, "-c", ATTACKER, endpoint, str(parts), str(PART_BYTES), kind, mode]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_endless_multipart_from_a_peer_without_the_cluster_key_holds_nothing() -> None:
    keys = CurveKeys.generate()
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), curve=keys)
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=10, heartbeat_timeout_s=1.0), curve=keys)
    before = rss_mib()
    attacker = _attack(f"tcp://127.0.0.1:{rx.data_port}")
    try:
        assert attacker.stdout is not None  # sent, or refused at the handshake: no matter
        assert attacker.stdout.readline().split()[0] in ("sent", "dropped")
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
        KVReceiver(LAYOUT, transfer_settings(transfer_host="0.0.0.0")).close()
        assert warned()
        caplog.clear()
        KVReceiver(
            LAYOUT, transfer_settings(transfer_host="0.0.0.0"), curve=CurveKeys.generate()
        ).close()
        KVReceiver(LAYOUT, transfer_settings()).close()  # loopback
        assert not warned()


# Without CURVE, peer_guard.py hangs up on a connection holding more than one whole
# message of its socket unread. Between two of its checks (the I/O thread's tick, 50 ms)
# a peer on loopback adds what it sends meanwhile: the bound below is the socket's
# whole-message limit plus that (here about 1 GiB/s).
ENDLESS = 1024  # frames of 1 MiB: without the guard, all of it is held (1 GiB)
SLACK_MIB = 96


def _held_and_dropped(attacker: subprocess.Popen, limit_bytes: int) -> None:
    """While `attacker` sends, RSS never grows past the bound; it was hung up on."""
    before, peak = rss_mib(), 0.0
    assert attacker.stdout is not None
    line: list[str] = []

    def read() -> None:
        line.extend(attacker.stdout.readline().split())  # type: ignore[union-attr]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    end = time.monotonic() + 60
    while reader.is_alive() and time.monotonic() < end:
        peak = max(peak, rss_mib() - before)
        time.sleep(0.005)
    bound = limit_bytes / 2**20 + SLACK_MIB
    assert line and line[0] == "dropped", f"the intruder was not hung up on: {line}"
    assert peak < bound, f"RSS grew {peak:.0f} MiB while it sent (bound {bound:.0f} MiB)"


def _stop(attacker: subprocess.Popen) -> None:
    attacker.kill()
    attacker.wait(5)


def test_endless_multipart_at_the_bootstrap_port_is_hung_up_on() -> None:
    with pair() as p:
        attacker = _attack(f"tcp://127.0.0.1:{p.tx.bootstrap_port}", ENDLESS, "DEALER")
        try:
            _held_and_dropped(attacker, CONTROL_LIMITS[1])
        finally:
            _stop(attacker)
        assert wait_until(lambda: p.tx.stats().get("unfinished") == 1, 3), p.tx.stats()
        serves(p)


def test_endless_multipart_at_the_data_port_is_hung_up_on() -> None:
    with pair() as p:
        attacker = _attack(f"tcp://127.0.0.1:{p.rx.data_port}", ENDLESS, "PUSH")
        try:
            _held_and_dropped(attacker, data_limits(LAYOUT)[1])
        finally:
            _stop(attacker)
        assert wait_until(lambda: p.rx.stats().get("unfinished") == 1, 3), p.rx.stats()
        serves(p)


def test_endless_multipart_from_a_prefill_a_request_names_is_hung_up_on() -> None:
    """The decode connects where a request says: a fake prefill there answers with one
    message that never ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pair() as p:
        attacker = _attack(f"tcp://127.0.0.1:{port}", ENDLESS, "ROUTER", "listen")
        try:
            assert attacker.stdout is not None and attacker.stdout.readline().strip() == "listening"
            p.rx.announce(make_req("fake", 77, N, port))
            _held_and_dropped(attacker, CONTROL_LIMITS[1])
        finally:
            _stop(attacker)
        assert wait_until(lambda: p.rx.stats().get("unfinished", 0) >= 1, 3), p.rx.stats()
        serves(p)


def test_endless_multipart_from_a_decode_a_ready_names_is_hung_up_on() -> None:
    """The prefill pushes KV to where a decode's Ready says; a fake decode there sends
    frames to the PUSH, which is sent nothing. The guard's checks run as the I/O
    thread's tick would."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    attacker = _attack(f"tcp://127.0.0.1:{port}", ENDLESS, "PULL", "listen")
    guard = PeerGuard({})
    data = DataSockets(Decoder(), None, None)
    data.guard = guard
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.05):
            guard.check()

    ticker = threading.Thread(target=tick, daemon=True)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "listening"
        data.get(f"tcp://127.0.0.1:{port}")
        ticker.start()
        _held_and_dropped(attacker, 0)
        assert wait_until(lambda: guard.dropped["unfinished"] >= 1, 3), guard.dropped
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join(5)
        _stop(attacker)
        data.close()
