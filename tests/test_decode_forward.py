"""The whole decode forward in one native call (kernels/native/decode_forward.c through
model/native_forward.py) gives the per-call path's logits bit for bit, over batch sizes,
thread counts, ragged contexts and sliding windows, for Llama, Qwen2 (q/k/v bias, tied
head) and Qwen3 (q/k norms); it refuses out-of-range inputs before writing anything; an
engine running it produces transformers' greedy tokens; models it does not cover keep
the per-call path, saying why."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.kernels.native import library
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.native_forward import NativeDecodeForward
from pdserve.model.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy, model_path


def _env(monkeypatch) -> None:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    monkeypatch.delenv("PDSERVE_PER_CALL_DECODE", raising=False)


def _runner(preset: str, monkeypatch) -> ModelRunner:
    _env(monkeypatch)
    # a pool of 4096 slots holds every step below (at most 320 tokens) at scattered
    # slots; _step fills and _both copies the whole pool, so a bigger one only costs time
    cache = CacheConfig(max_total_tokens=4096)
    runner = ModelRunner(EngineConfig(model_path=str(model_path(preset)), cache=cache))
    runner.warm_up_decode()
    if runner.native_forward is None:
        pytest.skip("the native decode forward is not built here (needs AVX2 and FMA)")
    return runner


def _step(runner: ModelRunner, lens: list[int], seed: int) -> ForwardBatch:
    """A decode step of len(lens) requests whose contexts (lens[i] - 1 tokens of random
    K/V) sit at scattered slots of the pool; the step writes position lens[i] - 1."""
    g = torch.Generator().manual_seed(seed)
    pool, table = runner.kv_pool, runner.req_pool.req_to_token
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    order = torch.randperm(pool.k.shape[1], generator=g)
    used = 0
    for row, n in enumerate(lens):
        table[row, :n] = order[used : used + n].to(table.dtype)
        used += n
    last = [int(table[row, n - 1]) for row, n in enumerate(lens)]
    vocab = runner.arch.vocab_size
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (len(lens),), generator=g),
        positions=torch.tensor([n - 1 for n in lens]),
        out_cache_loc=torch.tensor(last),
        rows=torch.arange(len(lens)),
        seq_lens=list(lens),
        extend_lens=[1] * len(lens),
        host_rows=list(range(len(lens))),
    )


def _both(runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-call logits, native logits) of one prepared step, each run on the same pool
    as it was before the step; the K/V each path wrote must be the same too (the step's
    attention reads this step's K/V back from the pool, so a path that skipped its write
    would read the other's if they ran on one pool)."""
    runner.prepare(batch)
    native = runner.native_forward
    assert native is not None and native.fits(batch)
    pool = runner.kv_pool
    k0, v0 = pool.k.clone(), pool.v.clone()
    per_call = runner.model.forward(batch, runner.attn)
    k1, v1 = pool.k.clone(), pool.v.clone()
    pool.k.copy_(k0)
    pool.v.copy_(v0)
    got = native(batch)
    assert torch.equal(pool.k, k1) and torch.equal(pool.v, v1), "the paths wrote different K/V"
    assert not torch.equal(k1, k0), "the step wrote no K"
    return per_call, got


@pytest.fixture(scope="module")
def grid_runners() -> dict[str, ModelRunner]:
    """One runner per preset for the grid below: each case refills the whole pool and the
    table rows it uses, so no case reads what an earlier one left."""
    return {}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[1], [5, 17, 2], [40] * 8, list(range(1, 18))])
def test_logits_equal_the_per_call_path(monkeypatch, grid_runners, preset, threads, lens) -> None:
    _env(monkeypatch)
    if preset not in grid_runners:
        grid_runners[preset] = _runner(preset, monkeypatch)
    assert_native_is_per_call(grid_runners[preset], lens, threads)


