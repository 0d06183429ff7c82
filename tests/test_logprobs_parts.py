"""The parts of logprobs, without a model: the sampler's top k, the prefill's prompt rows,
the packed prompt logprobs and their checks, and the OpenAI shapes (the whole path on
SmolLM2 is tests/test_openai_logprobs.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.model.sampling.pick import logprobs_of, sample
from pdserve.protocol import PrefillLogprobs, PromptLogprobs, TopLogprobs
from pdserve.sampling_params import SamplingParams, prompt_logprobs_problem
from pdserve.scheduler import prompt_logprobs
from pdserve.scheduler.admission import carried_problem
from pdserve.scheduler.request import Req
from pdserve.server.openai_logprobs import chat_logprobs, completion_logprobs


def test_top_logprobs_are_the_log_softmax_top_k() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=g) * 4
    params = [SamplingParams(top_logprobs=4), SamplingParams(), SamplingParams(top_logprobs=2)]
    tokens = torch.tensor([7, 8, 9])
    lp = logprobs_of(logits, tokens, params)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp.chosen, ref[torch.arange(3), tokens])
    assert lp.top_values is not None and lp.top_ids is not None
    want = ref.topk(4, dim=-1)  # the most any request asked; each keeps its own first k
    torch.testing.assert_close(lp.top_values, want.values)
    assert torch.equal(lp.top_ids, want.indices)


def test_a_batch_where_nobody_asked_pays_nothing() -> None:
    logits = torch.randn(2, 50)
    lp = logprobs_of(logits, torch.tensor([1, 2]), [SamplingParams()] * 2)
    assert lp.top_values is None and torch.isnan(lp.chosen).all()
    # sample() keeps its contract: the chosen ones only, computed when asked
    _, chosen = sample(logits, [SamplingParams(temperature=0, top_logprobs=3)] * 2, [0, 0], [0, 0])
    torch.testing.assert_close(chosen, torch.log_softmax(logits, -1).max(-1).values)


def test_top_logprobs_bounds() -> None:
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
    assert prompt_logprobs_problem(5000, None) is None
    assert prompt_logprobs_problem(4000, 1) is None  # an evaluation harness's usual ask
    problem = prompt_logprobs_problem(1000, 20)
    assert problem is not None and "at most 350 tokens" in problem
    assert prompt_logprobs_problem(350, 20) is None


def test_packed_prompt_logprobs_round_trip_and_refuse_bad_sizes() -> None:
    tops = [TopLogprobs([3, 4], [-0.5, -1.25]), TopLogprobs([5, 6], [-0.25, -2.0])]
    packed = PromptLogprobs.pack([-1.5, -0.75], tops, 2)
    assert packed.unpack() == ([-1.5, -0.75], tops)
    with pytest.raises(ValueError):
        PromptLogprobs(2, packed.chosen, packed.top_ids[:4], packed.top_values).unpack()
    with pytest.raises(ValueError):
        PromptLogprobs(2, b"abc", b"", b"").unpack()


def req(prompt: list[int], **params: int | None) -> Req:
    return Req("r", prompt, SamplingParams(**params))  # type: ignore[arg-type]


def test_prompt_rows_over_chunks_match_the_log_softmax() -> None:
    """Two steps of a chunked prompt beside a request that did not ask: each asking chunk
    reads all its rows, and the prompt's logprobs come out whole and in order."""
    g = torch.Generator().manual_seed(1)
    asking = req([5, 9, 2, 7, 1, 3], prompt_logprobs=2)
    other = req([4, 4, 4])
    table = torch.randn(6, 12, generator=g)  # row p: the logits after asking's token p
    for plan in ([(other, 0, 3), (asking, 0, 4)], [(asking, 4, 6)]):
        rows = prompt_logprobs.logit_rows(plan)
        assert rows is not None
        step = []  # the step's T tokens' logits, request after request
        for r, start, end in plan:
            step += [table[p] if r is asking else torch.zeros(12) for p in range(start, end)]
        logits = torch.stack(step)[rows.index]
        prompt_logprobs.record(plan, logits, rows)
        assert [rows.index[i] for i in rows.last] == [sum(e - s for _, s, e in plan[: i + 1]) - 1
                                                      for i in range(len(plan))]  # fmt: skip
    ref = torch.log_softmax(table, dim=-1)
    want = [ref[p - 1, asking.prompt_ids[p]].item() for p in range(1, 6)]
    assert asking.prompt_lps == pytest.approx(want, abs=1e-6)
    assert [t.ids for t in asking.prompt_tops] == ref[:5].topk(2, dim=-1).indices.tolist()
    assert prompt_logprobs.logit_rows([(other, 0, 3)]) is None  # nobody asked: as before


def test_carried_values_are_checked_before_use() -> None:
    r = req([1, 2, 3], top_logprobs=2, prompt_logprobs=1)
    good = PrefillLogprobs(
        first_top=TopLogprobs([4, 5], [-1.0, -2.0]),
        prompt=PromptLogprobs.pack([-1.0, -2.0], [TopLogprobs([1], [-0.5])] * 2, 1),
    )
    assert carried_problem(good, r, vocab_size=10) == ""
    assert "first token" in carried_problem(None, r, 10)
    short = PromptLogprobs.pack([-1.0], [TopLogprobs([1], [-0.5])], 1)
    assert "prompt logprobs" in carried_problem(PrefillLogprobs(first_top=good.first_top,
                                                                prompt=short), r, 10)  # fmt: skip
    assert "vocabulary" in carried_problem(good, r, vocab_size=5)
    nan = PrefillLogprobs(first_top=TopLogprobs([4, 5], [-1.0, float("nan")]), prompt=good.prompt)
    assert "finite" in carried_problem(nan, r, 10)


class Texts:
    """A tokenizer's decode for the shapes: token t is the text "t<t> "."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"t{i} " for i in ids)


def test_completion_shape_with_echo_and_chat_shape() -> None:
    tok = Texts()
    prompt = PromptLogprobs.pack([-1.0], [TopLogprobs([7], [-0.5])], 1)
    lp = completion_logprobs(tok, [9], [-0.25], [TopLogprobs([9, 8], [-0.25, -3.0])], 0,  # type: ignore[arg-type]
                             ([3, 4], prompt))  # fmt: skip
    assert lp["tokens"] == ["t3 ", "t4 ", "t9 "]
    assert lp["token_logprobs"] == [None, -1.0, -0.25]
    # the top k and the token there (k + 1 entries at most, as vLLM gives)
    assert lp["top_logprobs"] == [None, {"t7 ": -0.5, "t4 ": -1.0}, {"t9 ": -0.25, "t8 ": -3.0}]
    assert lp["text_offset"] == [0, 3, 6]
    chat = chat_logprobs(tok, [9], [-0.25], [TopLogprobs([9, 8], [-0.25, -3.0])])  # type: ignore[arg-type]
    entry = chat["content"][0]
    assert entry["token"] == "t9 " and entry["bytes"] == list(b"t9 ")
    assert [a["token"] for a in entry["top_logprobs"]] == ["t9 ", "t8 "]
    assert not math.isnan(entry["logprob"])
