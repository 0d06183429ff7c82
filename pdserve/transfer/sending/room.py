"""Prefill-side state of one room (I/O thread only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kvcache.pools import KVPool
from pdserve.transfer.base import Ticket
from pdserve.transfer.messages import Ready
from pdserve.transfer.sending.pieces import Piece
from pdserve.transfer.zmq_io import Tracker


@dataclass
class Room:
    room: int
    req: Ticket | None = None  # set by on_admit
    ready: Ready | None = None  # set when the decode's Ready arrives
    peer: bytes = b""  # decode's identity on the bootstrap ROUTER (its Announce or Ready)
    queued: bool = False  # the prefill has a request of this room (on_queue or on_admit)
    claimed: bool = False  # a Claim went to the decode (queued and its Ready known)
    pending: list[Piece] = field(default_factory=list)
    # (pool, slots, start, end) of every on_chunk: what is pushed again if the decode
    # lost some of it (Ready.again_of); the pages stay the room's until it is released
    made: list[tuple[KVPool, torch.Tensor, int, int]] = field(default_factory=list)
    pushes: int = 1  # times its KV was pushed (at most messages.MAX_PUSHES)
    done: tuple[int, float] | None = None  # (first_token, first_logprob) from on_done
    stages: dict[str, float] = field(default_factory=dict)  # from on_done, for KVDone
    sent: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, checksum)
    done_sent: bool = False
    resend_at: float = 0.0  # when the KVDone goes again if no Ack or Abort came (sender._tick)
    resend_gap: float = 0.0  # the wait before that: doubled each time, up to a cap
    deadline: float = 0.0
    # frames sent in place from the pool: its pages are read by libzmq until these are done
    inflight: list[Tracker] = field(default_factory=list)


def phase(st: Room) -> str:
    if st.req is None:
        return "wait_admit"
    if st.ready is None:
        return "wait_ready"
    return "wait_ack" if st.done_sent else "pushing"
