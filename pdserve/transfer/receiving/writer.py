"""The decode's writes of a checked chunk into its reserved slots (the I/O thread).

Where the transfer's rows go to whole pages of a CPU pool (transfer.py `paged`), a
chunk's kind is written by one call of the engine's page writer (kernels/page_io.py;
natively PageWriter.scatter, its C arguments made once per pool, its layers on the
engine's kernel threads), which checks each block against its hash right before it
writes it. Elsewhere (other slots) rows go by numpy's assignment, or by index_copy_ on a
GPU pool, after validate.py hashed every block.
Writes go straight from the frames' buffers (read-only views, no copy) into the pool.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

from pdserve.kernels.page_io import PORTABLE, PageIO, Writer
from pdserve.kvcache.pools import KVPool
from pdserve.transfer.checksum import HASH_BLOCK
from pdserve.transfer.messages import KINDS
from pdserve.transfer.pages import PageViews, PoolPages, byte_rows, np_pages, pieces
from pdserve.transfer.receiving.payload import Chunk
from pdserve.transfer.receiving.transfer import Paged, Transfer


def write_chunk(x: Transfer, c: Chunk, pages: PageIO = PORTABLE) -> str:
    """Why the chunk was refused while it was written ("" if it was written whole).
    Precondition: check_chunk passed with the same `pages` (it leaves the payload's
    blocks to this call exactly where this call checks them) and the caller holds x.lock
    with x.open set.

    The page writer checks each block before writing it: a block that fails may
    leave the chunk written in part, and the caller must fail the transfer."""
    kinds = KINDS[c.header.kind]
    if x.paged is not None:
        if not _write_paged(x.paged, c, kinds, pages):
            return "checksum mismatch"
    elif x.pool.k.is_cuda:
        _write_device(x, c, kinds)
    else:
        _write_rows(x, c, kinds)
    x.record(kinds, c.header)
    return ""


def _write_paged(paged: Paged, c: Chunk, kinds: tuple[int, ...], pages: PageIO) -> bool:
    h = c.header
    runs, layers = h.runs or [h.tok_end - h.tok_start], (h.layer_start, h.layer_end)
    writer = paged.writer
    if writer is None:  # not armed with the receiver's (tests, tools)
        writer = paged.writer = pages.writer(paged.kinds, paged.page_size)
    # NOTE: K's and V's segments have the same sizes (check_chunk), so each kind's block
    # hashes are its share of them
    per_kind, per_hashes = len(c.segments) // len(kinds), len(h.hashes) // len(kinds)
    for i, kind in enumerate(kinds):
        srcs = c.segments[i * per_kind : (i + 1) * per_kind]
        want = h.hashes[i * per_hashes : (i + 1) * per_hashes]
        if not writer.scatter(kind, layers, paged.pages, h.tok_start, runs, srcs, want, HASH_BLOCK):
            return False
    return True


def _write_rows(x: Transfer, c: Chunk, kinds: tuple[int, ...]) -> None:
    """A CPU pool whose slots are not whole pages: numpy's assignment, a kind at a time."""
    h, lay = c.header, x.pool.layout
    idx = x.slots[h.tok_start : h.tok_end]
    runs = h.runs or [h.tok_end - h.tok_start]  # without runs: one run, each layer a segment
    per_kind = len(c.segments) // len(kinds)
    for i, kind in enumerate(kinds):
        dst = (x.pool.k, x.pool.v)[kind][h.layer_start : h.layer_end]
        scatter_runs(dst, idx, runs, c.segments[i * per_kind : (i + 1) * per_kind], lay.page_size)


