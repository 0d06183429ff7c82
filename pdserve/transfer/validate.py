"""Receiver-side state of one transfer and the checks run before any byte is written.

Every header field is checked before anything of a chunk is written (room, session,
ranges, byte counts, no overlap, the hash count, the checksum of the block hashes), and
every payload block is checked against its hash before it is written (checksum.py):
by the page writer (kernels/page_io.py; natively block by block, each right before its
write), where it writes the chunk; otherwise all of them here, before the write. A block that fails stops the
write: the chunk is refused and the transfer fails, its pages (the request's own, no
one else's) freed unread.

Coverage map of one transfer (1 = received), per kind:
    cov[kind, layer, token]    kind 0 = K, 1 = V;  layer in [0, L);  token in [0, prompt_len)
KVDone is accepted only when every cell is exactly 1 (each written exactly once:
a chunk overlapping cells already received is refused before writing).

Writing: where the request's slots are whole pages in prompt order (as the decode's
allocator hands them out) and the pool is on the CPU, a chunk's kind is written by one
call of the engine's page writer (kernels/page_io.py; natively PageWriter.scatter, its
C arguments made once per pool, its layers on the engine's kernel threads, as the
chunk's frames are hashed), with its pages looked up once per transfer
(`Transfer.arm`: on the I/O thread right after the Ready is sent, while the prefill's
answer is on its way); elsewhere (other slots) by numpy's assignment (staging.py), or by
index_copy_ on a GPU pool.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kernels.native.page_copy import MAX_RUNS
from pdserve.kernels.page_io import PORTABLE, PageIO, Writer
from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.transfer import stages
from pdserve.transfer.base import Ticket
from pdserve.transfer.checksum import (
    HASH_BLOCK,
    block_hashes,
    blocks_of,
    chunk_checksum,
    done_digest,
)
from pdserve.transfer.messages import KVChunk, KVDone
from pdserve.transfer.staging import (
    PageViews,
    pool_views,
    request_pages,
    scatter_rows,
    scatter_runs,
)

_KINDS = {"kv": (0, 1), "k": (0,), "v": (1,)}


@dataclass(eq=False)
class Transfer:
    req: Ticket
    pool: KVPool
    slots: torch.Tensor  # int64 on the pool's device, len == prompt_len
    session: int
    endpoint: str  # the prefill's bootstrap endpoint
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: bool = True  # guarded by lock: False once terminal; no write after that
    started: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (index, checksum) written
    _cov: np.ndarray | None = field(init=False, default=None)
    _paged: Paged | None = field(init=False, default=None)
    _paged_known: bool = field(init=False, default=False)

    @property
    def cov(self) -> np.ndarray:
        """The coverage map (module docstring), made on first use: on the I/O thread
        (`arm`), not in the engine's expect()."""
        if self._cov is None:
            self._cov = np.zeros((2, self.pool.layout.num_layers, self.req.prompt_len), np.uint8)
        return self._cov

    def cover(self, kind: int, h: KVChunk) -> None:
        """Mark the cells chunk `h` wrote for `kind` (check_chunk found none set)."""
        self.cov[kind, h.layer_start : h.layer_end, h.tok_start : h.tok_end] = 1

    def arm(self, views: PageViews | None = None, writer: Writer | None = None) -> None:
        """Make what the first chunk needs (I/O thread, once the Ready is sent: the
        prefill's answer takes longer than this). `views`: the pool's (PoolPages.of);
        `writer`: the receiver's writer into that pool (KVReceiver._writer)."""
        _ = self.cov
        paged = self.paged(views)
        if paged is not None:
            paged.writer = writer

    def paged(self, views: PageViews | None = None) -> Paged | None:
        """The pool's K and V as pages (`views`, else made here) and this request's
        pages, found once (I/O thread); None where chunks go through the general path
        (a GPU pool, slots that are not whole pages in prompt order)."""
        if not self._paged_known:
            self._paged_known = True
            page_size = self.pool.layout.page_size
            k, v = views or pool_views(self.pool)
            pages = request_pages(self.slots.numpy(), page_size) if k is not None else None
            if k is not None and v is not None and pages is not None:
                self._paged = Paged((k, v), pages, page_size)
        return self._paged


@dataclass
class Paged:
    """Where a transfer's rows go: position p to row p % P of page pages[p // P]."""

    kinds: tuple[np.ndarray, np.ndarray]  # the pool's K, V: uint8 [L, num_pages, page bytes]
    pages: np.ndarray  # int64, the request's pages in prompt order
    page_size: int
    writer: Writer | None = None  # into `kinds`, where the transfer was armed with one


