"""Greedy tokens through prefill -> handoff -> overlap decode equal transformers'."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from tests.conftest import assert_pools_free, hf_greedy, model_path

NEW_TOKENS = 32


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(
    "preset,page_size,overlap,kernels",
    [
        ("tiny", 1, True, "torch"),
        ("tiny", 16, True, "torch"),
        ("tiny", 16, False, "torch"),
        ("tiny", 16, True, "triton"),  # FutureMap kernels under the Triton interpreter on CPU
        ("tiny-qwen2", 16, True, "torch"),
        ("tiny-qwen3", 1, True, "torch"),
        ("tiny-llama3", 16, True, "torch"),
    ],
)
def test_greedy_matches_transformers(
    preset: str, page_size: int, overlap: bool, kernels: str
) -> None:
    check_greedy(preset, page_size, overlap, kernels, device="cpu")


def check_greedy(preset: str, page_size: int, overlap: bool, kernels: str, device: str) -> None:
    """Five prompts (one prefilled in two chunks) through fewer rows than prompts: each
    request's greedy tokens equal transformers' (on the CPU, fp32); pools end free."""
    path = model_path(preset)
    prompts = _prompts(4096, [1, 7, 33, 70, 5], seed=page_size)
    llm = LLM(
        path,
        device=device,
        page_size=page_size,
        max_running_requests=3,  # fewer rows than prompts: rows are reused
        max_prefill_tokens=48,  # the 70-token prompt is prefilled in two chunks
        max_total_tokens=2048,
        max_context=512,
        disable_overlap=not overlap,
        kernel_backend=kernels,
    )
    assert llm.decode.runner.device == device
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS), (
            f"prompt of {len(prompt)} tokens"
        )
    assert_pools_free(llm)
    llm.close()


def test_text_prompts_and_eos_stop(tiny_model) -> None:
    llm = LLM(tiny_model, max_total_tokens=1024, max_context=256)
    outs = llm.generate(
        ["Hello, world!", "Ünïcödé ✓ 你好"], SamplingParams(max_tokens=8, temperature=0)
    )
    for out in outs:
        assert 1 <= len(out.token_ids) <= 8
        assert out.finish_reason in ("length", "stop")
        assert isinstance(out.text, str)
    assert_pools_free(llm)
    llm.close()


def test_invalid_requests_end_with_an_error(tiny_model) -> None:
    llm = LLM(tiny_model, max_total_tokens=1024, max_context=64)
    outs = llm.generate([[5] * 60, [5, 6]], SamplingParams(max_tokens=10, temperature=0))
    assert outs[0].error is not None and "context length" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 10
    assert_pools_free(llm)
    llm.close()
