"""Wire messages of the prefill <-> decode KV transfer (typed msgspec msgpack structs).

Channels (DESIGN §5):
    control  decode DEALER ──▶ prefill ROUTER (bootstrap port):  Ready, Ack, Abort, Heartbeat
             prefill ROUTER ──▶ decode DEALER:                    Abort, Heartbeat
    data     prefill PUSH   ──▶ decode PULL (data_endpoint):      KVChunk + raw frames, KVDone

A multipart message is [header] or [KVChunk header, payload frame(s)].
KVChunk payload: kind "kv" -> two frames (K then V), "k"/"v" -> one frame. Each frame
is the C-contiguous bytes of a [layer_end-layer_start, tok_end-tok_start, kv_heads,
head_dim] tensor of `dtype`; `nbytes` is the length of each frame and `checksum` is
frames_checksum() over the frames in order (crc32 of per-MiB-block crc32s).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024  # headers are small; anything larger is dropped unparsed


class _Msg(msgspec.Struct, tag_field="t", kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class Ready(_Msg, tag="ready", kw_only=True, frozen=True):
    """Decode -> prefill: slots for `room` are reserved; push KV to `data_endpoint`."""

    room: int
    rid: str = ""
    session: int  # random per expect(); echoed in every chunk so stale messages are refused
    data_endpoint: str
    layout: str  # KVLayout.fingerprint()
    num_tokens: int
    decode_id: str
    model: str = ""  # scheduler.identity.model_fingerprint(): what the decode serves


class KVChunk(_Msg, tag="chunk", kw_only=True, frozen=True):
    room: int
    session: int
    index: int
    layer_start: int
    layer_end: int
    tok_start: int
    tok_end: int
    kind: str  # "kv" | "k" | "v"
    dtype: str
    nbytes: int  # per payload frame
    checksum: int


class KVDone(_Msg, tag="done", kw_only=True, frozen=True):
    room: int
    session: int
    first_token: int
    first_logprob: float
    prompt_len: int
    num_chunks: int
    digest: int  # done_digest(): every chunk's (index, checksum) and the fields above


class Ack(_Msg, tag="ack", kw_only=True, frozen=True):
    room: int
    session: int


class Abort(_Msg, tag="abort", kw_only=True, frozen=True):
    room: int
    session: int = 0  # 0: any session of the room
    reason: str


class Heartbeat(_Msg, tag="hb", kw_only=True, frozen=True):
    sender: str
    seq: int


Message = Ready | KVChunk | KVDone | Ack | Abort | Heartbeat

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


CHECKSUM_BLOCK = 1 << 20
_CRC_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-crc")


def _blocks(frames: Sequence[Any]) -> list[memoryview]:
    out = []
    for f in frames:
        mv = memoryview(f).cast("B")
        out += [mv[i : i + CHECKSUM_BLOCK] for i in range(0, len(mv), CHECKSUM_BLOCK)]
    return out


def frames_checksum(frames: Sequence[Any]) -> int:
    """Checksum of payload frames (bytes, memoryviews, contiguous arrays): the frames are
    cut into 1 MiB blocks (a frame's last block may be shorter), each block gets a
    zlib.crc32, and the result is the crc32 of those block crcs packed as little-endian
    uint32 in order. Blocks are independent, so they are hashed on several threads
    (zlib releases the GIL)."""
    blocks = _blocks(frames)
    if len(blocks) > 2:
        crcs = list(_CRC_POOL.map(zlib.crc32, blocks))
    else:
        crcs = [zlib.crc32(b) for b in blocks]
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs))


def done_digest(
    pairs: Sequence[tuple[int, int]], first_token: int, first_logprob: float, prompt_len: int
) -> int:
    """Digest of a whole transfer: crc32 over its (chunk index, checksum) pairs in index
    order (so independent of arrival order), then the KVDone fields it vouches for."""
    crc = 0
    for index, checksum in sorted(pairs):
        crc = zlib.crc32(struct.pack("<qI", index, checksum), crc)
    tail = struct.pack("<qdqq", first_token, first_logprob, prompt_len, len(pairs))
    return zlib.crc32(tail, crc)


class Decoder:
    """Decodes headers; never raises. Drops (and counts) oversized, malformed,
    unknown-tag and wrong-version messages."""

    def __init__(self, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.max_bytes = max_bytes
        self._dec = msgspec.msgpack.Decoder(Message)
        self.dropped: dict[str, int] = {"oversized": 0, "malformed": 0, "version": 0}

    def decode(self, data: bytes | memoryview) -> Message | None:
        if len(data) > self.max_bytes:
            self.dropped["oversized"] += 1
            return None
        try:
            msg = self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            self.dropped["malformed"] += 1  # includes unknown tags and invalid UTF-8
            return None
        if msg.v != PROTOCOL_VERSION:
            self.dropped["version"] += 1
            return None
        return msg
