"""The CPU backend's native extend (model/attention/backends.py, NativeAttention._extends): each prompt token
one query of the decode kernel over its own causal keys, read in place from the pool.
It must give what torch's fused attention over the gathered keys gives: whole prompts,
a later chunk over a prefix, sliding windows, several requests and decode tokens in one
batch, and any thread count (the tokens go to the threads in chunks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.kernels.native import library
from pdserve.kvcache.pools import KVLayout, KVPool, slots_of
from pdserve.model.attention.backends import CpuAttention, NativeAttention, TorchAttention
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.native_kernels import NativeKernels

KH, H, D, PAGE = 2, 8, 64, 4


def _batch(pool: KVPool, r2t: torch.Tensor, reqs: list[tuple[int, int, int]]) -> ForwardBatch:
    """reqs: (row, prefix already in the pool, new tokens) -> one forward's batch."""
    out_loc, positions = [], []
    for row, prefix, n in reqs:
        total = prefix + n
        pages = pool.allocator.alloc(pool.allocator.pages_for(total))
        assert pages is not None
        slots = slots_of(pages[::-1], total, PAGE)  # pages out of order
        r2t[row, :total] = slots.to(r2t.dtype)
        out_loc += slots[prefix:total].tolist()
        positions += range(prefix, total)
    return ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(out_loc),
        rows=torch.tensor([r for r, _, _ in reqs]),
        seq_lens=[p + n for _, p, n in reqs],
        extend_lens=[n for _, _, n in reqs],
    )


def _backends(
    tmp_path, windows: tuple[int, ...], reqs, d: int = D
) -> list[tuple[CpuAttention, ForwardBatch]]:
    """The same pool contents, table and batch twice: native and fused (portable)."""
    layout = KVLayout(num_layers=2, num_kv_heads=KH, head_dim=d, dtype="float32", page_size=PAGE)
    out = []
    for native in (str(tmp_path), None):
        pool = KVPool(layout, 200, "cpu")
        g = torch.Generator().manual_seed(3)
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))  # stale prefixes
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        r2t = torch.zeros(6, 512, dtype=torch.int32)
        be = TorchAttention(pool, r2t, d**-0.5, windows)
        if native:
            be = _kernels(native).attention(be, H)
        batch = _batch(pool, r2t, reqs)
        be.prepare(batch)
        out.append((be, batch))
    assert isinstance(out[0][0], NativeAttention) and type(out[1][0]) is TorchAttention
    return out


CASES = {
    "one whole prompt": [(1, 0, 130)],
    "a chunk over a prefix": [(2, 37, 90)],
    "prompts and decode tokens": [(1, 0, 45), (3, 20, 1), (2, 50, 33), (4, 9, 1), (5, 0, 2)],
}


@pytest.mark.parametrize("windows", [(), (16, 0)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("threads", [1, 3])
def test_native_extend_matches_fused_attention(tmp_path, windows, case, threads) -> None:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    reqs = CASES[case]
    (native, nb), (fused, fb) = _backends(tmp_path, windows, reqs)
    t = sum(n for _, _, n in reqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layer in range(2):
            g = torch.Generator().manual_seed(10 + layer)
            q = torch.randn(t, H, D, generator=g) * 2  # sharp softmaxes
            k, v = torch.randn(2, t, KH, D, generator=g)
            got = native.forward(layer, q, k, v, nb)
            want = fused.forward(layer, q, k, v, fb)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(native.pool.k, fused.pool.k) and torch.equal(native.pool.v, fused.pool.v)


def test_a_head_size_without_a_fixed_copy_extends_by_the_fused_kernel(tmp_path) -> None:
    """Head size 256 (Gemma 3): the extends are torch's fused attention, bit for bit;
    the decode tokens stay on the native kernel."""
    if library.compiler() is None:
        pytest.skip("no C compiler")
    d = 256
    reqs = CASES["prompts and decode tokens"]
    (native, nb), (fused, fb) = _backends(tmp_path, (16, 0), reqs, d)
    t = sum(n for _, _, n in reqs)
    q = torch.randn(t, H, d, generator=torch.Generator().manual_seed(5))
    k, v = torch.randn(2, t, KH, d, generator=torch.Generator().manual_seed(6))
    got, want = native.forward(0, q, k, v, nb), fused.forward(0, q, k, v, fb)
    ext = torch.tensor([n > 1 for _, _, n in reqs for _ in range(n)])
    assert torch.equal(got[ext], want[ext])
    torch.testing.assert_close(got[~ext], want[~ext], rtol=2e-5, atol=2e-5)


def test_a_window_changes_the_native_extend(tmp_path) -> None:
    """The windowed case above is not vacuous: the window narrows the keys it reads."""
    if library.compiler() is None:
        pytest.skip("no C compiler")
    reqs = CASES["a chunk over a prefix"]
    (full, fb), _ = _backends(tmp_path, (), reqs)
    (narrow, nb), _ = _backends(tmp_path, (16,), reqs)
    q = torch.randn(90, H, D)
    k, v = torch.randn(2, 90, KH, D)
    assert not torch.allclose(full.forward(0, q, k, v, fb), narrow.forward(0, q, k, v, nb))


def test_a_shape_the_kernel_does_not_take_stays_eager(tmp_path, caplog) -> None:
    """32 query heads over one KV head (groups over paged_decode.c's 16): the native
    kernels keep the eager backend, say so, and an extend and a decode token still compute."""
    if library.compiler() is None:
        pytest.skip("no C compiler")
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32", page_size=PAGE)
    pool = KVPool(layout, 16, "cpu")
    r2t = torch.zeros(4, 64, dtype=torch.int32)
    eager = TorchAttention(pool, r2t, 0.25, ())
    with caplog.at_level("WARNING"):
        be = _kernels(str(tmp_path)).attention(eager, 32)
    assert be is eager and "does not take 32 query heads" in caplog.text
    batch = _batch(pool, r2t, [(1, 0, 5), (2, 3, 1)])
    be.prepare(batch)
    q, k, v = torch.randn(6, 32, 16), torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    assert be.forward(0, q, k, v, batch).shape == (6, 32 * 16)
    ok = _kernels(str(tmp_path)).attention(eager, 16)  # at the limit: taken
    assert isinstance(ok, NativeAttention)


def _kernels(cache_dir: str) -> NativeKernels:
    return NativeKernels(Path(cache_dir), torch.get_num_threads)
