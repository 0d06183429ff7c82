"""Wire messages of the prefill <-> decode KV transfer (typed msgspec msgpack structs).

Channels (docs/architecture.md §5):
    control  decode DEALER ──▶ prefill ROUTER (bootstrap port):  Announce, Ready, Ack, Abort, Heartbeat
             prefill ROUTER ──▶ decode DEALER:                    Claim, Abort, Heartbeat
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
segments). transfer/sending/push.py sends both; receiving/payload.py cuts the second into the first.
`hashes` holds the XXH3-64 of each HASH_BLOCK-byte block of each segment in order, and
`checksum` is the XXH3-64 of `hashes` (checksum.py): the decode checks each block right
before writing it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdserve.protocol import PrefillLogprobs
from pdserve.transfer.checksum import block_hashes, chunk_checksum, done_digest

# re-exported: the checksums of these messages
__all__ = ["block_hashes", "chunk_checksum", "done_digest"]

# 7: Ready.again_of (6: Announce, Claim, bounded fields, 5: block hashes, 4: runs packed in one
# frame, 3: KVChunk.runs, 2: XXH3-64, 1: crc32)
PROTOCOL_VERSION = 7
MAX_HEADER_BYTES = 64 * 1024  # headers are small; anything larger is dropped unparsed
MAX_REMOTE_TEXT = 256  # characters of a peer's text kept (a reason, a layout)
# times a room's KV is pushed: the first, and twice more for a decode that lost some on the
# way (Ready.again_of); both sides hold to it (a decode asking more often is refused)
MAX_PUSHES = 3

# Fields whose values go back on the wire, into reasons or into dicts: a header with one
# out of these bounds is dropped as malformed (counted), so no handler sees it.
Room = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # 63-bit bootstrap_room
Session = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=512)]  # fingerprints, ids
Endpoint = Annotated[str, msgspec.Meta(max_length=300)]  # "tcp://" + a DNS name + port


class _Msg(msgspec.Struct, tag_field="t", kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class Announce(_Msg, tag="announce", kw_only=True, frozen=True):
    """Decode -> prefill: a request of `room` reached this decode (no pages yet). From
    now on the decode's heartbeat covers the room: a prefill holding it for a decode
    that dies frees it in seconds, not at its Ready timeout."""

    room: Room
    decode_id: Name


class Ready(_Msg, tag="ready", kw_only=True, frozen=True):
    """Decode -> prefill: slots for `room` are reserved; push KV to `data_endpoint`."""

    room: Room
    rid: Name = ""
    session: Session  # random per expect(); echoed in every chunk so stale ones are refused
    data_endpoint: Endpoint  # netaddr.endpoint_problem checks it before any connect
    layout: Name  # KVLayout.fingerprint()
    num_tokens: int
    decode_id: Name
    model: Name = ""  # scheduler.identity.model_fingerprint(): what the decode serves
    # A Ready sent again (0: the first). Its own session: a repeat, while no Claim came (a
    # broken connection may have lost the Ready or the Claim). Another: a new session for
    # the one it names, KV was lost on the way and the prefill pushes all of it again.
    again_of: Session = 0


class Claim(_Msg, tag="claim", kw_only=True, frozen=True):
    """Prefill -> decode: this prefill has a request of `room` (queued or computing) and
    the decode's Ready for it. A decode whose Ready no prefill claims within its bootstrap
    timeout frees the pages it reserved (a peer that only heartbeats holds nothing)."""

    room: Room
    session: Session


# KVChunk.kind -> the kinds it carries, in frame order (0: K, 1: V)
KINDS = {"kv": (0, 1), "k": (0,), "v": (1,)}


class KVChunk(_Msg, tag="chunk", kw_only=True, frozen=True):
    room: Room
    session: Session
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
    room: Room
    session: Session
    first_token: int
    first_logprob: float
    prompt_len: int
    num_chunks: int
    digest: int  # done_digest(): every chunk's (index, checksum) and the fields above
    # what the request asked for beyond the first token's logprob (its top k, the prompt's
    # logprobs), outside the digest; the decode checks its shape before use
    logprobs: PrefillLogprobs | None = None
    # The prefill's time.time() stamps of this request (PREFILL_STAGES), for the TTFT
    # breakdown only: informational, outside the digest, never used to decide anything.
    stages: dict[str, float] = msgspec.field(default_factory=dict)


class Ack(_Msg, tag="ack", kw_only=True, frozen=True):
    room: Room
    session: Session


class Abort(_Msg, tag="abort", kw_only=True, frozen=True):
    room: Room
    session: Session = 0  # 0: any session of the room
    reason: str  # the sender's text: cut (remote_text) wherever it is kept


class Heartbeat(_Msg, tag="hb", kw_only=True, frozen=True):
    sender: Name
    seq: int


def remote_text(text: str, limit: int = MAX_REMOTE_TEXT) -> str:
    """`text` from a peer, cut to `limit` characters (it is kept and shown to clients)."""
    return text if len(text) <= limit else text[:limit] + "...(cut)"


Message = Announce | Ready | Claim | KVChunk | KVDone | Ack | Abort | Heartbeat

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
