"""A bound on what one peer connection makes libzmq hold unread: the unfinished message.

libzmq keeps a multipart message until its last frame has come, and bounds neither its
frame count nor its size (ZMQ_MAXMSGSIZE is per frame; the high-water marks count whole
messages), with poll() reporting nothing meanwhile: a peer that keeps sending frames
marked "more" grows this process without end. The guard watches each connection of a
socket and hangs up one that holds more than one whole message's worth unread:

    held = bytes the kernel gave libzmq (tcpi_bytes_received - SIOCINQ)
         - bytes of the messages the application received from it (frames and headers)
         - what a connection costs anyway (greeting, handshake, libzmq's read batch)

    connection opened ──▶ counted ──(held > limit, nothing received from it since the
                                     last check, and it holds no complete message)──▶
        shutdown(): libzmq drops the connection and frees the partial message

Complete messages waiting for the application are not the peer's doing (a busy or
stalled I/O thread): a connection is judged only where none can be waiting from it,
that is where the socket has no complete message at all (ZMQ_EVENTS), or where the
application received at least one message per connection of the socket since the last
check and none from this one (libzmq serves its connections in turn). The socket's
monitor says which file descriptors are its connections (ACCEPTED / CONNECTED /
DISCONNECTED carry the fd), each received message where it came from (ZMQ_SRCFD).

The byte count is exact for the NULL mechanism only (CURVE adds a box to each frame):
with CURVE, only holders of the cluster secret get past the handshake, and the owners
run no guard. Linux only (TCP_INFO's tcpi_bytes_received); elsewhere it logs once and
watches nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

# greeting (64 bytes) and READY command (about 50) of a NULL handshake, and the up to
# 8 KiB libzmq reads ahead into its batch buffer (part of messages not yet complete)
CONNECTION_SLACK = 64 << 10
_FRAME_HEADER = 9  # a ZMTP 3 long frame: flags and 8 bytes of size (short: 2)
_OPENED = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
_EVENTS = _OPENED | zmq.EVENT_DISCONNECTED
WARN_EVERY_S = 60.0
_TCPI_BYTES_RECEIVED = 128  # offset of the u64 in struct tcp_info (Linux >= 4.1)


def wire_bytes(parts: Sequence[zmq.Frame]) -> int:
    """What `parts` took on the wire in ZMTP 3 with NULL (frame headers included)."""
    return sum(len(p) + (2 if len(p) <= 255 else _FRAME_HEADER) for p in parts)


@dataclass
class _Conn:
    ends: tuple[object, object]  # (sockname, peername): which connection the fd was
    delivered: int = 0  # wire bytes of the messages the application received from it
    recent: int = 0  # of which since the last check
    read: int = 0  # at the last check: bytes libzmq had read from it


class _Watched:
    """One socket's connections (I/O thread only)."""

    def __init__(self, sock: zmq.Socket, limits: tuple[int, int]) -> None:
        self.sock = sock
        self.mon = sock.get_monitor_socket(_EVENTS)
        self.limit = limits[1] + limits[0] * _FRAME_HEADER + CONNECTION_SLACK
        self.conns: dict[int, _Conn] = {}
        self.msgs = 0  # messages the application received since the last check
        # fd -> bytes received since the last check from an fd whose ACCEPTED / CONNECTED
        # is not applied yet (see `events`)
        self.unclaimed: dict[int, int] = {}

    def received(self, fd: int, n: int) -> None:
        self.msgs += 1
        c = self.conns.get(fd)
        if c is None:
            self.unclaimed[fd] = self.unclaimed.get(fd, 0) + n
        else:
            c.delivered += n
            c.recent += n

    def judged(self) -> bool:
        """Whether no connection can hold a complete message now (see the top)."""
        waiting = bool(int(self.sock.get(zmq.EVENTS)) & zmq.POLLIN)
        return not waiting or self.msgs >= len(self.conns)

    def events(self) -> None:
        """Apply the monitor's events, in order (a check's first step).

        NOTE: libzmq queues a connection's ACCEPTED before its first message, and a closed
        fd's DISCONNECTED before the number can be reused, and all of them were applied
        at the last check: what was received since from an fd with no entry, or from an
        fd that is DISCONNECTED now, may be the new connection's, so it starts with that
        counted (too much at worst: its first verdict comes later, never wrongly)."""
        while int(self.mon.get(zmq.EVENTS)) & zmq.POLLIN:
            ev = parse_monitor_message(self.mon.recv_multipart())
            fd = int(ev["value"])
            if ev["event"] & _OPENED:
                ends = _ends(fd)
                if ends is not None:
                    n = self.unclaimed.pop(fd, 0)
                    self.conns[fd] = _Conn(ends, delivered=n, recent=n)
            else:
                c = self.conns.pop(fd, None)
                if c is not None and c.recent:
                    self.unclaimed[fd] = self.unclaimed.get(fd, 0) + c.recent
        self.unclaimed.clear()  # of connections that came and went since the last check

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:  # the socket is closed already
            pass
        self.mon.close(linger=0)


