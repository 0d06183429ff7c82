"""--quant-activations int8 (kernels/native/quant_int8.h) against its numpy reference
(tests/int8_reference.py: the same arithmetic written from the GGUF formats): per type,
batches 1 to 64, on the AVX-512 (VNNI) and AVX2 builds, and the tiled GEMM of the VNNI
build at its tiles' edges; the error bound is float32 summation noise. The reference's codes and scales are checked against gguf's
de-quantize, and the portable build (no AVX2) falls back to the float kernels."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdserve.kernels.native import abi, library
from pdserve.kernels.native.linear_quant import TYPES, LinearQuant, linear_quant
from tests import int8_reference as ref
from tests.test_quant_kernels import _cpu_flags, random_blocks

gguf_quants = pytest.importorskip("gguf.quants")

PATHS = {  # name -> (extra build flags, /proc/cpuinfo flags it needs)
    "vnni": ((), ("avx512f", "avx512_vnni", "avx512vl", "avx512bw")),
    "avx2": (("-mno-avx512f",), ("avx2", "fma")),
}
FLOAT_X = ("Q2_K", "Q3_K")  # no integer kernel: their projections keep float x
INT8_TYPES = sorted(t for t in TYPES if TYPES[t][0] not in FLOAT_X)
IDS = [TYPES[t][0] for t in INT8_TYPES]


def _build(flags: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> LinearQuant:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    path = library.build("linear_quant", tmp_path_factory.mktemp("native"), extra_flags=flags)
    assert path is not None
    lib = ctypes.CDLL(str(path))
    abi.check(lib, "linear_quant", abi.STRUCTS["linear_quant"])
    k = linear_quant(path.parent.parent, lib, int8=True)
    assert k is not None
    return k


@pytest.fixture(scope="module", params=list(PATHS))
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LinearQuant:
    flags, needs = PATHS[request.param]
    if not set(needs) <= _cpu_flags():
        pytest.skip(f"this CPU lacks {needs}")
    return _build(flags, tmp_path_factory)


@pytest.mark.parametrize("type_id", INT8_TYPES, ids=IDS)
def test_reference_codes_are_gguf_values(type_id: int) -> None:
    """The reference's codes and scales give gguf's de-quantized values: it reads the
    formats as gguf does."""
    _, block, size = TYPES[type_id]
    w = random_blocks(type_id, 3, 512, seed=type_id)
    want = np.asarray(gguf_quants.dequantize(w, type_id), np.float32)
    got = ref.dequantized(w, type_id, block, size)
    np.testing.assert_allclose(got, want, rtol=2**-22, atol=1e-30)


@pytest.mark.parametrize("k", [96, 512])
def test_quantize_equals_reference(kernel: LinearQuant, k: int) -> None:
    """x's 8-bit codes and scales equal the reference's bit for bit (both layouts)."""
    m = 5
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[1] = 0  # an all-zero row: scale 0, codes 0
    xq = kernel.quantize(x)
    assert xq is not None
    raw = xq.numpy()
    q32, d32 = ref.quantize(x.numpy(), 32)
    assert np.array_equal(raw[:, :k].view(np.int8), q32)
    assert np.array_equal(raw[:, k : k + k // 8].copy().view(np.float32), d32)
    if k % 256 == 0:
        q256, d256 = ref.quantize(x.numpy(), 256)
        at = k + k // 4
        assert np.array_equal(raw[:, at : at + k].view(np.int8), q256)
        d_at = at + k
        assert np.array_equal(raw[:, d_at : d_at + k // 64].copy().view(np.float32), d256)


def _check(kernel: LinearQuant, type_id: int, m: int, k: int, tiled: bool) -> None:
    """y = x @ W.T + b for n = 11 rows of W (a short last tile), written into columns
    [2, 13) of y only, within float32 noise of the reference; `tiled`: by the GEMM."""
    _, block, size = TYPES[type_id]
    n = 11
    w = random_blocks(type_id, n, k, seed=type_id * 100 + m)
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    y = torch.full((m, n + 4), float("nan"))
    xq = kernel.quantize(x)
    xt = kernel.tiles(xq, k) if tiled else None
    assert (xt is not None) == tiled
    kernel(x, torch.from_numpy(w), type_id, bias, y, col=2, xq=xq, xt=xt)
    want, scale = ref.matmul(x.numpy(), w, type_id, block, size)
    want = want + bias.double().numpy()
    got = y[:, 2 : 2 + n].double().numpy()
    assert np.isnan(y[:, :2]).all() and np.isnan(y[:, 2 + n :]).all()
    bound = 8 * k**0.5 * 2.0**-24 * (scale + np.abs(bias.double().numpy())) + 1e-30
    err = np.abs(got - want)
    assert (err <= bound).all(), f"k {k}: worst {(err / bound).max():.2f}x the noise bound"


@pytest.mark.parametrize("type_id", INT8_TYPES, ids=IDS)
# each row count of a pass (XR8 = 4); 64: the GEMM, x laid out by the kernel (VNNI builds)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 64])
def test_matmul_equals_reference(kernel: LinearQuant, type_id: int, m: int) -> None:
    assert kernel.int8_supported(type_id)
    for k in [512] if TYPES[type_id][1] == 256 else [96, 512]:  # 96: a row with no q256 part
        _check(kernel, type_id, m, k, tiled=False)


@pytest.mark.parametrize("type_id", INT8_TYPES, ids=IDS)
def test_gemm_equals_reference(
    kernel: LinearQuant, type_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiled GEMM (quant_gemm8.h) at its tiles' edges: 1 row (one group of 16,
    15 padded), 17 (a pair of groups, the second short), 50 (a pair, then one group
    alone); 3 super-blocks (768), a row of 32-blocks with no q256 part (96)."""
    if not kernel.gemm8_supported(type_id):
        pytest.skip("the GEMM needs AVX-512 VNNI")
    monkeypatch.setattr(kernel, "gemm_rows", dict.fromkeys(kernel.gemm_rows, 1))
    for m in (1, 17, 50):
        for k in [768] if TYPES[type_id][1] == 256 else [96, 768]:
            _check(kernel, type_id, m, k, tiled=True)


