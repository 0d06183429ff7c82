"""Checksums of KV payload frames, cheaper than the wire.

    frames_checksum([f0, f1, ...]) = xxh3_64( le_u64(xxh3_64(f0)) || le_u64(xxh3_64(f1)) || ... )

XXH3 (the `xxhash` package) runs at 10-25 GB/s per core here, several times loopback
TCP (zlib.crc32, the previous checksum, ran at about 1-2 GB/s and was the bottleneck).
The sender hashes on its I/O thread, mostly before the decode's Ready comes
(transfer/push.py). The receiver hashes a chunk's frames on the engine's kernel threads
(kernels/page_copy.py frame_hashes: the same XXH3-64, called from C), since a
chunk is hashed before it is written and the last chunk's hash is on the transfer's tail.
Non-cryptographic: it catches corruption, not forgery (CURVE authenticates the peer).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import xxhash


def frame_hash(frame: Any) -> int:
    """XXH3-64 of one frame's bytes (bytes, memoryview, contiguous array, zmq buffer)."""
    return xxhash.xxh3_64_intdigest(frame)


def combine(hashes: Sequence[int]) -> int:
    """The checksum of frames whose frame_hash() values are `hashes`, in order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(hashes)}Q", *hashes))


def frames_checksum(frames: Sequence[Any]) -> int:
    """Checksum of payload frames, in order (see the module docstring)."""
    return combine([frame_hash(f) for f in frames])


def done_digest(
    pairs: Sequence[tuple[int, int]], first_token: int, first_logprob: float, prompt_len: int
) -> int:
    """Digest of a whole transfer: XXH3-64 over its (chunk index, checksum) pairs in index
    order (so independent of arrival order), then the KVDone fields it vouches for."""
    body = b"".join(struct.pack("<qQ", i, c) for i, c in sorted(pairs))
    tail = struct.pack("<qdqq", first_token, first_logprob, prompt_len, len(pairs))
    return xxhash.xxh3_64_intdigest(body + tail)
