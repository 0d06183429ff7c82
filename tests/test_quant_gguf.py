"""--weights quantized: a GGUF's projections computed from the file's blocks give
transformers' greedy tokens, per type with a kernel (a small Llama GGUF of random blocks,
Q/K rows permuted as llama.cpp stores them); what has no kernel stays float32 by name;
--weights float32 and a Hugging Face folder hold no blocks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gguf_files import hf_greedy_gguf, write_random_gguf

from pdserve.kernels.native.linear_quant import TYPES
from pdserve.llm import LLM
from pdserve.model.weights import resident_bytes
from pdserve.sampling_params import SamplingParams

PROMPTS = [[5, 300, 17, 88, 410, 9], list(range(40, 71))]
NEW = 8
KERNEL_TYPES = sorted(name for name, _, _ in TYPES.values())


def _llm(path: Path, weights: str) -> LLM:
    return LLM(str(path), page_size=4, max_total_tokens=512, max_context=128, weights=weights)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_quantized_greedy_tokens_equal_transformers(tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / f"r-{qtype}.gguf", qtype)
    llm = _llm(path, "quantized")
    try:
        model = llm.prefill.runner.model
        assert all(lin.quant is not None for lin in model.linears())
        assert model.embed_quant is not None
        assert llm.decode.runner.native_forward is not None  # decode steps: one native call
        # the blocks are the file's: the weights held are about the file's size
        assert resident_bytes(model) <= 1.2 * path.stat().st_size
        ours = _greedy(llm)
    finally:
        llm.close()
    for p, out in zip(PROMPTS, ours):
        assert out == hf_greedy_gguf(path, p, NEW), (qtype, p)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_per_call_decode_gives_the_native_forwards_tokens(tmp_path, monkeypatch, qtype):
    """The decode's one native call and the per-call path (model/layers/linear.py) run the same
    kernel on the same blocks."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / f"r-{qtype}.gguf", qtype)
    runs = []
    for per_call in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PER_CALL_DECODE", per_call)
        llm = _llm(path, "quantized")
        try:
            assert (llm.decode.runner.native_forward is None) == (per_call == "1")
            params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True)
            runs.append([(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)])
        finally:
            llm.close()
    assert runs[0] == runs[1]


def test_float32_weights_hold_no_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / "r-Q8_0.gguf", "Q8_0")
    llm = _llm(path, "float32")
    try:
        model = llm.prefill.runner.model
        assert all(lin.quant is None for lin in model.linears())
        assert model.embed_quant is None
        assert resident_bytes(model) > 3 * path.stat().st_size  # float32 of 8.5-bit blocks
    finally:
        llm.close()


def test_type_without_kernel_stays_float32_by_name(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / "r-IQ3_S.gguf", "IQ3_S")
    with caplog.at_level(logging.INFO, logger="pdserve.model.quant_weights"):
        llm = _llm(path, "quantized")
    try:
        assert all(lin.quant is None for lin in llm.prefill.runner.model.linears())
        ours = _greedy(llm)
    finally:
        llm.close()
    assert "tensor model.layers.0.mlp.down_proj.weight stays float32: IQ3_S has no kernel" in (
        caplog.text
    )
    for p, out in zip(PROMPTS, ours):
        assert out == hf_greedy_gguf(path, p, NEW), p


def test_hugging_face_folder_holds_no_blocks():
    llm = LLM("tiny", max_total_tokens=256)  # quantized is the default: it has no GGUF
    try:
        assert all(lin.quant is None for lin in llm.prefill.runner.model.linears())
    finally:
        llm.close()
