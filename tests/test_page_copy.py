"""kernels/cpu/page_copy.c: the decode's page scatter equals numpy's indexed assignment,
on every store path (non-temporal AVX-512 / AVX / SSE2 stores, memcpy), and refuses
out-of-range pages and bad shapes before writing anything."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.page_copy import PageCopy, page_copy
from pdserve.transfer.staging import scatter_rows

# -march=native plus these: each build takes another path through the same source
ISAS = [(), ("-mno-avx512f",), ("-mno-avx",), ("-mno-sse2", "-mno-avx")]


@pytest.fixture(scope="module", params=ISAS, ids=["native", "avx", "sse2", "memcpy"])
def kernel(request, tmp_path_factory) -> PageCopy:
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler")
    if request.param and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("x86 flags")
    lib = cpu_native.build("page_copy", tmp_path_factory.mktemp("pc"), request.param)
    assert lib is not None
    return PageCopy(ctypes.CDLL(str(lib)))


def _case(layers: int, num_pages: int, pb: int, n: int, seed: int):
    g = np.random.default_rng(seed)
    dst = g.integers(0, 256, (layers, num_pages, pb), dtype=np.uint8)
    src = g.integers(0, 256, (layers, n, pb), dtype=np.uint8)
    src.setflags(write=False)  # like a received ZeroMQ frame
    pages = g.permutation(num_pages)[:n].astype(np.int64)
    want = dst.copy()
    want[:, pages] = src
    return dst, pages, src, want


@pytest.mark.parametrize("pb", [8192, 4096, 160, 80, 24])  # aligned for every store width, then not
def test_scatter_matches_indexing(kernel, pb) -> None:
    """One frame per layer (a frame sent in place, or a gathered frame's layer)."""
    dst, pages, src, want = _case(3, 40, pb, 17, seed=pb)
    kernel.scatter_frames(dst, pages, list(src))
    assert np.array_equal(dst, want)


def test_unaligned_pool_and_strided_layers(kernel) -> None:
    """A pool view 8 bytes off alignment, layers of a frame further apart than its pages."""
    base = np.zeros(3 * 41 * 256 + 8, dtype=np.uint8)
    dst = base[8:].reshape(3, 41, 256)[:, :40]  # layer stride 41 pages, 40 used
    src_all = np.random.default_rng(1).integers(0, 256, (3, 9, 256), dtype=np.uint8)
    src = src_all[:, 2:7]  # 5 pages of each layer, layers 9 pages apart
    pages = np.array([39, 0, 17, 5, 22], dtype=np.int64)
    want = dst.copy()
    want[:, pages] = src
    kernel.scatter_frames(dst, pages, list(src))
    assert np.array_equal(dst, want)
    assert not base[:8].any()  # nothing before the view


def test_out_of_range_page_writes_nothing(kernel) -> None:
    dst, pages, src, _ = _case(2, 10, 4096, 4, seed=3)
    before = dst.copy()
    for bad in (10, -1):
        pages[-1] = bad
        with pytest.raises(ValueError, match="outside"):
            kernel.scatter_frames(dst, pages, list(src))
        assert np.array_equal(dst, before)


def test_bad_shapes_are_refused(kernel) -> None:
    dst, pages, src, _ = _case(2, 10, 64, 4, seed=4)
    with pytest.raises(ValueError):
        kernel.scatter_frames(dst, pages[:3], list(src))  # fewer pages than the frames have
    with pytest.raises(ValueError):
        kernel.scatter_frames(dst, pages.astype(np.int32), list(src))
    with pytest.raises(ValueError):  # pages not contiguous rows
        kernel.scatter_frames(dst[:, :, :32], pages, list(src[:, :, :32].copy()))
    with pytest.raises(ValueError):  # a frame's pages not contiguous
        kernel.scatter_frames(dst, pages, [src[0], src[1, :, ::-1]])
    ro = dst.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError):
        kernel.scatter_frames(ro, pages, list(src))


@pytest.mark.parametrize("native", [True, False])
def test_scatter_rows_native_or_numpy(tmp_path, native) -> None:
    """The transfer's scatter (staging.scatter_rows) writes the same pool either way."""
    kernel = page_copy(tmp_path) if native else None
    if native and kernel is None:
        pytest.skip("no C compiler")
    P = 16
    pool = torch.randn(4, 64 * P, 2, 64)
    pages = torch.tensor([9, 3, 60, 0, 33])
    idx = (pages[:, None] * P + torch.arange(P)).reshape(-1)[5:-3]  # starts and ends mid-page
    src = torch.randn(4, len(idx), 2, 64)
    frame = src.view(4, len(idx), -1).view(torch.uint8).numpy().copy()
    frame.setflags(write=False)
    want = pool.clone()
    want[:, idx] = src
    scatter_rows(pool, idx, frame, P, kernel)
    assert torch.equal(pool, want)


def test_the_receiver_builds_the_scatter_at_start_up_or_not_at_all(monkeypatch) -> None:
    """Built when the receiver is made (a second's compile, never inside a transfer);
    --disable-compile (native_scatter=False) keeps numpy's assignment."""
    from pdserve.kvcache.pools import KVLayout
    from pdserve.transfer.receiver import KVReceiver

    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4)
    on, off = KVReceiver(lay), KVReceiver(lay, native_scatter=False)
    try:
        assert off._page_copy is None
        assert (on._page_copy is None) == (cpu_native.compiler() is None)
    finally:
        on.close()
        off.close()


def test_scatter_frames_refuses_before_writing(kernel) -> None:
    dst, pages, src, _ = _case(2, 10, 64, 4, seed=5)
    frames = [np.ascontiguousarray(src[layer]) for layer in range(2)]
    before = dst.copy()
    with pytest.raises(ValueError):
        kernel.scatter_frames(dst, pages, frames[:1])  # a frame short
    with pytest.raises(ValueError):
        kernel.scatter_frames(dst, pages, [frames[0], frames[1][:3]])  # a page short
    pages[2] = 10
    with pytest.raises(ValueError, match="outside"):
        kernel.scatter_frames(dst, pages, frames)
    assert np.array_equal(dst, before)
