"""Prefill side of the KV transfer: a `KVSink` that pushes KV to the decode over ZeroMQ.

Per room:   (on_queue + on_admit, Announce + Ready) in either order ─▶ Claim ─▶ push chunks
            ─▶ KVDone (again until answered: after 1, 2, 4, 4, ... heartbeats) ─▶ Ack ─▶ released ok
            any timeout / Abort / layout or model mismatch / silent decode ─▶ released, ok=False

A connection of the link that breaks loses what it carried (libzmq reconnects and goes on
with what is queued after it): lost KV makes the decode send its Ready again under a new
session (again_of), and all of the room's KV is pushed again (`_push_again`: the pages
are the room's until it is released); a lost KVDone, or a lost answer to it, is what the
repeated KVDone recovers (the decode answers a repeat with the Ack or Abort it gave:
receiving/ended.py).

Every room is tied to a decode from the start: the decode announces a room when the
request reaches it, and a room no decode announced within `kv_bootstrap_timeout_s` fails
(its request, queued or computing, ends with that reason). A room with a decode waits
up to `kv_ready_timeout_s` for the other side, but only while that decode heartbeats.
What a peer can make this side keep is bounded: rooms per peer and in all, refusals
remembered, text kept (peers.py), data endpoints (netaddr-checked, at most MAX_DATA_SOCKETS).

Invariants:
- Only the I/O thread touches the sockets and the pool memory; it emits a room's
  SinkEvent only after the last read of that room's slots, its own or libzmq's, so
  once poll() reports a room the prefill may free its pages at once.
- Pool memory reaches ZeroMQ only as frames sent in place (pieces.py): read by libzmq
  until their trackers say done, so a room's SinkEvent waits for those (`_report`;
  a dead decode's queued frames are released when its socket is dropped). Any other
  chunk is gathered into a staging tensor, reused only once its trackers say done and
  kept alive until then by what sent it (a native send's Pending, or pyzmq's frames).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from pdserve.config import TransferConfig
from pdserve.envs import cache_root
from pdserve.kernels.page_io import page_io
from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.transfer.base import SinkEvent, Ticket
from pdserve.transfer.curve import authorize
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import MAX_PUSHES, Abort, Decoder, Ready
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.sending.bootstrap import BootstrapChannel
from pdserve.transfer.sending.peers import (
    MAX_ROOMS_PER_PEER,
    DataSockets,
    PeerClock,
    PeerRooms,
    Refusals,
    timeout_reason,
)
from pdserve.transfer.sending.pieces import Piece
from pdserve.transfer.sending.push import Pusher
from pdserve.transfer.sending.release import Releases
from pdserve.transfer.sending.room import Room, phase
from pdserve.transfer.zmq_io import CurveKeys, MsgSocket, SendHook, bind, make_socket
from pdserve.transfer.zmq_native import native_send

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 8 << 20  # per payload frame; larger on_chunk ranges are split


class KVSender(BootstrapChannel):
    """`KVSink` over ZeroMQ. Methods other than the constructor are called from one
    engine thread; all socket work happens on a background I/O thread."""

    def __init__(
        self,
        layout: KVLayout,
        settings: TransferConfig,
        *,
        model: str = "",
        curve: CurveKeys | None = None,
        fault_hook: SendHook | None = None,
        max_rooms_per_peer: int = MAX_ROOMS_PER_PEER,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        native: bool = True,
        kernel_threads: Callable[[], int] | None = None,
    ) -> None:
        """`settings`: the bootstrap socket binds `transfer_host:bootstrap_port` (port 0:
        any free one, then in `self.bootstrap_port`); the timers are its fields.
        `native`: gather and hash pieces whose pages are scattered over the pool with the
        native kernel (kernels/native/page_copy.py), and send KV frames through libzmq's C
        API (zmq_native.py), both built (once per machine) and loaded here at start-up;
        False: torch's index_select, Python's xxhash and pyzmq's zero-copy send
        (--disable-compile). `kernel_threads`: the engine's (kernels/core_share.Cores),
        else torch's thread count."""
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.settings = settings
        # a room no decode announced fails after this (never later than kv_ready_timeout_s)
        self._unannounced_s = min(settings.kv_bootstrap_timeout_s, settings.kv_ready_timeout_s)
        self.model = model  # identity.model_fingerprint() of the served model
        pages = page_io(cache_root() if native else None, kernel_threads)  # chosen once
        send = native_send(cache_root()) if native else None
        self._pusher = Pusher(layout, max_frame_bytes, pages, native_send=send is not None)
        self._max_tokens = self._pusher.max_tokens
        self._decoder = Decoder()
        self._rooms: dict[int, Room] = {}
        self._refused = Refusals(settings.kv_ready_timeout_s)
        self._peers = PeerClock(settings.heartbeat_timeout_s)  # decodes heartbeat; silence = dead
        self._peer_rooms = PeerRooms(max_rooms_per_peer)
        self.refused_rooms = 0  # Announce / Ready past a cap (I/O thread; stats)
        self.pushed_again = 0  # rooms pushed again for a decode that lost KV (stats)
        self._data = DataSockets(self._decoder, curve, fault_hook, send, self._endpoints_in_use)
        # an unfinished message's bound (with CURVE, only the cluster's workers connect)
        self._guard = PeerGuard(self._decoder.dropped) if curve is None else None
        self._data.guard = self._guard
        self._seq = itertools.count()
        self._next_hb = 0.0
        self._io = IOThread("kv-sender", tick_s=min(0.05, settings.heartbeat_interval_s / 2))
        self._releases = Releases(self._io.emit)  # see _report
        self._io.on_tick = self._tick
        self._io.on_exit = self._on_exit
        if curve is not None:
            authorize(curve)  # ZAP: only holders of the cluster secret may connect
        router = make_socket(zmq.ROUTER, curve, curve_server=curve is not None)
        # NOTE: a decode keeps its routing id across reconnects (receiving/control.py); the
        # new connection takes the id over at once, even where this side has not yet seen
        # the old one break (without it the decode would be refused until it had)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # NOTE: before the bind, so the guard's monitor sees every connection
        self._ctrl = MsgSocket(router, self._decoder, fault_hook, guard=self._guard)
        self.bootstrap_port = bind(router, settings.transfer_host, settings.bootstrap_port)
        self._io.add_reader(router, self._on_control)
        self._io.start()

    # ---- KVSink (engine thread) -------------------------------------------------
    def on_queue(self, req: Ticket) -> None:
        self._io.submit(lambda: self._queue(req))

    def on_admit(self, req: Ticket) -> None:
        self._io.submit(lambda: self._admit(req))

    def on_chunk(
        self, req: Ticket, pool: KVPool, slots: torch.Tensor, start: int, end: int
    ) -> None:
        event = None
        if pool.k.is_cuda:  # NOTE: the I/O thread must not read KV the forward stream still writes
            event = torch.cuda.Event()
            event.record()
        self._io.submit(lambda: self._chunk(req, pool, slots, start, end, event))

    def on_done(
        self,
        req: Ticket,
        first_token: int,
        first_logprob: float,
        stages: dict[str, float] | None = None,
    ) -> None:
        stamps = stages or {}  # the engine's own; the receiver filters what comes off the wire
        self._io.submit(lambda: self._done(req, first_token, first_logprob, stamps))

    def on_abort(self, req: Ticket, reason: str) -> None:
        self._io.submit(lambda: self._abort_local(req, reason))

    def poll(self) -> list[SinkEvent]:
        return self._io.drain()

    def stats(self) -> dict[str, int]:
        rooms = {"active_rooms": len(self._rooms), "refused_rooms": self.refused_rooms,
                 "pushed_again": self.pushed_again}  # fmt: skip
        return {**rooms, **self._pusher.pieces, **self._decoder.dropped}

    def active_rooms(self) -> set[int]:
        return set(self._rooms)

    def room_phases(self) -> dict[int, str]:
        """room -> wait_admit | wait_ready | pushing | wait_ack (racy snapshot, tests/metrics)."""
        return {r: phase(st) for r, st in list(self._rooms.items())}

    def close(self) -> None:
        self._io.stop()

    def kill(self) -> None:
        """Die without goodbye (fault injection): no Abort, no events, sockets dropped."""
        self._io.stop(kill=True)

    # ---- engine commands (I/O thread) ---------------------------------------------
    def _queue(self, req: Ticket) -> None:
        """A request of req.room arrived: wait for its decode (bootstrap timeout) and
        claim the room if its Ready is here already."""
        if not req.room or self._refused.get(req.room) is not None:
            return  # refused: _admit reports it, or a room-only event already did
        st = self._rooms.get(req.room)
        if st is None:
            st = self._rooms[req.room] = Room(req.room)
            st.deadline = time.monotonic() + self._unannounced_s
        st.queued = True
        self._claim(st)

    def _admit(self, req: Ticket) -> None:
        st = self._rooms.get(req.room)
        if st is not None and st.req is not None:
            self._io.emit(SinkEvent(req.rid, False, f"duplicate active room {req.room}"))
            return
        refused = self._refused.pop(req.room)
        if refused is not None:
            self._io.emit(SinkEvent(req.rid, False, refused))
            return
        st = st or self._rooms.setdefault(req.room, Room(req.room))
        st.req, st.queued = req, True
        if st.peer or not st.deadline:  # (a room queued without a decode keeps its deadline)
            wait = self.settings.kv_ready_timeout_s if st.peer else self._unannounced_s
            st.deadline = time.monotonic() + wait
        if st.ready is not None:
            self._check_ready(st)

    def _chunk(
        self, req: Ticket, pool: KVPool, slots: torch.Tensor, start: int, end: int, event: Any
    ) -> None:
        if event is not None:
            event.synchronize()
        st = self._rooms.get(req.room)
        if st is None or st.req is not req:
            return  # failed or foreign: the event was already emitted
        st.made.append((pool, slots, start, end))
        for s in range(start, end, self._max_tokens):  # one frame-sized piece per entry
            piece = Piece(pool, slots, s, min(end, s + self._max_tokens))
            if st.ready is None:  # nowhere to send yet: hash now, off the transfer's path
                self._pusher.prepare(piece)
            st.pending.append(piece)
        self._flush(st)

    def _done(
        self, req: Ticket, first_token: int, first_logprob: float, stages: dict[str, float]
    ) -> None:
        st = self._rooms.get(req.room)
        if st is None or st.req is not req:
            return
        st.done, st.stages = (first_token, first_logprob), stages
        self._flush(st)

    def _abort_local(self, req: Ticket, reason: str) -> None:
        """The prefill refused or aborted `req` (admitted or not): tell the decode."""
        if not req.room:
            return
        st = self._rooms.get(req.room)
        if st is None:  # decode not known yet: its Ready gets an Abort
            self._refused.add(req.room, f"prefill refused: {reason}")
        elif st.req is req or st.req is None:  # (None: Ready came, never admitted)
            self._fail(st, f"prefill aborted: {reason}", tell_engine=False)

    # ---- pushing KV -----------------------------------------------------------------
    def _flush(self, st: Room) -> None:
        """Push whatever is computed, once the decode's Ready is known and accepted."""
        if st.ready is None or st.req is None:
            return
        try:
            self._push(st)
        except Exception as e:  # never leave the room hanging on an internal error
            log.exception("KV push of room %d failed", st.room)
            self._fail(st, f"internal error while sending KV: {e!r}")

    def _push(self, st: Room) -> None:
        assert st.ready is not None
        sock = self._data.get(st.ready.data_endpoint)
        if st.pending:  # one piece per turn; the rest is resubmitted behind other work
            self._pusher.send_chunk(sock, st, st.pending.pop(0))
            if st.pending:
                self._io.submit(lambda: self._flush(st) if self._rooms.get(st.room) is st else None)
                return
        if st.done is not None and not st.done_sent:
            self._pusher.send_done(sock, st)
            now = time.monotonic()
            st.deadline = now + self.settings.kv_timeout_s
            st.resend_gap = self.settings.heartbeat_interval_s
            st.resend_at = now + st.resend_gap

    def _push_again(self, st: Room, ready: Ready) -> None:
        """The decode lost some of st's KV on the way and asks for all of it again under
        `ready`'s new session (bootstrap._on_ready): the pages are still the room's."""
        assert st.ready is not None
        why = ""
        if st.req is None or st.done is None or ready.data_endpoint != st.ready.data_endpoint:
            why = "a Ready again for a room not pushed whole, or to another endpoint"
        elif st.pushes >= MAX_PUSHES:  # NOTE: a decode may not make this side push without end
            why = f"the decode asked for the KV more than {MAX_PUSHES} times"
        if why:  # (the Abort under the new session: the decode has left the old one)
            self._ctrl.send(Abort(room=st.room, session=ready.session, reason=why), to=st.peer)
            self._fail(st, why, notify=False)
            return
        st.pushes += 1
        st.ready, st.sent, st.done_sent, st.deadline = ready, [], False, float("inf")
        st.pending = [
            Piece(pool, slots, s, min(end, s + self._max_tokens))
            for pool, slots, start, end in st.made
            for s in range(start, end, self._max_tokens)
        ]
        self.pushed_again += 1
        self._flush(st)

    def _endpoints_in_use(self) -> set[str]:
        return {s.ready.data_endpoint for s in self._rooms.values() if s.ready is not None}

    def _remove(self, st: Room) -> None:
        if self._rooms.get(st.room) is st:
            del self._rooms[st.room]
        self._peer_rooms.drop(st)

    def _fail(self, st: Room, reason: str, notify: bool = True, tell_engine: bool = True) -> None:
        self._remove(st)
        if notify and st.ready is not None:
            self._ctrl.send(
                Abort(room=st.room, session=st.ready.session, reason=reason), to=st.peer
            )
        if st.req is not None:
            self._report(st, SinkEvent(st.req.rid, False, reason))
        elif tell_engine:  # queued in the prefill, not admitted: nothing of it was sent
            self._io.emit(SinkEvent("", False, reason, room=st.room))
        if st.ready is not None:
            self._data.drop_idle(st.ready.data_endpoint)
        if st.req is None or st.ready is None:
            # NOTE: one side not known yet: a later on_admit / Ready of this room is
            # refused with the same reason (a prefill rejection must reach the decode)
            self._refused.add(st.room, reason)

    def _report(self, st: Room, event: SinkEvent) -> None:
        """Emit `event` (the engine then frees st's pages) once libzmq reads none of them."""
        self._releases.report(st.inflight, event)

    # ---- timers (I/O thread) --------------------------------------------------------
    def _tick(self) -> None:
        if self._guard is not None:
            self._guard.check()
        now = time.monotonic()
        self._releases.tick()
        for st in [s for s in self._rooms.values() if s.deadline <= now]:
            try:
                why = timeout_reason(
                    st,
                    self.settings.kv_ready_timeout_s,
                    self.settings.kv_timeout_s,
                    self._unannounced_s,
                )
                self._fail(st, why)
            except Exception:  # this room's failure must not stop every other room's timer
                log.exception("timeout of room %d failed", st.room)
                self._remove(st)
        self._fail_silent_peers(now)
        self._resend_done(now)
        self._refused.expire(now)
        if now >= self._next_hb:
            self._next_hb = now + self.settings.heartbeat_interval_s
            self._heartbeat()

    def _resend_done(self, now: float) -> None:
        """Send the KVDone of each room still waiting for its answer again: a connection
        that broke may have lost it, or the decode's Ack (see the top)."""
        cfg = self.settings
        # NOTE: the gap doubles, up to 4 heartbeats: a KVDone waiting behind a slow link's
        # backlog (it carries the prompt's logprobs, if asked for) is not sent every beat
        cap = max(
            cfg.heartbeat_interval_s, min(4 * cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s)
        )
        for st in [s for s in self._rooms.values() if s.done_sent and s.resend_at <= now]:
            assert st.ready is not None
            st.resend_gap = min(2 * st.resend_gap, cap)
            st.resend_at = now + st.resend_gap
            try:
                self._pusher.send_done(self._data.get(st.ready.data_endpoint), st)
            except (zmq.ZMQError, RuntimeError) as e:  # no pipe now: the next turn tries again
                log.debug("KVDone of room %d not sent again: %s", st.room, e)

    def _on_exit(self, killed: bool) -> None:
        self._ctrl.close()
        self._data.close()
