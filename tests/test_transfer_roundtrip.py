"""KV transfer over real loopback sockets: bytes, orders, refusals, cleanup."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.kernels.native import library
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import (
    Side,
    gather,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
    wait_until,
)
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender

pytestmark = pytest.mark.timeout(60)


def layout(page_size: int = 4, dtype: str = "float32") -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=page_size)


@pytest.fixture
def pair(request):
    lay = getattr(request, "param", layout())
    tx = KVSender(
        lay, transfer_settings(kv_ready_timeout_s=5, kv_timeout_s=5, heartbeat_interval_s=0.1)
    )
    rx = KVReceiver(lay, transfer_settings(kv_timeout_s=5, heartbeat_timeout_s=2))
    yield tx, rx, lay
    tx.close()
    rx.close()


def sides(lay: KVLayout, n: int, seed: int) -> tuple[Side, Side]:
    pre = random_pool(lay, n + 3 * lay.page_size, seed)
    dec = random_pool(lay, n + 5 * lay.page_size, seed + 1000)
    # burn a few pages so the two sides' page ids differ
    dec.allocator.alloc(2)
    return Side(pre, *reserve(pre, n, seed)), Side(dec, *reserve(dec, n, seed + 1))


def assert_no_state(tx: KVSender, rx: KVReceiver) -> None:
    wait_until(lambda: not (tx.active_rooms() or rx.active_rooms()), 2)
    assert tx.active_rooms() == set()
    assert rx.active_rooms() == set()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_bytes_arrive_exactly(page_size: int, n: int) -> None:
    roundtrip(layout(page_size), n)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_bytes_arrive_exactly(dtype: str) -> None:
    """Frames travel as bytes: numpy has no bfloat16, the pool's dtype must not matter."""
    roundtrip(layout(4, dtype), 45)


@pytest.mark.parametrize("gather, scatter", [(True, True), (True, False), (False, True)])
def test_gathered_pieces_arrive_exactly(monkeypatch, gather: bool, scatter: bool) -> None:
    """The prefill's pages scattered over its pool, prefill chunks starting mid-page:
    every piece is gathered page by page and hashed per layer by the page I/O
    (kernels/page_io.py: the native kernel, or numpy and xxhash under
    --disable-compile), one packed frame per kind; the decode cuts a packed frame into
    its segments for either writer alike. The row gather (for slots not in whole pages)
    fails if it is called, and the page I/O is the one asked for."""
    from pdserve.kernels.page_io import PORTABLE, NativePages
    from pdserve.transfer.sending.staging import StagingPool

    if gather and library.compiler() is None:
        pytest.skip("no C compiler")

    def not_this(*_a, **_k):
        raise AssertionError("the row gather ran")

    monkeypatch.setattr(StagingPool, "gather", not_this)
    chosen = []
    monkeypatch.setattr(StagingPool, "gather_pages", _recording(StagingPool.gather_pages, chosen))
    stats = roundtrip(layout(4), 91, native_gather=gather, native_scatter=scatter)
    assert chosen and all(isinstance(p, NativePages) if gather else p is PORTABLE for p in chosen)
    assert stats["pieces_gathered"] > 0  # (a piece inside a few pages still goes in place)


def _recording(gather_pages, chosen: list):
    """StagingPool.gather_pages, recording the page I/O each call is given."""

    def record(self, src, tpages, t0, n, pages):
        chosen.append(pages)
        return gather_pages(self, src, tpages, t0, n, pages)

    return record


