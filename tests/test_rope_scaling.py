"""Rope scaling (yarn, dynamic, longrope) equals transformers past the original context.

Two levels: the cos/sin tables against transformers' own rotary modules, called one
position at a time as generate calls them (so its per-forward switches, longrope's short
to long and dynamic's growing base, happen as in serving), bit for bit; and greedy
tokens of checkpoints made by transformers, served by the engine pair: a prompt inside
the original context whose generation runs past it, and a prompt longer than it (which
transformers turns wholly by its length's frequencies).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.arch.registry import arch_from_config
from pdserve.model.layers.rope import RotaryEmbedding
from tests.conftest import _hf_model, assert_pools_free, greedy_of, hf_greedy
from tests.test_config_conformance import BASE, VOCAB, make_checkpoint

ORIGINAL = 32  # the original context of every preset here
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# transformers' Phi3Config and Llama take longrope factors as one list per rotated pair
LONG = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 1.0, 1.2, 1.1, 1.0, 1.3],
        "long_factor": [3.0, 5.0, 9.0, 4.0, 2.0, 8.0, 16.0, 6.0]}  # fmt: skip


def _hf_tables(cfg: Any, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (cos, sin) at 0 .. positions-1, each from a forward at that one
    position (generate's decode steps), after a first forward over 0 .. 7 (a prompt)."""
    import transformers

    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, torch.arange(8)[None])
    rows = [(cos[0], sin[0])]
    for p in range(8, positions):
        c, s = rope(x, torch.tensor([[p]]))
        rows.append((c[0], s[0]))
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


# name -> rope_parameters of a Llama config with max_position_embeddings = ORIGINAL
TABLES: dict[str, dict[str, Any]] = {
    "yarn": YARN,
    "yarn-mscale-all-dim": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.7, "truncate": False},
    "longrope": {**LONG, "original_max_position_embeddings": ORIGINAL, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


@pytest.mark.parametrize("case", list(TABLES))
def test_tables_equal_transformers(case: str) -> None:
    """Each table equals transformers' at every position up to 4x the original context:
    yarn's attention factor (mscale) scales cos and sin, longrope switches factors at
    the original context, dynamic grows its base per position past it."""
    import transformers

    params = {"rope_theta": 500.0, **TABLES[case]}
    kw = {**BASE, "head_dim": 16, "max_position_embeddings": ORIGINAL, "rope_parameters": params}
    cfg = transformers.LlamaConfig(**kw)
    arch = arch_from_config({"architectures": ["LlamaForCausalLM"], **cfg.to_dict()})
    positions = 4 * ORIGINAL
    ours = RotaryEmbedding(16, positions, arch.rope_theta, arch.rope_scaling, torch.float32, "cpu")
    cos, sin = _hf_tables(cfg, positions)
    assert torch.equal(ours.cos, cos)
    assert torch.equal(ours.sin_signed[:, 8:], sin[:, 8:])  # the second half is sin itself
    assert torch.equal(ours.sin_signed[:, :8], -sin[:, :8])
    if case != "dynamic":  # what each scaling changes is visible past the original context
        unscaled = RotaryEmbedding(16, positions, 500.0, None, torch.float32, "cpu")
        assert not torch.allclose(ours.cos[ORIGINAL:], unscaled.cos[ORIGINAL:], atol=1e-3)


def test_yarn_mscale_is_applied() -> None:
    """The attention factor 0.1 ln(4) + 1 multiplies the tables: position 0's cos is it."""
    arch = arch_from_config({"architectures": ["LlamaForCausalLM"], **BASE,
                             "rope_parameters": {"rope_theta": 100.0, **YARN}})  # fmt: skip
    rope = RotaryEmbedding(16, 4, arch.rope_theta, arch.rope_scaling, torch.float32, "cpu")
    assert rope.cos[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def _serve(
    path: Path, prompts: list[list[int]], new_tokens: int, one_by_one: bool = False, **kw: Any
) -> list[list[int]]:
    llm = LLM(path, page_size=4, max_running_requests=2, max_total_tokens=1024, max_context=128,
              **kw)  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        if one_by_one:  # each prompt after the one before has ended (and left its prefix)
            outs = [o for p in prompts for o in llm.generate([p], params)]
        else:
            outs = llm.generate(prompts, params)
        assert_pools_free(llm)
    finally:
        llm.close()
    return [o.token_ids for o in outs]


# name -> (family, config kwargs); prompts of 20 and 40 tokens, 16 new: past ORIGINAL
SERVED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-yarn": ("Qwen2", dict(rope_parameters={"rope_theta": 100.0, **YARN})),
    "llama-longrope": (
        "Llama",
        dict(
            max_position_embeddings=4 * ORIGINAL,
            rope_parameters={
                "rope_theta": 100.0,
                "original_max_position_embeddings": ORIGINAL,
                **LONG,
            },
        ),
    ),  # fmt: skip
    "llama-dynamic": (
        "Llama",
        dict(
            max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_theta": 100.0, "rope_type": "dynamic", "factor": 4.0},
        ),
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rope_scaling")


@pytest.mark.parametrize("case", list(SERVED))
def test_served_like_transformers_past_the_original_context(root: Path, case: str) -> None:
    family, kw = SERVED[case]
    path = make_checkpoint(root, case, family, **kw)
    g = torch.Generator().manual_seed(len(case))
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 40)]
    want = [hf_greedy(path, p, 16) for p in prompts]
    assert _serve(path, prompts, 16) == want


@pytest.mark.parametrize("case", ["llama-longrope", "llama-dynamic"])
def test_long_prompt_chunked_or_on_a_cached_prefix_is_turned_whole(root: Path, case: str) -> None:
    """transformers turns every position of a prompt past the switch by that prompt's
    length: so must a prompt prefilled in chunks (8 tokens a step here), and one whose
    first tokens another, shorter prompt left in the prefix cache (turned by the
    default vector: the long prompt must not reuse them)."""
    family, kw = SERVED[case]
    path = make_checkpoint(root, case, family, **kw)
    g = torch.Generator().manual_seed(7)
    long = torch.randint(3, VOCAB, (48,), generator=g).tolist()
    # a model of its own: transformers' dynamic rope keeps the frequencies of the longest
    # sequence the model object has run, so the shared one depends on the tests before
    want = greedy_of(_hf_model.__wrapped__(str(path)), long, 8)
    assert _serve(path, [long], 8, max_prefill_tokens=8) == [want]
    short = long[:24]  # within the switch: its KV is cached, page by page
    outs = _serve(path, [short, long], 8, one_by_one=True)
    assert outs == [hf_greedy(path, short, 8), want]
