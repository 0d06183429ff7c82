"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) served like
transformers, or refused naming the field.

Every checkpoint is made by transformers itself (its config class, its model class,
`save_pretrained`: one tensor per expert and projection, as the Hub's checkpoints),
2-3 layers, 8 experts, top 2, hidden 64. Greedy tokens are compared through the engine
pair; the pieces (routing and its normalisation, the shared expert's gate, the dense
layers between sparse ones) are also compared layer by layer with transformers' blocks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.checkpoints import tokenizer_build as tb
from pdserve.checkpoints.tensor_files import load_state
from pdserve.model.arch.moe import Experts, MoeModel, route
from pdserve.model.arch.registry import arch_from_config, load_arch
from pdserve.model.arch.rules import UnsupportedConfig
from pdserve.server.tokenizer import Tokenizer
from tests.conftest import _hf_model, assert_pools_free, hf_greedy
from tests.test_config_conformance import VOCAB, _prompts, make_checkpoint
from tests.test_e2e_pd import free_port, spawn, stop, wait_healthy

NEW_TOKENS = 8
MOE = dict(num_experts_per_tok=2, intermediate_size=96)
# name -> (family, config kwargs)
SERVED: dict[str, tuple[str, dict[str, Any]]] = {
    # a shared expert with its sigmoid gate; layer 0 dense (decoder_sparse_step 2)
    "qwen2moe-shared-step": (
        "Qwen2Moe",
        dict(
            MOE,
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
            num_hidden_layers=3,
        ),
    ),  # fmt: skip
    # top-k renormalised; layer 1 dense (mlp_only_layers); q/k RMSNorm per head
    "qwen3moe-norm-mlp-only": (
        "Qwen3Moe",
        dict(
            MOE,
            num_experts=8,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            head_dim=16,
        ),
    ),  # fmt: skip
    "mixtral-window": ("Mixtral", dict(MOE, num_local_experts=8, sliding_window=7)),
    # q/k norms over the whole projection, clip_qkv
    "olmoe-clip": ("Olmoe", dict(MOE, num_experts=8, clip_qkv=1.5, pad_token_id=0)),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


_MADE: dict[str, Path] = {}


def _checkpoint(root: Path, case: str) -> Path:
    if case not in _MADE:
        family, kw = SERVED[case]
        _MADE[case] = make_checkpoint(root, case, family, **kw)
    return _MADE[case]


def _serve(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(path, page_size=16, max_running_requests=2, max_total_tokens=1024, max_context=256)
    try:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        )
        assert_pools_free(llm)
    finally:
        llm.close()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("case", list(SERVED))
def test_served_like_transformers(root: Path, case: str) -> None:
    path = _checkpoint(root, case)
    prompts = _prompts(len(case))[:2]  # 41 and 3 tokens
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert any(len(set(w)) > 2 for w in want), want  # the model is not stuck on one token
    assert _serve(path, prompts) == want


@pytest.mark.slow  # about 20 s of CPU: three processes start and stop
def test_pdserve_up_serves_it_like_transformers(root: Path) -> None:
    """The whole path once (router -> prefill -> ZeroMQ KV -> decode, completions API) on
    the Qwen3-MoE preset, with a tokenizer of its vocabulary beside it."""
    path = _checkpoint(root, "qwen3moe-norm-mlp-only")
    tb.build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tb.tokenizer_config(256)))
    prompt = _prompts(9)[0]
    want = hf_greedy(path, prompt, NEW_TOKENS)
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(path), "--port",
            str(port), "--grace-period", "5", "--max-total-tokens", "1024"]  # fmt: skip
    proc = spawn(argv, "moe-up")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], timeout_s=300.0)
        body = {"prompt": [prompt], "max_tokens": NEW_TOKENS, "temperature": 0,
                "logprobs": 1, "ignore_eos": True}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    finally:
        stop(proc)
    assert r.status_code == 200, r.text
    tok = Tokenizer(path)
    pieces = r.json()["choices"][0]["logprobs"]["tokens"]
    assert pieces == [tok.decode([t], skip_special_tokens=False) for t in want]


def _ours(path: Path) -> MoeModel:
    arch = load_arch(path)
    return MoeModel(arch, load_state(path, torch.float32, "cpu"), 64)


