"""kernels/page_io.py: the portable page I/O gives the native one's bytes and hashes,
and refuses what it refuses, so an engine without a C compiler sends and receives the
same KV (the transfer never asks which one it has)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kernels.native.page_copy import page_copy
from pdserve.kernels.page_io import PORTABLE, NativePages, PageIO, page_io

L, PAGES, P, RB, BLOCK = 3, 9, 4, 24, 64


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> list[PageIO]:
    kernel = page_copy(tmp_path_factory.mktemp("pio"), split=True, threads=2)
    return [PORTABLE] if kernel is None else [PORTABLE, NativePages(kernel)]


def _case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, (L, PAGES, P * RB), dtype=np.uint8)
    return pool, rng.permutation(PAGES).astype(np.int64)


def _want(pool, tpages, t0, runs) -> list[bytes]:
    """gather_runs by plain indexing, a position at a time."""
    out = []
    for layer in range(L):
        p = t0
        for count in runs:
            rows = []
            for _ in range(count):
                page, row = tpages[p // P], p % P
                rows.append(pool[layer, page, row * RB : (row + 1) * RB].tobytes())
                p += 1
            out.append(b"".join(rows))
    return out


@pytest.mark.parametrize(("t0", "runs"), [(0, [1]), (3, [5, 2]), (1, [4, 4, 9]), (7, [P * 7])])
def test_each_gathers_what_indexing_reads_with_the_same_hashes(both, t0, runs) -> None:
    pool, tpages = _case(t0)
    want = _want(pool, tpages, t0, runs)
    hashes = PORTABLE.block_hashes(want, BLOCK)
    for io in both:
        frames = [bytearray(len(w)) for w in want]
        assert io.gather_runs(pool, tpages, P, t0, runs, frames, BLOCK) == hashes
        assert [bytes(f) for f in frames] == want


@pytest.mark.parametrize(("t0", "runs"), [(0, [1]), (3, [5, 2]), (2, [P * 6])])
def test_each_writes_what_indexing_writes_and_refuses_a_bad_block(both, t0, runs) -> None:
    pool, tpages = _case(100 + t0)
    src, _ = _case(200 + t0)
    srcs = [memoryview(s) for s in _want(src, tpages, t0, runs)[: 2 * len(runs)]]  # 2 layers
    hashes = PORTABLE.block_hashes(srcs, BLOCK)
    written = []
    for io in both:
        kinds = (pool.copy(), pool.copy())
        assert io.writer(kinds, P).scatter(1, (0, 2), tpages, t0, runs, srcs, hashes, BLOCK)
        assert _want(kinds[1], tpages, t0, runs)[: 2 * len(runs)] == [bytes(s) for s in srcs]
        assert np.array_equal(kinds[0], pool) and np.array_equal(kinds[1][2], pool[2])
        written.append(kinds[1])
        bad = bytearray(hashes)
        bad[-1] ^= 1
        again = (pool.copy(), pool.copy())
        assert not io.writer(again, P).scatter(0, (0, 2), tpages, t0, runs, srcs, bytes(bad), BLOCK)
    assert all(np.array_equal(w, written[0]) for w in written)


def test_the_portable_writer_writes_nothing_of_a_refused_chunk() -> None:
    pool, tpages = _case(5)
    srcs = [memoryview(bytes(4 * RB))] * L
    kinds = (pool.copy(), pool.copy())
    hashes = bytearray(PORTABLE.block_hashes(srcs, BLOCK))
    hashes[0] ^= 1
    assert not PORTABLE.writer(kinds, P).scatter(
        0, (0, L), tpages, 0, [4], srcs, bytes(hashes), BLOCK
    )
    assert np.array_equal(kinds[0], pool)


@pytest.mark.parametrize(
    ("t0", "runs", "pages"),
    [(0, [P * PAGES + 1], None), (P * PAGES, [1], None), (0, [2], np.array([PAGES], np.int64))],
)
def test_each_refuses_positions_or_pages_outside(both, t0, runs, pages) -> None:
    pool, tpages = _case(9)
    tpages = tpages if pages is None else pages
    srcs = [memoryview(bytes(sum(runs) * RB))] * len(runs)
    hashes = PORTABLE.block_hashes(srcs, BLOCK)
    for io in both:
        kinds = (pool.copy(), pool.copy())
        with pytest.raises(ValueError):
            io.writer(kinds, P).scatter(0, (0, 1), tpages, t0, runs, srcs, hashes, BLOCK)
        assert np.array_equal(kinds[0], pool)
        with pytest.raises(ValueError):
            io.gather_runs(pool, tpages, P, t0, runs, [bytearray(c * RB) for c in runs], BLOCK)


def test_the_choice_is_made_once_from_the_cache_dir(tmp_path) -> None:
    assert page_io(None) is PORTABLE
    chosen = page_io(tmp_path)
    assert chosen is PORTABLE or isinstance(chosen, NativePages)
