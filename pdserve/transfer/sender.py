"""Prefill side of the KV transfer: a `KVSink` that pushes KV to the decode over ZeroMQ.

Per room:   (on_admit, Ready) in either order ─▶ push chunks ─▶ KVDone ─▶ Ack ─▶ released ok
            any timeout / Abort / layout mismatch ─▶ released with ok=False

Invariants:
- Only the I/O thread touches the sockets and the pool memory; it emits a room's
  SinkEvent only after its last read of that room's slots, so once poll() reports
  a room the prefill may free its pages at once.
- Pool memory is never handed to ZeroMQ: each chunk is gathered into a staging
  tensor which pyzmq keeps alive until libzmq has sent it (copy=False frames).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch
import zmq

from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.transfer.base import SinkEvent, Ticket
from pdserve.transfer.curve import authorize
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import (
    Abort,
    Ack,
    Decoder,
    Heartbeat,
    Ready,
)
from pdserve.transfer.push import Pusher, Room, phase
from pdserve.transfer.zmq_io import CurveKeys, MsgSocket, SendHook, bind, make_socket

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 8 << 20  # per payload frame; larger on_chunk ranges are split


class KVSender:
    """`KVSink` over ZeroMQ. Methods other than the constructor are called from one
    engine thread; all socket work happens on a background I/O thread."""

    def __init__(
        self,
        bootstrap_host: str,
        bootstrap_port: int,
        layout: KVLayout,
        *,
        ready_timeout_s: float = 30.0,
        ack_timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        curve: CurveKeys | None = None,
        fault_hook: SendHook | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.ready_timeout_s = ready_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.heartbeat_s = heartbeat_s
        self._curve = curve
        self._hook = fault_hook
        self._pusher = Pusher(layout, max_frame_bytes)
        self._max_tokens = self._pusher.max_tokens
        self._decoder = Decoder()
        self._rooms: dict[int, Room] = {}
        self._refused: dict[int, tuple[str, float]] = {}  # room -> (reason, expiry)
        self._data: dict[str, MsgSocket] = {}  # decode data endpoint -> PUSH
        self._seq = itertools.count()
        self._next_hb = 0.0
        self._io = IOThread("kv-sender", tick_s=min(0.05, heartbeat_s / 2))
        self._io.on_tick = self._tick
        self._io.on_exit = self._on_exit
        if curve is not None:
            authorize(curve)  # ZAP: only holders of the cluster secret may connect
        router = make_socket(zmq.ROUTER, curve, curve_server=curve is not None)
        self.bootstrap_port = bind(router, bootstrap_host, bootstrap_port)
        self._ctrl = MsgSocket(router, self._decoder, fault_hook)
        self._io.add_reader(router, self._on_control)
        self._io.start()

    # ---- KVSink (engine thread) -------------------------------------------------
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

    def on_done(self, req: Ticket, first_token: int, first_logprob: float) -> None:
        self._io.submit(lambda: self._done(req, first_token, first_logprob))

    def on_abort(self, req: Ticket, reason: str) -> None:
        self._io.submit(lambda: self._abort_local(req, reason))

    def poll(self) -> list[SinkEvent]:
        return self._io.drain()

    def stats(self) -> dict[str, int]:
        return {"active_rooms": len(self._rooms), **self._decoder.dropped}

    def active_rooms(self) -> set[int]:
        return set(self._rooms)

    def room_phases(self) -> dict[int, str]:
        """room -> wait_admit | wait_ready | pushing | wait_ack (racy snapshot, for tests/metrics)."""
        return {r: phase(st) for r, st in list(self._rooms.items())}

    def close(self) -> None:
        self._io.stop()

    def kill(self) -> None:
        """Die without goodbye (fault injection): no Abort, no events, sockets dropped."""
        self._io.stop(kill=True)

    # ---- engine commands (I/O thread) ---------------------------------------------
    def _admit(self, req: Ticket) -> None:
        st = self._rooms.get(req.room)
        if st is not None and st.req is not None:
            self._io.emit(SinkEvent(req.rid, False, f"duplicate active room {req.room}"))
            return
        refused = self._refused.pop(req.room, None)
        if refused is not None:
            self._io.emit(SinkEvent(req.rid, False, refused[0]))
            return
        st = st or self._rooms.setdefault(req.room, Room(req.room))
        st.req = req
        st.deadline = time.monotonic() + self.ready_timeout_s
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
        for s in range(start, end, self._max_tokens):  # one frame-sized piece per entry
            st.pending.append((pool, slots, s, min(end, s + self._max_tokens)))
        self._flush(st)

    def _done(self, req: Ticket, first_token: int, first_logprob: float) -> None:
        st = self._rooms.get(req.room)
        if st is None or st.req is not req:
            return
        st.done = (first_token, first_logprob)
        self._flush(st)

    def _abort_local(self, req: Ticket, reason: str) -> None:
        st = self._rooms.get(req.room)
        if st is not None and st.req is req:
            self._fail(st, f"prefill aborted: {reason}")

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
        sock = self._data_socket(st.ready.data_endpoint)
        if st.pending:  # one piece per turn; the rest is resubmitted behind other work
            pool, slots, start, end = st.pending.pop(0)
            self._pusher.send_chunk(sock, st, pool, slots[start:end], start)
            if st.pending:
                self._io.submit(lambda: self._flush(st) if self._rooms.get(st.room) is st else None)
                return
        if st.done is not None and not st.done_sent:
            self._pusher.send_done(sock, st)
            st.deadline = time.monotonic() + self.ack_timeout_s

    def _data_socket(self, endpoint: str) -> MsgSocket:
        sock = self._data.get(endpoint)
        if sock is None:
            raw = make_socket(zmq.PUSH, self._curve_client())
            raw.connect(endpoint)
            sock = self._data[endpoint] = MsgSocket(raw, self._decoder, self._hook)
        return sock

    def _drop_idle_endpoint(self, endpoint: str) -> None:
        """After a failure: close the PUSH to a decode no live room uses, so KV queued
        for a dead or refusing decode is discarded instead of held forever."""
        if any(
            s.ready is not None and s.ready.data_endpoint == endpoint for s in self._rooms.values()
        ):
            return
        sock = self._data.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def _curve_client(self) -> CurveKeys | None:
        # NOTE: with CURVE the decode's data socket is a CURVE server using the same
        # keypair as this bootstrap server (one cluster keypair; see curve.py).
        return None if self._curve is None else self._curve.for_server(self._curve.public)

    # ---- control channel (I/O thread) -----------------------------------------------
    def _on_control(self) -> None:
        peer, msg, _ = self._ctrl.recv()
        if peer is None or msg is None:
            return
        if isinstance(msg, Ready):
            self._on_ready(peer, msg)
        elif isinstance(msg, Ack | Abort):
            self._on_ack_or_abort(msg)

    def _on_ready(self, peer: bytes, ready: Ready) -> None:
        st = self._rooms.get(ready.room)
        refused = self._refused.get(ready.room)
        if st is None and refused is not None:  # failed before the decode was known
            self._ctrl.send(
                Abort(room=ready.room, session=ready.session, reason=refused[0]), to=peer
            )
            return
        if st is not None and st.ready is not None:
            if st.ready.session != ready.session:  # a second decode claims an active room
                self._ctrl.send(
                    Abort(room=ready.room, session=ready.session, reason="duplicate active room"),
                    to=peer,
                )
            return
        st = st or self._rooms.setdefault(ready.room, Room(ready.room))
        st.ready, st.peer = ready, peer
        if st.req is None:
            st.deadline = time.monotonic() + self.ready_timeout_s  # wait for on_admit
        self._check_ready(st)

    def _check_ready(self, st: Room) -> None:
        assert st.ready is not None
        reason = self._ready_mismatch(st)
        if reason:
            self._fail(st, reason)
            return
        if st.req is not None:
            st.deadline = float("inf")  # both sides known: the ack timeout starts at KVDone
        self._flush(st)

    def _ready_mismatch(self, st: Room) -> str:
        assert st.ready is not None
        if st.ready.layout != self.fingerprint:
            return f"KV layout mismatch: decode {st.ready.layout!r} != prefill {self.fingerprint!r}"
        if st.req is not None and st.ready.num_tokens != st.req.prompt_len:
            return f"prompt length mismatch: decode reserved {st.ready.num_tokens}, prefill has {st.req.prompt_len}"
        return ""

    def _on_ack_or_abort(self, msg: Ack | Abort) -> None:
        st = self._rooms.get(msg.room)
        if st is None or st.ready is None or msg.session not in (0, st.ready.session):
            return  # stale
        if isinstance(msg, Abort):
            self._fail(st, f"decode aborted: {msg.reason}", notify=False)
        elif st.done_sent:
            del self._rooms[st.room]
            if st.req is not None:
                self._io.emit(SinkEvent(st.req.rid, True))

    def _fail(self, st: Room, reason: str, notify: bool = True) -> None:
        self._rooms.pop(st.room, None)
        if notify and st.ready is not None:
            self._ctrl.send(
                Abort(room=st.room, session=st.ready.session, reason=reason), to=st.peer
            )
        if st.req is not None:
            self._io.emit(SinkEvent(st.req.rid, False, reason))
        if st.ready is not None:
            self._drop_idle_endpoint(st.ready.data_endpoint)
        if st.req is None or st.ready is None:
            # NOTE: one side not known yet: a later on_admit / Ready of this room is
            # refused with the same reason (a prefill rejection must reach the decode)
            self._refused[st.room] = (reason, time.monotonic() + self.ready_timeout_s)

    # ---- timers (I/O thread) --------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        for st in [s for s in self._rooms.values() if s.deadline <= now]:
            self._fail(st, self._timeout_reason(st))
        for room in [r for r, (_, exp) in self._refused.items() if exp <= now]:
            del self._refused[room]
        if now >= self._next_hb:
            self._next_hb = now + self.heartbeat_s
            hb = Heartbeat(sender=f"prefill:{self.bootstrap_port}", seq=next(self._seq))
            for peer in {s.peer for s in self._rooms.values() if s.peer}:
                self._ctrl.send(hb, to=peer)

    def _timeout_reason(self, st: Room) -> str:
        if st.req is None:
            return f"prefill never admitted room {st.room} within {self.ready_timeout_s}s"
        if st.ready is None:
            return f"no Ready from the decode within {self.ready_timeout_s}s"
        return f"no Ack from the decode within {self.ack_timeout_s}s"

    def _on_exit(self, killed: bool) -> None:
        self._ctrl.close()
        for sock in self._data.values():
            sock.close()
        self._data.clear()
