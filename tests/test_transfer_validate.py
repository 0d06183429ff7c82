"""A hand-driven fake prefill sends bad messages; the decode refuses them before writing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
import zmq

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import (
    make_req,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
    wait_until,
)
from pdserve.transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Decoder,
    Heartbeat,
    KVChunk,
    KVDone,
    Ready,
    block_hashes,
    chunk_checksum,
    encode,
)
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.zmq_io import MsgSocket, bind, make_socket

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)
N = 10
TOKEN_BYTES = LAYOUT.token_bytes_per_layer


class FakePrefill:
    """Bootstrap ROUTER + data PUSH, driven by the test."""

    def __init__(self) -> None:
        self.router = MsgSocket(make_socket(zmq.ROUTER), Decoder())
        self.port = bind(self.router.sock, "127.0.0.1", 0)
        self.push: MsgSocket | None = None

    def recv(self, timeout_ms: int = 3000):
        """The next message other than the decode's heartbeats."""
        while True:
            assert self.router.sock.poll(timeout_ms), "nothing arrived at the fake prefill"
            got = self.router.recv()
            if not isinstance(got[1], Heartbeat):
                return got

    def accept_ready(self) -> Ready:
        _, ready, _ = self.recv()
        assert isinstance(ready, Ready)
        self.push = MsgSocket(make_socket(zmq.PUSH), Decoder())
        self.push.sock.connect(ready.data_endpoint)
        return ready

    def close(self) -> None:
        self.router.close()
        if self.push:
            self.push.close()


@pytest.fixture
def rig():
    fake = FakePrefill()
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=5, heartbeat_timeout_s=5))
    pool = random_pool(LAYOUT, 64, 3)
    _, slots = reserve(pool, N, 3)
    rx.expect(make_req("v", 11, N, fake.port), pool, slots)
    ready = fake.accept_ready()
    yield fake, rx, pool, ready
    rx.close()
    fake.close()


def chunk(ready: Ready, **kw) -> tuple[KVChunk, list[bytes]]:
    fields = dict(layer_start=0, layer_end=2, tok_start=0, tok_end=N, kind="kv", dtype="float32")
    fields.update(kw)
    n = (fields["layer_end"] - fields["layer_start"]) * (fields["tok_end"] - fields["tok_start"])
    frames = [
        np.random.rand(max(0, n) * TOKEN_BYTES // 4).astype(np.float32).tobytes() for _ in range(2)
    ]
    layers = max(1, fields["layer_end"] - fields["layer_start"])
    hashes = block_hashes([f[j * len(f) // layers : (j + 1) * len(f) // layers]
                           for f in frames for j in range(layers)])  # fmt: skip
    hdr = KVChunk(
        room=ready.room,
        session=ready.session,
        index=0,
        nbytes=len(frames[0]),
        checksum=chunk_checksum(hashes),
        hashes=hashes,
        **fields,
    )
    return hdr, frames


def assert_refused(fake: FakePrefill, rx: KVReceiver, pool, reason: str, before=None) -> None:
    """The transfer failed for `reason`, the prefill was told, and nothing was written
    (where `before`, the pool's K and V before the chunk was sent, is given: nothing
    outside the request's slots; see assert_bad_block_unwritten)."""
    outside = torch.ones(pool.k.shape[1], dtype=torch.bool)
    if before is not None:
        outside[rig_slots()] = False
    before = before or (pool.k.clone(), pool.v.clone())
    [ev] = wait_for(rx.poll, 1, 3)
    assert not ev.ok and reason in ev.reason, ev.reason
    _, abort, _ = fake.recv()
    assert isinstance(abort, Abort) and reason in abort.reason
    assert torch.equal(pool.k[:, outside], before[0][:, outside])
    assert torch.equal(pool.v[:, outside], before[1][:, outside])
    assert rx.active_rooms() == set()


def rig_slots() -> torch.Tensor:
    """The rig's reservation, made again."""
    return reserve(random_pool(LAYOUT, 64, 3), N, 3)[1]


def assert_bad_block_unwritten(pool, before, kind: int, pos: int) -> None:
    """The row that byte `pos` of a refused chunk's `kind` frame (a whole [layers, N]
    chunk) would have gone to still holds what it held: a block is checked before it
    is written (the blocks before it may have been: the request's own pages, freed)."""
    layer, token = divmod(pos % (2 * N * TOKEN_BYTES), N * TOKEN_BYTES)
    slot = rig_slots()[token // TOKEN_BYTES]
    dst, old = (pool.k, before[0]) if kind == 0 else (pool.v, before[1])
    assert torch.equal(dst[layer, slot], old[layer, slot])


def test_ready_carries_the_reservation(rig) -> None:
    _, _, _, ready = rig
    assert (ready.room, ready.rid, ready.num_tokens) == (11, "v", N)
    assert ready.layout == LAYOUT.fingerprint() and ready.session > 0


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(layer_end=3), "layer range"),
        (dict(layer_start=-1), "layer range"),
        (dict(tok_end=N + 1), "token range"),
        (dict(tok_start=5, tok_end=5), "token range"),
        (dict(dtype="float16"), "dtype"),
        (dict(kind="x"), "kind"),
    ],
)
def test_bad_header_refused_before_write(rig, fields, reason) -> None:
    fake, rx, pool, ready = rig
    before = pool.k.clone(), pool.v.clone()
    hdr, frames = chunk(ready, **fields)
    assert fake.push is not None
    fake.push.send(hdr, frames)
    assert_refused(fake, rx, pool, reason)
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])


