"""The decode's checks of what a prefill sends: pure, each returns why a message must be
refused ("" if it may be taken), and writes nothing.

Every header field of a chunk is checked before anything of it is written (room and
session by the receiver; here ranges, byte counts, no overlap with what arrived before,
the hash count, the checksum of the block hashes). Every payload block is checked
against its hash (checksum.py) before it is written: here, all of them, where the chunk
is written row by row; by the page writer as it writes each block (kernels/page_io.py;
natively block by block, each right before its write) where the transfer's rows go
to whole pages (transfer.py `paged`). A block that fails stops the write: the chunk is
refused and the transfer fails, its pages (the request's own, no one else's) freed unread.
"""

from __future__ import annotations

import numpy as np

from pdserve.kernels.native.page_copy import MAX_RUNS
from pdserve.kernels.page_io import PORTABLE, PageIO
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.checksum import block_hashes, blocks_of, chunk_checksum, done_digest
from pdserve.transfer.messages import KINDS, KVDone
from pdserve.transfer.receiving.payload import Chunk, frame_bytes
from pdserve.transfer.receiving.transfer import Transfer

INT64_MAX = (1 << 63) - 1


def check_chunk(layout: KVLayout, x: Transfer, c: Chunk, pages: PageIO = PORTABLE) -> str:
    """Why chunk `c` must be refused ("" if it may be written). Reads nothing but `x`.
    `pages`: the engine's page I/O, which hashes the blocks here, or checks them as its
    writer writes them where the transfer's rows go to whole pages (writer.write_chunk)."""
    h, bufs = c.header, c.frames
    n_layers, n_tok = layout.num_layers, x.req.prompt_len
    if not 0 <= h.index <= INT64_MAX:  # NOTE: done_digest packs it as an int64
        return f"chunk index {h.index} outside [0, {INT64_MAX}]"
    if not (0 <= h.layer_start < h.layer_end <= n_layers):
        return f"layer range [{h.layer_start}, {h.layer_end}) outside [0, {n_layers})"
    if not (0 <= h.tok_start < h.tok_end <= n_tok):
        return f"token range [{h.tok_start}, {h.tok_end}) outside [0, {n_tok})"
    if h.runs and (
        len(h.runs) > MAX_RUNS or min(h.runs) < 1 or sum(h.runs) != h.tok_end - h.tok_start
    ):
        return f"runs {h.runs[:8]} do not split [{h.tok_start}, {h.tok_end})"
    if h.kind not in KINDS:
        return f"kind {h.kind!r}"
    sizes = frame_bytes(layout, h) * len(KINDS[h.kind])
    if len(bufs) != len(sizes):
        return f"kind {h.kind!r} with {len(bufs)} payload frames, not {len(sizes)}"
    if h.dtype != layout.dtype:
        return f"dtype {h.dtype} != {layout.dtype}"
    per_kind = sum(sizes) // len(KINDS[h.kind])  # without runs: the kind's one frame
    if h.nbytes != per_kind or [b.nbytes for b in bufs] != sizes:
        return f"byte count {[b.nbytes for b in bufs][:8]} (header {h.nbytes}) != {sizes[:8]}"
    for kind in KINDS[h.kind]:
        if x.cov[kind, h.layer_start : h.layer_end, h.tok_start : h.tok_end].any():
            return "overlaps KV already received (duplicate chunk)"
    blocks = sum(blocks_of(s.nbytes) for s in c.segments)
    if len(h.hashes) != 8 * blocks:
        return f"{len(h.hashes)} bytes of block hashes for {blocks} blocks"
    if chunk_checksum(h.hashes) != h.checksum:
        return "checksum mismatch (block hashes)"
    # NOTE: last, so a frame of the wrong size is never hashed
    if x.paged is None and block_hashes(c.segments, pages) != h.hashes:  # else as written
        return "checksum mismatch"
    return ""


def check_done(x: Transfer, d: KVDone) -> str:
    """Why KVDone must be refused ("" if the transfer is complete and intact)."""
    if not -INT64_MAX - 1 <= d.first_token <= INT64_MAX:  # NOTE: done_digest packs it
        return f"first_token {d.first_token} outside int64"
    if d.prompt_len != x.req.prompt_len:
        return f"prompt_len {d.prompt_len} != reserved {x.req.prompt_len}"
    missing = cells_missing(x)
    if missing:
        return f"{missing} (kind, layer, token) cells of KV never arrived"
    if d.num_chunks != len(x.chunks):
        return f"{d.num_chunks} chunks sent, {len(x.chunks)} received"
    if d.digest != done_digest(x.chunks, d.first_token, d.first_logprob, d.prompt_len):
        return "transfer digest mismatch"
    return ""


def cells_missing(x: Transfer) -> int:
    """(kind, layer, token) cells of `x` no chunk has covered yet."""
    return x.cov.size - int(np.count_nonzero(x.cov))
