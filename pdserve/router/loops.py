"""The router's long-lived loops: each tick is guarded, and a loop that ends anyway
is fatal.

Invariants:
- one failing tick (a worker poll that raises anything) is logged and the loop goes on;
- a loop task that ends for any reason but cancellation (the app's shutdown) calls
  `on_death` with the reason: the router then answers /health with 503 and the
  process exits non-zero (router/cli.py), rather than serving with stale worker state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("pdserve.router")


async def every(interval_s: float, tick: Callable[[], Awaitable[object]], what: str) -> None:
    """Run `tick` every `interval_s` forever; an exception in one tick is logged only."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await tick()
        except Exception:
            log.exception("%s failed; it runs again in %.1fs", what, interval_s)


def watch(task: asyncio.Task, what: str, on_death: Callable[[str], None]) -> None:
    """Call `on_death(reason)` when `task` ends other than by cancellation."""

    def done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        on_death(f"{what} stopped: {exc!r}" if exc is not None else f"{what} returned")

    task.add_done_callback(done)
