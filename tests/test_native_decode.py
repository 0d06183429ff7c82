"""The native CPU decode attention (kernels/native/paged_decode.c): it reads the KV pool in
place and gives what the eager gather gives, and an engine with it produces the same
greedy tokens as transformers. Without a C compiler the engine falls back to the gather."""

from __future__ import annotations

import ctypes
import logging
import shutil

import pytest
import torch

from pdserve.kernels.native import library, paged_decode, par
from pdserve.model.attention import gather as da
from pdserve.model.attention.backends import NativeAttention
from pdserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> paged_decode.PagedDecode:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    k = paged_decode.paged_decode(tmp_path_factory.mktemp("native"))
    assert k is not None
    return k


def _case(b: int, length: int, kh: int, h: int, d: int, window: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    slots = 4 * b * length + 8
    kc, vc = torch.randn(slots, kh, d, generator=g), torch.randn(slots, kh, d, generator=g)
    q = torch.randn(b, h, d, generator=g) * 3  # sharp softmaxes: large score ranges
    idx = torch.randperm(slots - 1, generator=g)[: b * length].view(b, length) + 1
    lens = torch.randint(1, length + 1, (b,), generator=g)
    lens[0] = length
    pos = torch.arange(length)[None, :]
    hidden = pos >= lens[:, None]
    if window:
        hidden |= pos < (lens - window)[:, None]
    first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    bounds = torch.stack([first, lens], 1).contiguous()
    return q, kc, vc, idx.masked_fill(pos >= lens[:, None], 0), hidden, bounds


@pytest.mark.parametrize(
    "b,length,kh,h,d,window",
    [
        (1, 1, 1, 1, 8, 0),
        (1, 2, 2, 4, 16, 0),
        (3, 5, 2, 4, 16, 0),
        (4, 40, 2, 8, 64, 0),  # several 32-key blocks, GQA groups of 4 (the D = 64 path)
        (5, 97, 3, 9, 64, 0),  # SmolLM2's heads
        (2, 70, 4, 4, 128, 0),  # no grouping, long rows
        (6, 75, 2, 16, 24, 0),  # D not a multiple of the 8 lanes
        (4, 90, 2, 4, 32, 7),  # sliding window
        (4, 90, 2, 8, 64, 33),  # sliding window, the D = 64 path
        (2, 40, 1, 16, 128, 5),  # the D = 128 path, 16 query heads per group
        (3, 64, 1, 2, 16, 64),  # a window as long as the context
        (2, 600, 1, 4, 256, 512),  # Gemma 3 270M's heads (D = 256) and sliding window
        (2, 45, 16, 128, 64, 0),  # 128 query heads: two row walks of 64 heads each
        (3, 300, 2, 8, 64, 0),  # long rows: the prefetch runs ahead of the walk
        (3, 50, 4, 8, 64, 0),  # groups of 2 and 1: the 8-lane walk on every CPU
        (2, 33, 8, 8, 64, 0),
    ],
)
def test_native_matches_gather(kernel, b, length, kh, h, d, window) -> None:
    q, kc, vc, slots, hidden, bounds = _case(b, length, kh, h, d, window, seed=b * length + d)
    want = da.gathered(q, kc, vc, slots, hidden, 0.3)
    torch.testing.assert_close(kernel(q, kc, vc, slots, bounds, 0.3), want, rtol=1e-5, atol=1e-5)
    strided = torch.cat([q, q], dim=2)[:, :, :d]  # a view, as q comes out of the qkv split
    torch.testing.assert_close(kernel(strided, kc, vc, slots, bounds, 0.3), want)


def test_native_splits_requests_over_threads(kernel) -> None:
    q, kc, vc, slots, hidden, bounds = _case(7, 50, 2, 8, 64, 0, seed=5)
    want = da.gathered(q, kc, vc, slots, hidden, 0.3)
    before = torch.get_num_threads()
    try:
        for threads in (2, 3, 9):  # more threads than requests too
            torch.set_num_threads(threads)
            torch.testing.assert_close(kernel(q, kc, vc, slots, bounds, 0.3), want)
    finally:
        torch.set_num_threads(before)
    assert kernel(q[:0], kc, vc, slots[:0], bounds[:0], 0.3).shape == (0, 8, 64)


@pytest.mark.parametrize("b, kh, h", [(1, 4, 16), (1, 8, 8), (2, 4, 8), (3, 2, 8)])
def test_a_request_splits_over_threads_by_kv_heads_bit_for_bit(kernel, b, kh, h) -> None:
    """Units are (request, kv head) pairs: a batch of one request splits over threads by
    its heads (the quad walk at 4 query heads a group, the 8-lane walk at 1 and 2), and
    every split, whole requests or not, gives the bits one thread gives."""
    q, kc, vc, slots, hidden, bounds = _case(b, 300, kh, h, 64, 0, seed=b + kh)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(q, kc, vc, slots, bounds, 0.3)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            assert torch.equal(kernel(q, kc, vc, slots, bounds, 0.3), alone)
    finally:
        torch.set_num_threads(before)
    want = da.gathered(q, kc, vc, slots, hidden, 0.3)
    torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)


