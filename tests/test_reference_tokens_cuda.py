"""Greedy tokens on CUDA equal transformers' on the CPU (skipped without a GPU).

The same path as tests/test_reference_tokens.py with the engines on the GPU: the Triton
attention backend (chosen automatically on CUDA), CUDA forward and schedule streams,
and the FutureMap's Triton kernels compiled natively. The reference stays transformers
in fp32 on the CPU, so this also checks that nothing on the GPU path rounds through
TF32 (torch's matmuls default to full fp32; the attention kernel asks for "ieee").
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import assert_pools_free, hf_greedy, model_path
from tests.test_reference_tokens import NEW_TOKENS, _prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the engines run on the GPU"
)


@pytest.mark.parametrize(
    "preset,page_size,overlap,kernels",
    [
        ("tiny", 1, True, "triton"),
        ("tiny", 16, True, "triton"),
        ("tiny", 16, False, "triton"),
        ("tiny", 16, True, "torch"),
        ("tiny-qwen2", 16, True, "triton"),
        ("tiny-qwen3", 1, True, "triton"),
        ("tiny-llama3", 16, True, "triton"),
    ],
)
def test_greedy_on_cuda_matches_transformers(
    preset: str, page_size: int, overlap: bool, kernels: str
) -> None:
    path = model_path(preset)
    prompts = _prompts(4096, [1, 7, 33, 70, 5], seed=page_size)
    llm = LLM(
        path,
        device="cuda",
        page_size=page_size,
        max_running_requests=3,  # fewer rows than prompts: rows are reused
        max_prefill_tokens=48,  # the 70-token prompt is prefilled in two chunks
        max_total_tokens=2048,
        max_context=512,
        disable_overlap=not overlap,
        kernel_backend=kernels,
    )
    assert llm.decode.runner.device.startswith("cuda")
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