def _write_device(x: Transfer, c: Chunk, kinds: tuple[int, ...]) -> None:
    """A pool on a GPU: index_copy_ from the frames, landed before this returns (`land`)."""
    h, lay = c.header, x.pool.layout
    n_layers, n_tok = h.layer_end - h.layer_start, h.tok_end - h.tok_start
    idx = x.slots[h.tok_start : h.tok_end]
    per_kind = len(c.frames) // len(kinds)
    for i, kind in enumerate(kinds):
        dst = (x.pool.k, x.pool.v)[kind][h.layer_start : h.layer_end]
        frames = c.frames[i * per_kind : (i + 1) * per_kind]
        if h.runs:  # one frame per (layer, run) of each kind
            _copy_runs_to_device(dst, idx, h.runs, frames)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only view over the ZeroMQ frame
            src = torch.frombuffer(frames[0], dtype=getattr(torch, lay.dtype))
        shape = (n_layers, n_tok, lay.num_kv_heads, lay.head_dim)
        # from pageable memory the copy stages the frame's bytes before it returns
        dst.index_copy_(1, idx, src.view(shape).to(dst.device, non_blocking=True))
        land(dst.device)


def scatter_runs(
    dst: torch.Tensor, idx: torch.Tensor, runs: list[int], frames: list, page_size: int
) -> None:
    """dst[:, idx] = the frames' rows, from frames sent in place (messages.KVChunk.runs):
    frames[layer * len(runs) + r] holds run r's tokens of that layer (runs split idx in
    order), read straight from their buffers, whole pages by numpy's assignment."""
    rows, slots, off = byte_rows(dst), idx.numpy(), 0
    for r, count in enumerate(runs):
        part = slots[off : off + count]
        mid, pages, rest = pieces(part, page_size, dst.shape[1])
        per_layer = [
            np.frombuffer(frames[layer * len(runs) + r], dtype=np.uint8).reshape(count, -1)
            for layer in range(rows.shape[0])
        ]
        if len(pages):
            to = np_pages(rows, page_size)
            srcs = [f[mid].reshape(len(pages), -1) for f in per_layer]  # raises rather than copy
            for layer, src in enumerate(srcs):
                to[layer, pages] = src
        for piece in rest:
            if piece.start < piece.stop:
                for layer, f in enumerate(per_layer):
                    rows[layer, part[piece]] = f[piece]
        off += count


def _copy_runs_to_device(
    dst: torch.Tensor, idx: torch.Tensor, runs: list[int], frames: list[memoryview]
) -> None:
    """scatter_runs for a pool on a GPU (a CPU prefill's frames sent in place)."""
    off = 0
    for r, count in enumerate(runs):
        part = idx[off : off + count]
        for layer in range(dst.shape[0]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only view over the ZeroMQ frame
                src = torch.frombuffer(frames[layer * len(runs) + r], dtype=dst.dtype)
            dst[layer].index_copy_(0, part, src.view(count, *dst.shape[2:]).to(dst.device))
        off += count
    land(dst.device)


def land(device: torch.device) -> None:
    """Wait until this thread's writes on `device` are done.

    NOTE: the I/O thread's writes go to its own stream, which no stream of the decode
    waits for. Once a transfer is reported, the forward stream may read its slots; once
    it is aborted, its pages may go to another request. A write must have landed before
    either (tests/test_transfer_cuda.py provokes the race and fails without this wait)."""
    torch.cuda.current_stream(device).synchronize()


class PoolWriters:
    """Each pool's pages (PoolPages) and the engine's page writer into them, made once
    per pool (about a transfer's arming again, the first time) and reused while its
    views are the same. One per receiver, used by its I/O thread."""

    def __init__(self, pages: PageIO) -> None:
        self._pages = pages
        self._views = PoolPages()
        self._writers: weakref.WeakKeyDictionary[KVPool, tuple[PageViews, Writer]]
        self._writers = weakref.WeakKeyDictionary()

    def of(self, pool: KVPool) -> tuple[PageViews, Writer | None]:
        """`pool`'s K and V as pages, and the writer into them (None: not a CPU pool of
        pages)."""
        views = self._views.of(pool)
        k, v = views
        if k is None or v is None:
            return views, None
        hit = self._writers.get(pool)
        if hit is None or hit[0] is not views:
            hit = self._writers[pool] = (views, self._pages.writer((k, v), pool.layout.page_size))
        return views, hit[1]
