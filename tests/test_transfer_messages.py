"""Wire messages: round trips, the XXH3 block checksums, the order-independent digest."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from pdserve.transfer.checksum import HASH_BLOCK
from pdserve.transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Decoder,
    Heartbeat,
    KVChunk,
    KVDone,
    Ready,
    block_hashes,
    chunk_checksum,
    done_digest,
    encode,
)

MESSAGES = [
    Ready(
        room=2**62,
        rid="r",
        session=5,
        data_endpoint="tcp://h:1",
        layout="L1",
        num_tokens=3,
        decode_id="d",
    ),
    KVChunk(
        room=1,
        session=2,
        index=0,
        layer_start=0,
        layer_end=1,
        tok_start=0,
        tok_end=4,
        kind="kv",
        dtype="float32",
        nbytes=8,
        checksum=9,
        hashes=bytes(range(16)),
    ),
    KVDone(
        room=1, session=2, first_token=3, first_logprob=-0.25, prompt_len=4, num_chunks=1, digest=7
    ),
    KVDone(
        room=1,
        session=2,
        first_token=3,
        first_logprob=-0.25,
        prompt_len=4,
        num_chunks=1,
        digest=7,
        stages={"prefill_arrive": 1.0, "prefill_start": 1.5, "prefill_end": 2.0},
    ),
    Ack(room=1, session=2),
    Abort(room=1, reason="why"),
    Heartbeat(sender="p", seq=3),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    dec = Decoder()
    assert dec.decode(encode(msg)) == msg
    assert sum(dec.dropped.values()) == 0


def test_prefill_stamps_off_the_wire_keep_only_known_finite_ones() -> None:
    from pdserve.transfer.base import prefill_stages

    raw = {"prefill_start": 1.5, "prefill_end": float("nan"), "evil": 3.0, "prefill_arrive": 1}
    assert prefill_stages(raw) == {"prefill_start": 1.5, "prefill_arrive": 1.0}


def test_missing_field_is_malformed() -> None:
    dec = Decoder()
    data = encode(Ack(room=1, session=2)).replace(b"\xa7session\x02", b"")
    assert dec.decode(data) is None and dec.dropped["malformed"] == 1


def test_block_hashes_are_xxh3_of_each_block_of_each_segment_and_see_one_bit() -> None:
    a = np.random.default_rng(0).integers(0, 255, 3 * HASH_BLOCK + 17, dtype=np.uint8)
    b = a[:1000].copy()
    blocks = [a[i : i + HASH_BLOCK] for i in range(0, a.size, HASH_BLOCK)] + [b]
    want = b"".join(xxhash.xxh3_64(x.tobytes()).digest()[::-1] for x in blocks)  # LE u64
    assert block_hashes([a, b]) == want == block_hashes([memoryview(a), b])
    assert len(want) == 8 * 5  # 3 whole blocks, a short one, then b's one
    assert block_hashes([b, a]) != want  # segment order matters
    assert block_hashes([a[:100], a[100:], b]) != want  # so do the segment boundaries
    assert chunk_checksum(want) == xxhash.xxh3_64(want).intdigest()
    a[2 * HASH_BLOCK + 5] ^= 1
    assert block_hashes([a, b])[:16] == want[:16] and block_hashes([a, b])[16:24] != want[16:24]


def test_64_bit_checksum_round_trips_and_old_version_is_dropped() -> None:
    chunk = KVChunk(room=1, session=2, index=0, layer_start=0, layer_end=1, tok_start=0,
                    tok_end=1, kind="kv", dtype="float32", nbytes=4, checksum=2**64 - 1,
                    hashes=b"")  # fmt: skip
    dec = Decoder()
    assert dec.decode(encode(chunk)) == chunk
    old = KVChunk(**{f: getattr(chunk, f) for f in chunk.__struct_fields__ if f != "v"},
                  v=PROTOCOL_VERSION - 1)  # fmt: skip
    assert dec.decode(encode(old)) is None  # e.g. a crc32-era (v1) peer
    assert dec.dropped["version"] == 1


def test_done_digest_ignores_arrival_order_but_not_content() -> None:
    pairs = [(0, 11), (1, 22), (2, 2**64 - 1)]
    d = done_digest(pairs, 5, -0.5, 30)
    assert done_digest(list(reversed(pairs)), 5, -0.5, 30) == d
    assert done_digest(pairs[:2], 5, -0.5, 30) != d
    assert done_digest(pairs, 6, -0.5, 30) != d
    assert done_digest([(0, 11), (1, 23), (2, 2**64 - 1)], 5, -0.5, 30) != d


def test_block_hashes_fit_the_header_or_the_sender_is_refused() -> None:
    """A chunk's block hashes travel in its header, which a decode drops past
    MAX_HEADER_BYTES: the default frame size fits them even for 128 layers sent in
    MAX_RUNS runs; a frame size whose hashes would not fit is refused up front."""
    from pdserve.kvcache.pools import KVLayout
    from pdserve.transfer.messages import MAX_HEADER_BYTES
    from pdserve.transfer.sending.pieces import MAX_RUNS
    from pdserve.transfer.sending.push import Pusher
    from pdserve.transfer.sending.sender import MAX_FRAME_BYTES

    big = KVLayout(num_layers=128, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    pusher = Pusher(big, MAX_FRAME_BYTES)
    blocks = -(-MAX_FRAME_BYTES // HASH_BLOCK) + big.num_layers * MAX_RUNS
    worst = KVChunk(room=2**62, session=2**62, index=10**6, layer_start=0, layer_end=128,
                    tok_start=0, tok_end=pusher.max_tokens, kind="k", dtype="bfloat16",
                    nbytes=MAX_FRAME_BYTES, checksum=2**64 - 1, hashes=bytes(8 * blocks),
                    runs=[pusher.max_tokens // 4] * 4)  # fmt: skip
    assert len(encode(worst)) < MAX_HEADER_BYTES
    assert Decoder().decode(encode(worst)) == worst
    with pytest.raises(ValueError, match="block hashes"):
        Pusher(big, 64 * MAX_FRAME_BYTES)
