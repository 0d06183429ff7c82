"""kernels/native/linear_quant.c against "de-quantize with `gguf`, then the float32 matmul".

Per type, random blocks (random bits, finite half-precision scales), batches 1 to 64
(each way linear_quant.c splits a batch), an output width that ends in a short tile, on
every vector path this CPU runs (AVX-512, AVX2, portable C), each built with its own
flags. The error bound is
float32 summation-order noise: a few ulps of sum |x| |W|.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kernels.native import abi, library
from pdserve.kernels.native.linear_quant import (
    TYPES,
    Group,
    LinearQuant,
    linear_quant,
    row_bytes,
)

gguf_quants = pytest.importorskip("gguf.quants")

# byte offsets of each type's half-precision scales inside a block
HALVES = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108], 12: [0, 2],
          13: [0, 2], 14: [208],
          20: [0], 23: [0]}  # fmt: skip
PATHS = {  # name -> (extra build flags, /proc/cpuinfo flags it needs)
    "avx512": ((), ("avx512f",)),
    "avx2": (("-mno-avx512f",), ("avx2", "fma")),
    "portable": (("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx"), ()),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module", params=list(PATHS))
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LinearQuant:
    flags, needs = PATHS[request.param]
    if library.compiler() is None:
        pytest.skip("no C compiler")
    if not set(needs) <= _cpu_flags():
        pytest.skip(f"this CPU lacks {needs}")
    cache = tmp_path_factory.mktemp("native")
    path = library.build("linear_quant", cache, extra_flags=flags)
    assert path is not None
    lib = ctypes.CDLL(str(path))
    abi.check(lib, "linear_quant", abi.STRUCTS["linear_quant"])  # as library.load checks
    k = linear_quant(cache, lib)
    assert k is not None
    return k


def random_blocks(type_id: int, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] of random bits whose scales are finite halves near 0.01-0.1."""
    rng = np.random.default_rng(seed)
    _, _, size = TYPES[type_id]
    w = rng.integers(0, 256, (n, row_bytes(type_id, k)), dtype=np.uint8)
    blocks = w.reshape(-1, size)
    for off in HALVES[type_id]:
        scale = rng.uniform(0.01, 0.1, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return w


def reference(x: torch.Tensor, w: np.ndarray, type_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ de-quantized W.T in float64, the sum of |products| that bounds its noise)"""
    dq = torch.from_numpy(np.asarray(gguf_quants.dequantize(w, type_id), np.float32)).double()
    return x.double() @ dq.T, x.double().abs() @ dq.abs().T


@pytest.mark.parametrize("type_id", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
# rows of x: 1, the one-row kernels; 3, 8: the register kernels' passes of up to 8 rows;
# 9, 20, 64: the tiles
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20, 64])
def test_matmul_matches_dequantized(kernel: LinearQuant, type_id: int, m: int) -> None:
    k = 512 if TYPES[type_id][1] == 256 else 160
    n = 37  # ends in a short tile
    w = random_blocks(type_id, n, k, seed=type_id * 100 + m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    y = torch.full((m, n + 5), float("nan"))  # a wider output: columns [3, 3 + n) written
    kernel(x, torch.from_numpy(w), type_id, bias, y, col=3)
    ref, scale = reference(x, w, type_id)
    ref += bias.double()
    got = y[:, 3 : 3 + n].double()
    assert torch.isnan(y[:, :3]).all() and torch.isnan(y[:, 3 + n :]).all()
    err = (got - ref).abs()
    bound = 8 * k**0.5 * 2.0**-24 * (scale + bias.double().abs()) + 1e-30
    assert (err <= bound).all(), f"worst {(err / bound).max():.2f}x the float32 noise bound"


@pytest.mark.parametrize("type_id", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
def test_register_kernels_sum_in_chunks_of_k(kernel: LinearQuant, type_id: int) -> None:
    """8 rows of x with k = 2560: the register kernels take k in chunks (x's chunk in L1),
    the last one short, each chunk's sums added into y."""
    m, n, k = 8, 9, 2560
    w = random_blocks(type_id, n, k, seed=type_id + 7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(type_id))
    y = torch.full((m, n), float("nan"))
    kernel(x, torch.from_numpy(w), type_id, None, y)
    ref, scale = reference(x, w, type_id)
    err = (y.double() - ref).abs()
    assert (err <= 8 * k**0.5 * 2.0**-24 * scale + 1e-30).all()


@pytest.mark.parametrize("type_id", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
def test_rows_equal_dequantized_bit_for_bit_where_no_fma(kernel: LinearQuant, type_id: int) -> None:
    """Embedding look-ups: rows equal gguf's de-quantized rows (within one rounding of a
    fused multiply-add for the types whose value is d * q + m)."""
    k = 512
    w = random_blocks(type_id, 9, k, seed=type_id)
    ids = torch.tensor([8, 0, 3, 3])
    got = kernel.rows(torch.from_numpy(w), type_id, ids, k)
    want = torch.from_numpy(np.asarray(gguf_quants.dequantize(w, type_id), np.float32))[ids]
    if type_id in (3, 7, 12, 13):  # d * q + m, d * q - m: the compiler may fuse
        torch.testing.assert_close(got, want, rtol=2**-22, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("type_id", [8, 12, 14], ids=["Q8_0", "Q4_K", "Q6_K"])
def test_groups_equal_one_call_each(kernel: LinearQuant, type_id: int) -> None:
    """A grouped call (a layer's routed experts) writes what one call per group writes,
    bit for bit: each group's rows of x into its rows and columns of y, its own W."""
    k, n = 512, 37  # ends in a short tile
    ws = [torch.from_numpy(random_blocks(type_id, n, k, seed=s)) for s in range(4)]
    g = torch.Generator().manual_seed(type_id)
    rows = [1, 5, 40, 2]  # the one-row, register and tile paths in one call
    x = torch.randn(sum(rows), k, generator=g)
    grouped = torch.full((len(x), 2 * n), float("nan"))
    single = torch.full((len(x), 2 * n), float("nan"))
    calls, start = [], 0
    for i, (w, m) in enumerate(zip(ws, rows, strict=True)):
        xs, col = x[start : start + m], n * (i % 2)
        calls.append(Group(xs, w, type_id, grouped[start : start + m], col))
        kernel(xs, w, type_id, None, single[start : start + m], col)
        start += m
    kernel.groups(calls)
    assert torch.equal(grouped.isnan(), single.isnan())
    assert torch.equal(grouped.nan_to_num(), single.nan_to_num())


def test_refuses_mismatched_shapes(kernel: LinearQuant) -> None:
    w = torch.from_numpy(random_blocks(8, 4, 64, seed=1))
    with pytest.raises(ValueError, match="linear_quant"):
        kernel(torch.randn(2, 96), w, 8, None, torch.empty(2, 4))  # K 96 for rows of 64
    with pytest.raises(ValueError, match="linear_quant"):
        kernel(torch.randn(2, 64), w, 8, None, torch.empty(2, 3))  # 4 columns into 3