def test_native_refuses_shapes_beyond_its_limits(kernel) -> None:
    q, kc, vc, slots, _, bounds = _case(2, 4, 1, 32, 16, 0, seed=1)  # 32 query heads per group
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel(q, kc, vc, slots, bounds, 1.0)


def test_build_is_cached_and_keyed(tmp_path) -> None:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    a = library.build("paged_decode", tmp_path)
    assert a is not None and a.exists()
    mtime = a.stat().st_mtime_ns
    assert library.build("paged_decode", tmp_path) == a and a.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "native").iterdir()] == [a.name]  # no temp files left


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch) -> None:
    """The key covers the headers the sources include, not only the .c file."""
    if library.compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    shutil.copytree(library.SRC_DIR, src)
    monkeypatch.setattr(library, "SRC_DIR", src)
    a = library.build("paged_decode", tmp_path)
    header = src / "exp_poly.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    b = library.build("paged_decode", tmp_path)
    assert a is not None and b is not None and a != b and a.exists() and b.exists()


def _greedy(model, prompts, monkeypatch, native: str):
    from pdserve.llm import LLM

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", native)
    llm = LLM(str(model))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        return got, isinstance(llm.decode.runner.attn, NativeAttention)
    finally:
        llm.close()


def test_native_engine_greedy_tokens_match_transformers(monkeypatch, tiny_model) -> None:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
    got, native = _greedy(tiny_model, prompts, monkeypatch, "0")
    assert native, "the decode engine did not use the native kernel"
    assert got == [hf_greedy(tiny_model, p, 12) for p in prompts]


def test_no_compiler_falls_back_to_gather(monkeypatch, tiny_model, tmp_path, caplog) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither cc nor gcc
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(library, "_loaded", {})
    caplog.set_level(logging.WARNING)
    prompts = [[5, 9, 200, 31, 7]]
    got, native = _greedy(tiny_model, prompts, monkeypatch, "0")
    assert not native
    assert "no C compiler" in caplog.text and "stays eager" in caplog.text
    assert got == [hf_greedy(tiny_model, p, 12) for p in prompts]


def test_unwritable_cache_dir_means_no_kernel_not_a_crash(tmp_path, monkeypatch, caplog) -> None:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(library, "_loaded", {})
    caplog.set_level(logging.WARNING)
    assert paged_decode.paged_decode(blocker) is None  # <blocker>/native cannot be made
    assert "unavailable" in caplog.text


@pytest.mark.parametrize(
    "b,length,kh,h,d,window",
    [(5, 97, 3, 9, 64, 0), (4, 90, 2, 8, 64, 33), (3, 70, 2, 16, 128, 0), (2, 40, 1, 16, 128, 5)],
)
def test_avx512_and_8_lane_walks_agree(kernel, tmp_path, b, length, kh, h, d, window) -> None:
    """On an AVX-512 CPU the D = 64 / 128 paths with groups of 3 or more query heads run
    the 4-heads-a-vector walk (attend_quad.h); built with -mno-avx512f the same source
    runs the 8-lane walk. Both give the gather's result to fp32 rounding (the sums run
    in different orders)."""
    lib = library.build("paged_decode", tmp_path, ("-mno-avx512f",))
    assert lib is not None
    narrow = paged_decode.PagedDecode(ctypes.CDLL(str(lib)), par.Split(tmp_path))
    q, kc, vc, slots, hidden, bounds = _case(b, length, kh, h, d, window, seed=length + h)
    got, want = kernel(q, kc, vc, slots, bounds, 0.3), narrow(q, kc, vc, slots, bounds, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, da.gathered(q, kc, vc, slots, hidden, 0.3))
