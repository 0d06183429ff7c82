"""FutureMap kernels (Triton vs the torch reference) and the FutureMap itself."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import future_map as fm
from pdserve.kernels.future_map import gather_tokens, scatter_tokens
from pdserve.scheduler.future_map import FutureMap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7
SIZES = [(1, 1), (5, 3), (64, 17), (300, 257), (4097, 1500)]  # (rows R, batch B)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 40, (n,), generator=_generator(seed)).to(DEVICE)


def _rows(num_rows: int, batch: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows [B] (repeats allowed) that include row 0 and the last row."""
    rows = torch.randint(0, num_rows, (batch,), generator=_generator(seed))
    rows[0], rows[-1] = 0, num_rows - 1
    return rows.to(dtype).to(DEVICE)


def _unique_rows(num_rows: int, batch: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct rows [B], B <= R, including row 0 and (when B > 1) the last row."""
    middle = (
        torch.randperm(max(num_rows - 2, 0), generator=_generator(seed))[: max(batch - 2, 0)] + 1
    )
    ends = [torch.tensor([0]), middle, torch.tensor([num_rows - 1])]
    rows = torch.cat(ends if batch > 1 else ends[:1])
    return rows.to(dtype).to(DEVICE)


def test_triton_kernels_run_under_the_interpreter_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled, not interpreted")
    assert type(fm._gather_kernel).__name__ == "InterpretedFunction"
    assert type(fm._scatter_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("num_rows", "batch"), SIZES)
def test_gather_matches_reference(
    num_rows: int, batch: int, seed: int, row_dtype: torch.dtype
) -> None:
    src, rows = _tokens(num_rows, seed), _rows(num_rows, batch, seed, row_dtype)
    want = torch.full((batch,), POISON, dtype=torch.int64, device=DEVICE)
    fm.gather_tokens_ref(src, rows, want)
    got = torch.full((batch,), POISON, dtype=torch.int64, device=DEVICE)
    assert gather_tokens(src, rows, out=got, backend="triton") is got
    assert torch.equal(got, want)
    assert torch.equal(want, src[rows.long()])  # the reference is what it claims
    assert torch.equal(gather_tokens(src, rows, backend="triton"), want)  # allocated out


@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("num_rows", "batch"), SIZES)
def test_scatter_matches_reference(
    num_rows: int, batch: int, seed: int, row_dtype: torch.dtype
) -> None:
    rows = _unique_rows(num_rows, batch, seed, row_dtype)
    values = _tokens(batch, seed + 100)
    want = torch.full((num_rows,), POISON, dtype=torch.int64, device=DEVICE)
    fm.scatter_tokens_ref(want, rows, values)
    got = torch.full((num_rows,), POISON, dtype=torch.int64, device=DEVICE)
    scatter_tokens(got, rows, values, backend="triton")
    assert torch.equal(got, want)
    assert torch.equal(got[rows.long()], values)
    untouched = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    untouched[rows.long()] = False
    assert bool((got[untouched] == POISON).all())


def test_scatter_with_padding_duplicates_at_row_0() -> None:
    rows = torch.tensor([0, 3, 0, 5, 0], dtype=torch.int64, device=DEVICE)
    values = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int64, device=DEVICE)
    for backend in fm.BACKENDS:
        dst = torch.full((6,), POISON, dtype=torch.int64, device=DEVICE)
        scatter_tokens(dst, rows, values, backend=backend)
        assert dst[[1, 2, 4]].tolist() == [POISON] * 3
        assert dst[[3, 5]].tolist() == [11, 13]
        assert int(dst[0]) in (10, 12, 14)


@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_empty_batch(backend: str) -> None:
    src = torch.arange(8, dtype=torch.int64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert gather_tokens(src, empty, backend=backend).shape == (0,)
    scatter_tokens(src, empty, empty, backend=backend)
    assert torch.equal(src, torch.arange(8, device=DEVICE))


def _bad_calls() -> list[tuple[str, object]]:
    i64 = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([1, 2], dtype=torch.int64, device=DEVICE)
    vals = torch.tensor([5, 6], dtype=torch.int64, device=DEVICE)
    return [
        ("dtype", lambda b: gather_tokens(i64.int(), rows, backend=b)),
        ("dtype", lambda b: gather_tokens(i64, rows.float(), backend=b)),
        ("dtype", lambda b: scatter_tokens(i64, rows, vals.int(), backend=b)),
        ("1-D", lambda b: gather_tokens(i64.view(2, 4), rows, backend=b)),
        ("1-D", lambda b: scatter_tokens(i64, rows.view(1, 2), vals.view(1, 2), backend=b)),
        ("length", lambda b: gather_tokens(i64, rows, out=i64[:3].clone(), backend=b)),
        ("length", lambda b: scatter_tokens(i64, rows, vals[:1], backend=b)),
        (
            "contiguous",
            lambda b: gather_tokens(torch.zeros(16, dtype=torch.int64)[::2], rows.cpu(), backend=b),
        ),
        ("is on", lambda b: gather_tokens(i64, rows.to("meta"), backend=b)),
        ("backend", lambda b: gather_tokens(i64, rows, backend="cuda-graph")),
    ]


@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_bad_arguments_raise_value_error(backend: str) -> None:
    for words, call in _bad_calls():
        with pytest.raises(ValueError, match=words):
            call(backend)  # type: ignore[operator]


@pytest.mark.skipif(DEVICE != "cpu", reason="row bounds are checked on CPU only")
@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_out_of_range_rows_raise_on_cpu(backend: str) -> None:
    src = torch.zeros(4, dtype=torch.int64)
    for bad in ([4], [-1], [0, 9]):
        rows = torch.tensor(bad, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            gather_tokens(src, rows, backend=backend)
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            scatter_tokens(src, rows, torch.zeros_like(rows), backend=backend)


@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_future_map_stash_publish_resolve(backend: str) -> None:
    fmap = FutureMap(6, device=DEVICE, backend=backend)
    assert fmap.output_tokens.dtype == torch.int64 and fmap.output_tokens.tolist() == [0] * 6
    fmap.stash(2, 101)
    fmap.stash(5, 105)
    rows = torch.tensor([2, 5, 0], dtype=torch.int32, device=DEVICE)  # 0: padding entry
    assert fmap.resolve(rows).tolist() == [101, 105, 0]
    fmap.publish(rows, torch.tensor([201, 205, 999], dtype=torch.int64, device=DEVICE))
    assert fmap.resolve(rows[:2]).tolist() == [201, 205]
    assert fmap.output_tokens[[1, 3, 4]].tolist() == [0, 0, 0]


@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_future_map_decode_loop_feeds_each_step_from_the_last(backend: str) -> None:
    fmap = FutureMap(9, device=DEVICE, backend=backend)
    rows = torch.tensor([3, 7, 1], dtype=torch.int64, device=DEVICE)
    for row, first in zip(rows.tolist(), (30, 70, 10)):
        fmap.stash(row, first)
    history = []
    for _ in range(4):
        ids = fmap.resolve(rows)
        history.append(ids.tolist())
        fmap.publish(rows, ids * 2 + 1)  # a deterministic stand-in for sampling
    assert history == [[30, 70, 10], [61, 141, 21], [123, 283, 43], [247, 567, 87]]


@pytest.mark.parametrize("backend", fm.BACKENDS)
def test_future_map_resolve_from_host_rows_sees_every_publish(backend: str) -> None:
    """With the rows also given as a list (the CPU path reads them through numpy, keeping
    the GIL), resolve gives what the device path gives, sees each publish and stash since,
    and returns a copy, not a view of the map."""
    fmap = FutureMap(9, device=DEVICE, backend=backend)
    host_rows = [3, 7, 0, 3, 1]  # out of order, a repeat, and the padding row
    rows = torch.tensor(host_rows, dtype=torch.int64, device=DEVICE)
    for row, first in ((3, 30), (7, 70), (1, 10)):
        fmap.stash(row, first)
    for _ in range(3):
        ids = fmap.resolve(rows, host_rows)
        assert ids.dtype == torch.int64 and ids.tolist() == fmap.resolve(rows).tolist()
        fmap.publish(rows[[0, 1, 4]], ids[[0, 1, 4]] * 2 + 1)
    assert ids.tolist() == [123, 283, 0, 123, 43]
    ids.fill_(-5)
    assert fmap.resolve(rows, host_rows).tolist() == [247, 567, 0, 247, 87]


def test_future_map_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        FutureMap(0)
    with pytest.raises(ValueError):
        FutureMap(4, backend="numpy")
    fmap = FutureMap(4)
    for row in (0, 4, -1):
        with pytest.raises(ValueError, match="row must lie"):
            fmap.stash(row, 1)
