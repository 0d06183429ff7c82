"""The one-pass gather + hash of a KV frame (kernels/cpu/kv_gather.c) against torch's
gather and xxhash's one-shot XXH3 of the gathered frame, which the receiver checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from pdserve.kernels.kv_gather_native import NativeGather, native_gather, slot_runs
from pdserve.model.make import cache_root
from pdserve.transfer.checksum import frame_hash
from pdserve.transfer.staging import StagingPool


@pytest.fixture(scope="module")
def gather() -> NativeGather:
    g = native_gather(cache_root())
    if g is None:
        pytest.skip("no C compiler, or xxhash exports no streaming XXH3")
    return g


def shuffled_pages(num_pages: int, page: int, n: int, seed: int) -> torch.Tensor:
    """The slots of n tokens on shuffled pages (the last one partial), as a pool hands out."""
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    return slots[:n]


SLOT_CASES = {
    "shuffled pages": lambda: shuffled_pages(64, 16, 1000, 1),
    "partial pages": lambda: shuffled_pages(64, 16, 37, 2),
    "single slots": lambda: torch.tensor([5, 900, 3, 4, 1023, 0]),
    "one run": lambda: torch.arange(100, 612),
    "adjacent pages": lambda: torch.cat([torch.arange(32, 64), torch.arange(0, 16)]),
    "repeated slot": lambda: torch.tensor([7, 7, 8, 7]),
    "empty": lambda: torch.zeros(0, dtype=torch.int64),
}


@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frame_and_hash_match_torch_and_xxhash(gather, case: str, dtype: torch.dtype) -> None:
    src = torch.randn(3, 1024, 2, 64).to(dtype)
    slots = SLOT_CASES[case]()
    out = torch.full((3, len(slots), 2, 64), float("nan"), dtype=dtype)  # poisoned
    digest = gather(src, slots, out)
    assert torch.equal(out, src[:, slots])
    assert digest == xxhash.xxh3_64_intdigest(out.view(torch.uint8).numpy().tobytes())


def test_frames_past_a_hash_block(gather) -> None:
    """8 layers x 1000 rows of 1 KiB: runs straddle the 256 KiB hash blocks and the last
    update is a remainder; a block hashed twice, skipped or cut short changes the hash."""
    src = torch.randn(8, 4096, 2, 128)
    slots = shuffled_pages(256, 16, 1000, 3)
    out = torch.empty(8, 1000, 2, 128)
    assert gather(src, slots, out) == frame_hash(out.numpy())
    out2 = torch.empty(8, 999, 2, 128)
    assert gather(src, slots[:999], out2) == frame_hash(out2.numpy())
    assert frame_hash(out2.numpy()) != frame_hash(out.numpy())


@pytest.mark.parametrize("bad", [-1, 1024, 1 << 40])
def test_slot_outside_the_pool_writes_nothing(gather, bad: int) -> None:
    src = torch.randn(2, 1024, 2, 8)
    slots = torch.tensor([0, 1, 2, bad, 5])
    out = torch.full((2, 5, 2, 8), 7.0)
    with pytest.raises(IndexError):
        gather(src, slots, out)
    assert bool((out == 7.0).all())


def test_refuses_mismatched_buffers(gather) -> None:
    src = torch.randn(2, 64, 2, 8)
    slots = torch.arange(4)
    with pytest.raises(ValueError):
        gather(src, slots, torch.empty(2, 5, 2, 8))  # wrong length
    with pytest.raises(ValueError):
        gather(src, slots, torch.empty(2, 4, 2, 8, dtype=torch.float16))  # wrong dtype
    with pytest.raises(ValueError):
        gather(src[:, ::2], slots, torch.empty(2, 4, 2, 8))  # not contiguous


def test_slot_runs() -> None:
    runs = slot_runs(np.array([4, 5, 6, 7, 0, 1, 9, 10, 11, 3]))
    assert runs.tolist() == [[4, 4], [0, 2], [9, 3], [3, 1]]
    assert slot_runs(np.zeros(0, dtype=np.int64)).shape == (0, 2)


def test_staging_pool_gives_the_same_frame_and_hash_either_way(gather) -> None:
    src = torch.randn(4, 512, 2, 16)
    slots = shuffled_pages(32, 16, 300, 4)
    numel = 4 * 300 * 2 * 16
    frames = []
    for native in (None, gather):
        pool = StagingPool(numel, src.dtype, page_size=16, native=native)
        _, frame, digest = pool.gather(src, slots)
        frames.append((frame.copy(), digest))
    (a, ha), (b, hb) = frames
    assert np.array_equal(a, b) and ha == hb == frame_hash(a)
