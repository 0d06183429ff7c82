"""Greedy tokens on CUDA equal transformers' on the CPU (skipped without a GPU).

The same path as tests/test_reference_tokens.py with the engines on the GPU: the Triton
attention backend (chosen automatically on CUDA), CUDA forward and schedule streams,
and the FutureMap's Triton kernels compiled natively. The reference stays transformers
in fp32 on the CPU, so this also checks that nothing on the GPU path rounds through
TF32 (torch's matmuls default to full fp32; the attention kernel asks for "ieee").
bfloat16 is checked against transformers in bf16 on the same GPU, to bf16's precision
(the bound of tests/test_bf16_tokens.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_bf16_tokens import check_bf16
from tests.test_reference_tokens import check_greedy

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
    check_greedy(preset, page_size, overlap, kernels, device="cuda")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-llama3"])
def test_bf16_greedy_on_cuda_agrees_with_transformers_bf16(preset: str) -> None:
    """bfloat16 on the GPU (Triton attention, CUDA graphs) against transformers in bf16 on
    the same GPU, to bf16's precision (tests/test_bf16_tokens.py)."""
    check_bf16(preset, "cuda", "triton")
