"""KV frames sent in place from the prefill's pool (transfer/sending/pieces.py): the bytes, when
the path is taken, and the page lifetime it needs (the sender reports a room only once
libzmq reads none of its pages)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from pdserve.envs import cache_root
from pdserve.kvcache.pools import KVLayout, slots_of
from pdserve.transfer import stages
from pdserve.transfer.loopback import (
    Side,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
)
from pdserve.transfer.messages import Decoder, Ready
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending import sender
from pdserve.transfer.sending.peers import DataSockets
from pdserve.transfer.sending.pieces import MAX_RUNS, slot_runs
from pdserve.transfer.sending.sender import KVSender
from pdserve.transfer.zmq_io import MsgSocket, make_socket
from pdserve.transfer.zmq_native import Frames, native_send
from tests.test_transfer_roundtrip import arrives_exactly

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)


def test_slot_runs() -> None:
    assert slot_runs(np.array([4, 5, 6, 7])) == [(4, 4)]
    assert slot_runs(np.array([6, 7, 20, 21, 22, 3])) == [(6, 2), (20, 3), (3, 1)]
    assert slot_runs(np.arange(0, 2 * MAX_RUNS + 2, 2)) is None  # one run per slot: gather
    assert slot_runs(np.array([], dtype=np.int64)) is None


def in_runs(pool, n: int, runs: int) -> Side:
    """`n` tokens' pages in `runs` runs of consecutive pages (a page left out between)."""
    need = pool.allocator.pages_for(n)
    got = pool.allocator.alloc(need + runs - 1)  # a fresh pool: ascending, consecutive
    assert got is not None
    parts = np.array_split(np.arange(need), runs)
    pages = [got[int(i) + r] for r, part in enumerate(parts) for i in part]
    return Side(pool, pages, slots_of(pages, n, pool.page_size))


def transfer(pre: Side, n: int, chunk: int) -> KVSender:
    """`pre`'s prompt into a decode's shuffled pages (the decode scatters), checked by
    the roundtrip tests' arrives_exactly; returns the (closed) sender for its stats."""
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), max_frame_bytes=1 << 20)
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=5))
    try:
        dec_pool = random_pool(LAYOUT, n + 5 * LAYOUT.page_size, 99)
        dec_pool.allocator.alloc(2)
        arrives_exactly(tx, rx, pre, Side(dec_pool, *reserve(dec_pool, n, 5)), chunk)
        return tx
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("n, chunk", [(1, 1), (7, 3), (64, 64), (301, 50)])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_bytes_sent_in_place_arrive_exactly(n: int, chunk: int, runs: int) -> None:
    pool = random_pool(LAYOUT, n + 8 * LAYOUT.page_size, n + runs)
    pre = in_runs(pool, n, runs)
    tx = transfer(pre, n, chunk)
    assert tx._pusher._staging is None  # no piece was gathered
    stats = tx.stats()
    assert stats["pieces_gathered"] == 0 and stats["pieces_in_place"] == -(-n // chunk)


def test_scattered_pages_are_gathered() -> None:
    n = 64
    pool = random_pool(LAYOUT, n + 8 * LAYOUT.page_size, 5)
    pre = Side(pool, *reserve(pool, n, 5))  # shuffled pages: one run per page
    assert slot_runs(pre.slots.numpy()) is None
    tx = transfer(pre, n, n)
    assert tx._pusher._staging is not None
    assert tx.stats()["pieces_gathered"] == 1 and tx.stats()["pieces_in_place"] == 0


def hashed_before_ready(
    n: int, chunk: int, change_after: bool, pieces: list | None = None
) -> tuple[str, dict]:
    """A prompt computed (pages in one run) before the decode's Ready: wait until the
    sender has taken in every chunk, optionally change one byte of the prefill's pool,
    then let the decode ask. Returns (the decode's failure reason or "", stage seconds
    spent meanwhile). `pieces`: filled with the room's pieces as they were before the
    Ready, once the sender has reported the room."""
    pool = random_pool(LAYOUT, n + 8 * LAYOUT.page_size, 3)
    pre = in_runs(pool, n, 1)
    dec_pool = random_pool(LAYOUT, n + 5 * LAYOUT.page_size, 4)
    dec = Side(dec_pool, *reserve(dec_pool, n, 5))
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), max_frame_bytes=1 << 12)
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=5))
    try:
        before = stages.snapshot()
        push_prompt(tx, make_req("r", 42, n, tx.bootstrap_port), pre, chunk=chunk)
        taken = threading.Event()
        tx._io.submit(taken.set)  # behind the chunks: they have all been taken in
        assert taken.wait(5)
        if change_after:
            pool.k[1, int(pre.slots[n - 1]), 0, 0] += 1.0  # in the last piece
        held = list(tx._rooms[42].pending)  # the I/O thread is done with them until Ready
        made = [
            type(p.prepared.zframes[0]) if p.prepared and p.prepared.zframes else None for p in held
        ]
        rx.expect(make_req("r", 42, n, tx.bootstrap_port), dec.pool, dec.slots)
        [ev] = wait_for(rx.poll)
        after = stages.snapshot()
        if pieces is not None:
            [sent] = wait_for(tx.poll, 1, 5)  # only once libzmq let go of every frame
            assert sent.ok == ev.ok
            pieces += [(was_made, p) for was_made, p in zip(made, held)]
        spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("prepare", "checksum")}
        if ev.ok:
            assert torch.equal(pool.k[:, pre.slots], dec_pool.k[:, dec.slots])
            assert torch.equal(pool.v[:, pre.slots], dec_pool.v[:, dec.slots])
        return ev.reason, spent
    finally:
        tx.close()
        rx.close()