class PeerGuard:
    """The guarded sockets of one I/O thread. `dropped`: counts the connections hung
    up (as "unfinished"; the owner's stats)."""

    def __init__(self, dropped: dict[str, int]) -> None:
        self.dropped = dropped
        dropped.setdefault("unfinished", 0)
        self._socks: dict[zmq.Socket, _Watched] = {}
        self._warned: dict[object, float] = {}  # peer host -> when its hang-up was logged

    def watch(self, sock: zmq.Socket, limits: tuple[int, int]) -> None:
        """Guard `sock`'s connections: `limits` (frames, bytes) of the largest whole
        message a peer may send it ((0, 0): it is sent nothing)."""
        if _SUPPORTED:
            self._socks[sock] = _Watched(sock, limits)

    def forget(self, sock: zmq.Socket) -> None:
        """Before `sock` is closed."""
        w = self._socks.pop(sock, None)
        if w is not None:
            w.close()

    def received(self, sock: zmq.Socket, parts: Sequence[zmq.Frame]) -> None:
        """The application received `parts` (one whole message, no routing id) from
        `sock`, with copy=False (a Frame knows the fd it came from)."""
        w = self._socks.get(sock)
        if w is not None and parts:
            w.received(parts[0].get(zmq.SRCFD), wire_bytes(parts))

    def check(self) -> None:
        """Hang up every connection holding more than its socket's limit unread (the
        owner's tick)."""
        for w in list(self._socks.values()):
            w.events()
            judged = w.judged()
            for fd, c in list(w.conns.items()):
                if self._over(w, fd, c) and judged:
                    self._hang_up(w, fd, c)
                c.recent = 0
            w.msgs = 0

    def close(self) -> None:
        for sock in list(self._socks):
            self.forget(sock)

    @staticmethod
    def _over(w: _Watched, fd: int, c: _Conn) -> bool:
        read = _bytes_read(fd)
        if read is None or read < c.read:  # not this connection any more: its events follow
            return False
        c.read = read
        return read - c.delivered > w.limit and not c.recent

    def _hang_up(self, w: _Watched, fd: int, c: _Conn) -> None:
        # NOTE: the fd is libzmq's: make sure it is still the connection counted (a
        # number closed and reused between the monitor's event and here is left alone)
        if _ends(fd) != c.ends:
            return
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        del w.conns[fd]
        self.dropped["unfinished"] += 1
        self._log(c, w.limit)

    def _log(self, c: _Conn, limit: int) -> None:
        """At warning once a minute per peer host (one that reconnects to do it again
        must not flood the log), else at debug."""
        peer, now = c.ends[1], time.monotonic()
        host = peer[0] if isinstance(peer, tuple) else peer
        quiet = now - self._warned.get(host, -WARN_EVERY_S) < WARN_EVERY_S
        if not quiet:
            if len(self._warned) >= 1024:
                self._warned.clear()
            self._warned[host] = now
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "hung up on %s: %d bytes of an unfinished message held (limit %d); "
                "a worker never sends that", peer, c.read - c.delivered, limit)  # fmt: skip


def _ends(fd: int) -> tuple[object, object] | None:
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return s.getsockname(), s.getpeername()
    except OSError:
        return None
    finally:
        s.detach()  # NOTE: libzmq's fd: never closed here


def _bytes_read(fd: int) -> int | None:
    """Bytes the kernel has handed to the reader of TCP socket `fd` so far."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        (unread,) = struct.unpack("=i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))
    except OSError:
        return None
    finally:
        s.detach()  # NOTE: libzmq's fd: never closed here
    (received,) = struct.unpack_from("=Q", info, _TCPI_BYTES_RECEIVED)
    return int(received) - int(unread)


def _supported() -> bool:
    """TCP_INFO with tcpi_bytes_received (Linux >= 4.1)."""
    try:
        with socket.socket() as s:
            n = len(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
    except (AttributeError, OSError):
        n = 0
    if n < _TCPI_BYTES_RECEIVED + 8:
        log.warning("no TCP_INFO bytes_received here: an unfinished multipart message from "
                    "a peer is not bounded (turn on CURVE; docs/security.md)")  # fmt: skip
    return n >= _TCPI_BYTES_RECEIVED + 8


_SUPPORTED = _supported()