def test_wrong_byte_count_and_checksum_refused(rig) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    assert fake.push is not None
    fake.push.send(hdr, [frames[0], frames[1][:-4]])
    assert_refused(fake, rx, pool, "byte count")


def test_checksum_mismatch_refused(rig) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    bad = bytearray(frames[1])
    bad[3] ^= 1
    before = pool.k.clone(), pool.v.clone()
    assert fake.push is not None
    fake.push.send(hdr, [frames[0], bytes(bad)])
    assert_refused(fake, rx, pool, "checksum mismatch", before)
    assert_bad_block_unwritten(pool, before, 1, 3)


def test_forged_block_hashes_refused_before_write(rig) -> None:
    """Block hashes that do not hash to the header's checksum (or are one short) are
    refused before anything is written."""
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    forged = KVChunk(**{**_fields(hdr), "hashes": bytes(len(hdr.hashes))})
    assert fake.push is not None
    fake.push.send(forged, frames)
    assert_refused(fake, rx, pool, "checksum mismatch (block hashes)")


def test_block_hash_count_refused_before_write(rig) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    short = hdr.hashes[:-8]
    forged = KVChunk(**{**_fields(hdr), "hashes": short, "checksum": chunk_checksum(short)})
    assert fake.push is not None
    fake.push.send(forged, frames)
    assert_refused(fake, rx, pool, "bytes of block hashes")


