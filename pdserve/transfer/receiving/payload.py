"""A received KVChunk's payload cut as its header names it (views of the frames, no copy).

    frames    the frames as they came, except a kind's (layer, run) segments packed into
              one frame (a piece gathered page by page, messages.py): cut apart. What
              check_chunk counts and sizes.
    segments  one view per (kind, layer, run), K's then V's: what the block hashes cover
              (checksum.py) and the writer writes. With runs, the frames; without, each
              kind's frame cut into its layers.

NOTE: made before any check, so it reads only what the header bounds (the layout's
layers, MAX_RUNS runs, the kind's frames): a forged range costs nothing here, and frames
of other sizes than the header announces are left as they came, for check_chunk to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kernels.native.page_copy import MAX_RUNS
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.messages import KINDS, KVChunk


@dataclass(frozen=True, slots=True)
class Chunk:
    header: KVChunk
    frames: list[memoryview]
    segments: list[memoryview]


def received(layout: KVLayout, h: KVChunk, raw: list[memoryview]) -> Chunk:
    """Chunk `h` with payload frames `raw` (the module docstring). Without runs each
    kind's frame is cut into its layers whatever its size: check_chunk then refuses a
    frame that is not the size the header announces, before any hash or write."""
    frames = unpack(layout, h, raw)
    layers = h.layer_end - h.layer_start
    bounded = 0 <= h.layer_start < h.layer_end <= layout.num_layers
    if h.runs or not bounded or len(frames) != len(KINDS.get(h.kind, ())):
        return Chunk(h, frames, frames)
    segments = []
    for b in frames:
        whole = memoryview(b).cast("B")
        step = whole.nbytes // layers
        segments += [whole[j * step : (j + 1) * step] for j in range(layers)]
    return Chunk(h, frames, segments)


def frame_bytes(layout: KVLayout, h: KVChunk) -> list[int]:
    """The byte count of each payload frame of one kind that header `h` announces."""
    layers, row = h.layer_end - h.layer_start, layout.token_bytes_per_layer
    if not h.runs:
        return [layers * (h.tok_end - h.tok_start) * row]
    return [c * row for _ in range(layers) for c in h.runs]


def unpack(layout: KVLayout, h: KVChunk, bufs: list[memoryview]) -> list[memoryview]:
    """`bufs` with each kind's frame of packed (layer, run) segments cut into views of
    them; otherwise the frames as they came, for check_chunk to judge."""
    kinds = len(KINDS.get(h.kind, ()))
    if not h.runs or len(h.runs) > MAX_RUNS or min(h.runs) < 1 or len(bufs) != kinds:
        return bufs
    if not 0 <= h.layer_start < h.layer_end <= layout.num_layers:
        return bufs
    sizes = frame_bytes(layout, h)
    if len(sizes) == 1 or any(b.nbytes != sum(sizes) for b in bufs):
        return bufs
    out = []
    for b in bufs:
        whole, at = b.cast("B"), 0
        for size in sizes:
            out.append(whole[at : at + size])
            at += size
    return out
