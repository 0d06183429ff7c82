"""Page-wise gather/scatter between pool slots and a frame match plain indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.transfer.pages import page_split, request_pages
from pdserve.transfer.receiving.writer import scatter_runs
from pdserve.transfer.sending.staging import gather_rows

P = 4
SLOTS = 12 * P


def _slot_lists() -> list[torch.Tensor]:
    pages = torch.tensor([5, 2, 9, 0])
    whole = (pages[:, None] * P + torch.arange(P)).reshape(-1)
    return [
        whole,  # whole pages only
        whole[2:],  # enters page 5 mid-way
        whole[:-1],  # ends inside page 0
        whole[1:-2],  # both
        torch.tensor([7, 3, 40, 41, 42, 43, 1]),  # no page structure
        whole[:2],  # shorter than a page
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(6))
def test_gather_and_scatter_match_indexing(dtype, case) -> None:
    idx = _slot_lists()[case]
    pool = torch.randn(3, SLOTS, 2, 5).to(dtype)
    out = torch.full((3, len(idx), 2, 5), float("nan"), dtype=dtype)  # poisoned
    gather_rows(pool, idx, out, P)
    assert torch.equal(out, pool[:, idx])

    dst = torch.zeros_like(pool)
    frame = out.view(3, len(idx), -1).view(torch.uint8).numpy().copy()
    frame.setflags(write=False)  # like a received ZeroMQ frame
    scatter_runs(dst, idx, [len(idx)], list(frame), P)  # one run, a frame per layer
    want = torch.zeros_like(pool)
    want[:, idx] = out
    assert torch.equal(dst, want)


def test_page_split() -> None:
    idx = np.array([22, 23, 8, 9, 10, 11, 0, 1])
    head, pages = page_split(idx, P)  # type: ignore[misc]
    assert head == 2 and pages.tolist() == [2]
    assert page_split(np.array([8, 9, 11, 10]), P) is None  # not in order inside the page
    assert page_split(idx, 1) is None


def test_request_pages() -> None:
    """A request's slots as whole pages in prompt order (the last maybe in part) give its
    pages; anything else (entered mid-page, out of order inside a page) gives None."""
    whole = _slot_lists()[0].numpy()
    assert request_pages(whole, P).tolist() == [5, 2, 9, 0]
    assert request_pages(whole[:-1], P).tolist() == [5, 2, 9, 0]  # ends inside page 0
    assert request_pages(whole[:2], P).tolist() == [5]
    assert request_pages(whole[2:], P) is None  # starts mid-page
    swapped = whole.copy()
    swapped[[5, 6]] = swapped[[6, 5]]
    assert request_pages(swapped, P) is None
    assert request_pages(whole[:0], P) is None


def test_pool_pages_made_once_per_pool_and_again_for_new_tensors() -> None:
    """The receiver's page views of a pool are reused while its K and V are the same
    tensors, and write into them; a pool given new tensors gets new views."""
    from pdserve.kvcache.pools import KVLayout, KVPool
    from pdserve.transfer.pages import PoolPages

    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=P)
    pool, cache = KVPool(lay, 6), PoolPages()
    k, v = cache.of(pool)
    assert k is not None and v is not None and k.shape == (2, 6, P * 16)
    assert cache.of(pool)[0] is k  # reused
    k[1, 3, :16] = 255  # page 3's first row of layer 1 ...
    assert torch.isnan(pool.k[1, 3 * P]).all()  # ... is the pool's slot 12 (0xff.. = NaN)
    assert not pool.v.any()
    pool.k = torch.zeros_like(pool.k)
    assert cache.of(pool)[0] is not k