def check_chunk(
    layout: KVLayout,
    x: Transfer,
    h: KVChunk,
    bufs: list[memoryview],
    pages: PageIO = PORTABLE,
) -> str:
    """Why chunk `h` must be refused ("" if it may be written). Reads nothing but `x`.
    `pages`: the engine's page I/O, which hashes the blocks, or checks them as its
    writer writes them where it writes this transfer (write_chunk)."""
    with stages.timed("verify"):
        return _check_chunk(layout, x, h, bufs, pages)


def hash_segments(layout: KVLayout, h: KVChunk, bufs: list[memoryview]) -> list[memoryview]:
    """What checksum.block_hashes covers: with runs, the (kind, layer, run) segments as
    `segments` gave them; without, each kind's frame cut into its layers. Precondition:
    the frames have the sizes `h` announces (check_chunk)."""
    if h.runs:
        return bufs
    layers = h.layer_end - h.layer_start
    out = []
    for b in bufs:
        whole = memoryview(b).cast("B")
        step = whole.nbytes // layers
        out += [whole[j * step : (j + 1) * step] for j in range(layers)]
    return out


def frame_bytes(layout: KVLayout, h: KVChunk) -> list[int]:
    """The byte count of each payload frame of one kind that header `h` announces."""
    layers, row = h.layer_end - h.layer_start, layout.token_bytes_per_layer
    if not h.runs:
        return [layers * (h.tok_end - h.tok_start) * row]
    return [c * row for _ in range(layers) for c in h.runs]


def segments(layout: KVLayout, h: KVChunk, bufs: list[memoryview]) -> list[memoryview]:
    """A chunk's payload as one buffer per (kind, layer, run) segment: where a chunk with
    runs packs each kind's segments into one frame (messages.py), that frame cut into
    views of them (no copy); otherwise the frames as they came, for check_chunk to judge.
    NOTE: before check_chunk, so it reads only what the header bounds (the layout's
    layers, MAX_RUNS runs): a forged range costs nothing here."""
    kinds = len(_KINDS.get(h.kind, ()))
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


def _check_chunk(
    layout: KVLayout, x: Transfer, h: KVChunk, bufs: list[memoryview], pages: PageIO
) -> str:
    n_layers, n_tok = layout.num_layers, x.req.prompt_len
    if not (0 <= h.layer_start < h.layer_end <= n_layers):
        return f"layer range [{h.layer_start}, {h.layer_end}) outside [0, {n_layers})"
    if not (0 <= h.tok_start < h.tok_end <= n_tok):
        return f"token range [{h.tok_start}, {h.tok_end}) outside [0, {n_tok})"
    if h.runs and (
        len(h.runs) > MAX_RUNS or min(h.runs) < 1 or sum(h.runs) != h.tok_end - h.tok_start
    ):
        return f"runs {h.runs[:8]} do not split [{h.tok_start}, {h.tok_end})"
    if h.kind not in _KINDS:
        return f"kind {h.kind!r}"
    sizes = frame_bytes(layout, h) * len(_KINDS[h.kind])
    if len(bufs) != len(sizes):
        return f"kind {h.kind!r} with {len(bufs)} payload frames, not {len(sizes)}"
    if h.dtype != layout.dtype:
        return f"dtype {h.dtype} != {layout.dtype}"
    per_kind = sum(sizes) // len(_KINDS[h.kind])  # without runs: the kind's one frame
    if h.nbytes != per_kind or [b.nbytes for b in bufs] != sizes:
        return f"byte count {[b.nbytes for b in bufs][:8]} (header {h.nbytes}) != {sizes[:8]}"
    for kind in _KINDS[h.kind]:
        if x.cov[kind, h.layer_start : h.layer_end, h.tok_start : h.tok_end].any():
            return "overlaps KV already received (duplicate chunk)"
    segs = hash_segments(layout, h, bufs)
    blocks = sum(blocks_of(s.nbytes) for s in segs)
    if len(h.hashes) != 8 * blocks:
        return f"{len(h.hashes)} bytes of block hashes for {blocks} blocks"
    if chunk_checksum(h.hashes) != h.checksum:
        return "checksum mismatch (block hashes)"
    # NOTE: last, so a frame of the wrong size is never hashed
    if x.paged() is None and block_hashes(segs, pages) != h.hashes:  # else as written
        return "checksum mismatch"
    return ""


