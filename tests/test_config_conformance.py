"""A checkpoint's config is a contract: each field that changes the computation is
served exactly like transformers or refused at load, naming the field.

Every checkpoint here is made by transformers itself (its config class, its model
class, `save_pretrained`), so the config.json layout is the one transformers 5
writes; a few cases then rewrite config.json into an older or foreign layout.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import assert_pools_free, hf_greedy

VOCAB = 512
NEW_TOKENS = 8
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' tiny init, so that logits have clear top-1 gaps
    and every tensor (norms, biases) visibly matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                std = 1.0 if "embed" in name else 1.5 / p.shape[1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_checkpoint(
    root: Path, name: str, family: str, edit: Callable[[dict[str, Any]], None] | None = None, **kw
) -> Path:
    """A random checkpoint saved by transformers; `edit` then rewrites its config.json."""
    import transformers

    cls = getattr(transformers, f"{family}Config")
    cfg = cls(**{**BASE, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model, seed=len(name))
    path = root / name
    model.save_pretrained(path)
    if edit is not None:
        data = json.loads((path / "config.json").read_text())
        edit(data)
        (path / "config.json").write_text(json.dumps(data))
    return path


def _old_rope_layout(scaling: dict[str, Any] | None, theta: float):
    """transformers 4 wrote `rope_theta` at the top and the scaling as `rope_scaling`."""

    def edit(cfg: dict[str, Any]) -> None:
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = scaling

    return edit


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (family, config kwargs, config.json edit); every one served like transformers
SERVED: dict[str, tuple[str, dict[str, Any], Any]] = {
    # transformers-5 layout: rope_theta inside rope_parameters with rope_type "default"
    "llama-theta-tied": (
        "Llama",
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 100.0}, tie_word_embeddings=True
        ),
        None,
    ),
    "llama-old-linear": ("Llama", {}, _old_rope_layout({"type": "linear", "factor": 4.0}, 50.0)),
    "llama-llama3": ("Llama", dict(rope_parameters=LLAMA3), None),
    # biases on q/k/v/o and the MLP, another activation, head_dim != hidden / heads
    "llama-bias-gelu-headdim": (
        "Llama",
        dict(attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh", head_dim=24),
        None,
    ),
    "mistral-window": ("Mistral", dict(sliding_window=7, head_dim=16), None),
    # layer 1 slides (max_window_layers=1), layer 0 is full
    "qwen2-window": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        None,
    ),
    # explicit layer_types (first layer slides), q/k/v/o bias
    "qwen3-layer-types": (
        "Qwen3",
        dict(
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            attention_bias=True,
            head_dim=16,
            hidden_act="relu",
        ),
        None,
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 41 and 70 tokens: longer than every window; 70 is prefilled in two chunks
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (41, 3, 70)]


@pytest.mark.parametrize("case", list(SERVED))
def test_served_like_transformers(root: Path, case: str) -> None:
    family, kw, edit = SERVED[case]
    path = make_checkpoint(root, case, family, edit, **kw)
    prompts = _prompts(len(case))
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    for page_size, overlap in ((1, True), (16, False)):
        llm = LLM(
            path,
            page_size=page_size,
            max_running_requests=2,
            max_prefill_tokens=48,
            max_total_tokens=1024,
            max_context=256,
            disable_overlap=not overlap,
        )
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        )
        got = [o.token_ids for o in outs]
        assert got == want, f"{case}: page_size={page_size} overlap={overlap}"
        assert_pools_free(llm)
        llm.close()


def test_triton_backend_honours_the_windows(root: Path) -> None:
    """The Triton kernels (interpreted on CPU) serve the Qwen2 sliding layer like
    transformers: a chunked prefill over a prefix, then decode steps past the window."""
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.model.runner import ModelRunner
    from tests.test_triton_attention import _greedy

    family, kw, edit = SERVED["qwen2-window"]
    path = make_checkpoint(root, "qwen2-window-triton", family, edit, **kw)
    cache = CacheConfig(page_size=4, max_total_tokens=64, max_context=32)
    runner = ModelRunner(EngineConfig(str(path), attention_backend="triton", cache=cache))
    assert runner.arch.layer_windows == (0, 6)
    prompt = _prompts(1)[0][:14]
    assert _greedy(runner, prompt, 5) == hf_greedy(path, prompt, 5)
