"""Seeded fault injection in the transfer's send path (tests and chaos runs).

Frames passed to a hook are valid only during the call (the sender recycles its
staging buffers once ZeroMQ is done), so anything kept for later is copied.

`FaultInjector` is a `SendHook`: pass it as `KVSender(fault_hook=...)`. Each `Fault`
targets one message type ("KVChunk", "KVDone", "Heartbeat", "Abort") and fires either
on the `nth` message of that type (0-based) or with probability `prob`.

    drop       the message never leaves
    delay      the I/O thread sleeps `delay_s` before sending it
    duplicate  sent twice
    reorder    held back and sent after the next message of the same channel
    truncate   last frame cut to half its length
    corrupt    one byte of the last frame flipped (the header if there is no payload)

`kill_peer(sender)` stops a sender abruptly: no Abort, no goodbye, sockets dropped.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from pdserve.transfer.zmq_io import Frame

ACTIONS = ("drop", "delay", "duplicate", "reorder", "truncate", "corrupt")
_DATA_KINDS = {"KVChunk", "KVDone"}  # sent on the data socket; the rest on the control socket


@dataclass(frozen=True)
class Fault:
    action: str
    kind: str = "KVChunk"
    nth: int | None = None
    prob: float = 0.0
    delay_s: float = 0.5

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, f"unknown fault action {self.action!r}"


class FaultInjector:
    def __init__(self, faults: list[Fault], seed: int = 0) -> None:
        self.faults = faults
        self.rng = random.Random(seed)
        self.seen: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()
        self._held: dict[bool, list[Frame]] = {}  # channel (is data) -> held-back message

    def __call__(self, kind: str, frames: list[Frame]) -> list[list[Frame]]:
        n = self.seen[kind]
        self.seen[kind] += 1
        held = self._held.pop(kind in _DATA_KINDS, None)  # released after this message
        out = [frames]
        for f in self.faults:
            if f.kind == kind and (f.nth == n if f.nth is not None else self.rng.random() < f.prob):
                self.fired[f.action] += 1
                out = self._apply(f, kind, out)
        if held is not None:
            out.append(held)
        return out

    def _apply(self, f: Fault, kind: str, out: list[list[Frame]]) -> list[list[Frame]]:
        if f.action == "drop":
            return []
        if f.action == "delay":
            time.sleep(f.delay_s)
            return out
        if f.action == "duplicate":
            return out + [list(m) for m in out]
        if f.action == "reorder":
            if out:  # NOTE: copied: the caller may reuse its buffers once this call returns
                self._held[kind in _DATA_KINDS] = [bytes(memoryview(f).cast("B")) for f in out[0]]
            return out[1:]
        return [self._damage(f.action, m) for m in out]

    def _damage(self, action: str, msg: list[Frame]) -> list[Frame]:
        last = bytearray(memoryview(msg[-1]).cast("B"))
        if action == "truncate":
            last = last[: len(last) // 2]
        elif last:
            last[self.rng.randrange(len(last))] ^= 0xFF
        return [*msg[:-1], bytes(last)]


def kill_peer(sender: object) -> None:
    """Kill a KVSender mid-transfer: its I/O thread exits without sending anything more."""
    sender.kill()  # type: ignore[attr-defined]
