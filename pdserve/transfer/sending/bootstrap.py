"""The prefill's bootstrap channel: what decodes say on its ROUTER (I/O thread only).

    Announce  a decode has a request of the room: the room is tied to that decode (its
              heartbeat covers it) before either side holds anything for it
    Ready     the decode reserved pages: its data endpoint (checked: netaddr), layout
              and model (checked: peers.ready_mismatch) -> Claim back, then KV is pushed
    Ready     again, from the room's decode: a repeat (again_of: its own session) while
              unclaimed, answered with the Claim again (it may have been lost); or under
              a new session (again_of: the one it replaces): the decode lost some of the
              KV on the way, and all of it is pushed again
    Ack       the decode has the KV: the room is released ok
    Abort     the decode gave up: the room fails (session 0: before or without a Ready)
    Heartbeat both ways, every heartbeat_interval_s: a decode silent past
              heartbeat_timeout_s is dead, and every room held for it fails

A room a decode opens before this prefill has its request counts against that decode's
share (PeerRooms) and all rooms (MAX_ROOMS); past either the Ready is refused by name.
Refusals go both ways: a room the prefill refused before the decode was known gets an
Abort for its Ready; a decode's Abort for a room not admitted here yet is reported as a
room-only SinkEvent (a queued request is dropped) and refuses a later on_admit.
Mixed into KVSender, which owns the state and the failure paths named below.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdserve.config import TransferConfig
from pdserve.netaddr import endpoint_problem
from pdserve.transfer.base import SinkEvent
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import Abort, Ack, Announce, Claim, Heartbeat, Ready, remote_text
from pdserve.transfer.sending.peers import MAX_ROOMS, PeerClock, PeerRooms, Refusals, ready_mismatch
from pdserve.transfer.sending.room import Room
from pdserve.transfer.zmq_io import MsgSocket


class BootstrapChannel:
    # owned by KVSender
    _rooms: dict[int, Room]
    _refused: Refusals
    _peers: PeerClock
    _peer_rooms: PeerRooms
    _ctrl: MsgSocket
    _io: IOThread
    fingerprint: str
    model: str
    settings: TransferConfig
    refused_rooms: int
    bootstrap_port: int
    _seq: Iterator[int]  # Heartbeat.seq

    if TYPE_CHECKING:

        def _fail(
            self, st: Room, reason: str, notify: bool = True, tell_engine: bool = True
        ) -> None: ...

        def _flush(self, st: Room) -> None: ...

        def _push_again(self, st: Room, ready: Ready) -> None: ...

        def _remove(self, st: Room) -> None: ...

        def _report(self, st: Room, event: SinkEvent) -> None: ...

    def _heartbeat(self) -> None:
        """Tell each decode holding a room here that this prefill is alive."""
        hb = Heartbeat(sender=f"prefill:{self.bootstrap_port}", seq=next(self._seq))
        for peer in {s.peer for s in self._rooms.values() if s.peer}:
            self._ctrl.send(hb, to=peer)

    def _fail_silent_peers(self, now: float) -> None:
        """A decode that stopped heartbeating is dead: fail every room held for it."""
        for st in [s for s in self._rooms.values() if s.peer]:
            silent = self._peers.silent_for(st.peer, now)
            if silent > self._peers.timeout_s:
                self._fail(st, f"decode silent for {silent:.1f}s (dead?)", notify=False)
        self._peers.forget_except({s.peer for s in self._rooms.values() if s.peer})

    def _on_control(self) -> None:
        peer, msg, _ = self._ctrl.recv(block=False)
        if peer is None or msg is None:
            return
        self._peers.heard(peer)
        if isinstance(msg, Ready):
            self._on_ready(peer, msg)
        elif isinstance(msg, Announce):
            self._on_announce(peer, msg)
        elif isinstance(msg, Ack | Abort):
            self._on_ack_or_abort(msg)

    def _on_announce(self, peer: bytes, msg: Announce) -> None:
        """A decode has a request of msg.room: its heartbeat covers the room from now on."""
        st = self._rooms.get(msg.room)
        if st is None and self._refused.get(msg.room) is not None:
            return  # its Ready gets the refusal
        if st is None:
            st = self._new_room(msg.room, peer)
            if st is None:
                return
        elif not st.peer:
            self._peer_rooms.set_peer(st, peer)
            if st.ready is None:  # the other side may queue a while: the heartbeat covers it
                st.deadline = time.monotonic() + self.settings.kv_ready_timeout_s

    def _new_room(self, room: int, peer: bytes) -> Room | None:
        """A room a decode opened (Announce, Ready) before this prefill had its request;
        None past the caps (counted; its Ready is refused by name)."""
        if self._peer_rooms.full(peer) or len(self._rooms) >= MAX_ROOMS:
            self.refused_rooms += 1
            return None
        st = self._rooms[room] = Room(room)
        self._peer_rooms.set_peer(st, peer)
        st.deadline = (
            time.monotonic() + self.settings.kv_ready_timeout_s
        )  # wait for on_queue / on_admit
        return st

    def _on_ready(self, peer: bytes, ready: Ready) -> None:
        st = self._rooms.get(ready.room)
        refused = self._refused.get(ready.room)
        if st is None and refused is not None:  # failed before the decode was known
            self._ctrl.send(Abort(room=ready.room, session=ready.session, reason=refused), to=peer)
            return
        if st is not None and st.ready is not None:
            if ready.session == st.ready.session:  # a repeat: our Claim may have been lost
                if st.claimed and peer == st.peer:
                    self._ctrl.send(Claim(room=st.room, session=ready.session), to=peer)
            elif ready.again_of == st.ready.session and peer == st.peer:
                self._push_again(st, ready)  # the decode lost KV on the way
            else:  # a second decode claims an active room
                dup = Abort(room=ready.room, session=ready.session, reason="duplicate active room")
                self._ctrl.send(dup, to=peer)
            return
        if ready.again_of and (st is None or ready.again_of != ready.session):
            # a repeat or a push again of a room not here: it ended (a new room would wait
            # for a request that is gone), or its Announce and Ready were both lost
            gone = Abort(room=ready.room, session=ready.session, reason="prefill has no such room")
            self._ctrl.send(gone, to=peer)
            return
        why = endpoint_problem(ready.data_endpoint)
        if st is None and not why:
            st = self._new_room(ready.room, peer)
            why = "" if st is not None else "too many rooms held for this decode"
        if why or st is None:
            reason = f"Ready refused: {why}"
            self._ctrl.send(Abort(room=ready.room, session=ready.session, reason=reason), to=peer)
            if st is not None:
                self._fail(st, reason, notify=False)
            return
        if st.peer != peer:
            self._peer_rooms.set_peer(st, peer)
        st.ready = ready
        if st.req is None:
            st.deadline = time.monotonic() + self.settings.kv_ready_timeout_s  # wait for on_admit
        self._check_ready(st)

    def _claim(self, st: Room) -> None:
        """Tell the decode this prefill has the room's request, once (it frees its pages
        if no prefill claims its Ready within its bootstrap timeout)."""
        if st.queued and st.ready is not None and not st.claimed:
            st.claimed = True
            self._ctrl.send(Claim(room=st.room, session=st.ready.session), to=st.peer)

    def _check_ready(self, st: Room) -> None:
        assert st.ready is not None
        reason = ready_mismatch(st, self.fingerprint, self.model)
        if reason:
            self._fail(st, reason)
            return
        self._claim(st)  # NOTE: before any KV: the decode's bootstrap timer stops here
        if st.req is not None:
            st.deadline = float("inf")  # both sides known: the ack timeout starts at KVDone
        self._flush(st)

    def _on_ack_or_abort(self, msg: Ack | Abort) -> None:
        st = self._rooms.get(msg.room)
        if isinstance(msg, Abort) and msg.session == 0 and (st is None or st.ready is None):
            self._on_early_abort(msg, st)
            return
        if st is None or st.ready is None or msg.session not in (0, st.ready.session):
            return  # stale
        if isinstance(msg, Abort):
            self._fail(st, f"decode aborted: {remote_text(msg.reason)}", notify=False)
        elif st.done_sent:
            self._remove(st)
            if st.req is not None:
                self._report(st, SinkEvent(st.req.rid, True))

    def _on_early_abort(self, msg: Abort, st: Room | None) -> None:
        """The decode refused a room before sending Ready (or before the prefill admitted
        it): drop what is held now, and refuse the room when the prefill gets to it."""
        reason = f"decode refused: {remote_text(msg.reason)}"
        if st is not None:
            self._fail(st, reason, notify=False)
            return
        self._refused.add(msg.room, reason)
        self._io.emit(SinkEvent("", False, reason, room=msg.room))  # a queued request
