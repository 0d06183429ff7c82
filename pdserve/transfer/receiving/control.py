"""The decode's control sockets: one DEALER per prefill bootstrap endpoint (I/O thread only).

A client names the prefill (bootstrap_host / bootstrap_port), so the endpoints come from
outside: they are checked before they get here (netaddr.tcp_endpoint), and the sockets
are bounded in number, reused, and closed when idle or failed:

    at most `max_sockets` at once      a new endpoint beyond it closes the least recently
                                       used idle one, or is refused (the send fails)
    idle `idle_s` with no room         closed, and forgotten (`prune`)
    a send that libzmq refuses         closed at once (no pipe: the peer refused us);
                                       the next send to that endpoint connects afresh

`announced`: the rooms this decode announced to a prefill and holds no transfer for yet
(waiting for pages); its heartbeats go to their prefills too.

Every DEALER carries the decode's own routing id (`routing_id`), so a connection that
breaks and reconnects (libzmq does so by itself) is the same peer to the prefill's
ROUTER: the rooms it holds there, and the heartbeats that keep them, carry on. With a
fresh id per connection the prefill would take the old one for a silent decode and
fail every room it held after the heartbeat timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import Decoder, Message
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.zmq_io import CurveKeys, MsgSocket, connect, make_socket

log = logging.getLogger(__name__)

MAX_CONTROL_SOCKETS = 256  # prefills one decode talks to at once
CONTROL_IDLE_S = 30.0  # a socket no room uses is closed after this long unused


class ControlSockets:
    def __init__(
        self,
        io: IOThread,
        decoder: Decoder,
        curve: CurveKeys | None,
        on_message: Callable[[str, MsgSocket], None],
        busy: Callable[[], set[str]],
        routing_id: bytes = b"",
        max_sockets: int = MAX_CONTROL_SOCKETS,
        idle_s: float = CONTROL_IDLE_S,
    ) -> None:
        """`on_message(endpoint, sock)`: `sock` has a message; `busy()`: the endpoints
        some room still needs (never closed for being idle or to make room)."""
        self._io, self._decoder, self._curve = io, decoder, curve
        self._on_message, self._busy = on_message, busy
        self._routing_id = routing_id
        self.max_sockets, self.idle_s = max_sockets, idle_s
        self._socks: dict[str, MsgSocket] = {}
        self._used: dict[str, float] = {}  # endpoint -> last send or message
        self.last_seen: dict[str, float] = {}  # endpoint -> last message from the prefill
        self.refused = 0  # sends refused: too many endpoints, or no pipe to the peer
        self.announced: dict[int, str] = {}  # room -> prefill endpoint, no transfer yet
        self.guard: PeerGuard | None = None  # set by the owner (peer_guard.py)

    def announce(self, room: int, endpoint: str, msg: Message) -> None:
        self.announced[room] = endpoint
        self.send(endpoint, msg)

    def settle(self, room: int, endpoint: str) -> None:
        """`room` no longer waits as announced (its transfer started, or it ended)."""
        if self.announced.get(room) == endpoint:
            del self.announced[room]

    def __len__(self) -> int:
        return len(self._socks)

    def send(self, endpoint: str, msg: Message) -> bool:
        """Send `msg` to the prefill at `endpoint` (connecting first); False if it could
        not go (counted; the caller fails what depended on it)."""
        sock = self._socks.get(endpoint) or self._open(endpoint)
        if sock is None:
            self.refused += 1
            return False
        self._used[endpoint] = time.monotonic()
        try:
            sock.send(msg)
        except zmq.ZMQError as e:
            log.warning("control send to %s failed (%s): closing it", endpoint, e)
            self.refused += 1
            self.close(endpoint)
            return False
        return True

    def heard(self, endpoint: str) -> None:
        self.last_seen[endpoint] = self._used[endpoint] = time.monotonic()

    def prune(self, now: float) -> None:
        """Close the sockets no room needs that were unused for idle_s."""
        idle = [e for e, t in self._used.items() if now - t > self.idle_s]
        if idle:
            busy = self._busy()
            for endpoint in idle:
                if endpoint not in busy:
                    self.close(endpoint)

    def close(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        self._used.pop(endpoint, None)
        self.last_seen.pop(endpoint, None)
        if sock is not None:
            self._io.remove_reader(sock.sock)
            sock.close()

    def close_all(self) -> None:
        for endpoint in list(self._socks):
            self.close(endpoint)

    def _open(self, endpoint: str) -> MsgSocket | None:
        if len(self._socks) >= self.max_sockets and not self._evict():
            log.warning("control sockets: %d open, all in use; refusing %s", len(self), endpoint)
            return None
        curve = None if self._curve is None else self._curve.for_server(self._curve.public)
        raw = make_socket(zmq.DEALER, curve, never_block=True)
        if self._routing_id:
            raw.setsockopt(zmq.ROUTING_ID, self._routing_id)
        sock = MsgSocket(raw, self._decoder, guard=self.guard)  # its monitor sees the connect
        try:
            connect(raw, endpoint)
        except zmq.ZMQError as e:
            log.warning("cannot connect to %s: %s", endpoint, e)
            sock.close()
            return None
        self._socks[endpoint] = sock
        self._io.add_reader(raw, lambda: self._on_message(endpoint, sock))
        return sock

    def _evict(self) -> bool:
        """Close the least recently used socket no room needs; False if all are needed."""
        busy = self._busy()
        for endpoint in sorted(self._used, key=self._used.__getitem__):
            if endpoint not in busy:
                self.close(endpoint)
                return True
        return False