def write_chunk(x: Transfer, h: KVChunk, bufs: list[memoryview], pages: PageIO = PORTABLE) -> str:
    """Why the chunk was refused while it was written ("" if it was written whole).
    Precondition: check_chunk passed with the same `pages` (it leaves the payload's
    blocks to this call exactly where this call checks them) and the caller holds x.lock
    with x.open set.

    Scatters straight from the frame's buffer (a read-only view, no copy) into the pool.
    The page writer checks each block before writing it: a block that fails may
    leave the chunk written in part, and the caller must fail the transfer."""
    with stages.timed("scatter"):
        return _write_chunk(x, h, bufs, pages)


def _write_chunk(x: Transfer, h: KVChunk, bufs: list[memoryview], pages: PageIO) -> str:
    if (paged := x.paged()) is not None:  # a call per kind
        return _write_paged(x, h, bufs, pages, paged)
    lay = x.pool.layout
    n_layers, n_tok = h.layer_end - h.layer_start, h.tok_end - h.tok_start
    idx = x.slots[h.tok_start : h.tok_end]
    if h.runs:  # one frame per (layer, run) of each kind
        per_kind = n_layers * len(h.runs)
        for i, kind in enumerate(_KINDS[h.kind]):
            dst = (x.pool.k, x.pool.v)[kind][h.layer_start : h.layer_end]
            frames = bufs[i * per_kind : (i + 1) * per_kind]
            if dst.is_cuda:
                _copy_runs_to_device(dst, idx, h.runs, frames)
            else:
                scatter_runs(dst, idx, h.runs, frames, lay.page_size)
            x.cover(kind, h)
        x.chunks.append((h.index, h.checksum))
        return ""
    for kind, buf in zip(_KINDS[h.kind], bufs):
        dst = (x.pool.k, x.pool.v)[kind][h.layer_start : h.layer_end]
        if dst.is_cuda:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only view over the ZeroMQ frame
                src = torch.frombuffer(buf, dtype=getattr(torch, lay.dtype))
            shape = (n_layers, n_tok, lay.num_kv_heads, lay.head_dim)
            # from pageable memory the copy stages the frame's bytes before it returns
            dst.index_copy_(1, idx, src.view(shape).to(dst.device, non_blocking=True))
            land(dst.device)
        else:  # straight from the frame's bytes into the pool pages
            frame = np.frombuffer(buf, dtype=np.uint8).reshape(n_layers, n_tok, -1)
            scatter_rows(dst, idx, frame, lay.page_size)
        x.cover(kind, h)
    x.chunks.append((h.index, h.checksum))
    return ""


def _write_paged(
    x: Transfer, h: KVChunk, bufs: list[memoryview], pages: PageIO, paged: Paged
) -> str:
    runs, kinds = h.runs or [h.tok_end - h.tok_start], _KINDS[h.kind]
    segs = hash_segments(x.pool.layout, h, bufs)  # a view per layer and run: srcs, by kind
    per_kind, at = len(segs) // len(kinds), 0
    writer, layers = paged.writer, (h.layer_start, h.layer_end)
    if writer is None:  # not armed with the receiver's (tests, tools)
        writer = paged.writer = pages.writer(paged.kinds, paged.page_size)
    for i, kind in enumerate(kinds):
        srcs = segs[i * per_kind : (i + 1) * per_kind]
        end = at + 8 * sum(blocks_of(s.nbytes) for s in srcs)
        want = h.hashes if len(kinds) == 1 else h.hashes[at:end]
        if not writer.scatter(kind, layers, paged.pages, h.tok_start, runs, srcs, want, HASH_BLOCK):
            return "checksum mismatch"
        x.cover(kind, h)
        at = end
    x.chunks.append((h.index, h.checksum))
    return ""


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


def check_done(x: Transfer, d: KVDone) -> str:
    """Why KVDone must be refused ("" if the transfer is complete and intact)."""
    if d.prompt_len != x.req.prompt_len:
        return f"prompt_len {d.prompt_len} != reserved {x.req.prompt_len}"
    missing = x.cov.size - int(np.count_nonzero(x.cov))
    if missing:
        return f"{missing} (kind, layer, token) cells of KV never arrived"
    if d.num_chunks != len(x.chunks):
        return f"{d.num_chunks} chunks sent, {len(x.chunks)} received"
    if d.digest != done_digest(x.chunks, d.first_token, d.first_logprob, d.prompt_len):
        return "transfer digest mismatch"
    return ""
