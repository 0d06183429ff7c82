"""The transfer port: the seams where KV leaves the prefill and enters the decode.

The prefill engine talks to a `KVSink`; the decode engine to a `KVSource`.
Two implementations exist: an in-process handoff (offline `LLM`, unit tests)
and the ZeroMQ transfer in `pdserve.transfer` (the real PD path).

Prefill side, per request:    on_queue -> on_admit -> on_chunk* -> on_done | on_abort,
                               then poll() says release
Decode side,  per request:    announce -> expect -> poll() says done(first_token) | failed(reason)
                               cancel() at any time (client gone, timeout)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import msgspec
import torch

from pdserve.kvcache.pools import KVPool
from pdserve.protocol import PrefillLogprobs

# The prefill's own time.time() stamps of a request, carried to the decode with the first
# token for the TTFT breakdown (server/generation.py): its frontend's handler started,
# it reached the prefill, its first prompt chunk started computing, its first token was
# sampled.
PREFILL_STAGES = ("prefill_http", "prefill_arrive", "prefill_start", "prefill_end")


def prefill_stages(raw: dict[str, float]) -> dict[str, float]:
    """The known, finite stamps of `raw` (it came off the wire: anything else is dropped)."""
    return {
        k: float(v)
        for k, v in raw.items()
        if k in PREFILL_STAGES and isinstance(v, (int, float)) and math.isfinite(v)
    }


class Ticket(Protocol):
    """What the transfer knows of a request: identity, size and peer, nothing more.

    The scheduler's request state (`pdserve.scheduler.request.Req`) satisfies it and
    is passed as is; the transfer never reads or writes anything else of it.
    """

    @property
    def rid(self) -> str: ...

    @property
    def room(self) -> int:  # 63-bit bootstrap_room chosen by the router
        ...

    @property
    def prompt_len(self) -> int:  # tokens of KV to move
        ...

    @property
    def bootstrap_host(self) -> str | None:  # the prefill's bootstrap address (decode side)
        ...

    @property
    def bootstrap_port(self) -> int | None: ...

    @property
    def prefill_logprobs(self) -> PrefillLogprobs | None:  # prefill side: sent with KVDone
        ...


@dataclass(frozen=True)
class KVTicket:
    """A plain `Ticket`, for transfers driven without a scheduler (tests, benchmarks)."""

    rid: str
    room: int
    prompt_len: int
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    prefill_logprobs: PrefillLogprobs | None = None


class SinkEvent(msgspec.Struct, frozen=True):
    """Prefill side: the KV of `rid` may be freed (`ok`: the decode has it).

    rid "" with a `room`: the decode refused that room before the prefill admitted a
    request for it; a queued request of that room is dropped with `reason`."""

    rid: str
    ok: bool
    reason: str = ""
    room: int = 0


class SourceEvent(msgspec.Struct, frozen=True):
    """Decode side: the KV of `rid` is in its reserved slots (ok) or never will be."""

    rid: str
    ok: bool
    first_token: int = -1
    first_logprob: float = 0.0
    reason: str = ""
    stages: dict[str, float] = msgspec.field(default_factory=dict)  # the prefill's stamps
    prefill_logprobs: PrefillLogprobs | None = None  # KVDone's (unchecked: the decode checks)


class KVSink(Protocol):
    def on_queue(self, req: Ticket) -> None:
        """A prefill request arrived (queued: no row, no pages yet). Its room is known to
        the sink from now on: a room no decode claims within the bootstrap timeout is
        reported (a room-only SinkEvent) and its request dropped."""

    def on_admit(self, req: Ticket) -> None:
        """A prefill request was admitted (row and pages owned by the prefill). Its
        room is now known to the sink; the decode's Ready may arrive before or after."""

    def on_chunk(
        self, req: Ticket, pool: KVPool, slots: torch.Tensor, start: int, end: int
    ) -> None:
        """KV of prompt positions [start, end) is computed in every layer.

        `slots[i]` is the KV slot of position i (the whole prompt's slots). The
        memory stays untouched until poll() reports this request released.
        """

    def on_done(
        self,
        req: Ticket,
        first_token: int,
        first_logprob: float,
        stages: dict[str, float] | None = None,
    ) -> None:
        """The whole prompt is computed and the first token sampled. `stages`: the
        prefill's PREFILL_STAGES stamps, passed on to the decode for its TTFT breakdown."""

    def on_abort(self, req: Ticket, reason: str) -> None:
        """The prefill gives up on the request (client gone, rejected); tell the decode.
        For an admitted request, poll() later reports it released (ok=False) once
        the sink no longer reads its KV; only then does the prefill free the pages."""

    def poll(self) -> list[SinkEvent]:
        """Requests whose KV the prefill may now free. Never blocks."""
        ...


class KVSource(Protocol):
    def announce(self, req: Ticket) -> None:
        """`req` arrived (queued: no row, no pages yet): tell its prefill now, so a decode
        that dies before it reserves anything does not leave the prefill holding the room."""

    def expect(self, req: Ticket, pool: KVPool, slots: torch.Tensor) -> None:
        """Row and pages are reserved: KV of prompt position i goes to `slots[i]`
        (len(slots) == req.prompt_len). Start the transfer (send Ready)."""

    def cancel(self, req: Ticket, reason: str) -> None:
        """Stop waiting for `req`; after this returns nothing writes into its slots."""

    def reject(self, req: Ticket, reason: str) -> None:
        """`req` was refused or aborted before expect(): tell its prefill (by room), so
        the prefill drops the request instead of holding it for a decode that never comes."""

    def poll(self) -> list[SourceEvent]:
        """Transfers that ended since the last call. Never blocks."""
        ...
