"""kernels/native/page_copy.c: the decode's page scatter equals plain indexing and the
receiver's numpy path, on every store path (non-temporal AVX-512 / AVX / SSE2 stores,
memcpy), and refuses out-of-range positions, pages and bad shapes before writing."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdserve.kernels.native import library
from pdserve.kernels.native.page_copy import PageCopy, page_copy
from pdserve.kernels.page_io import PORTABLE, NativePages
from pdserve.transfer.loopback import transfer_settings

# -march=native plus these: each build takes another path through the same source
ISAS = [(), ("-mno-avx512f",), ("-mno-avx",), ("-mno-sse2", "-mno-avx")]


@pytest.fixture(scope="module", params=ISAS, ids=["native", "avx", "sse2", "memcpy"])
def kernel(request, tmp_path_factory) -> PageCopy:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    if request.param and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("x86 flags")
    lib = library.build("page_copy", tmp_path_factory.mktemp("pc"), request.param)
    assert lib is not None
    return PageCopy(ctypes.CDLL(str(lib)))


def test_the_receiver_builds_the_scatter_at_start_up_or_not_at_all(monkeypatch) -> None:
    """Built when the receiver is made (a second's compile, never inside a transfer);
    --disable-compile (native_scatter=False) keeps numpy's assignment."""
    from pdserve.kvcache.pools import KVLayout
    from pdserve.transfer.receiving.receiver import KVReceiver

    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4)
    on, off = (
        KVReceiver(lay, transfer_settings()),
        KVReceiver(lay, transfer_settings(), native_scatter=False),
    )
    try:
        assert off._pages is PORTABLE
        assert (on._pages is PORTABLE) == (library.compiler() is None)
    finally:
        on.close()
        off.close()


def _runs_case(ps: int, rb: int, seed: int):
    """A pool of 3 layers, a request of 5 shuffled pages holding 5 * ps - 3 positions."""
    g = np.random.default_rng(seed)
    dst = g.integers(0, 256, (3, 12, ps * rb), dtype=np.uint8)
    tpages = g.permutation(12)[:5].astype(np.int64)
    return g, dst, tpages


def _runs_want(dst, tpages, ps, rb, layer0, t0, runs, srcs):
    """scatter_runs by plain indexing, a position at a time."""
    want = dst.copy()
    layers = len(srcs) // len(runs)
    for j in range(layers):
        p = t0
        for r, count in enumerate(runs):
            rows = np.frombuffer(srcs[j * len(runs) + r], np.uint8).reshape(count, rb)
            for row in rows:
                page, off = tpages[p // ps], (p % ps) * rb
                want[layer0 + j, page, off : off + rb] = row
                p += 1
    return want


# (first position, runs): from a page's start or not, ending inside a page or not,
# runs that cross pages and runs shorter than one
RUNS = [(0, [4 * 4]), (1, [2]), (3, [1, 6, 2]), (5, [7, 1, 1, 4]), (0, [17])]


@pytest.mark.parametrize("rb", [256, 64, 24])  # rows aligned for every store width, then not
@pytest.mark.parametrize("t0, runs", RUNS)
def test_scatter_runs_matches_indexing(kernel, rb, t0, runs) -> None:
    """A received chunk of one kind: each (layer, run) a buffer of rows, written by prompt
    position into the request's pages, whatever the alignment."""
    ps = 4
    g, dst, tpages = _runs_case(ps, rb, seed=rb + t0)
    layer0, layers = 1, 2
    srcs = [
        g.integers(0, 256, count * rb, dtype=np.uint8).tobytes()  # read-only, like a frame
        for _ in range(layers)
        for count in runs
    ]
    want = _runs_want(dst, tpages, ps, rb, layer0, t0, runs, srcs)
    kernel.scatter_runs(dst[layer0 : layer0 + layers], tpages, ps, t0, runs, srcs)
    assert np.array_equal(dst, want)


def test_unaligned_pool_and_strided_layers(kernel) -> None:
    """A pool view 8 bytes off alignment (no non-temporal stores), layers further apart
    than their pages."""
    ps, rb = 4, 64
    base = np.zeros(3 * 13 * ps * rb + 8, dtype=np.uint8)
    dst = base[8:].reshape(3, 13, ps * rb)[:, :12]  # layer stride 13 pages, 12 used
    tpages = np.array([11, 0, 7], dtype=np.int64)
    srcs = [np.random.default_rng(layer).bytes(10 * rb) for layer in range(3)]
    want = _runs_want(dst, tpages, ps, rb, 0, 1, [10], srcs)
    kernel.scatter_runs(dst, tpages, ps, 1, [10], srcs)
    assert np.array_equal(dst, want)
    assert not base[:8].any()  # nothing before the view


def test_scatter_runs_refuses_before_writing(kernel) -> None:
    ps, rb = 4, 64
    _, dst, tpages = _runs_case(ps, rb, seed=9)
    before = dst.copy()
    frames = [bytes(3 * rb) for _ in range(3)]
    with pytest.raises(ValueError, match="outside"):  # positions past the request's pages
        kernel.scatter_runs(dst, tpages, ps, 5 * ps - 2, [3], frames)
    with pytest.raises(ValueError, match="outside"):
        kernel.scatter_runs(dst, tpages, ps, -1, [3], frames)
    bad = tpages.copy()
    bad[1] = 12  # a page outside the pool
    with pytest.raises(ValueError, match="outside"):
        kernel.scatter_runs(dst, bad, ps, 2, [3], frames)
    with pytest.raises(ValueError):  # a frame short
        kernel.scatter_runs(dst, tpages, ps, 0, [3], frames[:2])
    with pytest.raises(ValueError):  # a frame a row short
        kernel.scatter_runs(dst, tpages, ps, 0, [3], [*frames[:2], bytes(2 * rb)])
    with pytest.raises(ValueError):
        kernel.scatter_runs(dst, tpages.astype(np.int32), ps, 0, [3], frames)
    ro = dst.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError):
        kernel.scatter_runs(ro, tpages, ps, 0, [3], frames)
    assert np.array_equal(dst, before)


