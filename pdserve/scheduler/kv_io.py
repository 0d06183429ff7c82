"""The seams where KV leaves the prefill and enters the decode.

The prefill engine talks to a `KVSink`; the decode engine to a `KVSource`.
Two implementations exist: an in-process handoff (offline `LLM`, unit tests)
and the ZeroMQ transfer in `pdserve.transfer` (the real PD path).

Prefill side, per request:    on_chunk* -> on_done | on_abort,   then poll() says release
Decode side,  per request:    expect -> poll() says done(first_token) | failed(reason)
                               cancel() at any time (client gone, timeout)
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch

from pdserve.scheduler.pools import KVPool
from pdserve.scheduler.request import Req


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


class KVSink(Protocol):
    def on_admit(self, req: Req) -> None:
        """A prefill request was admitted (row and pages owned by the prefill). Its
        room is now known to the sink; the decode's Ready may arrive before or after."""

    def on_chunk(self, req: Req, pool: KVPool, slots: torch.Tensor, start: int, end: int) -> None:
        """KV of prompt positions [start, end) is computed in every layer.

        `slots[i]` is the KV slot of position i (the whole prompt's slots). The
        memory stays untouched until poll() reports this request released.
        """

    def on_done(self, req: Req, first_token: int, first_logprob: float) -> None:
        """The whole prompt is computed and the first token sampled."""

    def on_abort(self, req: Req, reason: str) -> None:
        """The prefill gives up on the request (client gone, rejected); tell the decode.
        For an admitted request, poll() later reports it released (ok=False) once
        the sink no longer reads its KV; only then does the prefill free the pages."""

    def poll(self) -> list[SinkEvent]:
        """Requests whose KV the prefill may now free. Never blocks."""
        ...


class KVSource(Protocol):
    def expect(self, req: Req, pool: KVPool, slots: torch.Tensor) -> None:
        """Row and pages are reserved: KV of prompt position i goes to `slots[i]`
        (len(slots) == req.prompt_len). Start the transfer (send Ready)."""

    def cancel(self, req: Req, reason: str) -> None:
        """Stop waiting for `req`; after this returns nothing writes into its slots."""

    def reject(self, req: Req, reason: str) -> None:
        """`req` was refused or aborted before expect(): tell its prefill (by room), so
        the prefill drops the request instead of holding it for a decode that never comes."""

    def poll(self) -> list[SourceEvent]:
        """Transfers that ended since the last call. Never blocks."""
        ...
