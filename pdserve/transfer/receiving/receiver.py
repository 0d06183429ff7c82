"""Decode side of the KV transfer: a `KVSource` that receives KV over ZeroMQ.

Per request:  announce ─▶ expect ─▶ Ready ─▶ KVChunk* (validated, then written) ─▶ KVDone ─▶ ok + Ack
              anything wrong, a timeout, a silent prefill or an Abort ─▶ failed (+ Abort)
Refused before expect (reject) ─▶ Abort(room, session 0) so the prefill drops it too.
Every `heartbeat_interval_s` the receiver sends a Heartbeat to each prefill it has transfers or
announced rooms with, so a prefill finds a dead decode in seconds. The prefill endpoint
comes from the request: checked first (netaddr), its socket bounded (control.py).

Invariants:
- The I/O thread writes into a request's slots only while holding that transfer's
  lock with `open` set; every terminal path (ok, failure, cancel) clears `open`
  under the same lock. So once cancel() returns or poll() reports the request,
  nothing writes into its slots again and the decode may free its pages.
- A chunk's header is validated completely (room, session, ranges, byte counts, the
  checksum of its block hashes, no overlap with what arrived before) before a single
  byte is written, and each block of its payload is checked against its hash before
  it is written (validate.py, writer.py); a chunk refused part-way fails its transfer.

KVReceiver's engine-thread side and its control sockets are here; what comes on its data
socket is handled by data.py's DataChannel.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import torch
import zmq

from pdserve.config import TransferConfig
from pdserve.envs import cache_root
from pdserve.kernels.page_io import page_io
from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.netaddr import tcp_endpoint
from pdserve.transfer.base import SourceEvent, Ticket
from pdserve.transfer.curve import authorize
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import Abort, Announce, Claim, Decoder, Heartbeat, Ready, remote_text
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.receiving.control import ControlSockets
from pdserve.transfer.receiving.data import DataChannel, data_limits
from pdserve.transfer.receiving.ended import End, Ended
from pdserve.transfer.receiving.transfer import Transfer
from pdserve.transfer.receiving.writer import PoolWriters
from pdserve.transfer.zmq_io import CurveKeys, MsgSocket, bind, make_socket

log = logging.getLogger(__name__)


class KVReceiver(DataChannel):
    """`KVSource` over ZeroMQ. expect/cancel/poll are called from one engine thread."""

    def __init__(
        self,
        layout: KVLayout,
        settings: TransferConfig,
        *,
        model: str = "",
        curve: CurveKeys | None = None,
        native_scatter: bool = True,
        kernel_threads: Callable[[], int] | None = None,
    ) -> None:
        """`settings`: the data socket binds `transfer_host:data_port` (0: any free port,
        then in `self.data_port`) and is advertised as `advertise_host` (an address, "auto"
        resolved by the caller); the timers are its fields. `native_scatter`: write whole
        pages and hash chunks in C, on as many threads as the engine's kernels use,
        `kernel_threads` (kernels/core_share.Cores; None: torch's thread count), built
        (once per machine, about a second) and loaded here at start-up, never inside a
        transfer; False, or no C compiler: numpy and Python's xxhash (--disable-compile).
        Either is the page I/O of kernels/page_io.py, chosen here once."""
        self.layout = layout
        self._fingerprint = layout.fingerprint()  # in every Ready
        self._pages = page_io(cache_root() if native_scatter else None, kernel_threads)
        self.settings = settings
        self.model = model  # identity.model_fingerprint(); sent in Ready
        self._next_hb = 0.0
        self._hb_seq = 0
        self.decode_id = f"decode-{secrets.randbits(48):012x}"
        self._curve = curve
        self._decoder = Decoder()
        self._writers = PoolWriters(self._pages)  # I/O thread
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards self._xfers (engine thread vs I/O thread)
        self._xfers: dict[int, Transfer] = {}
        self._ended = Ended()  # guarded by _lock: how the latest transfers ended (ended.py)
        self._io = IOThread("kv-receiver", tick_s=0.05)
        # prefill bootstrap endpoint -> DEALER (I/O thread)
        self._ctl = ControlSockets(
            self._io, self._decoder, curve, self._on_control, self._busy, self.decode_id.encode()
        )
        # an unfinished message's bound (with CURVE, only the cluster's workers connect)
        self._guard = PeerGuard(self._decoder.dropped) if curve is None else None
        self._ctl.guard = self._guard
        self._io.on_tick = self._tick
        self._io.on_exit = self._on_exit
        if curve is not None:
            authorize(curve)  # ZAP: only holders of the cluster secret may connect
        pull = make_socket(zmq.PULL, curve, curve_server=curve is not None)
        # NOTE: before the bind, so the guard's monitor sees every connection
        self._data = MsgSocket(pull, self._decoder, limits=data_limits(layout), guard=self._guard)
        self.data_port = bind(pull, settings.transfer_host, settings.data_port)
        self.data_endpoint = f"tcp://{settings.advertise_host}:{self.data_port}"
        self._io.add_reader(pull, self._on_data)
        self._io.start()

    # ---- KVSource (engine thread) -----------------------------------------------------
    def announce(self, req: Ticket) -> None:
        """`req` reached the decode (no pages yet): tell its prefill now, so this decode's
        heartbeat covers the room from the start (messages.Announce)."""
        endpoint = _endpoint(req)
        if endpoint is None or not req.room:
            return  # expect() refuses it, naming the field
        msg = Announce(room=req.room, decode_id=self.decode_id)
        self._io.submit(lambda: self._ctl.announce(req.room, endpoint, msg))

    def expect(self, req: Ticket, pool: KVPool, slots: torch.Tensor) -> None:
        """Precondition: `slots` (len == req.prompt_len) are reserved for `req` in `pool`."""
        reason = self._refuse_reason(req, pool, slots)
        endpoint = _endpoint(req)
        if reason or endpoint is None:
            self._io.emit(SourceEvent(req.rid, False, reason=reason))
            with self._lock:
                live = req.room in self._xfers  # a duplicate: the live one keeps the room
            if endpoint is not None and not live:  # its prefill must not wait for a Ready
                abort = Abort(room=req.room, session=0, reason=reason)
                self._io.submit(lambda: self._withdraw(req.room, endpoint, abort))
            return
        if slots.dtype != torch.int64 or slots.device != pool.k.device:
            slots = slots.to(pool.k.device, torch.int64)
        # NOTE: `secrets`, not `random`: the session proves a chunk belongs to this reservation,
        # so a peer must not predict it from sessions it has seen (random's state is recoverable)
        x = Transfer(req, pool, slots, secrets.randbits(62) + 1, endpoint)
        x.deadline = time.monotonic() + self.settings.kv_timeout_s
        ready = x.ready = Ready(
            room=req.room,
            rid=req.rid,
            session=x.session,
            data_endpoint=self.data_endpoint,
            layout=self._fingerprint,
            num_tokens=req.prompt_len,
            decode_id=self.decode_id,
            model=self.model,
        )
        with self._lock:
            self._xfers[req.room] = x
        self._io.submit(lambda: self._send_ready(x, ready))

    def cancel(self, req: Ticket, reason: str) -> None:
        """After this returns nothing writes into req's slots; poll() reports nothing for it."""
        with self._lock:
            x = self._xfers.get(req.room)
            if x is None or x.req is not req:
                return
            del self._xfers[req.room]
            abort = Abort(room=req.room, session=x.session, reason=f"decode cancelled: {reason}")
            self._ended.add(req.room, End(x.session, x.endpoint, abort.reason))
        with x.lock:
            x.open = False
        self._io.submit(lambda: self._ctl.send(x.endpoint, abort))

    def reject(self, req: Ticket, reason: str) -> None:
        """Tell `req`'s prefill that this decode refused the room (no Ready was sent)."""
        endpoint = _endpoint(req)
        if not req.room or endpoint is None:
            return
        abort = Abort(room=req.room, session=0, reason=reason)
        self._io.submit(lambda: self._withdraw(req.room, endpoint, abort))

    def poll(self) -> list[SourceEvent]:
        return self._io.drain()

    def wait(self, timeout_s: float) -> list[SourceEvent]:
        """poll(), after blocking up to `timeout_s` for the first event (tools and
        benchmarks: an engine polls between steps and never blocks)."""
        return self._io.wait(timeout_s)

    def stats(self) -> dict[str, int]:
        """Counters of refused and dropped messages, and the active transfers."""
        with self._lock:
            counts = {"active_rooms": len(self._xfers), **self._decoder.dropped, **self.counters}
        return {**counts, "control_sockets": len(self._ctl), "control_refused": self._ctl.refused}

    def active_rooms(self) -> set[int]:
        with self._lock:
            return set(self._xfers)

    def close(self) -> None:
        self._io.stop()

    def _refuse_reason(self, req: Ticket, pool: KVPool, slots: torch.Tensor) -> str:
        if pool.layout is not self.layout and pool.layout != self.layout:
            return f"pool layout {pool.layout.fingerprint()} != receiver layout {self._fingerprint}"
        if len(slots) != req.prompt_len or req.prompt_len == 0:
            return f"reserved {len(slots)} slots for a prompt of {req.prompt_len} tokens"
        try:
            tcp_endpoint(req.bootstrap_host, req.bootstrap_port)
        except ValueError as e:
            return f"request has no valid bootstrap address: {e}"
        with self._lock:
            if req.room in self._xfers:
                return f"duplicate active room {req.room}"
        return ""

    # ---- I/O thread -------------------------------------------------------------------
    def _busy(self) -> set[str]:
        """The prefill endpoints a transfer or an announced room still needs."""
        with self._lock:
            busy = {x.endpoint for x in self._xfers.values()}
        return busy | set(self._ctl.announced.values())

    def _withdraw(self, room: int, endpoint: str, abort: Abort) -> None:
        self._ctl.settle(room, endpoint)
        self._ctl.send(endpoint, abort)

    def _send_ready(self, x: Transfer, ready: Ready) -> None:
        self._ctl.settle(x.req.room, x.endpoint)  # the transfer covers it now
        if not self._ctl.send(x.endpoint, ready):
            self._fail(x, f"cannot reach prefill {x.endpoint}", notify=False)
            return
        x.ready_sent = time.monotonic()
        # NOTE: off the transfer's path, while the Ready is on its way
        x.arm(*self._writers.of(x.pool))

    def _on_control(self, endpoint: str, sock: MsgSocket) -> None:
        _, msg, _ = sock.recv(block=False)
        if msg is None:
            return
        self._ctl.heard(endpoint)
        if isinstance(msg, Abort | Claim):
            with self._lock:
                x = self._xfers.get(msg.room)
            if x is None or x.endpoint != endpoint or msg.session not in (0, x.session):
                return  # another prefill's room, or a stale session
            if isinstance(msg, Claim):
                x.claimed = True
            else:
                self._fail(x, f"prefill aborted: {remote_text(msg.reason)}", notify=False)
        elif not isinstance(msg, Heartbeat):
            self._count("unexpected_message")

    def _close(self, x: Transfer, reason: str = "") -> bool:
        """Make `x` terminal (`reason`: why it failed, "" if it ended well); False if
        something else (cancel, another failure) did first."""
        with self._lock:
            if self._xfers.get(x.req.room) is x:
                del self._xfers[x.req.room]
                self._ended.add(x.req.room, End(x.session, x.endpoint, reason))
        with x.lock:
            was_open, x.open = x.open, False
        return was_open

    def _fail(self, x: Transfer, reason: str, notify: bool = True) -> None:
        if not self._close(x, reason):
            return
        self._io.emit(SourceEvent(x.req.rid, False, reason=reason))
        if notify:
            self._ctl.send(x.endpoint, Abort(room=x.req.room, session=x.session, reason=reason))

    def _tick(self) -> None:
        if self._guard is not None:
            self._guard.check()
        now = time.monotonic()
        with self._lock:
            xfers = list(self._xfers.values())
        for x in xfers:
            try:
                self._check_timers(x, now)
            except Exception as e:  # fail this transfer, never the others' timers
                log.exception("transfer timer of room %d failed", x.req.room)
                self._fail(x, f"internal error: {e!r}", notify=False)
        if now >= self._next_hb:
            self._next_hb = now + self.settings.heartbeat_interval_s
            self._heartbeat(self._busy())
            self._ctl.prune(now)

    def _check_timers(self, x: Transfer, now: float) -> None:
        cfg = self.settings
        silent = now - max(x.started, self._ctl.last_seen.get(x.endpoint, 0.0))
        if now > x.deadline:
            self._fail(x, f"KV transfer timed out after {cfg.kv_timeout_s}s")
        elif not x.claimed and now - x.started > cfg.kv_bootstrap_timeout_s:
            self._fail(x, f"prefill {x.endpoint} did not claim room {x.req.room} within "
                          f"{cfg.kv_bootstrap_timeout_s}s (it has no request of that room)")  # fmt: skip
        elif silent > cfg.heartbeat_timeout_s:
            self._fail(x, f"prefill {x.endpoint} silent for {silent:.1f}s (dead?)")
        elif not x.claimed and x.ready and 0 < x.ready_sent <= now - cfg.heartbeat_interval_s:
            # NOTE: a broken connection may have lost the Ready or the prefill's Claim: a
            # repeat gets the Claim again (a prefill still waiting for its request ignores it)
            x.ready_sent = now
            with self._lock:
                self.counters["ready_sent_again"] += 1
            self._ctl.send(x.endpoint, msgspec.structs.replace(x.ready, again_of=x.session))

    def _heartbeat(self, endpoints: set[str]) -> None:
        """I/O thread: tell each prefill with a live transfer or an announced room that
        this decode is alive."""
        self._hb_seq += 1
        for endpoint in endpoints:
            self._ctl.send(endpoint, Heartbeat(sender=self.decode_id, seq=self._hb_seq))

    def _on_exit(self, killed: bool) -> None:
        self._data.close()
        self._ctl.close_all()


def _endpoint(req: Ticket) -> str | None:
    """The prefill endpoint `req` names, None where it names none or a bad one."""
    try:
        return tcp_endpoint(req.bootstrap_host, req.bootstrap_port)
    except ValueError:
        return None
