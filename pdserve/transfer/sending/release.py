"""A room's release to the prefill engine, held until libzmq reads none of its pages
(I/O thread only).

Frames sent in place are the pool's own memory (pieces.py): the engine frees a room's
pages as soon as it takes the room's SinkEvent, so that event waits until every tracker
of the room's frames is done (`report`, then `tick` for those still read).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from pdserve.transfer.base import SinkEvent
from pdserve.transfer.zmq_io import Tracker

SETTLE_S = 0.002  # how long a report waits for trackers libzmq is about to finish


def settled(trackers: list[Tracker], wait_s: float = SETTLE_S) -> bool:
    """Whether libzmq is done with every tracked frame, waiting up to `wait_s` in all:
    a pyzmq frame's tracker is set by pyzmq's collector thread a moment after libzmq lets
    go (a native send's at once, by libzmq's I/O thread)."""
    end = time.monotonic() + wait_s
    for t in trackers:
        if t.done:
            continue
        try:
            t.wait(max(0.0, end - time.monotonic()))
        except zmq.NotDone:
            return False
    return True


class Releases:
    def __init__(self, emit: Callable[[SinkEvent], None]) -> None:
        self._emit = emit
        self._held: list[tuple[list[Tracker], SinkEvent]] = []

    def report(self, trackers: list[Tracker], event: SinkEvent) -> None:
        """Emit `event` once libzmq reads none of the frames `trackers` track: at once
        for frames it is already done with, else from a later tick."""
        if settled(trackers):
            self._emit(event)
        else:
            self._held.append((trackers, event))

    def tick(self) -> None:
        held, self._held = self._held, []
        for trackers, event in held:
            if all(t.done for t in trackers):
                self._emit(event)
            else:
                self._held.append((trackers, event))
