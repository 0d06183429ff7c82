"""The compiled CPU decode attention (pdserve.model.decode_attention): it reads the KV
pool in place and gives what the eager gather gives, and an engine with it on produces
the same greedy tokens as transformers (and so as the eager path)."""

from __future__ import annotations

import torch

from pdserve.model import decode_attention as da
from pdserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy


def _case(b: int, length: int, kh: int = 2, h: int = 4, d: int = 16, slots: int = 256):
    g = torch.Generator().manual_seed(b * 1000 + length)
    kc = torch.randn(slots, kh, d, generator=g)
    vc = torch.randn(slots, kh, d, generator=g)
    q = torch.randn(b, h, d, generator=g)
    idx = torch.randint(1, slots, (b, length), generator=g)
    lens = torch.randint(1, length + 1, (b,), generator=g)
    lens[0] = length
    hidden = torch.arange(length)[None, :] >= lens[:, None]
    if lens[-1] > 1:
        hidden[-1, 0] = True  # a sliding window hides the oldest key
    return q, kc, vc, idx.masked_fill(hidden, 0), hidden


def test_in_place_matches_gather_eager_and_compiled() -> None:
    fn = da.compiled_in_place()
    with torch.inference_mode():
        for b, length in ((1, 2), (3, 5), (4, 40)):
            args = _case(b, length)
            want = da.gathered(*args, 0.25)
            torch.testing.assert_close(da.in_place(*args, 0.25), want)
            torch.testing.assert_close(fn(*args, 0.25), want)


def test_compiled_engine_greedy_tokens_match_transformers(monkeypatch, tiny_model) -> None:
    from pdserve.llm import LLM

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
    llm = LLM(str(tiny_model))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        attn = llm.decode.runner.attn
        assert getattr(attn, "_decode_fn", None) is da.compiled_in_place(), "not compiled"
    finally:
        llm.close()
    for p, out in zip(prompts, got, strict=True):
        assert out == hf_greedy(tiny_model, p, 12)


def test_a_failed_compile_leaves_decode_attention_eager(monkeypatch, tiny_model, caplog) -> None:
    """No C++ compiler (a slim image) must not keep the decode from starting: it logs
    and runs the eager gather."""
    from pdserve.config import EngineConfig
    from pdserve.model.runner import ModelRunner

    def broken(cache_dir=None):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(da, "compiled_in_place", broken)
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    runner = ModelRunner(EngineConfig(model_path=str(tiny_model), compile=True))
    assert runner.attn.compile_dir is not None  # compiling was asked for
    with caplog.at_level("WARNING"):
        runner.warm_up_decode()
    assert runner.attn._decode_fn is da.gathered
    assert "stays eager" in caplog.text and "InvalidCxxCompiler" in caplog.text