def roundtrip(
    lay: KVLayout, n: int, native_gather: bool = True, native_scatter: bool = True
) -> dict[str, int]:
    """One transfer of n tokens between shuffled pages; the sender's stats."""
    tx = KVSender(
        lay, transfer_settings(heartbeat_interval_s=0.1), max_frame_bytes=4096, native=native_gather
    )
    rx = KVReceiver(lay, transfer_settings(kv_timeout_s=5), native_scatter=native_scatter)
    try:
        pre, dec = sides(lay, n, seed=n * 31 + lay.page_size)
        assert not torch.equal(pre.slots, dec.slots) or n == 1
        arrives_exactly(tx, rx, pre, dec, chunk=max(1, n // 3))
        return tx.stats()
    finally:
        tx.close()
        rx.close()


def arrives_exactly(tx: KVSender, rx: KVReceiver, pre: Side, dec: Side, chunk: int) -> None:
    """One transfer of `pre`'s prompt into `dec`'s slots in prefill chunks of `chunk`:
    both sides report success, the decode's slots hold the prefill's bytes, and neither
    side keeps any state afterwards."""
    n = len(pre.slots)
    rx.expect(make_req("r", 42, n, tx.bootstrap_port), dec.pool, dec.slots)
    push_prompt(tx, make_req("r", 42, n, tx.bootstrap_port), pre, chunk=chunk)
    [ev] = wait_for(rx.poll)
    assert ev.ok, ev.reason
    assert (ev.first_token, ev.first_logprob) == (7, -0.5)
    k_pre, v_pre = gather(pre.pool, pre.slots)
    k_dec, v_dec = gather(dec.pool, dec.slots)
    assert torch.equal(k_pre, k_dec) and torch.equal(v_pre, v_dec)
    [sev] = wait_for(tx.poll)
    assert sev.ok and sev.rid == "r"
    assert_no_state(tx, rx)


def test_ready_after_prefill_done(pair) -> None:
    """The prefill finishes (and buffers) before the decode's Ready arrives."""
    tx, rx, lay = pair
    pre, dec = sides(lay, 40, seed=3)
    push_prompt(tx, make_req("a", 5, 40, tx.bootstrap_port), pre, chunk=16)
    assert wait_for(tx.poll, 1, 0.3) == []  # nothing can finish without the decode
    rx.expect(make_req("a", 5, 40, tx.bootstrap_port), dec.pool, dec.slots)
    [ev] = wait_for(rx.poll)
    assert ev.ok, ev.reason
    assert torch.equal(gather(pre.pool, pre.slots)[0], gather(dec.pool, dec.slots)[0])
    assert [e.ok for e in wait_for(tx.poll)] == [True]


def test_ready_before_admit(pair) -> None:
    """The decode's Ready arrives before the prefill even admitted the request."""
    tx, rx, lay = pair
    pre, dec = sides(lay, 33, seed=4)
    rx.expect(make_req("b", 6, 33, tx.bootstrap_port), dec.pool, dec.slots)
    assert wait_until(lambda: bool(tx.active_rooms()), 2)
    assert tx.active_rooms() == {6}
    push_prompt(tx, make_req("b", 6, 33, tx.bootstrap_port), pre, chunk=8)
    [ev] = wait_for(rx.poll)
    assert ev.ok, ev.reason
    assert torch.equal(gather(pre.pool, pre.slots)[1], gather(dec.pool, dec.slots)[1])
    assert [e.ok for e in wait_for(tx.poll)] == [True]


def test_many_rooms_interleaved(pair) -> None:
    tx, rx, lay = pair
    n_reqs, rng = 6, random.Random(0)
    lens = [rng.randint(1, 50) for _ in range(n_reqs)]
    pairs = [sides(lay, n, seed=10 + i) for i, n in enumerate(lens)]
    for i, (n, (_, dec)) in enumerate(zip(lens, pairs)):
        if i % 2:
            rx.expect(make_req(f"q{i}", 100 + i, n, tx.bootstrap_port), dec.pool, dec.slots)
    for i, (n, (pre, _)) in enumerate(zip(lens, pairs)):
        push_prompt(tx, make_req(f"q{i}", 100 + i, n, tx.bootstrap_port), pre, chunk=7)
    for i, (n, (_, dec)) in enumerate(zip(lens, pairs)):
        if not i % 2:
            rx.expect(make_req(f"q{i}", 100 + i, n, tx.bootstrap_port), dec.pool, dec.slots)
    events = wait_for(rx.poll, n_reqs)
    assert sorted(e.rid for e in events if e.ok) == sorted(f"q{i}" for i in range(n_reqs))
    for pre, dec in pairs:
        assert torch.equal(gather(pre.pool, pre.slots)[0], gather(dec.pool, dec.slots)[0])
        assert torch.equal(gather(pre.pool, pre.slots)[1], gather(dec.pool, dec.slots)[1])
    assert len([e for e in wait_for(tx.poll, n_reqs) if e.ok]) == n_reqs


def test_layout_mismatch_refused_on_both_sides() -> None:
    tx = KVSender(layout(4), transfer_settings(heartbeat_interval_s=0.1))
    rx = KVReceiver(layout(8), transfer_settings(kv_timeout_s=5))
    try:
        pre = random_pool(layout(4), 64, 1)
        dec = random_pool(layout(8), 64, 2)
        p_side, d_side = Side(pre, *reserve(pre, 20, 1)), Side(dec, *reserve(dec, 20, 2))
        before = dec.k.clone(), dec.v.clone()
        rx.expect(make_req("m", 9, 20, tx.bootstrap_port), dec, d_side.slots)
        push_prompt(tx, make_req("m", 9, 20, tx.bootstrap_port), p_side, chunk=20)
        [ev] = wait_for(rx.poll)
        assert not ev.ok and "layout mismatch" in ev.reason and "P8" in ev.reason
        # NOTE: a Ready handled before on_admit also reports the room alone (rid "") first
        [sev] = wait_for(lambda: [e for e in tx.poll() if e.rid == "m"])
        assert not sev.ok and "layout mismatch" in sev.reason
        assert torch.equal(dec.k, before[0]) and torch.equal(dec.v, before[1])
        assert_no_state(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_duplicate_active_room_refused(pair) -> None:
    tx, rx, lay = pair
    pre, dec = sides(lay, 12, seed=5)
    _, dec2 = sides(lay, 12, seed=6)
    before = dec2.pool.k.clone()
    rx.expect(make_req("d1", 77, 12, tx.bootstrap_port), dec.pool, dec.slots)
    rx.expect(make_req("d2", 77, 12, tx.bootstrap_port), dec2.pool, dec2.slots)
    [dup] = wait_for(rx.poll)
    assert (dup.rid, dup.ok) == ("d2", False) and "duplicate active room" in dup.reason
    req_p = make_req("d1", 77, 12, tx.bootstrap_port)
    tx.on_admit(req_p)
    tx.on_admit(make_req("p2", 77, 12, tx.bootstrap_port))
    [sdup] = wait_for(tx.poll)
    assert (sdup.rid, sdup.ok) == ("p2", False) and "duplicate active room" in sdup.reason
    tx.on_chunk(req_p, pre.pool, pre.slots, 0, 12)
    tx.on_done(req_p, 1, 0.0)
    [ev] = wait_for(rx.poll)
    assert ev.ok and ev.rid == "d1"
    assert torch.equal(dec2.pool.k, before)
    assert [e.ok for e in wait_for(tx.poll)] == [True]


def test_cancel_stops_writes_and_tells_prefill(pair) -> None:
    tx, rx, lay = pair
    pre, dec = sides(lay, 30, seed=8)
    req_d = make_req("c", 55, 30, tx.bootstrap_port)
    rx.expect(req_d, dec.pool, dec.slots)
    req_p = make_req("c", 55, 30, tx.bootstrap_port)
    tx.on_admit(req_p)
    assert wait_until(lambda: bool(tx.active_rooms()), 2)
    rx.cancel(req_d, "client gone")
    before = dec.pool.k.clone(), dec.pool.v.clone()
    tx.on_chunk(req_p, pre.pool, pre.slots, 0, 30)
    tx.on_done(req_p, 1, 0.0)
    [sev] = wait_for(tx.poll)
    assert not sev.ok and "client gone" in sev.reason
    assert wait_for(rx.poll, 1, 0.3) == []  # cancel reports nothing
    assert torch.equal(dec.pool.k, before[0]) and torch.equal(dec.pool.v, before[1])
    assert_no_state(tx, rx)


def test_wait_blocks_until_the_transfer_ends_or_times_out(pair) -> None:
    """KVReceiver.wait (benchmarks): [] after its timeout with nothing in flight; with a
    transfer in flight it returns that transfer's event, before its timeout."""
    tx, rx, lay = pair
    t0 = time.monotonic()
    assert rx.wait(0.2) == []
    assert time.monotonic() - t0 >= 0.19
    pre, dec = sides(lay, 40, seed=4)
    rx.expect(make_req("w", 9, 40, tx.bootstrap_port), dec.pool, dec.slots)
    push_prompt(tx, make_req("w", 9, 40, tx.bootstrap_port), pre, chunk=16)
    t0 = time.monotonic()
    [ev] = rx.wait(10)
    assert ev.ok and ev.rid == "w" and time.monotonic() - t0 < 5
    assert rx.poll() == []
    assert [e.ok for e in wait_for(tx.poll)] == [True]
