"""A room's KV as frame-sized pieces of its prompt, and the pieces that go in place.

In place: where a piece's slots lie in at most MAX_RUNS runs of consecutive slots (a
prefill pool hands a request's pages out in ascending runs, kvcache/pools.py), each
layer's run of K (then V) is already contiguous in the pool,

    pool.k[layer, s0 : s0 + n]   (n tokens' rows, slots s0.. consecutive)

so it goes out as its own frame straight from the pool, with no gather (`KVChunk.runs`
says how the frames split the tokens). The room keeps the frames' trackers
(`Room.inflight`): the sender reports the room to the engine, which then frees its
pages, only once libzmq is done with every one of them (sender.py).

Hashed early: a piece computed while the decode's Ready has not come yet (a decode
that admits late, or a prefill faster than the decode's admission) is hashed at once
(`Pusher.prepare`, the 'prepare' stage), so when the Ready comes its first byte goes on
the wire without waiting for a hash. Its frames are made for the socket then too (the
address arrays of a native send, zmq_native.Frames, or pyzmq's zero-copy zmq.Frames,
`zero_copy`), so that building them is off the Ready's path as well. The
checksum sent is the one taken then: the pages it covers are final and stay untouched
until the room is reported, and if they were not, the decode would refuse the chunk
(tests/test_transfer_in_place.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zmq

from pdserve.kvcache.pools import KVPool
from pdserve.transfer.zmq_native import Frames

Made = list[zmq.Frame] | Frames  # a message's frames, made before it is due


@dataclass
class InPlace:
    """A piece's frames read in place from the pool (views, no copy)."""

    runs: list[tuple[int, int]]
    frames: tuple[list[np.ndarray], list[np.ndarray]]  # K's, V's: one per (layer, run)
    hashes: tuple[bytes, bytes] | None = None  # K's, V's block hashes, once prepare() took them
    # K's, V's frames made for the socket by Pusher.prepare (zero-copy zmq.Frames, or
    # zmq_native.Frames); sent once, then dropped (NOTE: a pyzmq frame's tracker is done
    # only once this object is gone too)
    zframes: tuple[Made, Made] | None = None


@dataclass
class Piece:
    """KV of prompt positions [start, end) whose slots are slots[start:end]."""

    pool: KVPool
    slots: torch.Tensor
    start: int
    end: int
    prepared: InPlace | None = None  # hashed before the decode's Ready came


MAX_RUNS = 4  # runs of slots a piece may have and still go in place (frames: layers * runs)


def slot_runs(idx: np.ndarray, max_runs: int = MAX_RUNS) -> list[tuple[int, int]] | None:
    """(first slot, count) of each run of consecutive slots in `idx`, or None if more
    than `max_runs` (or `idx` is empty)."""
    if len(idx) == 0:
        return None
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    if len(breaks) >= max_runs:
        return None
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(idx)]))
    return [(int(idx[a]), int(b - a)) for a, b in zip(starts, ends)]


def in_place(piece: Piece) -> InPlace | None:
    """`piece`'s frames straight from its pool, or None where it cannot go in place
    (more than MAX_RUNS runs of slots, or a pool on a GPU: gathered into staging)."""
    if piece.pool.k.is_cuda:
        return None
    runs = slot_runs(piece.slots[piece.start : piece.end].numpy())
    if runs is None:
        return None
    return InPlace(runs, (_frames(piece.pool.k, runs), _frames(piece.pool.v, runs)))


def zero_copy(frames: list[np.ndarray]) -> list[zmq.Frame]:
    """`frames` as zmq.Frames that libzmq reads in place, each with its tracker."""
    return [zmq.Frame(f, copy=False, track=True) for f in frames]


def _frames(src: torch.Tensor, runs: list[tuple[int, int]]) -> list[np.ndarray]:
    """One frame per (layer, run) of `src` (a pool's K or V): views, no copy."""
    rows = src.view(src.shape[0], src.shape[1], -1).view(torch.uint8).numpy()
    return [rows[layer, s0 : s0 + c] for layer in range(len(rows)) for s0, c in runs]