def _chunk_case(kind: str, layers: tuple[int, int], toks: tuple[int, int], runs: list[int]):
    """A KVChunk of random bytes for a 37-token request (pages of 4, shuffled)."""
    from pdserve.kvcache.pools import KVLayout
    from pdserve.transfer.checksum import block_hashes, chunk_checksum
    from pdserve.transfer.messages import KVChunk

    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    row, n_layers = lay.token_bytes_per_layer, layers[1] - layers[0]
    g = np.random.default_rng(len(runs) + toks[0])
    sizes = (
        [c * row for _ in range(n_layers) for c in runs]
        if runs
        else [n_layers * (toks[1] - toks[0]) * row]
    )
    frames = [g.integers(0, 256, s, dtype=np.uint8).tobytes() for _ in kind for s in sizes]
    segs = frames if runs else [f[j * (len(f) // n_layers) : (j + 1) * (len(f) // n_layers)]
                                for f in frames for j in range(n_layers)]  # fmt: skip
    hashes = block_hashes(segs)
    hdr = KVChunk(room=1, session=7, index=0, layer_start=layers[0], layer_end=layers[1],
                  tok_start=toks[0], tok_end=toks[1], kind=kind, dtype="float32",
                  nbytes=sum(sizes), checksum=chunk_checksum(hashes), hashes=hashes,
                  runs=runs)  # fmt: skip
    return lay, hdr, [memoryview(f) for f in frames]


@pytest.mark.parametrize(
    "kind, layers, toks, runs",
    [
        ("kv", (0, 3), (0, 37), []),  # a whole gathered prompt, last page in part
        ("k", (1, 3), (5, 18), []),  # enters and leaves pages mid-way
        ("v", (0, 3), (3, 37), [2, 9, 23]),  # sent in place: runs of the prefill's slots
        ("kv", (0, 2), (8, 16), [8]),
    ],
)
def test_receiver_writes_the_same_through_its_one_call_path(tmp_path, kind, layers, toks, runs):
    """writer.write_chunk with the native scatter (one scatter_runs call per kind) puts
    every byte where numpy's indexed assignment does."""
    from pdserve.transfer.loopback import make_req, random_pool, reserve
    from pdserve.transfer.receiving.payload import received
    from pdserve.transfer.receiving.transfer import Transfer
    from pdserve.transfer.receiving.validate import check_chunk
    from pdserve.transfer.receiving.writer import write_chunk

    kernel = page_copy(tmp_path)
    if kernel is None:
        pytest.skip("no C compiler")
    lay, hdr, bufs = _chunk_case(kind, layers, toks, runs)
    pools = []
    for pages in (NativePages(kernel), PORTABLE):
        pool = random_pool(lay, 64, seed=0)
        _, slots = reserve(pool, 37, seed=1)
        x = Transfer(make_req("r", 1, 37, 1), pool, slots, session=7, endpoint="tcp://x")
        assert check_chunk(lay, x, received(lay, hdr, bufs), pages) == ""
        assert write_chunk(x, received(lay, hdr, bufs), pages) == ""
        assert (x.paged is not None) and x.cov.sum() == len(kind) * (
            (layers[1] - layers[0]) * (toks[1] - toks[0])
        )
        pools.append(pool)
    assert torch.equal(pools[0].k.view(torch.uint8), pools[1].k.view(torch.uint8))
    assert torch.equal(pools[0].v.view(torch.uint8), pools[1].v.view(torch.uint8))
    fresh = random_pool(lay, 64, seed=0)
    for kv in kind:  # something was written
        assert not torch.equal(getattr(pools[0], kv), getattr(fresh, kv))


@pytest.fixture(scope="module")
def two_threads(tmp_path_factory) -> PageCopy:
    """The native build, its work split over two of par.c's threads (the receiver's)."""
    kernel = page_copy(tmp_path_factory.mktemp("pc2"), split=True, threads=2)
    if kernel is None:
        pytest.skip("no C compiler")
    return kernel


@pytest.mark.parametrize("t0, runs", RUNS)
def test_two_threads_write_what_indexing_writes(two_threads, t0, runs) -> None:
    """Layers split over two threads (each takes the next layer in turn): every row where
    plain indexing puts it, nothing else touched."""
    ps, rb, layers = 4, 64, 3
    g, dst, tpages = _runs_case(ps, rb, seed=t0 + len(runs))
    srcs = [g.bytes(count * rb) for _ in range(layers) for count in runs]
    want = _runs_want(dst, tpages, ps, rb, 0, t0, runs, srcs)
    for _ in range(20):  # workers asleep, spinning, or not started
        two_threads.scatter_runs(dst, tpages, ps, t0, runs, srcs)
        assert np.array_equal(dst, want)


def test_two_threads_refuse_before_writing(two_threads) -> None:
    ps, rb = 4, 64
    _, dst, tpages = _runs_case(ps, rb, seed=3)
    before = dst.copy()
    bad = tpages.copy()
    bad[4] = 12  # the last page of the request is outside the pool: layers 0-2 are fine
    with pytest.raises(ValueError, match="outside"):
        two_threads.scatter_runs(dst, bad, ps, 0, [17], [bytes(17 * rb)] * 3)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize("threads", [1, 2])
def test_block_hashes_are_the_python_ones(tmp_path, threads) -> None:
    """The native block hashes equal the xxhash package's, for every kind of buffer a
    frame arrives as, empty ones and ones that end on, before or after a block's end."""
    from pdserve.transfer.checksum import HASH_BLOCK, block_hashes

    kernel = page_copy(tmp_path, split=threads > 1, threads=threads)
    if kernel is None:
        pytest.skip("no C compiler")
    g = np.random.default_rng(5)
    sizes = (0, 1, 31, 240, HASH_BLOCK - 1, HASH_BLOCK, HASH_BLOCK + 1, 3 << 18)
    frames: list = [g.bytes(n) for n in sizes]
    frames += [bytearray(g.bytes(1000)), memoryview(g.integers(0, 9, 77, dtype=np.uint8))]
    got = kernel.block_hashes(frames, HASH_BLOCK)
    if got is None:
        pytest.skip("this xxhash library exports no XXH3-64")
    assert got == block_hashes(frames)
    assert kernel.block_hashes([], HASH_BLOCK) == b""


def _fresh(lay):
    from pdserve.transfer.loopback import make_req, random_pool, reserve
    from pdserve.transfer.receiving.transfer import Transfer

    pool = random_pool(lay, 64, seed=0)
    _, slots = reserve(pool, 37, seed=1)
    return Transfer(make_req("r", 1, 37, 1), pool, slots, session=7, endpoint="tcp://x")


def test_native_write_refuses_a_flipped_byte_before_writing_its_block(two_threads) -> None:
    """The fused check on two threads: check_chunk passes the header and leaves the
    payload to the scatter, which refuses one byte changed in any frame; the row that
    byte belongs to keeps its old bytes, and nothing outside the request is touched.
    The intact chunk writes whole."""
    from pdserve.transfer.receiving.payload import received
    from pdserve.transfer.receiving.validate import check_chunk
    from pdserve.transfer.receiving.writer import write_chunk

    lay, hdr, bufs = _chunk_case("v", (0, 3), (3, 37), [2, 9, 23])
    x = _fresh(lay)
    assert check_chunk(lay, x, received(lay, hdr, bufs), NativePages(two_threads)) == ""
    assert write_chunk(x, received(lay, hdr, bufs), NativePages(two_threads)) == ""
    row = lay.token_bytes_per_layer
    for i in (0, len(bufs) // 2, len(bufs) - 1):
        x = _fresh(lay)
        before = x.pool.v.clone()
        bad = bytearray(bufs[i])
        at = len(bad) // 3
        bad[at] ^= 1
        frames = [*bufs[:i], memoryview(bytes(bad)), *bufs[i + 1 :]]
        assert check_chunk(lay, x, received(lay, hdr, frames), NativePages(two_threads)) == ""
        assert (
            write_chunk(x, received(lay, hdr, frames), NativePages(two_threads))
            == "checksum mismatch"
        )
        layer, run = divmod(i, 3)
        pos = 3 + sum(hdr.runs[:run]) + at // row  # the flipped byte's prompt position
        slot = x.slots[pos]
        assert torch.equal(x.pool.v[layer, slot], before[layer, slot])
        outside = torch.ones(x.pool.v.shape[1], dtype=torch.bool)
        outside[x.slots] = False
        assert torch.equal(x.pool.v[:, outside], before[:, outside])
        assert x.chunks == [] and not x.cov.any()  # never counted as received


def test_scatter_writes_the_blocks_before_a_bad_one_and_stops_there(two_threads) -> None:
    """scatter_runs with hashes, a byte flipped in block 1 of layer 1 (of 3): layer 1's
    block 0 is written, its blocks 1 and 2 are not; layers 0 and 2 are written whole."""
    from pdserve.transfer.checksum import HASH_BLOCK, block_hashes

    ps, rb, n = 4, 1024, 40  # 40 KiB a layer: blocks of 16, 16 and 8 KiB
    g = np.random.default_rng(9)
    dst = g.integers(0, 256, (3, 16, ps * rb), dtype=np.uint8)
    tpages = g.permutation(16)[: n // ps].astype(np.int64)
    srcs = [g.bytes(n * rb) for _ in range(3)]
    want = _runs_want(dst, tpages, ps, rb, 0, 0, [n], srcs)
    hashes = block_hashes(srcs)
    bad = bytearray(srcs[1])
    bad[HASH_BLOCK + 7] ^= 4
    before = dst.copy()
    assert not two_threads.scatter_runs(dst, tpages, ps, 0, [n], [srcs[0], bytes(bad), srcs[2]],
                                        hashes, HASH_BLOCK)  # fmt: skip
    assert np.array_equal(dst[0], want[0]) and np.array_equal(dst[2], want[2])
    rows = HASH_BLOCK // rb  # positions per block
    for p in range(n):
        page, off = tpages[p // ps], (p % ps) * rb
        got = dst[1, page, off : off + rb]
        expect = (want if p < rows else before)[1, page, off : off + rb]
        assert np.array_equal(got, expect), p
    with pytest.raises(ValueError, match="hashes"):
        two_threads.scatter_runs(dst, tpages, ps, 0, [n], srcs, hashes[:-8], HASH_BLOCK)


def _writer_case(kernel: PageCopy, rb: int, seed: int):
    """Two pools of 3 layers (a K and a V), the writer into them, a request's pages."""
    g, k, tpages = _runs_case(4, rb, seed)
    v = g.integers(0, 256, k.shape, dtype=np.uint8)
    writer = kernel.writer((k, v), 4)
    if writer is None:
        pytest.skip("this xxhash library exports no XXH3-64")
    return g, (k, v), tpages, writer


@pytest.mark.parametrize("rb", [256, 24])
@pytest.mark.parametrize("t0, runs", RUNS)
def test_writer_writes_what_indexing_writes(kernel, rb, t0, runs) -> None:
    """PageWriter, made once per pool: chunks of either kind, a layer range of their own,
    for two requests' pages in turn, each where scatter_runs (plain indexing) puts it."""
    from pdserve.transfer.checksum import HASH_BLOCK, block_hashes

    g, kinds, tpages, writer = _writer_case(kernel, rb, seed=rb + t0)
    other = np.ascontiguousarray(tpages[::-1])
    for kind, pages, (lo, hi) in ((1, tpages, (1, 3)), (0, other, (0, 2)), (1, other, (2, 3))):
        srcs = [memoryview(g.bytes(count * rb)) for _ in range(hi - lo) for count in runs]
        want = _runs_want(kinds[kind], pages, 4, rb, lo, t0, runs, srcs)
        assert writer.scatter(kind, (lo, hi), pages, t0, runs, srcs, block_hashes(srcs), HASH_BLOCK)
        assert np.array_equal(kinds[kind], want)


def test_writer_refuses_before_writing(two_threads) -> None:
    """What the C code trusts is checked first, in Python or in C (the sources' sizes
    and the hash count: pd_page_runs_check); a refused chunk writes nothing, and a
    source's failed block is refused as scatter_runs refuses it."""
    from pdserve.transfer.checksum import HASH_BLOCK, block_hashes

    rb = 64
    g, kinds, tpages, writer = _writer_case(two_threads, rb, seed=4)
    before = [k.copy() for k in kinds]
    srcs = [memoryview(g.bytes(3 * rb)) for _ in range(3)]
    sums = block_hashes(srcs)

    def refused(match: str, **change) -> None:
        args = dict(kind=0, layers=(0, 3), tpages=tpages, t0=0, runs=[3], srcs=srcs,
                    hashes=sums, block=HASH_BLOCK) | change  # fmt: skip
        with pytest.raises(ValueError, match=match):
            writer.scatter(**args)

    refused("outside", t0=5 * 4 - 2)  # positions past the request's pages
    refused("outside", t0=-1)
    refused("outside", tpages=np.array([12, 1, 2, 3, 4], np.int64))  # a page outside the pool
    refused("outside", srcs=[*srcs[:2], memoryview(g.bytes(2 * rb))])  # a source a row short
    refused("outside", srcs=srcs[:2])  # a layer's source missing
    refused("outside", hashes=sums[:-8])  # a hash missing
    refused("layers", layers=(2, 4))
    refused("layers", runs=[])
    refused("pages", tpages=tpages.astype(np.int32))
    refused("contiguous", srcs=[*srcs[:2], memoryview(np.zeros((3, 2 * rb), np.uint8)[:, ::2])])
    for k, b in zip(kinds, before):
        assert np.array_equal(k, b)
    bad = bytearray(srcs[2])
    bad[5] ^= 1
    assert not writer.scatter(0, (0, 3), tpages, 0, [3], [*srcs[:2], memoryview(bytes(bad))],
                              sums, HASH_BLOCK)  # fmt: skip
    assert writer.scatter(0, (0, 3), tpages, 0, [3], srcs, sums, HASH_BLOCK)  # then a good one


def test_without_the_c_hash_the_check_hashes_in_python(tmp_path, monkeypatch) -> None:
    """An xxhash build that exports no XXH3-64: PageCopy says so (None, not verifies),
    and the native page I/O hashes and checks those blocks in Python instead
    (kernels/page_io.py), refusing a flipped byte all the same."""
    from pdserve.transfer.receiving.payload import received
    from pdserve.transfer.receiving.validate import check_chunk
    from pdserve.transfer.receiving.writer import write_chunk

    kernel = page_copy(tmp_path, split=True, threads=2)
    if kernel is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kernel, "_xxh3", None)
    lay, hdr, bufs = _chunk_case("k", (1, 3), (5, 18), [])
    assert kernel.block_hashes(bufs, 16384) is None and not kernel.verifies
    pages = NativePages(kernel)
    assert pages.block_hashes(bufs, 16384) == PORTABLE.block_hashes(bufs, 16384)
    x = _fresh(lay)
    assert (
        check_chunk(lay, x, received(lay, hdr, bufs), pages)
        == ""
        == write_chunk(x, received(lay, hdr, bufs), pages)
    )
    bad = bytearray(bufs[0])
    bad[-1] ^= 0x80
    y, frames = _fresh(lay), [memoryview(bytes(bad))]
    reason = check_chunk(lay, y, received(lay, hdr, frames), pages) or write_chunk(
        y, received(lay, hdr, frames), pages
    )
    assert reason == "checksum mismatch"


def _gather_want(pool, tpages, ps, rb, t0, runs):
    """gather_runs by plain indexing: each (layer, run) frame's rows, a position at a
    time."""
    frames = []
    for layer in range(pool.shape[0]):
        p = t0
        for count in runs:
            rows = []
            for _ in range(count):
                page, off = tpages[p // ps], (p % ps) * rb
                rows.append(pool[layer, page, off : off + rb])
                p += 1
            frames.append(np.concatenate(rows).tobytes())
    return frames


@pytest.mark.parametrize("t0, runs", RUNS)
def test_gather_reads_what_indexing_reads(kernel, t0, runs) -> None:
    """The prefill's page gather (every build: its copies are plain memcpy either way)
    fills each frame with the rows plain indexing reads, and leaves the pool as it was."""
    ps, rb = 4, 64
    _, pool, tpages = _runs_case(ps, rb, seed=t0 * 7 + len(runs))
    before = pool.copy()
    frames = [bytearray(count * rb) for _ in range(3) for count in runs]
    kernel.gather_runs(pool, tpages, ps, t0, runs, frames, 0)
    assert [bytes(f) for f in frames] == _gather_want(pool, tpages, ps, rb, t0, runs)
    assert np.array_equal(pool, before)


@pytest.mark.parametrize("t0, runs", RUNS)
def test_two_threads_gather_and_hash_each_frame(two_threads, t0, runs) -> None:
    """Layers split over two threads: the same bytes, and each frame's hash is the
    xxhash package's over what it holds (the sender's checksum of it)."""
    from pdserve.transfer.checksum import HASH_BLOCK, block_hashes

    ps, rb = 4, 64
    _, pool, tpages = _runs_case(ps, rb, seed=t0 + 3 * len(runs))
    want = _gather_want(pool, tpages, ps, rb, t0, runs)
    for _ in range(20):  # workers asleep, spinning, or not started
        frames = [np.zeros(count * rb, np.uint8) for _ in range(3) for count in runs]
        hashes = two_threads.gather_runs(pool, tpages, ps, t0, runs, frames, HASH_BLOCK)
        assert [f.tobytes() for f in frames] == want
        if hashes is not None:
            assert hashes == block_hashes(want)


def test_gather_refuses_before_copying(two_threads) -> None:
    """Positions past the request's pages, a page outside the pool, a frame of the
    wrong size or a read-only one: refused, and no frame is touched."""
    ps, rb = 4, 64
    _, pool, tpages = _runs_case(ps, rb, seed=4)
    frames = [np.full(3 * rb, 9, np.uint8) for _ in range(3)]
    with pytest.raises(ValueError, match="outside"):
        two_threads.gather_runs(pool, tpages, ps, 5 * ps - 2, [3], frames, 64)
    bad = tpages.copy()
    bad[1] = 12
    with pytest.raises(ValueError, match="outside"):
        two_threads.gather_runs(pool, bad, ps, 2, [3], frames, 64)
    with pytest.raises(ValueError):
        two_threads.gather_runs(
            pool, tpages, ps, 0, [3], [*frames[:2], np.zeros(2 * rb, np.uint8)], 64
        )
    with pytest.raises(ValueError, match="read-only"):
        two_threads.gather_runs(pool, tpages, ps, 0, [3], [*frames[:2], bytes(3 * rb)], 64)
    assert all((f == 9).all() for f in frames)


def test_gather_without_the_c_hash_still_gathers(tmp_path, monkeypatch) -> None:
    """An xxhash build that exports no XXH3-64: the frames are filled and no hashes
    come back (the sender then hashes them in Python)."""
    kernel = page_copy(tmp_path, split=True, threads=2)
    if kernel is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kernel, "_xxh3", None)
    ps, rb = 4, 64
    _, pool, tpages = _runs_case(ps, rb, seed=6)
    frames = [np.zeros(9 * rb, np.uint8) for _ in range(3)]
    assert kernel.gather_runs(pool, tpages, ps, 2, [9], frames, 64) is None
    assert [f.tobytes() for f in frames] == _gather_want(pool, tpages, ps, rb, 2, [9])