def test_pieces_computed_before_ready_are_hashed_before_it_comes() -> None:
    """Pusher.prepare: a room whose KV is complete before the decode's Ready has its
    pieces hashed then (the 'prepare' stage), and its sends hash nothing."""
    reason, spent = hashed_before_ready(70, 16, change_after=False)
    assert reason == ""
    assert spent["prepare"] > 0 and spent["checksum"] == 0


def test_frames_of_a_hashed_piece_are_made_before_the_ready_and_dropped_once_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through pyzmq's send, prepare() also makes a piece's zero-copy frames (about 12 us
    each, 16 for a 1k-token prompt here), so the Ready's first send only queues them. They
    are sent once and then dropped, or their trackers would never be done and the room
    never reported."""
    monkeypatch.setattr(sender, "native_send", lambda cache_dir: None)  # as without libzmq's C API
    pieces: list = []
    reason, _ = hashed_before_ready(70, 16, change_after=False, pieces=pieces)
    assert reason == "" and len(pieces) == 5
    assert all(made is list for made, _ in pieces)  # pyzmq frames, one per (layer, run)
    assert all(p.prepared.zframes is None for _, p in pieces)


def test_a_native_send_makes_its_frames_before_the_ready_too() -> None:
    """Through libzmq's C API (zmq_native.py) prepare() makes each message's frame
    addresses (zmq_native.Frames) instead; sent once, then dropped, and the room is
    reported once libzmq let go of every frame."""
    if native_send(cache_root()) is None:
        pytest.skip("libzmq's C API not reachable here")
    pieces: list = []
    reason, _ = hashed_before_ready(70, 16, change_after=False, pieces=pieces)
    assert reason == "" and len(pieces) == 5
    assert all(made is Frames for made, _ in pieces)
    assert all(p.prepared.zframes is None for _, p in pieces)


def test_a_byte_changed_after_hashing_is_refused() -> None:
    """The checksum that goes out is the one prepare() took: the decode refuses the chunk
    if the pool's bytes differ from it when they are sent (fail closed, never a 200)."""
    reason, _ = hashed_before_ready(70, 16, change_after=True)
    assert "checksum mismatch" in reason


def fake_ready(port: int, room: int, n: int, data_endpoint: str) -> MsgSocket:
    """A decode's Ready for `room`, from a DEALER the test holds (it never heartbeats)."""
    sock = MsgSocket(make_socket(zmq.DEALER), Decoder())
    sock.sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(
        Ready(
            room=room,
            rid="r",
            session=5,
            data_endpoint=data_endpoint,
            layout=LAYOUT.fingerprint(),
            num_tokens=n,
            decode_id="d",
        )  # fmt: skip
    )
    return sock


