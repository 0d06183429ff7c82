"""The decode's data socket: what prefills push to its PULL (I/O thread only).

    KVChunk   header, then payload frames: cut as the header names them (payload.py),
              checked (validate.py), written into the reserved slots (writer.py)
    KVDone    checked (validate.check_done): the transfer is reported ok, the Ack goes back;
              one repeated for a transfer that ended lately gets the same answer again
              (the Ack, or the Abort; ended.py)
    lost KV   a KVDone whose KV did not all arrive (a broken connection lost some) asks
              the prefill for all of it again, under a new session, up to
              messages.MAX_PUSHES times in all (Ready.again_of); then the transfer fails

A chunk or KVDone of no live transfer (an unknown room, a stale session) is counted and
dropped. Mixed into KVReceiver, which owns the state and the failure paths named below.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import zmq

from pdserve.kernels.native.page_copy import MAX_RUNS
from pdserve.kernels.page_io import PageIO
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer import stages
from pdserve.transfer.base import SourceEvent, prefill_stages
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.messages import MAX_HEADER_BYTES, MAX_PUSHES, Abort, Ack, KVChunk, KVDone
from pdserve.transfer.receiving.control import ControlSockets
from pdserve.transfer.receiving.ended import Ended
from pdserve.transfer.receiving.payload import received
from pdserve.transfer.receiving.transfer import Transfer
from pdserve.transfer.receiving.validate import cells_missing, check_chunk, check_done
from pdserve.transfer.receiving.writer import write_chunk
from pdserve.transfer.zmq_io import MAX_WIRE_FRAME_BYTES, MsgSocket


def data_limits(layout: KVLayout) -> tuple[int, int]:
    """The most frames and bytes one message on the data socket may have: a header, then
    a kind's (layer, run) frames for both kinds, each kind at most the largest frame the
    wire takes (zmq_io.MAX_WIRE_FRAME_BYTES; a sender splits its pieces far below)."""
    frames = 2 * layout.num_layers * MAX_RUNS
    return 1 + frames, 2 * MAX_WIRE_FRAME_BYTES + MAX_HEADER_BYTES


class DataChannel:
    # owned by KVReceiver
    layout: KVLayout
    counters: Counter[str]
    _data: MsgSocket
    _ctl: ControlSockets
    _io: IOThread
    _pages: PageIO
    _lock: threading.Lock
    _xfers: dict[int, Transfer]
    _ended: Ended

    if TYPE_CHECKING:

        def _close(self, x: Transfer, reason: str = "") -> bool: ...

        def _fail(self, x: Transfer, reason: str, notify: bool = True) -> None: ...

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _lookup(self, room: int, session: int) -> Transfer | None:
        with self._lock:
            x = self._xfers.get(room)
        if x is None:
            self._count("unknown_room")
        elif x.session != session:
            self._count("stale_session")
            return None
        return x

    def _on_data(self) -> None:
        _, msg, frames = self._data.recv(block=False)
        if isinstance(msg, KVChunk):
            self._on_chunk(msg, frames)
        elif isinstance(msg, KVDone):
            self._on_done(msg)
        elif msg is not None:
            self._count("unexpected_message")

    def _on_chunk(self, hdr: KVChunk, frames: list[zmq.Frame]) -> None:
        x = self._lookup(hdr.room, hdr.session)
        if x is None:
            return
        self._ctl.heard(x.endpoint)
        x.claimed = True
        chunk = received(self.layout, hdr, [f.buffer for f in frames])
        t0 = time.perf_counter()
        reason = check_chunk(self.layout, x, chunk, self._pages)
        t1 = t2 = time.perf_counter()
        try:
            with x.lock:
                if not reason and x.open:  # NOTE: cancel() may have closed it since the lookup
                    # "" unless a block failed its hash as it was about to be written
                    reason = write_chunk(x, chunk, self._pages)
                    t2 = time.perf_counter()
        except Exception as e:  # fail closed: partially written KV is never reported ok
            self._fail(x, f"internal error while writing KV: {e!r}")
            return
        finally:  # NOTE: timed here, not inside each: the chunk's path enters stages once
            stages.add("verify", t1 - t0)
            stages.add("scatter", t2 - t1)
        if reason:
            self._count("refused_chunk")
            self._fail(x, f"chunk {hdr.index} refused: {reason}")

    def _on_done(self, done: KVDone) -> None:
        x = self._lookup(done.room, done.session)
        if x is None:
            self._answer_again(done)
            return
        reason = check_done(x, done)
        if reason and cells_missing(x) and x.pushes < MAX_PUSHES:
            self._ask_again(x)
            return
        if reason:
            self._fail(x, f"KVDone refused: {reason}")
            return
        if self._close(x):
            stamps = prefill_stages(done.stages)
            ok = SourceEvent(x.req.rid, True, done.first_token, done.first_logprob, stages=stamps,
                             prefill_logprobs=done.logprobs)  # fmt: skip
            # NOTE: the Ack first: sent after the report, it reached the prefill together
            # with the engine's next Ready, which then waited for it (traced, 1k tokens
            # back to back: the Ready handled 0.35 ms after expect(), 0.25 with the Ack first)
            self._ctl.send(x.endpoint, Ack(room=done.room, session=done.session))
            self._io.emit(ok)

    def _ask_again(self, x: Transfer) -> None:
        """Some of x's KV was lost on the way: start over under a new session, and ask
        the prefill (which holds the KV until the room ends) to push all of it again."""
        # NOTE: `secrets`, as every session (receiver.expect)
        session = secrets.randbits(62) + 1
        with self._lock:
            if self._xfers.get(x.req.room) is not x:
                return  # cancelled meanwhile
            with x.lock:
                ready = x.again(session)
        self._count("pushed_again")
        self._ctl.send(x.endpoint, ready)

    def _answer_again(self, done: KVDone) -> None:
        """A KVDone of no live transfer. The prefill sends it again when it heard no
        answer (a broken connection lost the first KVDone or our answer): one of a
        transfer that ended gets the same answer again; one of the session a transfer
        left (`_ask_again`) gets its Ready again (lost, or still on its way)."""
        with self._lock:
            x = self._xfers.get(done.room)
            again = x.ready if x is not None and x.previous == done.session else None
            end = self._ended.get(done.room, done.session)
        if x is not None and again is not None:
            self._ctl.send(x.endpoint, again)
            return
        if end is None:
            return
        self._count("repeated_done")
        if end.reason:
            self._ctl.send(
                end.endpoint, Abort(room=done.room, session=done.session, reason=end.reason)
            )
        else:
            self._ctl.send(end.endpoint, Ack(room=done.room, session=done.session))
