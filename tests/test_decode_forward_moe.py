"""The one-call native decode forward on mixture-of-experts models (kernels/native/
decode_moe.h): its logits equal the per-call path's (model/arch/moe.py) bit for bit for
a Qwen3-MoE (Q4_K experts, float and int8 activations), a Mixtral (a `llama` file with
experts, Q8_0) and a Qwen2-MoE (a shared expert and its gate, Q6_K), each written as GGUF
by tests/test_moe_gguf.py's and tests/test_moe_quant.py's helpers; at batch 1 and at
batches whose tokens share experts. The plan's renormalisation and its grouping of a
batch's tokens by expert are each shown to matter. Greedy tokens against transformers:
tests/test_moe_gguf.py and tests/test_moe_quant.py, whose engines now decode here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.checkpoints.resolve import resolve_model
from pdserve.config import CacheConfig, EngineConfig
from pdserve.kernels.native import library
from pdserve.model.arch.moe import MoeModel
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.runner import ModelRunner
from tests.test_decode_forward import _both, _step, assert_native_is_per_call
from tests.test_moe_gguf import write_moe_gguf
from tests.test_moe_quant import write_llamacpp_moe

pytest.importorskip("gguf")

# name -> (how the file is written, --quant-activations)
FILES = {
    "qwen3moe-Q4_K": ("qwen3moe", "Q4_K", "float"),
    "qwen3moe-Q4_K-int8": ("qwen3moe", "Q4_K", "int8"),
    "mixtral-Q8_0": ("mixtral", "Q8_0", "float"),
    "qwen2moe-Q6_K": ("qwen2moe", "Q6_K", "float"),
}


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelRunner]:
    """name -> its runner, made on first use (each GGUF written once)."""
    if library.compiler() is None:
        pytest.skip("no C compiler")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield {}


def _runner(runners: dict[str, ModelRunner], name: str, tmp: Path, mp) -> ModelRunner:
    mp.setenv("PDSERVE_DISABLE_COMPILE", "0")
    mp.delenv("PDSERVE_PER_CALL_DECODE", raising=False)
    if name not in runners:
        family, qtype, acts = FILES[name]
        path = tmp / f"{family}-{qtype}.gguf"
        if not path.exists():
            if family == "mixtral":
                write_llamacpp_moe(path, family, qtype)
            else:
                write_moe_gguf(path, family, qtype)
        folder = resolve_model(str(path)).path  # converted; the experts read from the file
        cfg = EngineConfig(model_path=str(folder), cache=CacheConfig(max_total_tokens=1024),
                           quant_activations=acts)  # fmt: skip
        runner = ModelRunner(cfg)
        runner.warm_up_decode()
        assert isinstance(runner.model, MoeModel)
        if runner.native_forward is None:
            pytest.skip("the native decode forward is not built here (needs AVX2 and FMA)")
        runners[name] = runner
    return runners[name]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("name", list(FILES))
@pytest.mark.parametrize("lens", [[3], [5, 17, 2, 9, 30, 4, 11]])
def test_logits_equal_the_per_call_path(runners, gguf_dir, monkeypatch, name, lens) -> None:
    runner = _runner(runners, name, gguf_dir, monkeypatch)
    assert runner.native_forward is not None
    assert bool(runner.native_forward.plan.quant_x8) == (FILES[name][2] == "int8")
    assert_native_is_per_call(runner, lens, threads=2)


def _same_token_step(runner: ModelRunner, b: int) -> ForwardBatch:
    """b requests with one context (the same slots), token and position: every token
    routes to the same experts, and every row's logits must be the same."""
    batch = _step(runner, [12] * b, seed=5)
    table = runner.req_pool.req_to_token
    table[1:b, :12] = table[0, :12]
    batch.input_ids[:] = batch.input_ids[0]
    batch.out_cache_loc[:] = table[0, 11]
    return batch


def test_every_token_an_expert_shares_is_computed(runners, gguf_dir, monkeypatch) -> None:
    """Six tokens on the same experts: a grouped call that computed only an expert's
    first token would leave the other rows' logits apart from the first's."""
    runner = _runner(runners, "qwen3moe-Q4_K", gguf_dir, monkeypatch)
    per_call, native = _both(runner, _same_token_step(runner, 6))
    assert torch.equal(native, per_call)
    assert all(torch.equal(native[i], native[0]) for i in range(6))


def test_the_plan_renormalises_the_top_k(runners, gguf_dir, monkeypatch) -> None:
    """Qwen3-MoE here has norm_topk_prob: the plan's flag off changes the logits."""
    runner = _runner(runners, "qwen3moe-Q4_K", gguf_dir, monkeypatch)
    native = runner.native_forward
    assert native is not None and runner.arch.moe is not None and runner.arch.moe.norm_topk_prob
    layers = [native.plan.layer[i].moe.contents for i in range(runner.arch.num_layers)]
    assert all(m.norm_topk == 1 for m in layers)
    batch = _step(runner, [4, 9], seed=7)
    pool = runner.kv_pool
    k0, v0 = pool.k.clone(), pool.v.clone()
    per_call, got = _both(runner, batch)
    assert torch.equal(got, per_call)
    pool.k.copy_(k0)
    pool.v.copy_(v0)
    for m in layers:
        m.norm_topk = 0
    try:
        unnormed = native(batch)
    finally:
        for m in layers:
            m.norm_topk = 1
    assert not torch.allclose(unnormed, per_call, atol=1e-3)


def test_routing_weights_sum_to_one_only_where_renormalised(runners, gguf_dir, monkeypatch):
    runner = _runner(runners, "qwen3moe-Q4_K", gguf_dir, monkeypatch)
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    ops = runner.model.ops
    for norm in (True, False):
        w, chosen = ops.moe_route(logits, 2, norm)
        want = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
        assert torch.equal(chosen, want.indices)
        ref = want.values / want.values.sum(-1, keepdim=True) if norm else want.values
        torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
        assert torch.allclose(w.sum(-1), torch.ones(5)) == norm


@pytest.mark.parametrize(
    ("family", "weights", "why"),
    [
        ("olmoe", "quantized", "OLMoE's attention"),
        ("qwen3moe", "float32", "not in a GGUF's blocks"),
    ],
)
def test_what_it_does_not_cover_keeps_the_per_call_path_and_says_why(
    runners, gguf_dir, monkeypatch, caplog, family, weights, why
) -> None:
    import logging

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    monkeypatch.delenv("PDSERVE_PER_CALL_DECODE", raising=False)
    path = gguf_dir / f"{family}-Q8_0.gguf"
    if family == "olmoe":
        write_llamacpp_moe(path, family, "Q8_0")
    else:
        write_moe_gguf(path, family, "Q8_0")
    folder = resolve_model(str(path)).path
    caplog.set_level(logging.INFO)
    cfg = EngineConfig(model_path=str(folder), cache=CacheConfig(max_total_tokens=256),
                       weights=weights)  # fmt: skip
    runner = ModelRunner(cfg)
    runner.warm_up_decode()
    assert runner.native_forward is None
    assert why in caplog.text
