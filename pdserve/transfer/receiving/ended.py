"""Transfers the decode ended lately, and how, so that a KVDone that comes again is answered.

A broken connection loses whatever it carried: a KVDone on the data link, an Ack or an
Abort on the control link. The prefill sends the KVDone of a room again until it hears
back (sending/sender.py); the decode answers a repeated KVDone of a room it ended with
the answer it gave the first time: an Ack if the transfer ended well, its Abort if not
(a room the prefill never heard the end of would hold its pages until `kv_timeout_s`).

Only the latest `max_rooms` are kept (a repeat of an older one is dropped, as any KVDone
of an unknown room); the answer goes to the prefill the transfer had, never to an
address the message names.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ENDED = 4096


@dataclass(frozen=True)
class End:
    session: int
    endpoint: str  # the prefill's bootstrap endpoint
    reason: str  # "" for a transfer that ended well


class Ended:
    """room -> End, the latest `max_rooms` (callers hold the receiver's lock)."""

    def __init__(self, max_rooms: int = MAX_ENDED) -> None:
        self.max_rooms = max_rooms
        self._rooms: dict[int, End] = {}

    def add(self, room: int, end: End) -> None:
        self._rooms.pop(room, None)  # re-inserted last: the dict's order is the age
        self._rooms[room] = end
        while len(self._rooms) > self.max_rooms:
            del self._rooms[next(iter(self._rooms))]

    def get(self, room: int, session: int) -> End | None:
        """How `room` ended, if it is the same transfer (its session)."""
        end = self._rooms.get(room)
        return end if end is not None and end.session == session else None
