"""Gemma 3 on the one-call native decode forward (kernels/native/decode_forward.c): its
logits equal the per-call path's (Gemma3Model.forward) bit for bit, on float32 weights
and on a GGUF's Q8_0 blocks (float and int8 activations), with sliding layers whose
window is shorter than the contexts and a rope table per layer type; an engine on it
gives transformers' greedy tokens; soft-capped logits keep the per-call path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.checkpoints.resolve import resolve_model
from pdserve.config import CacheConfig, EngineConfig
from pdserve.model.native_forward import refusal
from pdserve.model.runner import ModelRunner
from tests.conftest import hf_greedy
from tests.test_decode_forward import _both, _env, _step
from tests.test_gemma3 import SERVED, make_gemma3
from tests.test_gemma3_gguf import write_gemma3_gguf

WINDOW = 6  # the sliding layers' (make_gemma3); every context below but [1] is longer


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3-native")


@pytest.fixture(scope="module")
def runners(root: Path) -> dict[str, ModelRunner]:
    """Built on first use, one per weights kind, shared by the cases."""
    return {}


def _runner(root: Path, runners: dict[str, ModelRunner], kind: str) -> ModelRunner:
    if kind not in runners:
        if kind == "f32":  # sliding, full, sliding: two rope thetas, two windows
            kw, edit = SERVED["mixed-layers"]
            path = make_gemma3(root, "native-mixed", edit, **kw)
        else:  # six layers (five sliding), head size 256, every projection in Q8_0 blocks
            gguf = root / "gemma3-Q8_0.gguf"
            if not gguf.exists():
                write_gemma3_gguf(root, "Q8_0")
            with pytest.MonkeyPatch.context() as mp:  # converted under the test's folder only
                mp.setenv("PDSERVE_CACHE_DIR", str(root / "cache"))
                path = resolve_model(str(gguf)).path
        cache = CacheConfig(max_total_tokens=4096)
        quant_x = "int8" if kind.endswith("int8") else "float"  # --quant-activations
        cfg = EngineConfig(model_path=str(path), cache=cache, quant_activations=quant_x)
        runner = ModelRunner(cfg)
        runner.warm_up_decode()
        runners[kind] = runner
    runner = runners[kind]
    if runner.native_forward is None:
        pytest.skip("the native decode forward is not built here (needs AVX2 and FMA)")
    return runner


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q8_0-int8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[1], [5, 17, 2], [40] * 4, list(range(1, 18))])
def test_logits_equal_the_per_call_path(monkeypatch, root, runners, kind, threads, lens) -> None:
    _env(monkeypatch)
    runner = _runner(root, runners, kind)
    windows = set(runner.arch.layer_windows)
    assert windows == {WINDOW, 0}, windows
    assert len(runner.model.ropes) == 2, "a rope per layer type"
    if kind != "f32":
        assert all(lin.quant is not None for lin in runner.model.linears()[:-1])
    assert runner.native_forward is not None
    assert bool(runner.native_forward.plan.quant_x8) == kind.endswith("int8")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_call, native = _both(runner, _step(runner, lens, seed=len(lens) + threads))
    finally:
        torch.set_num_threads(before)
    assert native.shape == (len(lens), runner.arch.vocab_size)
    assert torch.equal(native, per_call)


def test_the_rope_tables_and_windows_differ_per_layer(monkeypatch, root, runners) -> None:
    """The equality above would hold for a forward that used one rope or one window if
    the layers' were alike: here each layer type's changes the logits."""
    _env(monkeypatch)
    runner = _runner(root, runners, "f32")
    local, full = runner.model.ropes
    assert not torch.equal(local.cos, full.cos)
    batch = _step(runner, [30, 12], seed=5)
    want, _ = _both(runner, batch)
    before = runner.model.rope_of_layer
    runner.model.rope_of_layer = [0] * len(before)  # every layer on the sliding layers' rope
    try:
        runner.prepare(batch)
        assert not torch.equal(runner.model.forward(batch, runner.attn), want)
    finally:
        runner.model.rope_of_layer = before


def test_an_engine_on_it_matches_transformers(monkeypatch, root) -> None:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    _env(monkeypatch)
    kw, edit = SERVED["mixed-layers"]
    path = make_gemma3(root, "native-engine", edit, **kw)
    llm = LLM(str(path), max_total_tokens=1024, max_context=256)
    try:
        if llm.decode.runner.native_forward is None:
            pytest.skip("the native decode forward is not built here")
        prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert got == [hf_greedy(path, p, 10) for p in prompts]


def test_soft_capped_logits_keep_the_per_call_path(monkeypatch, root, runners) -> None:
    _env(monkeypatch)
    runner = _runner(root, runners, "f32")
    assert refusal(runner.model, runner.attn) is None
    arch = runner.model.arch
    runner.model.arch = replace(arch, final_logit_softcapping=30.0)  # refusal reads only this
    try:
        assert "soft-capped" in (refusal(runner.model, runner.attn) or "")
    finally:
        runner.model.arch = arch
