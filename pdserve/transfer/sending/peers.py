"""Bookkeeping shared by the sender's control channel (I/O thread only).

`Refusals`: rooms that ended before one side was known. A room refused or aborted by
one side before the other side showed up is remembered for `ttl_s`, so the late side
(an on_admit, or the decode's Ready) is refused at once instead of waiting for a timeout.

`PeerClock`: when each decode (a ROUTER identity) was last heard from. A live decode
heartbeats every `heartbeat_interval_s`; a peer silent past the timeout is presumed dead and
every room held for it is failed.

`PeerRooms`: how many rooms each decode holds here, so that one peer (or a flood of
Ready / Announce for rooms no prefill request has) is refused past a cap.

`ready_mismatch` / `timeout_reason`: why a room must fail (user-facing reasons).
Text a peer sent is cut (messages.remote_text) before it is kept or passed on.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import zmq

from pdserve.transfer.identity import describe_mismatch
from pdserve.transfer.messages import Decoder, remote_text
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.sending.room import Room
from pdserve.transfer.zmq_io import CurveKeys, MsgSocket, SendHook, connect, make_socket
from pdserve.transfer.zmq_native import NativeSend

MAX_REFUSALS = 16384  # rooms remembered as refused; the oldest go first
MAX_DATA_SOCKETS = 256  # decode data endpoints a prefill pushes to at once
# rooms one decode may hold here: its queue and its batch (SchedulerConfig's defaults
# are 4096 queued and 64 running); and all decodes together
MAX_ROOMS_PER_PEER = 8192
MAX_ROOMS = 65536


class Refusals:
    def __init__(self, ttl_s: float, max_rooms: int = MAX_REFUSALS) -> None:
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self._rooms: dict[int, tuple[str, float]] = {}  # room -> (reason, expiry)

    def add(self, room: int, reason: str) -> None:
        self._rooms.pop(room, None)  # re-inserted last: the dict's order is the age
        self._rooms[room] = (remote_text(reason), time.monotonic() + self.ttl_s)
        while len(self._rooms) > self.max_rooms:
            del self._rooms[next(iter(self._rooms))]

    def get(self, room: int) -> str | None:
        got = self._rooms.get(room)
        return None if got is None else got[0]

    def pop(self, room: int) -> str | None:
        got = self._rooms.pop(room, None)
        return None if got is None else got[0]

    def expire(self, now: float) -> None:
        for room in [r for r, (_, exp) in self._rooms.items() if exp <= now]:
            del self._rooms[room]


class PeerClock:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._seen: dict[bytes, float] = {}

    def heard(self, peer: bytes) -> None:
        self._seen[peer] = time.monotonic()

    def silent_for(self, peer: bytes, now: float) -> float:
        """Seconds since `peer` was last heard from (0 for a peer never heard: a Ready
        always marks its sender heard, so that only happens for peerless rooms)."""
        return now - self._seen.get(peer, now)

    def forget_except(self, live: set[bytes]) -> None:
        for peer in [p for p in self._seen if p not in live]:
            del self._seen[peer]


class PeerRooms:
    """Rooms per decode (a ROUTER identity), counted as rooms get and lose their peer."""

    def __init__(self, per_peer: int = MAX_ROOMS_PER_PEER) -> None:
        self.per_peer = per_peer
        self._n: Counter[bytes] = Counter()
        self._counted: dict[int, bytes] = {}  # id(room) -> the peer it counts for

    def full(self, peer: bytes) -> bool:
        return self._n[peer] >= self.per_peer

    def set_peer(self, st: Room, peer: bytes) -> None:
        self.drop(st)
        st.peer = peer
        self._counted[id(st)] = peer
        self._n[peer] += 1

    def drop(self, st: Room) -> None:
        """`st` left the table (its peer stays on it: a late answer still reaches it)."""
        peer = self._counted.pop(id(st), None)
        if peer is not None:
            self._n[peer] -= 1
            if self._n[peer] <= 0:
                del self._n[peer]


class DataSockets:
    """One PUSH per decode data endpoint (I/O thread only), reused, at most `max_sockets`:
    a new endpoint beyond it closes the least recently used one no room needs (`busy`),
    or fails the room that asked."""

    def __init__(
        self,
        decoder: Decoder,
        curve: CurveKeys | None,
        hook: SendHook | None,
        native: NativeSend | None = None,
        busy: Callable[[], set[str]] = set,
    ) -> None:
        self._decoder, self._curve, self._hook, self._native = decoder, curve, hook, native
        self._busy = busy
        self._socks: dict[str, MsgSocket] = {}  # in order of last use, oldest first
        self.max_sockets = MAX_DATA_SOCKETS
        self.guard: PeerGuard | None = None  # set by the owner (peer_guard.py)

    def __len__(self) -> int:
        return len(self._socks)

    def get(self, endpoint: str) -> MsgSocket:
        """The PUSH to `endpoint` (checked by netaddr.endpoint_problem), connected once;
        RuntimeError past max_sockets (the room that asked fails, naming it)."""
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            self._socks[endpoint] = sock  # most recently used: last
        else:
            if len(self._socks) >= self.max_sockets and not self._evict():
                raise RuntimeError(f"pushing to {len(self._socks)} decode endpoints already")
            # NOTE: with CURVE the decode's data socket is a CURVE server using the same
            # keypair as the bootstrap server (one cluster keypair; see curve.py).
            curve = None if self._curve is None else self._curve.for_server(self._curve.public)
            raw = make_socket(zmq.PUSH, curve, never_block=True)
            sock = MsgSocket(raw, self._decoder, self._hook, self._native, guard=self.guard)
            connect(raw, endpoint)  # after the guard's monitor is on
            self._socks[endpoint] = sock
        return sock

    def _evict(self) -> bool:
        busy = self._busy()
        idle = next((e for e in self._socks if e not in busy), None)
        if idle is not None:
            self.drop(idle)
        return idle is not None

    def drop_idle(self, endpoint: str) -> None:
        """Close the PUSH to `endpoint` unless a room still uses it (`busy`)."""
        if endpoint not in self._busy():
            self.drop(endpoint)

    def drop(self, endpoint: str) -> None:
        """Close the PUSH to `endpoint` (no live room uses it), so KV queued for a dead
        or refusing decode is discarded instead of held forever."""
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


def ready_mismatch(st: Room, layout: str, model: str) -> str:
    """Why the decode's Ready of `st` cannot be served by this prefill ("" if it can)."""
    assert st.ready is not None
    if st.ready.layout != layout:
        return f"KV layout mismatch: decode {st.ready.layout!r} != prefill {layout!r}"
    if st.ready.model != model:
        return f"model mismatch: {describe_mismatch(st.ready.model, model)}"
    if st.req is not None and st.ready.num_tokens != st.req.prompt_len:
        return f"prompt length mismatch: decode reserved {st.ready.num_tokens}, prefill has {st.req.prompt_len}"
    return ""


def timeout_reason(st: Room, kv_ready_timeout_s: float, kv_timeout_s: float, boot_s: float) -> str:
    if not st.peer:
        return (f"no Ready from any decode for room {st.room}: no decode announced it "
                f"within {boot_s}s (the decode is gone, or never got the request)")  # fmt: skip
    if st.req is None:
        return f"prefill never admitted room {st.room} within {kv_ready_timeout_s}s"
    if st.ready is None:
        return f"no Ready from the decode within {kv_ready_timeout_s}s"
    return f"no Ack from the decode within {kv_timeout_s}s"