def test_room_reported_only_after_libzmq_lets_go_of_its_pages(monkeypatch) -> None:
    """The race: frames sent in place are the pool's pages. A room that fails while they
    still sit in libzmq's queue (here: a decode endpoint nobody listens on) must not be
    reported, or the prefill frees pages that libzmq sends later (another request's KV
    by then). Keeping the data socket open keeps the frames queued; the report comes
    only once the socket is closed and libzmq has dropped them. Fails with the wait in
    KVSender._report removed (the room is reported at its ack timeout)."""
    closes: list[MsgSocket] = []
    monkeypatch.setattr(DataSockets, "drop", lambda self, ep: closes.append(self._socks.pop(ep)))
    n = 32
    pool = random_pool(LAYOUT, n + 8 * LAYOUT.page_size, 1)
    pre = in_runs(pool, n, 1)
    # a port held by a listener that never answers ZeroMQ's greeting: the frames stay
    # queued (a freed port could be taken by another process, which would take them)
    mute = socket.create_server(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
    tx = KVSender(LAYOUT, transfer_settings(kv_timeout_s=0.3, heartbeat_interval_s=0.05))
    ctrl = fake_ready(tx.bootstrap_port, 9, n, dead)
    try:
        push_prompt(tx, make_req("r", 9, n, tx.bootstrap_port), pre, chunk=n)
        deadline = time.monotonic() + 5
        while not closes and time.monotonic() < deadline:  # the room failed (ack timeout)
            assert tx.poll() == []
            time.sleep(0.01)
        assert closes, "the room did not fail"
        assert wait_for(tx.poll, 1, 1.0) == []  # frames still queued: no report
        closes[0].close()  # libzmq drops the queued frames
        [ev] = wait_for(tx.poll, 1, 3)
        assert not ev.ok and "no Ack" in ev.reason
    finally:
        ctrl.close()
        tx.close()
        mute.close()


def test_runs_copied_into_a_device_pool(monkeypatch) -> None:
    """writer._copy_runs_to_device (a CPU prefill's frames, a GPU decode's pool) puts each
    run's tokens of each layer at their slots; run here on a CPU pool, without the wait
    for the device."""
    from pdserve.transfer.receiving import writer

    monkeypatch.setattr(writer, "land", lambda device: None)
    pool = random_pool(LAYOUT, 64, 3)
    _, slots = reserve(pool, 10, 3)
    runs = [3, 7]
    want = torch.randn(LAYOUT.num_layers, 10, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    frames = [
        memoryview(want[layer, a : a + c].contiguous().numpy().tobytes())
        for layer in range(LAYOUT.num_layers)
        for a, c in ((0, 3), (3, 7))
    ]
    writer._copy_runs_to_device(pool.k, slots, runs, frames)
    assert torch.equal(pool.k[:, slots], want)


@pytest.mark.parametrize("runs", [[], [3, 7]], ids=["one-frame-per-kind", "in-place-runs"])
def test_the_device_writer_writes_what_the_row_writer_does(monkeypatch, runs) -> None:
    """writer.write_chunk's path for a pool on a GPU (index_copy_ from the frames) puts
    the same bytes as its path for a CPU pool whose slots are not whole pages; run here
    on CPU pools, without the wait for the device."""
    from pdserve.transfer.messages import KVChunk, block_hashes, chunk_checksum
    from pdserve.transfer.receiving import writer
    from pdserve.transfer.receiving.payload import received
    from pdserve.transfer.receiving.transfer import Transfer

    monkeypatch.setattr(writer, "land", lambda device: None)
    n, layers = 10, LAYOUT.num_layers
    sent = [torch.randn(layers, n, LAYOUT.num_kv_heads, LAYOUT.head_dim) for _ in "kv"]
    cuts = [(0, 3), (3, 7)] if runs else [(0, n)]
    frames = [
        t[layer, a : a + c].numpy().tobytes()
        for t in sent
        for layer in range(layers)
        for a, c in cuts
    ]
    if not runs:  # one frame per kind: its layers one after another
        frames = [t.numpy().tobytes() for t in sent]
    segs = (
        frames
        if runs
        else [
            f[i * len(f) // layers : (i + 1) * len(f) // layers]
            for f in frames
            for i in range(layers)
        ]
    )
    hashes = block_hashes(segs)
    h = KVChunk(room=1, session=7, index=0, layer_start=0, layer_end=layers, tok_start=0, tok_end=n,
                kind="kv", dtype="float32", nbytes=len(b"".join(frames)) // 2,
                checksum=chunk_checksum(hashes), hashes=hashes, runs=runs)  # fmt: skip
    pools = []
    for path in (writer._write_device, writer._write_rows):
        pool = random_pool(LAYOUT, 64, 3)
        slots = torch.randperm(pool.k.shape[1], generator=torch.Generator().manual_seed(4))[:n]
        x = Transfer(make_req("r", 1, n, 1), pool, slots, session=7, endpoint="tcp://x")
        path(x, received(LAYOUT, h, [memoryview(f) for f in frames]), (0, 1))
        assert torch.equal(pool.k[:, slots], sent[0]) and torch.equal(pool.v[:, slots], sent[1])
        pools.append(pool)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
