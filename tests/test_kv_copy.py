"""KV copy kernels (gather into staging, scatter from staging): Triton vs torch reference."""

from __future__ import annotations

import pytest
import torch

import pdserve.kernels  # noqa: F401  (TRITON_INTERPRET before any kernel is defined)
from pdserve.kernels import kv_copy
from pdserve.kernels.kv_copy import gather_kv, scatter_kv, stage_to_host

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32]
# (layers, slots S, KH, D, n); 3*40 = 120: a row that is not a power of two
SHAPES = [(1, 8, 1, 4, 1), (3, 64, 2, 16, 17), (2, 96, 3, 40, 96)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed)).to(DEVICE, dtype)


def _slots(num_slots: int, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """n distinct shuffled slots, including the first and the last one when n > 1."""
    perm = torch.randperm(num_slots, generator=_gen(seed))[:n]
    if n > 1:
        rest = perm[(perm != 0) & (perm != num_slots - 1)][: n - 2]
        perm = torch.cat([torch.tensor([num_slots - 1]), rest, torch.tensor([0])])
    return perm.to(dtype).to(DEVICE)


def test_kernels_run_under_the_interpreter_without_cuda() -> None:
    if CUDA:
        pytest.skip("CUDA present: kernels are compiled, not interpreted")
    assert type(kv_copy._gather_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("layers", "s", "kh", "d", "n"), SHAPES)
def test_gather_matches_reference(layers, s, kh, d, n, slot_dtype, dtype) -> None:
    seed = layers * 100 + n
    pool = _pool((layers, s, kh, d), seed, dtype)
    slots = _slots(s, n, seed, slot_dtype)
    want = torch.full((layers, n, kh, d), -3.0, dtype=dtype, device=DEVICE)
    kv_copy.gather_kv_ref(pool, slots, want)
    got = torch.full_like(want, float("nan"))  # poisoned
    assert gather_kv(pool, slots, got, backend="triton") is got
    assert torch.equal(got, want)
    assert torch.equal(want, pool[:, slots.long()])  # the reference itself is right


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layers", "s", "kh", "d", "n"), SHAPES)
def test_scatter_matches_reference(layers, s, kh, d, n, dtype) -> None:
    seed = layers * 10 + n
    stage = _pool((layers, n, kh, d), seed, dtype)
    slots = _slots(s, n, seed + 1, torch.int64)
    want = torch.full((layers, s, kh, d), float("nan"), dtype=dtype, device=DEVICE)
    got = want.clone()
    kv_copy.scatter_kv_ref(want, slots, stage)
    scatter_kv(got, slots, stage, backend="triton")
    assert torch.equal(got[:, slots], stage)
    untouched = torch.ones(s, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert got[:, untouched].isnan().all(), "wrote outside the listed slots"


def test_layer_range_view_and_roundtrip() -> None:
    """A layer range of the pool (a strided view), gathered then scattered into a second
    pool at other slots, as prefill -> decode does."""
    src = _pool((4, 40, 2, 8), 5, torch.float32)
    dst = torch.zeros_like(src)
    a, b = _slots(40, 12, 6, torch.int64), _slots(40, 12, 7, torch.int32)
    stage = gather_kv(src[1:3], a, backend="triton")
    assert stage.shape == (2, 12, 2, 8) and stage.is_contiguous()
    scatter_kv(dst[1:3], b, stage, backend="triton")
    assert torch.equal(dst[1:3, b.long()], src[1:3, a])
    assert not dst[0].any() and not dst[3].any()


def test_wrappers_reject_bad_inputs() -> None:
    pool = _pool((2, 16, 2, 4), 0, torch.float32)
    slots = _slots(16, 4, 0, torch.int64)
    with pytest.raises(ValueError, match="backend"):
        gather_kv(pool, slots, backend="cuda")
    with pytest.raises(ValueError, match="must be"):
        gather_kv(pool, slots, out=torch.empty(2, 5, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gather_kv(pool.transpose(2, 3), slots)
    with pytest.raises(ValueError, match="int32/int64"):
        scatter_kv(pool, slots.float(), torch.zeros(2, 4, 2, 4, device=DEVICE))
    if not CUDA:
        with pytest.raises(ValueError, match="lie in"):
            gather_kv(pool, torch.tensor([0, 16]), backend="triton")


def test_stage_to_host_copies_into_a_host_frame() -> None:
    stage = _pool((2, 3, 2, 4), 1, torch.float32)
    host = torch.full((2, 3, 2, 4), float("nan"))
    assert stage_to_host(stage, host) is host
    assert torch.equal(host, stage.cpu())
    with pytest.raises(ValueError, match="host"):
        stage_to_host(stage, torch.empty(2, 3, 2, 5))


@pytest.mark.skipif(not CUDA, reason="needs CUDA: pinned host staging and a copy stream")
def test_pinned_staging_on_a_copy_stream() -> None:
    pool = _pool((4, 4096, 8, 128), 3, torch.bfloat16)
    slots = _slots(4096, 2048, 3, torch.int64)
    host = torch.empty((4, 2048, 8, 128), dtype=torch.bfloat16, pin_memory=True)
    copy = torch.cuda.Stream()
    copy.wait_stream(torch.cuda.current_stream())  # NOTE: the pool was written there
    with torch.cuda.stream(copy):
        stage = gather_kv(pool, slots, backend="triton")
        stage_to_host(stage, host)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert torch.equal(host, pool[:, slots].cpu())
