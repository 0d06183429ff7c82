"""The offline `LLM` ends every request: a refusal on either side is an error result,
never a hang, and both engines end with every row and page free."""

from __future__ import annotations

import pytest

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.conftest import assert_pools_free, hf_greedy

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(tiny_model, max_total_tokens=64, max_context=4096)  # a context beyond the pool


def test_decode_refusal_is_an_error_result_not_a_hang(llm: LLM) -> None:
    prompt = list(range(5, 25))  # 20 tokens: the prefill holds them, the decode cannot
    [out] = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0))
    assert out.error and "KV pages" in out.error and not out.token_ids, out
    assert_pools_free(llm)


def test_prefill_refusal_is_an_error_result(llm: LLM) -> None:
    [out] = llm.generate([[5, 6, 7, 99999]], SamplingParams(max_tokens=2, temperature=0.0))
    assert out.error and "vocabulary" in out.error, out
    assert_pools_free(llm)


def test_refused_and_served_requests_in_one_batch(llm: LLM, tiny_model) -> None:  # type: ignore[no-untyped-def]
    good, bad = list(range(5, 15)), list(range(5, 25))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([good, bad, good], params)
    assert outs[0].token_ids == outs[2].token_ids == hf_greedy(tiny_model, good, 6)
    assert outs[1].token_ids == hf_greedy(tiny_model, bad, 6)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    outs = llm.generate([bad, good], long)
    assert all(o.error for o in outs), outs  # both need more pages than the pool has
    assert_pools_free(llm)
