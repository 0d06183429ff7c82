"""The interface both engines (prefill and decode) offer to their process loop.

The engine process (pdserve.server) owns one engine and calls, from one thread:
    add_request / abort  as frontend messages arrive,
    step()               in a loop; it returns the TokenEvents ready now,
    has_work()           False when a step has nothing to compute (idle, or only waiting
                         for KV transfers): the loop then waits a few ms for messages
                         before the next step().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.protocol import EngineRequest, TokenEvent


class Engine(Protocol):
    role: str  # "prefill" | "decode"
    # Set by the process loop: the engine may send events through it from inside step(),
    # on the same thread (the decode does, for first tokens whose KV lands while a
    # forward runs). None: events go out only when step() returns.
    publish: Callable[[list[TokenEvent]], None] | None

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Invalid or unservable requests are not raised: they end
        with an error TokenEvent returned by a later step()."""

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """End `rid` (if known) with finish_reason "abort"; frees its row and pages."""

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration. Returns quickly when idle."""
        ...

    def has_work(self) -> bool:
        """A step would compute now (not just wait on transfers)."""
        ...

    def has_unfinished(self) -> bool:
        """Some request has not reached its terminal state, or resources await release."""
        ...

    def stats(self) -> dict[str, float]:
        """free_rows, total_rows, free_kv_pages, total_kv_pages, running, queued, ..."""
        ...

    def close(self) -> None: ...