@pytest.mark.parametrize("case", ["qwen2moe-shared-step", "qwen3moe-norm-mlp-only"])
def test_each_mlp_equals_transformers_block(root: Path, case: str) -> None:
    """Each layer's MLP (sparse: routing, normalisation, experts, shared expert and its
    gate; dense where decoder_sparse_step / mlp_only_layers say) equals transformers'
    module on the same input, and the layers are sparse where transformers' are."""
    path = _checkpoint(root, case)
    ours, theirs = _ours(path), _hf_model(str(path))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(ours.layers):
        mlp = theirs.model.layers[i].mlp
        assert (layer.experts is not None) == hasattr(mlp, "experts"), i
        with torch.no_grad():
            want = mlp(x[None])[0]
        torch.testing.assert_close(ours._mlp(layer, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_routing_equals_transformers_router(norm: bool) -> None:
    """Softmax in float32, top k, and the renormalisation exactly where norm_topk_prob."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=norm)  # fmt: skip
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=g))
        x = torch.randn(6, 64, generator=g)
        logits, want_w, want_e = router(x)
    spec = arch_from_config(_moe_cfg("Qwen3MoeForCausalLM", norm_topk_prob=norm)).moe
    assert spec is not None and spec.norm_topk_prob == norm
    weights, chosen = route(logits, spec)
    assert torch.equal(chosen, want_e)
    assert torch.equal(weights, want_w)
    assert torch.allclose(weights.sum(-1), torch.ones(6)) == norm


def test_reads_only_routed_experts(root: Path) -> None:
    """Experts no token routes to are never read: NaN in their weights changes nothing."""
    model = _ours(_checkpoint(root, "mixtral-window"))
    layer = model.layers[0]
    e = layer.experts
    assert e is not None and model.arch.moe is not None
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    want = model._mlp(layer, x)
    _, chosen = route(e.router(x), model.arch.moe)
    unrouted = sorted(set(range(8)) - set(chosen.flatten().tolist()))
    assert len(unrouted) == 6
    poisoned = Experts(e.router, e.gate_up.clone(), e.down.clone(), None, None, None)
    poisoned.gate_up[unrouted] = float("nan")
    poisoned.down[unrouted] = float("nan")
    layer.experts = poisoned
    assert torch.equal(model._mlp(layer, x), want)


def _moe_cfg(arch: str, **fields: Any) -> dict[str, Any]:
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    return {"architectures": [arch], **small, **fields}


# name -> (architecture, config.json fields, the field the error must name)
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3moe-window": ("Qwen3MoeForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
    "qwen2moe-window": ("Qwen2MoeForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
    "top-k-past-experts": ("OlmoeForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    "mixtral-sparse-step": (
        "MixtralForCausalLM",
        {"decoder_sparse_step": 2},
        "decoder_sparse_step",
    ),
    "mixtral-no-norm": ("MixtralForCausalLM", {"norm_topk_prob": False}, "norm_topk_prob"),
    "qwen3moe-clip": ("Qwen3MoeForCausalLM", {"clip_qkv": 4.0}, "clip_qkv"),
    "qwen3moe-shared": (
        "Qwen3MoeForCausalLM",
        {"shared_expert_intermediate_size": 64},
        "shared_expert_intermediate_size",
    ),
    "olmoe-layer-types": (
        "OlmoeForCausalLM",
        {"layer_types": ["sliding_attention"] * 2},
        "layer_types",
    ),  # fmt: skip
    "expert-counts-differ": ("MixtralForCausalLM", {"num_local_experts": 4}, "num_local_experts"),
    "mixtral-bias": ("MixtralForCausalLM", {"attention_bias": True}, "attention_bias"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_naming_the_field(case: str) -> None:
    arch, fields, needle = REFUSED[case]
    with pytest.raises(UnsupportedConfig, match=f"`{needle}`"):
        arch_from_config(_moe_cfg(arch, **fields))


def test_moe_fields_refused_on_dense_families() -> None:
    cfg = _moe_cfg("LlamaForCausalLM")
    with pytest.raises(UnsupportedConfig, match="`num_experts`"):
        arch_from_config(cfg)