@pytest.mark.parametrize("frame, pos", [(0, 0), (0, 333), (1, 1), (1, -1)])
def test_corrupted_byte_caught_by_xxh3_block_hash(rig, frame, pos) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    layers = [f[j * len(f) // 2 : (j + 1) * len(f) // 2] for f in frames for j in range(2)]
    blocks = [xxhash.xxh3_64(x).intdigest() for x in layers]  # one block per layer here
    assert hdr.hashes == struct.pack("<4Q", *blocks)
    assert hdr.checksum == xxhash.xxh3_64(hdr.hashes).intdigest()
    bad = [bytearray(f) for f in frames]
    bad[frame][pos] ^= 0x5A  # one byte, any bits
    before = pool.k.clone(), pool.v.clone()
    assert fake.push is not None
    fake.push.send(hdr, [bytes(b) for b in bad])
    assert_refused(fake, rx, pool, "checksum mismatch", before)
    assert_bad_block_unwritten(pool, before, frame, pos % len(frames[0]))


def test_swapped_k_and_v_frames_refused(rig) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = chunk(ready)
    before = pool.k.clone(), pool.v.clone()
    assert fake.push is not None
    fake.push.send(hdr, frames[::-1])
    assert_refused(fake, rx, pool, "checksum mismatch", before)
    assert_bad_block_unwritten(pool, before, 0, 0)  # K's first block: V's bytes


def test_garbage_is_dropped_and_counted(rig) -> None:
    fake, rx, pool, ready = rig
    before = pool.k.clone()
    assert fake.push is not None
    sock = fake.push.sock
    sock.send(b"\x93not msgpack at all")
    sock.send(encode(Heartbeat(sender="x", seq=1))[:-1] + b"\xc1")  # malformed
    sock.send(b"\x81\xa1t\xa4evil")  # unknown tag
    sock.send(b"\x00" * 70_000)  # oversized header
    this, other = (b"\xa1v" + bytes([v]) for v in (PROTOCOL_VERSION, PROTOCOL_VERSION + 1))
    sock.send(encode(Heartbeat(sender="x", seq=1)).replace(this, other))  # another version
    hdr, frames = chunk(ready)
    fake.push.send(KVChunk(**{**_fields(hdr), "room": 999}), frames)  # unknown room
    fake.push.send(KVChunk(**{**_fields(hdr), "session": ready.session + 1}), frames)  # stale
    assert wait_until(lambda: rx.stats().get("stale_session", 0) == 1, 3)
    s = rx.stats()
    assert (s["malformed"], s["oversized"], s["version"], s["unknown_room"]) == (3, 1, 1, 1)
    assert rx.poll() == [] and rx.active_rooms() == {11}  # the transfer itself is unharmed
    assert torch.equal(pool.k, before)
    fake.push.send(hdr, frames)
    assert wait_until(lambda: not torch.equal(pool.k, before), 3)  # a valid chunk is written
    done = KVDone(
        room=11,
        session=ready.session,
        first_token=5,
        first_logprob=0.0,
        prompt_len=N,
        num_chunks=1,
        digest=0,
    )
    fake.push.send(done)
    assert_refused(fake, rx, pool, "digest mismatch")


def _fields(s: KVChunk) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def runs_chunk(ready: Ready, runs: list[int], kind: str = "k") -> tuple[KVChunk, list[bytes]]:
    """A chunk sent in place: one frame per (layer, run) of `kind`, layer-major."""
    frames = [
        np.random.rand(c * TOKEN_BYTES // 4).astype(np.float32).tobytes()
        for _ in range(LAYOUT.num_layers)
        for c in runs
    ]
    hdr = KVChunk(room=ready.room, session=ready.session, index=0, layer_start=0,
                  layer_end=LAYOUT.num_layers, tok_start=0, tok_end=sum(runs), kind=kind,
                  dtype="float32", nbytes=sum(len(f) for f in frames),
                  checksum=chunk_checksum(block_hashes(frames)), hashes=block_hashes(frames),
                  runs=runs)  # fmt: skip
    return hdr, frames


@pytest.mark.parametrize("packed", [False, True])
def test_runs_written_where_they_belong(rig, packed: bool) -> None:
    """A chunk with runs: one frame per (layer, run) segment (sent in place), or (packed)
    the kind's segments one after another in one frame (a gathered piece, messages.py),
    written exactly alike under the same checksum."""
    fake, rx, pool, ready = rig
    hdr, frames = runs_chunk(ready, [3, 7])
    assert fake.push is not None
    fake.push.send(hdr, [b"".join(frames)] if packed else frames)
    _, slots = reserve(random_pool(LAYOUT, 64, 3), N, 3)  # the rig's reservation again
    want = [  # layer by layer: its two runs' tokens in order
        torch.tensor(np.frombuffer(frames[2 * i] + frames[2 * i + 1], dtype=np.float32))
        for i in range(LAYOUT.num_layers)
    ]
    written = lambda: all(  # noqa: E731
        torch.equal(pool.k[i, slots].reshape(-1), w) for i, w in enumerate(want)
    )
    assert wait_until(written, 3)
    assert rx.active_rooms() == {11}  # V still to come


@pytest.mark.parametrize(
    "runs, frames_fix, reason",
    [
        ([3, 6], None, "runs"),  # runs cover 9 of the 10 tokens
        ([3, 0, 7], None, "runs"),
        ([3, 7], "drop", "payload frames"),
        ([3, 7], "short", "byte count"),
    ],
)
def test_bad_runs_refused_before_write(rig, runs, frames_fix, reason) -> None:
    fake, rx, pool, ready = rig
    hdr, frames = runs_chunk(ready, [3, 7])
    if frames_fix is None:
        hdr = KVChunk(**{**_fields(hdr), "runs": runs})
    elif frames_fix == "drop":
        frames = frames[:-1]
    else:
        frames = [frames[0][:-4], *frames[1:]]
    assert fake.push is not None
    fake.push.send(hdr, frames)
    assert_refused(fake, rx, pool, reason)


@pytest.mark.parametrize("fix, reason", [("short", "payload frames"), ("flip", "checksum")])
def test_bad_packed_runs_refused(rig, fix, reason) -> None:
    """A packed frame a byte short is not cut into segments (refused by its frame
    count, before any write); a flipped byte in it fails its block's hash."""
    fake, rx, pool, ready = rig
    hdr, frames = runs_chunk(ready, [3, 7])
    packed = bytearray(b"".join(frames))
    if fix == "short":
        packed = packed[:-1]
    else:
        packed[len(packed) // 2] ^= 1
    before = pool.k.clone(), pool.v.clone()
    assert fake.push is not None
    fake.push.send(hdr, [bytes(packed)])
    assert_refused(fake, rx, pool, reason, None if fix == "short" else before)
    if fix == "flip":
        assert_bad_block_unwritten(pool, before, 0, len(packed) // 2)


def test_segments_cut_only_a_whole_packed_frame() -> None:
    """payload.unpack: views of the packed frame's segments (no copy), and anything
    else as it came."""
    from pdserve.transfer.receiving.payload import unpack

    ready = Ready(
        room=1, session=2, data_endpoint="tcp://x", layout="", num_tokens=N, decode_id="d"
    )
    hdr, frames = runs_chunk(ready, [3, 7])
    packed = memoryview(b"".join(frames))
    cut = unpack(LAYOUT, hdr, [packed])
    assert [bytes(c) for c in cut] == frames
    assert all(c.obj is packed.obj for c in cut)
    as_sent = [memoryview(f) for f in frames]
    assert unpack(LAYOUT, hdr, as_sent) is as_sent
    assert unpack(LAYOUT, hdr, [packed[:-1]])[0].nbytes == packed.nbytes - 1
    whole = KVChunk(**{**_fields(hdr), "runs": []})
    assert unpack(LAYOUT, whole, [packed]) == [packed]
    forged = KVChunk(**{**_fields(hdr), "layer_end": 10**15})  # left for check_chunk
    assert unpack(LAYOUT, forged, [packed]) == [packed]
    many = KVChunk(**{**_fields(hdr), "runs": [1] * 10**5})
    assert unpack(LAYOUT, many, [packed]) == [packed]
