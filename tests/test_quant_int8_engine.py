"""--quant-activations int8 through the engine: the decode's one native call and the
per-call path quantize x the same way (same tokens, same logprobs), the flag changes what
is computed (the logprobs differ from the float path's), and where no GGUF blocks serve it
is refused by name. Its arithmetic is checked in tests/test_quant_int8.py; its token
agreement with the float path on real models is measured, not asserted
(benchmarks/int8_agreement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import write_random_gguf

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

PROMPTS = [[5, 300, 17, 88, 410, 9], list(range(40, 71))]
NEW = 6


def _run(path: Path, acts: str) -> list[tuple[list[int], object]]:
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128, quant_activations=acts)
    try:
        forward = llm.decode.runner.native_forward
        if forward is not None:
            assert bool(forward.plan.quant_x8) == (acts == "int8")
        assert all(
            lin.quant[0].int8 == (acts == "int8") for lin in llm.prefill.runner.model.linears()
        )
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True)
        return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


def test_native_and_per_call_decode_agree_and_differ_from_float(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / "r-Q4_K.gguf", "Q4_K")
    runs = {}
    for per_call in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PER_CALL_DECODE", per_call)
        runs[per_call] = _run(path, "int8")
    assert runs["0"] == runs["1"]
    monkeypatch.setenv("PDSERVE_PER_CALL_DECODE", "0")
    assert _run(path, "float") != runs["0"]  # the flag reaches the kernels


def test_refused_where_no_blocks_serve(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--quant-activations int8"):
        LLM("tiny", max_total_tokens=256, quant_activations="int8")  # a folder: no GGUF
    path = write_random_gguf(tmp_path / "r-Q8_0.gguf", "Q8_0")
    with pytest.raises(ValueError, match="--quant-activations int8.*--weights float32"):
        LLM(str(path), max_total_tokens=256, weights="float32", quant_activations="int8")
    with pytest.raises(ValueError, match="quant_activations"):
        LLM(str(path), max_total_tokens=256, quant_activations="int4")


def test_a_type_without_integer_kernel_keeps_float_x(tmp_path, monkeypatch):
    """Q3_K has no integer kernel: with int8 asked, a file of Q3_K blocks computes the
    float path's values (x's codes are made and left unread), native forward included."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PDSERVE_PER_CALL_DECODE", "0")
    path = write_random_gguf(tmp_path / "r-Q3_K.gguf", "Q3_K")
    assert _run(path, "int8") == _run(path, "float")
