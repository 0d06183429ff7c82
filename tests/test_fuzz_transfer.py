"""Hypothesis fuzzing of the transfer's wire decoder and its write validator.

Properties: the header decoder never raises, whatever the bytes; oversized headers are
refused unparsed; a chunk header accepted by check_chunk writes only inside the request's
reserved slots (every other slot of the pool is bit-identical afterwards), and exactly the
bytes it carried; an accepted KVDone needs every cell of the reservation written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.envs import cache_root
from pdserve.kernels.page_io import PORTABLE, page_io
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import make_req, random_pool, reserve
from pdserve.transfer.messages import (
    MAX_HEADER_BYTES,
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
    encode,
)
from pdserve.transfer.receiving.payload import received
from pdserve.transfer.receiving.transfer import Transfer
from pdserve.transfer.receiving.validate import check_chunk, check_done
from pdserve.transfer.receiving.writer import write_chunk

pytestmark = pytest.mark.timeout(120)
NATIVE = page_io(cache_root())  # PORTABLE where no C compiler is
FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)
N = 7  # prompt tokens reserved
TB = LAYOUT.token_bytes_per_layer

VALID = [
    Ready(room=1, rid="r", session=2, data_endpoint="tcp://127.0.0.1:1", layout="x",
          num_tokens=3, decode_id="d"),
    KVChunk(room=1, session=2, index=0, layer_start=0, layer_end=1, tok_start=0, tok_end=1,
            kind="kv", dtype="float32", nbytes=4, checksum=5, hashes=b"\x01" * 16),
    KVDone(room=1, session=2, first_token=3, first_logprob=-0.5, prompt_len=3, num_chunks=1,
           digest=9),
    Ack(room=1, session=2), Abort(room=1, reason="x"), Heartbeat(sender="p", seq=1),
]  # fmt: skip


@FAST
@given(st.binary(max_size=512))
def test_decoder_never_raises_on_random_bytes(data: bytes) -> None:
    msg = Decoder().decode(data)
    assert msg is None or isinstance(msg, (Ready, KVChunk, KVDone, Ack, Abort, Heartbeat))


@FAST
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)),
                                        max_size=6), st.integers(0, 400))  # fmt: skip
def test_decoder_never_raises_on_mutated_messages(msg, flips, cut) -> None:
    raw = bytearray(encode(msg))
    for pos, val in flips:
        raw[pos % len(raw)] = val
    dec = Decoder()
    out = dec.decode(bytes(raw[: max(1, len(raw) - cut % len(raw))]))
    assert out is None or out.v == PROTOCOL_VERSION
    assert (out is None) == (sum(dec.dropped.values()) == 1)


def test_decoder_invalid_utf8_string() -> None:
    raw = bytearray(encode(VALID[0]))
    raw[raw.index(b"tcp://")] = 0x80  # first byte of the data_endpoint string
    dec = Decoder()
    assert dec.decode(bytes(raw)) is None and dec.dropped["malformed"] == 1


def test_decoder_refuses_oversized_and_wrong_version() -> None:
    dec = Decoder()
    big = Heartbeat(sender="x" * MAX_HEADER_BYTES, seq=1)
    assert dec.decode(encode(big)) is None and dec.dropped["oversized"] == 1
    assert (
        dec.decode(encode(Ack(room=1, session=1, v=PROTOCOL_VERSION + 1))) is None
        and dec.dropped["version"] == 1
    )
    assert dec.decode(encode(VALID[3])) == VALID[3]


def _transfer() -> Transfer:
    pool = random_pool(LAYOUT, 3 * N, seed=0)  # room for other requests' pages too
    _, slots = reserve(pool, N, seed=1)
    return Transfer(make_req("r", 1, N, 1), pool, slots, session=7, endpoint="tcp://x")


ints = st.integers(-2, N + 2)


@st.composite
def chunks(draw):
    ls, le, ts, te = draw(st.integers(-1, 3)), draw(st.integers(-1, 3)), draw(ints), draw(ints)
    kind = draw(st.sampled_from(["kv", "k", "v", "kk", ""]))
    want = max(0, (le - ls) * (te - ts) * TB)
    size = draw(st.sampled_from([want, want, want + 4, max(0, want - 4), 0]))
    nframes = draw(st.sampled_from([len(kind) if kind in ("kv", "k", "v") else 1, 1, 2, 3]))
    frames = [draw(st.binary(min_size=size, max_size=size)) for _ in range(nframes)]
    good = block_hashes(_layers(frames, le - ls))
    bad = good[:-1] + bytes([good[-1] ^ 1]) if good else b"\x00" * 8
    hashes = draw(st.sampled_from([good, good, good, bad, good[8:]]))
    good_sum = chunk_checksum(hashes)
    hdr = KVChunk(room=1, session=7, index=draw(st.integers(0, 5)), layer_start=ls,
                  layer_end=le, tok_start=ts, tok_end=te, kind=kind,
                  dtype=draw(st.sampled_from(["float32", "float32", "bfloat16"])),
                  nbytes=draw(st.sampled_from([size, size, size + 1])),
                  checksum=draw(st.sampled_from([good_sum, good_sum, good_sum ^ 1])),
                  hashes=hashes)  # fmt: skip
    return hdr, [memoryview(f) for f in frames], hashes == good


def _layers(frames: list[bytes], layers: int) -> list[bytes]:
    """The segments a no-runs chunk's block hashes cover: each frame cut into its layers
    (the frames whole where that cannot be: such a chunk is refused before its hashes)."""
    if layers < 1 or any(len(f) % layers for f in frames):
        return frames
    step = [len(f) // layers for f in frames]
    return [f[j * n : (j + 1) * n] for f, n in zip(frames, step) for j in range(layers)]


@FAST
@given(st.lists(chunks(), min_size=1, max_size=6))
def test_accepted_chunks_write_only_inside_the_reservation(batch) -> None:
    """Either page I/O checks a chunk's blocks as its writer writes them (natively each
    just before its write). A chunk whose block hashes are not its bytes' is never
    written whole, and nothing lands outside the request."""
    x = _transfer()
    k0, v0 = x.pool.k.clone(), x.pool.v.clone()
    outside = torch.ones(x.pool.k.shape[1], dtype=torch.bool)
    outside[x.slots] = False
    for i, (hdr, bufs, intact) in enumerate(batch):
        pages = NATIVE if i % 2 else PORTABLE  # the first chunk in numpy
        chunk = received(LAYOUT, hdr, bufs)  # as the receiver cuts what came
        if check_chunk(LAYOUT, x, chunk, pages) == "":
            assert 0 <= hdr.layer_start < hdr.layer_end <= LAYOUT.num_layers
            assert 0 <= hdr.tok_start < hdr.tok_end <= N
            if write_chunk(x, chunk, pages) == "":  # the receiver's scatter
                assert intact
                _assert_written(x, hdr, bufs)
            else:
                assert not intact
                break  # the receiver fails the transfer here
    assert torch.equal(x.pool.k[:, outside], k0[:, outside])
    assert torch.equal(x.pool.v[:, outside], v0[:, outside])


@st.composite
def sound_chunks(draw):
    """A chunk every header check accepts (ranges, kind, sizes, its hashes' checksum),
    whose hashes are its bytes'."""
    ls = draw(st.integers(0, LAYOUT.num_layers - 1))
    le = draw(st.integers(ls + 1, LAYOUT.num_layers))
    ts = draw(st.integers(0, N - 1))
    te = draw(st.integers(ts + 1, N))
    kind = draw(st.sampled_from(["kv", "k", "v"]))
    size = (le - ls) * (te - ts) * TB
    frames = [draw(st.binary(min_size=size, max_size=size)) for _ in kind]
    hashes = block_hashes(_layers(frames, le - ls))
    hdr = KVChunk(room=1, session=7, index=0, layer_start=ls, layer_end=le, tok_start=ts,
                  tok_end=te, kind=kind, dtype="float32", nbytes=size,
                  checksum=chunk_checksum(hashes), hashes=hashes)  # fmt: skip
    return hdr, frames


@FAST
@given(sound_chunks(), st.integers(0, 10**6), st.integers(1, 255))
def test_a_corrupted_byte_never_reaches_the_pool(chunk, at, flip) -> None:
    """One byte of a sound chunk flipped on the wire (its header and hashes intact): the
    chunk is refused, by check_chunk's compare or by the page writer as it is about to
    write that block (either page I/O), and the pool never holds the flipped byte; nothing outside the
    request is touched."""
    hdr, frames = chunk
    f, at = at % len(frames), at % len(frames[0])
    bad = bytearray(frames[f])
    bad[at] ^= flip
    bufs = [memoryview(b) for b in frames[:f] + [bytes(bad)] + frames[f + 1 :]]
    for pages in (NATIVE, PORTABLE):
        _refused_unwritten(hdr, bufs, pages, f, at)


def _refused_unwritten(hdr: KVChunk, bufs: list[memoryview], pages, f: int, at: int) -> None:
    x = _transfer()
    k0, v0 = x.pool.k.clone(), x.pool.v.clone()
    chunk = received(LAYOUT, hdr, bufs)
    reason = check_chunk(LAYOUT, x, chunk, pages)
    if reason == "":  # left to the writer: it checks as it writes
        assert x.paged is not None
        assert write_chunk(x, chunk, pages) == "checksum mismatch"
    else:
        assert reason == "checksum mismatch"
    per_layer = (hdr.tok_end - hdr.tok_start) * TB
    layer, tok = hdr.layer_start + at // per_layer, hdr.tok_start + at % per_layer // TB
    kind = {"kv": (0, 1), "k": (0,), "v": (1,)}[hdr.kind][f]
    pool, before = ((x.pool.k, k0), (x.pool.v, v0))[kind]
    row = pool[layer, x.slots[tok]].numpy().tobytes()
    assert row == before[layer, x.slots[tok]].numpy().tobytes()  # the flipped byte: never
    outside = torch.ones(x.pool.k.shape[1], dtype=torch.bool)
    outside[x.slots] = False
    assert torch.equal(x.pool.k[:, outside], k0[:, outside])
    assert torch.equal(x.pool.v[:, outside], v0[:, outside])


def _assert_written(x: Transfer, hdr: KVChunk, bufs: list[memoryview]) -> None:
    kinds = {"kv": (0, 1), "k": (0,), "v": (1,)}[hdr.kind]
    idx = x.slots[hdr.tok_start : hdr.tok_end]
    for kind, buf in zip(kinds, bufs):
        got = (x.pool.k, x.pool.v)[kind][hdr.layer_start : hdr.layer_end][:, idx]
        assert got.numpy().tobytes() == bytes(buf)


@FAST
@given(st.lists(chunks(), max_size=4), st.integers(0, N + 1), st.integers(0, 6))
def test_done_accepted_only_when_every_cell_arrived(batch, plen, nchunks) -> None:
    x = _transfer()
    for hdr, bufs, _ in batch:
        chunk = received(LAYOUT, hdr, bufs)
        if check_chunk(LAYOUT, x, chunk) == "":
            write_chunk(x, chunk)  # refused where a block is not its hash: not covered
    done = KVDone(room=1, session=7, first_token=1, first_logprob=0.0, prompt_len=plen,
                  num_chunks=nchunks, digest=0)  # fmt: skip
    if check_done(x, done) == "":
        assert bool(np.all(x.cov == 1)) and plen == N
