"""In-process KV handoff: the prefill's KV pages and first token handed to the
decode in memory. The offline `LLM` and the unit tests use it; the servers use
the ZeroMQ transfer (pdserve.transfer) instead.

Requests pair up by `room`. Whichever side arrives second triggers the copy:
    sink.on_done(room)  +  source.expect(room)  ->  copy KV, source event, sink event

A refusal or abort on either side ends the room on the other side too:
    sink.on_abort(room)                    ->  source event (failed), now or at expect
    source.reject / source.cancel(room)    ->  sink event (released, failed), now or at on_admit
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kvcache.pools import KVPool
from pdserve.protocol import PrefillLogprobs
from pdserve.transfer.base import SinkEvent, SourceEvent, Ticket


@dataclass
class _Prefilled:
    rid: str
    pool: KVPool
    slots: torch.Tensor
    first_token: int
    first_logprob: float
    stages: dict[str, float]
    logprobs: PrefillLogprobs | None = None


@dataclass
class _Expected:
    rid: str
    pool: KVPool
    slots: torch.Tensor


class InProcessHandoff:
    def __init__(self) -> None:
        self.prefilled: dict[int, _Prefilled] = {}
        self.expected: dict[int, _Expected] = {}
        self.failed_rooms: dict[int, str] = {}  # refused by the prefill, decode not here yet
        self.cancelled_rooms: dict[int, str] = {}  # refused by the decode
        self.admitted: dict[int, str] = {}  # room -> prefill rid, from on_admit
        self.sink = _Sink(self)
        self.source = _Source(self)
        self.sink_events: list[SinkEvent] = []
        self.source_events: list[SourceEvent] = []

    def _try_copy(self, room: int) -> None:
        src, dst = self.prefilled.get(room), self.expected.get(room)
        if src is None or dst is None:
            return
        del self.prefilled[room], self.expected[room]
        self.admitted.pop(room, None)
        if len(src.slots) != len(dst.slots):
            reason = f"prompt length mismatch: prefill {len(src.slots)}, decode {len(dst.slots)}"
            self.sink_events.append(SinkEvent(src.rid, ok=False, reason=reason))
            self.source_events.append(SourceEvent(dst.rid, ok=False, reason=reason))
            return
        d = dst.slots.to(dst.pool.k.device)
        dst.pool.k[:, d] = src.pool.k[:, src.slots].to(dst.pool.k.device)
        dst.pool.v[:, d] = src.pool.v[:, src.slots].to(dst.pool.v.device)
        self.sink_events.append(SinkEvent(src.rid, ok=True))
        self.source_events.append(
            SourceEvent(
                dst.rid,
                ok=True,
                first_token=src.first_token,
                first_logprob=src.first_logprob,
                stages=src.stages,
                prefill_logprobs=src.logprobs,
            )
        )


class _Sink:
    def __init__(self, h: InProcessHandoff) -> None:
        self.h = h
        self.where: dict[str, tuple[KVPool, torch.Tensor]] = {}  # rid -> prefill pool, slots

    def on_queue(self, req: Ticket) -> None:
        pass  # one process: no decode to wait for

    def on_admit(self, req: Ticket) -> None:
        reason = self.h.cancelled_rooms.pop(req.room, None)
        if reason is not None:
            self.h.sink_events.append(SinkEvent(req.rid, ok=False, reason=reason))
            return
        self.h.admitted[req.room] = req.rid

    def on_chunk(
        self, req: Ticket, pool: KVPool, slots: torch.Tensor, start: int, end: int
    ) -> None:
        if self.h.admitted.get(req.room) == req.rid:  # not refused meanwhile
            self.where[req.rid] = (pool, slots)  # copied whole at on_done: no pipelining

    def on_done(
        self,
        req: Ticket,
        first_token: int,
        first_logprob: float,
        stages: dict[str, float] | None = None,
    ) -> None:
        if req.rid not in self.where:
            return  # the decode refused it; the release event is already out
        pool, slots = self.where.pop(req.rid)
        self.h.prefilled[req.room] = _Prefilled(
            req.rid, pool, slots, first_token, first_logprob, stages or {}, req.prefill_logprobs
        )
        self.h._try_copy(req.room)

    def on_abort(self, req: Ticket, reason: str) -> None:
        self.where.pop(req.rid, None)
        self.h.prefilled.pop(req.room, None)
        if self.h.admitted.pop(req.room, None) == req.rid:
            self.h.sink_events.append(SinkEvent(req.rid, ok=False, reason=reason))  # released
        exp = self.h.expected.pop(req.room, None)
        if exp is not None:
            self.h.source_events.append(SourceEvent(exp.rid, ok=False, reason=f"prefill: {reason}"))
        else:
            self.h.failed_rooms[req.room] = reason

    def poll(self) -> list[SinkEvent]:
        out, self.h.sink_events = self.h.sink_events, []
        return out


class _Source:
    def __init__(self, h: InProcessHandoff) -> None:
        self.h = h

    def announce(self, req: Ticket) -> None:
        pass  # one process: nothing to tell

    def expect(self, req: Ticket, pool: KVPool, slots: torch.Tensor) -> None:
        reason = self.h.failed_rooms.pop(req.room, None)
        if reason is not None:
            self.h.source_events.append(SourceEvent(req.rid, ok=False, reason=f"prefill: {reason}"))
            return
        self.h.expected[req.room] = _Expected(req.rid, pool, slots)
        self.h._try_copy(req.room)

    def cancel(self, req: Ticket, reason: str) -> None:
        if self.h.expected.pop(req.room, None) is not None:
            self.reject(req, reason)

    def reject(self, req: Ticket, reason: str) -> None:
        """The decode gave up on the room: release the prefill's side of it."""
        reason = f"decode refused: {reason}"
        self.h.prefilled.pop(req.room, None)
        rid = self.h.admitted.pop(req.room, None)
        if rid is not None:
            self.h.sink.where.pop(rid, None)
            self.h.sink_events.append(SinkEvent(rid, ok=False, reason=reason))
        else:  # queued in the prefill (or not there yet)
            self.h.cancelled_rooms[req.room] = reason
            self.h.sink_events.append(SinkEvent("", ok=False, reason=reason, room=req.room))

    def poll(self) -> list[SourceEvent]:
        out, self.h.source_events = self.h.source_events, []
        return out