def assert_native_is_per_call(runner: ModelRunner, lens: list[int], threads: int) -> None:
    """A step of requests with `lens` contexts on `threads` threads: the one native call's
    logits are the per-call path's, bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_call, native = _both(runner, _step(runner, lens, seed=len(lens)))
    finally:
        torch.set_num_threads(before)
    assert native.shape == (len(lens), runner.arch.vocab_size)
    assert torch.equal(native, per_call)


def test_sliding_windows_per_layer(monkeypatch) -> None:
    runner = _runner("tiny", monkeypatch)
    assert runner.native_forward is not None
    kernel, layers = runner.native_forward.kernel, runner.arch.num_layers
    runner.attn.windows = tuple(3 if i % 2 else 0 for i in range(layers))  # as Qwen2's mix
    runner.native_forward, why = NativeDecodeForward.build(kernel, runner.model, runner.attn, None)
    assert why is None
    per_call, got = _both(runner, _step(runner, [2, 9, 30], seed=3))
    assert torch.equal(got, per_call)
    runner.attn.windows = ()  # full attention differs: the windows were used
    full = _step(runner, [2, 9, 30], seed=3)  # the same pool and inputs again
    runner.prepare(full)
    assert not torch.equal(runner.model.forward(full, runner.attn), got)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("input_ids", 10**6, "vocabulary"),
        ("input_ids", -1, "vocabulary"),
        ("positions", 10**7, "rotary"),
        ("out_cache_loc", 10**9, "KV slot"),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_written(
    monkeypatch, field, value, message
) -> None:
    runner = _runner("tiny", monkeypatch)
    batch = _step(runner, [4, 6], seed=1)
    getattr(batch, field)[1] = value
    runner.prepare(batch)
    k, v = runner.kv_pool.k.clone(), runner.kv_pool.v.clone()
    assert runner.native_forward is not None
    with pytest.raises(ValueError, match=message):
        runner.native_forward(batch)
    assert torch.equal(runner.kv_pool.k, k) and torch.equal(runner.kv_pool.v, v)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_an_engine_on_it_matches_transformers(monkeypatch, preset) -> None:
    from pdserve.llm import LLM

    if library.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    path = model_path(preset)
    llm = LLM(str(path))
    try:
        if llm.decode.runner.native_forward is None:
            pytest.skip("the native decode forward is not built here")
        prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert got == [hf_greedy(path, p, 12) for p in prompts]


def test_a_model_it_does_not_cover_keeps_the_per_call_path_and_says_why(
    monkeypatch, caplog
) -> None:
    import torch.nn.functional as F

    from pdserve.model.layers import activations

    if library.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    monkeypatch.setitem(activations.ACTIVATIONS, "silu", F.gelu)  # not the native SiLU
    caplog.set_level(logging.INFO)
    runner = ModelRunner(EngineConfig(model_path=str(model_path("tiny"))))
    runner.warm_up_decode()
    assert runner.native_forward is None
    assert "activation is neither SiLU nor GELU-tanh" in caplog.text


def test_the_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_PER_CALL_DECODE", "1")
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    runner = ModelRunner(EngineConfig(model_path=str(model_path("tiny"))))
    runner.warm_up_decode()
    assert runner.native_forward is None


def test_window_kinds_are_counted_not_layers(monkeypatch) -> None:
    """Many layers with few distinct windows fit; more distinct windows than the plan
    holds keep the per-call path."""
    from pdserve.model.native_forward import refusal

    runner = _runner("tiny", monkeypatch)
    runner.model.arch = replace(runner.model.arch, num_layers=5)  # refusal reads only this
    runner.attn.windows = (0, 0, 0, 0, 0)
    assert refusal(runner.model, runner.attn) is None
    runner.attn.windows = (0, 2, 3, 4, 4)
    assert refusal(runner.model, runner.attn) is None
    runner.attn.windows = (0, 2, 3, 4, 5)
    assert "distinct attention windows" in (refusal(runner.model, runner.attn) or "")
