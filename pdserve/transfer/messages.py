"""Wire messages of the prefill <-> decode KV transfer (typed msgspec msgpack structs).

Channels (docs/architecture.md §5):
    control  decode DEALER ──▶ prefill ROUTER (bootstrap port):  Ready, Ack, Abort, Heartbeat
             prefill ROUTER ──▶ decode DEALER:                    Abort, Heartbeat
    data     prefill PUSH   ──▶ decode PULL (data_endpoint):      KVChunk + raw frames, KVDone

A multipart message is [header] or [KVChunk header, payload frame(s)].
KVChunk payload: kind "kv" -> two frames (K then V), "k"/"v" -> one frame. Each frame
is the C-contiguous bytes of a [layer_end-layer_start, tok_end-tok_start, kv_heads,
head_dim] tensor of `dtype`; `nbytes` is the length of each frame. Its segments (for
the checksum) are its layers, frame after frame.
With `runs` (token counts summing to tok_end - tok_start) a kind's KV comes instead as
(layer, run) segments, layer-major: [run tokens, kv_heads, head_dim] each, `nbytes` the
kind's bytes in all. Each segment is its own frame (the prefill pool's own memory, sent
without a gather where a request's slots lie in a few runs), or a kind's segments come
one after another in one frame (a piece gathered page by page: fewer frames, the same
segments). transfer/push.py sends both; validate.segments cuts the second into the first.
`hashes` holds the XXH3-64 of each HASH_BLOCK-byte block of each segment in order, and
`checksum` is the XXH3-64 of `hashes` (checksum.py): the decode checks each block right
before writing it.
"""

from __future__ import annotations

import msgspec

from pdserve.transfer.checksum import block_hashes, chunk_checksum, done_digest

# re-exported: the checksums of these messages
__all__ = ["block_hashes", "chunk_checksum", "done_digest"]

# 5: block hashes (4: runs packed in one frame, 3: KVChunk.runs, 2: XXH3-64, 1: crc32)
PROTOCOL_VERSION = 5
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
    nbytes: int  # bytes of each kind: its one frame, or with runs its segments together
    checksum: int  # chunk_checksum(hashes)
    hashes: bytes  # block_hashes(): each HASH_BLOCK of each segment, in order
    runs: list[int] = msgspec.field(default_factory=list)  # [] : one tensor per kind


class KVDone(_Msg, tag="done", kw_only=True, frozen=True):
    room: int
    session: int
    first_token: int
    first_logprob: float
    prompt_len: int
    num_chunks: int
    digest: int  # done_digest(): every chunk's (index, checksum) and the fields above
    # The prefill's time.time() stamps of this request (PREFILL_STAGES), for the TTFT
    # breakdown only: informational, outside the digest, never used to decide anything.
    stages: dict[str, float] = msgspec.field(default_factory=dict)


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
