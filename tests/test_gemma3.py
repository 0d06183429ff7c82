"""Gemma 3 (`Gemma3ForCausalLM`) served like transformers, or refused naming the field.

Every checkpoint is made by transformers itself (Gemma3TextConfig, its model class,
`save_pretrained`), with weights re-drawn so that every tensor matters; a few cases then
rewrite config.json into the older layout (top-level rope_theta, rope_local_base_freq,
rope_scaling) or leave layer_types out. Prompts of 41 and 70 tokens run past every
window here (70 is prefilled in two chunks), so the sliding layers attend to fewer keys
than the full ones in prefill and in decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.native.library import compiler
from pdserve.model.attention.backends import NativeAttention
from tests.conftest import assert_pools_free, hf_greedy
from tests.test_config_conformance import BASE, _prompts

NEW_TOKENS = 8
S, F = "sliding_attention", "full_attention"


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Norm weights around 0 (Gemma scales by 1 + weight), embeddings at 1/sqrt(hidden)
    (the model multiplies them by sqrt(hidden)), projections large enough that each
    sublayer moves the residual: greedy tokens then differ from step to step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[1] ** 0.5)


def make_gemma3(root: Path, name: str, edit: dict[str, Any] | None = None, **kw) -> Path:
    """A random Gemma 3 saved by transformers; `edit`: config.json keys then set (a None
    value deletes the key)."""
    import transformers

    base = {**BASE, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 6}
    cfg = transformers.Gemma3TextConfig(**{**base, "tie_word_embeddings": False, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model, seed=len(name))
    path = root / name
    model.save_pretrained(path)
    if edit:
        data = json.loads((path / "config.json").read_text())
        for key, value in edit.items():
            data.pop(key) if value is None else data.__setitem__(key, value)
        (path / "config.json").write_text(json.dumps(data))
    return path


MIXED = [S, F, S]
# name -> (Gemma3TextConfig kwargs, config.json edit); each served like transformers
SERVED: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # head_dim 32 != 64 / 4, query_pre_attn_scalar != head_dim, a rope per layer type
    "mixed-layers": (
        dict(
            layer_types=MIXED,
            query_pre_attn_scalar=24,
            rope_parameters={
                F: {"rope_type": "default", "rope_theta": 1000.0},
                S: {"rope_type": "default", "rope_theta": 50.0},
            },
        ),  # fmt: skip
        None,
    ),
    # transformers 4's layout: the full layers' rope_theta and linear rope_scaling at the
    # top, the sliding layers' theta as rope_local_base_freq; q/k/v/o biases
    "old-rope-layout-bias": (
        dict(layer_types=MIXED, attention_bias=True),
        {
            "rope_parameters": None,
            "rope_theta": 300.0,
            "rope_local_base_freq": 20.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),  # fmt: skip
    # no layer_types: every sliding_window_pattern-th layer is full;
    # soft-capped logits (the cap leaves the argmax; test_softcapped_logprobs shows it)
    "pattern-tied-softcap": (
        dict(final_logit_softcapping=2.0, sliding_window=9),
        {"layer_types": None, "sliding_window_pattern": 2, "_sliding_window_pattern": None},
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3")


def _serve(
    path: Path, prompts: list[list[int]], page_size: int, overlap: bool, native: bool = True
) -> list[list[int]]:
    """Greedy tokens from the offline engine pair; `native`: the CPU attention kernels
    (kernels/native/paged_decode.c, for decode and extend) are on, where a compiler is."""
    llm = LLM(
        path,
        page_size=page_size,
        max_running_requests=2,
        max_prefill_tokens=48,
        max_total_tokens=1024,
        max_context=256,
        disable_overlap=not overlap,
    )
    try:
        for runner in (llm.prefill.runner, llm.decode.runner):
            assert isinstance(runner.attn, NativeAttention) == (native and compiler() is not None)
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        )
        assert_pools_free(llm)
    finally:
        llm.close()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("case", list(SERVED))
def test_served_like_transformers(root: Path, case: str) -> None:
    kw, edit = SERVED[case]
    path = make_gemma3(root, case, edit, **kw)
    prompts = _prompts(len(case))
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert any(len(set(w)) > 2 for w in want), want  # the model is not stuck on one token
    for page_size, overlap in ((1, True), (16, False)):
        got = _serve(path, prompts, page_size, overlap)
        assert got == want, f"{case}: page_size={page_size} overlap={overlap}"


def test_portable_kernels_serve_it_too(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native CPU kernels off: torch's fused attention for prefill and the
    gathered decode attention, each with the layer's window."""
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "1")
    kw, edit = SERVED["mixed-layers"]
    path = make_gemma3(root, "mixed-portable", edit, **kw)
    prompts = _prompts(5)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert _serve(path, prompts, 16, True, native=False) == want


def test_triton_backend_honours_the_layer_windows(root: Path) -> None:
    """The Triton kernels (interpreted on CPU): a chunked prefill over a prefix, then
    decode steps past the window, each layer with its window, rope and scale."""
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.model.runner import ModelRunner
    from tests.test_triton_attention import _greedy

    kw, edit = SERVED["mixed-layers"]
    path = make_gemma3(root, "mixed-triton", edit, **kw)
    cache = CacheConfig(page_size=4, max_total_tokens=64, max_context=32)
    runner = ModelRunner(EngineConfig(str(path), attention_backend="triton", cache=cache))
    assert runner.arch.layer_windows == (6, 0, 6)
    prompt = _prompts(1)[0][:14]
    assert _greedy(runner, prompt, 5) == hf_greedy(path, prompt, 5)


def test_bfloat16_to_its_own_precision(root: Path) -> None:
    """bfloat16 served against transformers in bfloat16, as tests/test_bf16_tokens.py
    scores it: each token pdserve picks is within a few bf16 ULPs of transformers' best
    logit when transformers re-reads the prompt and pdserve's tokens."""
    import transformers

    from tests.test_bf16_tokens import score

    kw, edit = SERVED["mixed-layers"]
    path = make_gemma3(root, "mixed-bf16", edit, **kw)
    prompts = _prompts(11)
    llm = LLM(path, dtype="bfloat16", max_total_tokens=1024, max_context=256)
    try:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        )
    finally:
        llm.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    agree = steps = 0
    for prompt, out in zip(prompts, outs):
        regrets, allowed, hits = score(hf, prompt, out.token_ids)
        assert all(r <= a for r, a in zip(regrets, allowed)), (regrets, allowed)
        agree, steps = agree + hits, steps + len(regrets)
    assert agree >= 0.85 * steps, (agree, steps)


def test_softcapped_logprobs(root: Path) -> None:
    """final_logit_softcapping, with the head tied to the embedding: the logprobs of the
    greedy tokens are transformers' of the capped logits (uncapped, these logits span far
    more than the cap's +-2). Logprobs, not only tokens: the cap keeps the argmax, and a
    tied random model repeats its tokens."""
    import transformers

    kw = dict(layer_types=MIXED, final_logit_softcapping=2.0, tie_word_embeddings=True)
    path = make_gemma3(root, "softcap", None, **kw)
    prompt = _prompts(3)[0]
    llm = LLM(path, max_total_tokens=1024, max_context=256)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
        out = llm.generate([prompt], params)[0]
    finally:
        llm.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert float(logits.abs().max()) <= 2.0
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-4)
    assert out.token_ids == hf_greedy(path, prompt, 6)
