"""Phi-3 (`Phi3ForCausalLM`: fused qkv_proj and gate_up_proj, partial rotary, longrope)
served like transformers, or refused naming the field.

Checkpoints are made by transformers itself. The longrope preset's original context is
32 positions: a prompt of 10 tokens and its 16 greedy tokens stay inside it (short
factors), a prompt of 40 runs past it (long factors on every position, as transformers
turns a sequence longer than the original context). Phi3ForCausalLM.generate recomputes
its whole cache with the long factors when a generation crosses the original context;
the decode rebuilds the request's keys at that step as well (scheduler/rekey.py):
prompts of 16 to 32 tokens cross it while decoding, with and without n-gram speculation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import SpeculativeConfig
from pdserve.model.arch.registry import arch_from_config
from pdserve.model.arch.rules import UnsupportedConfig
from tests.conftest import assert_pools_free, hf_greedy
from tests.test_config_conformance import VOCAB, make_checkpoint

ORIGINAL = 32
HALF = 8  # rotated pairs of a 32-wide head at partial_rotary_factor 0.5
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 100.0,
    "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
    "long_factor": [2.0 + 3.0 * i for i in range(HALF)],
}
# name -> config kwargs (head_dim 32 = hidden 64 / 2 heads; kv heads 1)
SERVED: dict[str, dict[str, Any]] = {
    "longrope-partial-window-tied": dict(
        partial_rotary_factor=0.5,
        original_max_position_embeddings=ORIGINAL,
        max_position_embeddings=4 * ORIGINAL,
        rope_parameters=LONGROPE,
        sliding_window=9,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("phi3")


def _make(root: Path, case: str) -> Path:
    kw = dict(num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, **SERVED[case])
    return make_checkpoint(root, case, "Phi3", **kw)


def _serve(
    path: Path, prompts: list[list[int]], new_tokens: int, spec: bool = False
) -> tuple[list[list[int]], dict[str, float]]:
    """Greedy tokens of `prompts` served in one batch, and the decode's stats."""
    n = len(prompts)
    ngram = SpeculativeConfig("ngram", k=4, max_batch=n) if spec else None
    llm = LLM(path, page_size=4, max_running_requests=n, max_total_tokens=1024, max_context=128,
              speculative=ngram)  # fmt: skip
    try:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        )
        assert_pools_free(llm)
        stats = llm.stats()["decode"]
    finally:
        llm.close()
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("case", list(SERVED))
def test_served_like_transformers(root: Path, case: str) -> None:
    path = _make(root, case)
    g = torch.Generator().manual_seed(len(case))
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (10, 40)]
    want = [hf_greedy(path, p, 16) for p in prompts]
    assert any(len(set(w)) > 2 for w in want), want
    assert _serve(path, prompts, 16)[0] == want


def _crossing_prompts() -> list[list[int]]:
    """Prompts whose generations cross the original context while decoding: 20 tokens
    at its 13th step, 32 at its first; and two whose greedy tokens repeat spans before
    the switch, so n-gram drafts accepted there would carry them past it in one step."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 31, 32)]
    repeating = [
        torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        for seed, n in ((7, 20), (18, 16))
    ]
    return [prompts[0], prompts[2], *repeating]


@pytest.mark.parametrize("spec", [False, True], ids=["one-token-steps", "ngram"])
def test_generation_crossing_the_original_context_equals_transformers(
    root: Path, spec: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' generate runs the whole sequence again with the long factors at the
    step that first passes the original context; without the decode's rekey the tokens
    after that step differ. With speculation, requests step one token at a time up to
    the switch (rekey.short_keys): without that rule a verifying step accepts drafts
    across it, its request is never rekeyed, and the repeating prompts' tokens differ."""
    from pdserve.scheduler import spec_step

    spans: list[tuple[int, int]] = []  # (first, last) position of each verified request
    verify = spec_step.speculate

    def spy(eng: Any, batch: list[Any], proposal: Any) -> None:
        before = [r.prompt_len + r.launched_steps for r in batch]
        verify(eng, batch, proposal)
        spans.extend((b, r.prompt_len + r.launched_steps - 1) for r, b in zip(batch, before))

    monkeypatch.setattr(spec_step, "speculate", spy)
    path = _make(root, "longrope-partial-window-tied")
    prompts = _crossing_prompts()
    want = [hf_greedy(path, p, 24) for p in prompts]
    assert all(len(set(w)) > 2 for w in want), want
    got, stats = _serve(path, prompts, 24, spec)
    assert got == want
    if spec:  # drafts were taken, and no verifying step ran across the switch
        assert stats["spec_accepted_tokens"] > 0 and spans, stats
        assert not any(first < ORIGINAL <= last for first, last in spans), spans


def test_longrope_switches_at_the_original_context() -> None:
    """Past the original context the long factors turn the rotated pairs (the short
    ones before it); the attention factor sqrt(1 + ln 4 / ln 32) scales both."""
    from pdserve.model.layers.rope import RotaryEmbedding

    arch = arch_from_config(_cfg(**SERVED["longrope-partial-window-tied"]))
    assert arch.rotary_dim == 16 and arch.rope_scaling is not None
    rope = RotaryEmbedding(32, 64, arch.rope_theta, arch.rope_scaling, torch.float32, "cpu", 16)
    factor = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(32.0))).sqrt()
    inv = 1.0 / (100.0 ** (torch.arange(0, 16, 2).float() / 16))
    for p, factors in (
        (ORIGINAL - 1, LONGROPE["short_factor"]),
        (ORIGINAL, LONGROPE["long_factor"]),
    ):
        want = torch.cos(p * inv / torch.tensor(factors)) * factor
        torch.testing.assert_close(rope.cos[p, :HALF], want)


def _cfg(**fields: Any) -> dict[str, Any]:
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return {"architectures": ["Phi3ForCausalLM"], **small, **fields}


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "linear-rope": (
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "rope_parameters.rope_type",
    ),
    "short-factor-length": (
        {"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 3}},
        "rope_parameters.short_factor",
    ),
    "odd-rotary": ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    "experts": ({"num_local_experts": 4}, "num_local_experts"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_naming_the_field(case: str) -> None:
    fields, needle = REFUSED[case]
    with pytest.raises(UnsupportedConfig, match=f"`{needle}`"):
        arch_from_config(_cfg(**fields))
