"""Every GGUF tensor type the `gguf` package de-quantizes is served exactly as transformers
loads it: a small Llama GGUF of random blocks per type converts to the very float32
weights transformers computes from the same file (bit for bit, Q/K rows un-permuted,
de-quantized in uneven row slabs), and a few types give transformers' greedy tokens
through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import hf_greedy_gguf, write_llama_gguf, write_random_gguf
from safetensors.torch import load_file

from pdserve.checkpoints.gguf import convert as gguf_convert
from pdserve.checkpoints.gguf import tensors as gguf_tensors
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

# The types named in the project's model list; the installed gguf may read more.
NAMED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ4_NL", "IQ4_XS"]  # fmt: skip
TYPES = gguf_tensors.dequantizable_types()
PROMPTS = [[5, 300, 17, 88, 410, 9], list(range(40, 71))]
NEW = 8


def test_every_named_type_is_readable():
    assert set(NAMED) <= set(TYPES), set(NAMED) - set(TYPES)


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return m.state_dict()


@pytest.mark.parametrize("qtype", TYPES)
def test_weights_equal_transformers_bit_for_bit(tmp_path, monkeypatch, qtype):
    # 7 rows of 256 per slab: tensors end in a short slab, as large ones do
    monkeypatch.setattr(gguf_tensors, "SLAB_FLOATS", 7 * 256)
    path = write_random_gguf(tmp_path / f"r-{qtype}.gguf", qtype)
    ours = load_file(str(gguf_convert.convert(path, tmp_path / "out") / "model.safetensors"))
    theirs = _hf_state(path)
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        assert w.dtype == torch.float32 and torch.isfinite(w).all(), name
        assert torch.equal(w, theirs[name]), (qtype, name)
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"][:2],
                           ours["model.layers.0.self_attn.k_proj.weight"][:2])  # fmt: skip


def _greedy(path: Path) -> list[list[int]]:
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        return [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_quantized_llama_greedy_tokens_equal_transformers(tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / f"m-{qtype}.gguf", qtype)
    for p, out in zip(PROMPTS, _greedy(path)):
        assert out == hf_greedy_gguf(path, p, NEW), (qtype, p)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_random_block_greedy_tokens_equal_transformers(tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / f"r-{qtype}.gguf", qtype)
    for p, out in zip(PROMPTS, _greedy(path)):
        assert out == hf_greedy_gguf(path, p, NEW), (qtype, p)