def test_gemm_reads_its_tiles_and_lays_out_the_same(kernel: LinearQuant) -> None:
    """At a prompt's rows the int8 path is the GEMM: its output follows the tiles it is
    given; given only x's codes (the decode's one call) it lays them out itself, to the
    same bits."""
    if not kernel.gemm8_supported(12):
        pytest.skip("the GEMM needs AVX-512 VNNI")
    m, k = 32, 256
    w = torch.from_numpy(random_blocks(12, 4, k, seed=1))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    xq, xt = kernel.prepare(x)
    assert xt is not None and kernel.gemm8_supported(12, m)
    y, y0, own = torch.empty(m, 4), torch.empty(m, 4), torch.empty(m, 4)
    kernel(x, w, 12, None, y, xq=xq, xt=xt)
    kernel(x, w, 12, None, y0, xq=xq, xt=torch.zeros_like(xt))
    kernel(x, w, 12, None, own, xq=xq)
    assert not torch.equal(y, y0) and torch.equal(y0, torch.zeros_like(y0))
    assert torch.equal(own, y)


def test_x_is_laid_out_for_the_gemm_only_where_a_part_takes_it(kernel: LinearQuant) -> None:
    """A projection's x is tiled when one of its parts' types takes the GEMM at x's rows,
    not at the lowest count of any type: Q4_K (12) below its own count gets codes only,
    the same rows beside a block-of-32 part (8) get tiles too."""
    if not kernel.gemm8_supported(12):
        pytest.skip("the GEMM needs AVX-512 VNNI")
    below = kernel.gemm_rows[12] - 1
    assert below >= kernel.gemm_rows[2]  # the rows where the two types differ
    x = torch.randn(below, 256, generator=torch.Generator().manual_seed(3))
    assert kernel.prepare(x, [12])[1] is None
    assert kernel.prepare(x, [12, 2])[1] is not None
    assert kernel.prepare(torch.cat([x, x[:1]]), [12])[1] is not None


def test_a_gemm_range_writes_only_its_tiles(kernel: LinearQuant) -> None:
    """A thread's range of tiles writes its own columns of y only, even where it ends
    inside a group of tiles unpacked together (the other threads write the rest)."""
    if not kernel.gemm8_supported(8):
        pytest.skip("the GEMM needs AVX-512 VNNI")
    m, n, k = 20, 37, 64  # 10 tiles of 4 rows, the last short
    w = torch.from_numpy(random_blocks(8, n, k, seed=2))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    xq, xt = kernel.prepare(x)
    assert xt is not None
    want = torch.empty(m, n)
    kernel(x, w, 8, None, want, xq=xq, xt=xt)
    for lo, hi in [(1, 2), (3, 6), (9, 10)]:
        y = torch.full((m, n), float("nan"))
        args = kernel_args(x, w, y, xq)
        kernel._gemm(ctypes.byref(abi.Gemm8Args(ctypes.addressof(args), xt.data_ptr())), lo, hi)
        cols = slice(4 * lo, min(4 * hi, n))
        assert torch.equal(y[:, cols], want[:, cols])
        rest = torch.ones(n, dtype=torch.bool)
        rest[cols] = False
        assert torch.isnan(y[:, rest]).all()


def kernel_args(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, xq: torch.Tensor
) -> abi.QuantArgs:
    (m, k), n = x.shape, w.shape[0]
    return abi.QuantArgs(x.data_ptr(), xq.data_ptr(), w.data_ptr(), 0, y.data_ptr(), m, n, k,
                         y.shape[1], w.shape[1], 8, 0)  # fmt: skip


@pytest.mark.parametrize("name", FLOAT_X)
def test_types_without_integer_kernel_keep_float_x(kernel: LinearQuant, name: str) -> None:
    """Given x's codes, a type with no integer kernel computes the float path's y."""
    type_id = next(t for t, v in TYPES.items() if v[0] == name)
    assert not kernel.int8_supported(type_id)
    w = torch.from_numpy(random_blocks(type_id, 5, 512, seed=type_id))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    y8, y32 = torch.empty(3, 5), torch.empty(3, 5)
    kernel(x, w, type_id, None, y8, xq=kernel.quantize(x))
    kernel(x, w, type_id, None, y32)
    assert torch.equal(y8, y32)


def test_portable_build_falls_back_to_float(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without AVX2 no type has an integer kernel: given x's codes, y is the float one."""
    flags = ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx")
    kernel = _build(flags, tmp_path_factory)
    assert not any(kernel.int8_supported(t) for t in TYPES)
    w = torch.from_numpy(random_blocks(12, 4, 256, seed=3))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    y8, y32 = torch.empty(2, 4), torch.empty(2, 4)
    kernel(x, w, 12, None, y8, xq=kernel.quantize(x))
    kernel(x, w, 12, None, y32)
    assert torch.equal(y8, y32)
