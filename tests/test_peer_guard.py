"""peer_guard.PeerGuard on its own: the socket and its checks driven by the test thread.

A raw ZMTP peer here lives in the test process (no RSS is measured here: the hostile
tests in test_hostile_wire_multipart.py do that from a process of its own)."""

from __future__ import annotations

import socket
import struct
import time

import zmq

from pdserve.transfer.messages import Decoder
from pdserve.transfer.peer_guard import PeerGuard, wire_bytes
from pdserve.transfer.zmq_io import MsgSocket, make_socket


def _pull() -> tuple[MsgSocket, PeerGuard, int]:
    guard = PeerGuard({})
    raw = make_socket(zmq.PULL)
    sock = MsgSocket(raw, Decoder(), guard=guard)
    return sock, guard, raw.bind_to_random_port("tcp://127.0.0.1")


def _push(port: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _intruder(port: int) -> socket.socket:
    """A raw ZMTP 3.0 PUSH (NULL) that has sent 4 MiB of one unfinished message."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    s.sendall(bytes([0x04, len(body)]) + body)
    got = b""  # the server's greeting and READY: a frame sent before it fails the handshake
    while len(got) < 66 or len(got) < 66 + got[65]:
        got += s.recv(4096)
    part = b"x" * (1 << 20)
    for _ in range(4):
        s.sendall(b"\x03" + struct.pack(">Q", len(part)) + part)
    return s


def _hung_up(s: socket.socket) -> bool:
    try:
        for _ in range(64):
            s.sendall(b"\x03" + struct.pack(">Q", 1 << 20) + b"x" * (1 << 20))
    except OSError:
        return True
    return False


def _settle(guard: PeerGuard, s: float = 0.3) -> None:
    """Let libzmq read what was sent and the monitor report the connections."""
    time.sleep(s)
    guard.check()


def test_complete_messages_waiting_for_the_application_are_never_cut() -> None:
    """A stalled I/O thread: 2 MiB of whole messages (32 x the limit) wait unread."""
    sock, guard, port = _pull()
    peer = _push(port)
    try:
        for _ in range(2048):
            peer.send(b"y" * 1024)
        for _ in range(3):
            _settle(guard)  # none received: nothing can be judged
        assert guard.dropped["unfinished"] == 0
        for _ in range(2048):
            assert sock.sock.poll(1000)
            sock.recv(block=False)
        _settle(guard)
        assert guard.dropped["unfinished"] == 0
        peer.send(b"z")  # the connection still works
        assert sock.sock.poll(1000)
    finally:
        peer.close()
        sock.close()


def test_an_unfinished_message_is_cut_beside_a_busy_peer() -> None:
    """One peer keeps the socket readable with whole messages; the one with an
    unfinished message is hung up once the application has received from the socket."""
    sock, guard, port = _pull()
    peer = _push(port)
    intruder = _intruder(port)
    try:
        for _ in range(64):
            peer.send(b"y" * 1024)
        _settle(guard)  # the socket is readable and nothing was received: no verdict
        assert guard.dropped["unfinished"] == 0
        for _ in range(8):  # the application receives (the legitimate peer's messages)
            sock.recv(block=False)
        guard.check()
        assert guard.dropped["unfinished"] == 1
        assert _hung_up(intruder)
        for _ in range(56):
            assert sock.sock.poll(1000)
            sock.recv(block=False)
        _settle(guard)
        assert guard.dropped["unfinished"] == 1  # the legitimate peer stays
    finally:
        intruder.close()
        peer.close()
        sock.close()


def test_wire_bytes_counts_zmtp_frame_headers() -> None:
    frames = [zmq.Frame(b"a" * 255), zmq.Frame(b"b" * 256)]
    assert wire_bytes(frames) == 255 + 2 + 256 + 9
