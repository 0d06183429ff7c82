"""Checksums of KV payload, cheaper than the wire, checked block by block.

A chunk's payload is a list of segments (one layer's run of rows of one kind:
receiving/payload.py). Each segment is hashed in blocks of HASH_BLOCK bytes, the last
one shorter, and the chunk carries those hashes:

    KVChunk.hashes    = le_u64(xxh3_64(block 0)) || le_u64(xxh3_64(block 1)) || ...
    KVChunk.checksum  = xxh3_64(KVChunk.hashes)       (in the transfer's digest)

Why blocks: the decode hashes a block and writes it into its pages while it is in
the core's L1 cache (kernels/native/page_copy.py scatter_runs), so the received bytes are
read from memory once; hashing a whole frame and then writing it read them twice.
Every block is still compared before it is written. A later block that fails leaves
the chunk written in part, in the request's own pages: the transfer fails and those
pages are freed, never read (transfer/receiving/validate.py).

XXH3 (the `xxhash` package) runs several times faster per core than loopback TCP
moves bytes, so the checksum is not the bottleneck (zlib.crc32 is slower than the wire).
The sender hashes on its I/O thread, mostly before the decode's Ready comes
(transfer/sending/push.py), the native gather as it fills each frame.
Non-cryptographic: it catches corruption, not forgery (CURVE authenticates the peer).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import xxhash

from pdserve.kernels.page_io import PORTABLE, PageIO

# NOTE: fits L1 (32-48 KiB per core on x86 and Arm servers) with room for the stores;
# a multiple of every vector store's width, so the decode's stores stay aligned
HASH_BLOCK = 16 * 1024


def blocks_of(nbytes: int) -> int:
    """How many blocks a segment of `nbytes` bytes is hashed in."""
    return -(-nbytes // HASH_BLOCK)


def block_hashes(segments: Sequence[Any], pages: PageIO = PORTABLE) -> bytes:
    """KVChunk.hashes of `segments` (bytes, memoryviews, contiguous arrays), in order,
    by the engine's page I/O (kernels/page_io.py: on its kernel threads where native)."""
    return pages.block_hashes(segments, HASH_BLOCK)


def chunk_checksum(hashes: bytes) -> int:
    """KVChunk.checksum of a chunk whose block hashes are `hashes`."""
    return xxhash.xxh3_64_intdigest(hashes)


def done_digest(
    pairs: Sequence[tuple[int, int]], first_token: int, first_logprob: float, prompt_len: int
) -> int:
    """Digest of a whole transfer: XXH3-64 over its (chunk index, checksum) pairs in index
    order (so independent of arrival order), then the KVDone fields it vouches for."""
    body = b"".join(struct.pack("<qQ", i, c) for i, c in sorted(pairs))
    tail = struct.pack("<qdqq", first_token, first_logprob, prompt_len, len(pairs))
    return xxhash.xxh3_64_intdigest(body + tail)
