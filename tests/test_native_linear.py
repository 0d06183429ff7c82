"""The native fp32 linear (kernels/native/linear_f32.c): y = x @ W.T + b for any row count,
any width (the last 16-column panel padded), with or without bias, split over threads
with the same bits as one thread; a decode engine moves every projection to it and
still produces transformers' greedy tokens. Where it cannot be built (no compiler, no
AVX2), the projections stay on oneDNN."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from pdserve.kernels.native import library, linear_f32, par
from pdserve.model.layers.linear import Linear
from pdserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> linear_f32.LinearF32:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    k = linear_f32.linear_f32(tmp_path_factory.mktemp("native"))
    if k is None:
        pytest.skip("linear_f32 not built here (needs x86-64 with AVX2 and FMA)")
    return k


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 24, 64, 257])
@pytest.mark.parametrize(
    ("n", "k"), [(16, 8), (40, 33), (48, 20), (384, 256), (1376, 688), (4096, 256)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(kernel, m, n, k, bias) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = Linear(w, b)
    lin.use_native(kernel)
    assert lin.native is kernel and lin.weight.shape == (-(-n // 16), k, 16)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    got = lin(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * k**0.5)


def test_non_contiguous_rows_and_empty_batch(kernel) -> None:
    w = torch.randn(48, 32)
    lin = Linear(w)
    lin.use_native(kernel)
    wide = torch.randn(9, 64)
    x = wide[:, ::2]  # a strided view
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-4)
    assert lin(torch.empty(0, 32)).shape == (0, 48)


def test_wrong_input_is_refused_not_read_out_of_bounds(kernel) -> None:
    lin = Linear(torch.randn(32, 16))
    lin.use_native(kernel)
    for bad in (torch.randn(2, 17), torch.randn(2, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="linear_f32"):
            lin(bad)


def test_threads_split_panels_with_identical_bits(kernel) -> None:
    w, x, b = torch.randn(1000, 300), torch.randn(11, 300), torch.randn(1000)
    lin = Linear(w, b)
    lin.use_native(kernel)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(3)  # more parts than cores: each still writes its own columns
        three = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="the AVX-512 path needs an AVX-512 CPU")
@pytest.mark.parametrize("m", [1, 8, 13, 64])
def test_avx512_and_avx2_paths_give_the_same_bits(kernel, tmp_path, m) -> None:
    """The AVX-512 blocks (12 rows x two panels) add the same products in the same order
    as the AVX2 blocks (6 rows x one panel): the same W gives the same bits on either CPU.
    Panels 0-1 pair, panel 2 goes alone, panel 3 is padded (N = 60)."""
    lib = library.build("linear_f32", tmp_path, ("-mno-avx512f",))
    assert lib is not None
    avx2 = linear_f32.LinearF32(ctypes.CDLL(str(lib)), par.Split(tmp_path))
    w, b = torch.randn(60, 70), torch.randn(60)
    x = torch.randn(m, 70)
    wide, packed = kernel.pack(w, b), avx2.pack(w, b)
    assert torch.equal(wide[0], packed[0])  # one layout for both
    got, want = kernel(x, *wide, 60), avx2(x, *packed, 60)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, x @ w.T + b, rtol=1e-5, atol=1e-4)


def test_use_native_is_idempotent_from_either_layout(kernel) -> None:
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    for onednn in (True, False):
        lin = Linear(w)
        if not onednn and lin.onednn:  # the portable layout: W.T kept [in, out]
            lin.onednn, lin.weight = False, w.t().contiguous()
        lin.use_native(kernel)
        packed = lin.weight
        lin.use_native(kernel)
        assert lin.weight is packed
        torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-4)


def _greedy(model, prompts, monkeypatch):  # type: ignore[no-untyped-def]
    from pdserve.llm import LLM

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    llm = LLM(str(model))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        natives = [lin.native is not None for lin in llm.decode.runner.model.linears()]
        return got, natives
    finally:
        llm.close()


def test_engine_moves_every_projection_and_matches_transformers(
    kernel, monkeypatch, tiny_model
) -> None:
    prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
    got, natives = _greedy(tiny_model, prompts, monkeypatch)
    assert all(natives), natives
    assert got == [hf_greedy(tiny_model, p, 12) for p in prompts]


def test_without_the_kernel_projections_stay_on_onednn(monkeypatch, tiny_model, caplog) -> None:
    monkeypatch.setattr(linear_f32, "linear_f32", lambda *_: None)
    caplog.set_level(logging.WARNING)
    got, natives = _greedy(tiny_model, [[5, 9, 200, 31, 7]], monkeypatch)
    assert not any(natives)
    assert "stay on oneDNN" in caplog.text
    assert got == [hf_greedy(tiny_model, [5, 9, 200, 31, 7], 12)]
