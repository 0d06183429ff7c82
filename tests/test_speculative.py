"""Speculative decoding is exact: greedy output with speculation on equals the output with
it off, token for token (scheduler/speculation.py, spec_step.py).

The tiny random model rarely repeats itself, so n-gram lookups would seldom propose
anything. The property test therefore drafts from an oracle: the output of the run
without speculation, with chosen draft tokens corrupted, so every verification has a
known mix of accepted and rejected tokens; max_tokens and a stop token (EOS too) land
inside drafts. With the acceptance rule broken the same comparison fails
(test_broken_acceptance_rule_is_caught).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import SpeculativeConfig
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import speculation
from pdserve.scheduler.ngram import NgramProposer
from pdserve.scheduler.speculation import Speculator
from tests.conftest import assert_pools_free

VOCAB = 4096
REFS: dict[tuple[int, ...], list[int]] = {}  # prompt -> output without speculation
BAD: set[int] = set()  # output indexes whose drafted token the oracle gets wrong


class Oracle:
    """A proposer with NgramProposer's interface that drafts the reference output."""

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self.prompt, self.outputs = tuple(prompt), 0

    def extend(self, tokens: list[int]) -> None:
        self.outputs += len(tokens)

    def propose(self, k: int) -> list[int]:
        ref = REFS.get(self.prompt, [])
        draft = ref[self.outputs : self.outputs + k]
        return [(t + 1) % VOCAB if self.outputs + j in BAD else t for j, t in enumerate(draft)]


@pytest.fixture(scope="module")
def llms(tiny_model):
    made = {
        (ps, overlap): LLM(tiny_model, page_size=ps, max_context=160, max_total_tokens=2048,
                           max_running_requests=4, disable_overlap=not overlap)
        for ps, overlap in ((1, True), (4, False), (16, True))
    }  # fmt: skip
    yield made
    for llm in made.values():
        llm.close()


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], spec):
    """Each prompt with its own params, all in one batch; `spec`: the decode's Speculator."""
    llm.decode.spec = spec
    outs = _generate_batch(llm, prompts, params)
    assert_pools_free(llm)
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


def _generate_batch(llm: LLM, prompts, params):
    from pdserve.llm import RequestOutput
    from pdserve.protocol import EngineRequest

    outs = {}
    for i, (p, q) in enumerate(zip(prompts, params)):
        rid = f"b{id(outs)}-{i}"
        outs[rid] = RequestOutput(prompt=p)
        er = EngineRequest(rid=rid, input_ids=p, params=q, room=i + 1)
        llm.prefill.add_request(er)
        llm.decode.add_request(er)
    llm._run(outs)
    return list(outs.values())


def _compare(llm, prompts, params, k, eos=None):
    arch = llm.decode.runner.arch
    if eos is not None:
        llm.decode.runner.arch = dataclasses.replace(arch, eos_token_ids=(eos,))
    try:
        off = _run(llm, prompts, params, None)
        for p, (tokens, _, _) in zip(prompts, off):  # the longest of equal prompts
            REFS[tuple(p)] = max(REFS.get(tuple(p), []), tokens, key=len)
        spec = Speculator(SpeculativeConfig(mode="ngram", k=k, max_batch=4))
        on = _run(llm, prompts, params, spec)
    finally:
        llm.decode.runner.arch = arch
    return off, on, spec


KINDS = ["plain"] * 5 + ["logprobs"] * 2 + ["optout", "penalty", "seeded"]
prompt_st = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=30)


@st.composite
def case(draw):
    n = draw(st.integers(1, 3))
    prompts = [draw(prompt_st) for _ in range(n)]
    params = []
    for _ in range(n):
        kind = draw(st.sampled_from(KINDS))
        p = SamplingParams(max_tokens=draw(st.sampled_from([1, *range(3, 21)])), temperature=0.0,
                           ignore_eos=True, logprobs=kind == "logprobs",
                           speculative=kind != "optout")  # fmt: skip
        if kind == "penalty":
            p = _with(p, repetition_penalty=1.3)
        if kind == "seeded":
            p = _with(p, temperature=0.8, seed=draw(st.integers(0, 99)))
        params.append(p)
    return {
        "prompts": prompts,
        "params": params,
        "k": draw(st.integers(1, 6)),
        "cfg": draw(st.sampled_from([(1, True), (4, False), (16, True)])),
        "bad": draw(st.sets(st.integers(0, 20), max_size=8)),
        "stop_at": draw(st.one_of(st.none(), st.integers(1, 19))),
        "eos": draw(st.booleans()),
    }


def _with(p: SamplingParams, **kw) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(p, **kw)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(c=case())
def test_greedy_tokens_equal_with_speculation(llms, monkeypatch, c):
    monkeypatch.setattr(speculation, "NgramProposer", Oracle)
    BAD.clear()
    BAD.update(c["bad"])
    REFS.clear()
    llm = llms[c["cfg"]]
    prompts, params = c["prompts"], c["params"]
    eos = None
    if c["stop_at"] is not None:  # a stop token (or EOS) the output reaches mid-draft
        off = _run(llm, prompts[:1], params[:1], None)[0][0]
        if c["stop_at"] < len(off):
            tok = off[c["stop_at"]]
            if c["eos"]:
                eos, params = tok, [_with(params[0], ignore_eos=False), *params[1:]]
            else:
                params = [_with(params[0], stop_token_ids=[tok]), *params[1:]]
    off, on, spec = _compare(llm, prompts, params, c["k"], eos)
    for (t_off, r_off, lp_off), (t_on, r_on, lp_on) in zip(off, on):
        assert t_on == t_off
        assert r_on == r_off
        assert lp_on == pytest.approx(lp_off, abs=1e-4, nan_ok=True)
    assert spec.accepted <= spec.drafted
    plain = all(p.greedy and not p.penalized for p in params)
    drafts = any(
        p.speculative and p.max_tokens >= 3 and len(o[0]) >= 2 for p, o in zip(params, off)
    )
    if plain and drafts:  # the oracle drafts whenever a request is eligible
        assert spec.steps > 0


def test_drafts_are_verified_and_partly_accepted(llms, monkeypatch):
    """The oracle's drafts go through the verifying step: all accepted where right, cut
    at the first wrong token, and the KV pages of rejected positions come back."""
    monkeypatch.setattr(speculation, "NgramProposer", Oracle)
    BAD.clear()
    BAD.update({5, 6, 13})
    llm = llms[(1, True)]
    prompts = [[7, 8, 9, 10], [11, 12]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    off, on, spec = _compare(llm, prompts, params, k=4)
    assert [o[0] for o in on] == [o[0] for o in off]
    assert spec.steps > 0 and 0 < spec.accepted < spec.drafted
    stats = llm.decode.stats()
    assert stats["spec_drafted_tokens"] == spec.drafted
    # every verifying step looked for drafts first; a lookup finding none is counted too
    assert stats["spec_lookups"] >= spec.steps and stats["spec_lookups"] == spec.lookups
    assert stats["spec_empty_lookups"] == spec.empty_lookups < spec.lookups


def test_broken_acceptance_rule_is_caught(llms, monkeypatch):
    """Accepting one draft token more than the model agrees with changes the output: the
    comparison above fails on it."""
    monkeypatch.setattr(speculation, "NgramProposer", Oracle)
    right = speculation.accept_greedy
    monkeypatch.setattr(speculation, "accept_greedy",
                        lambda d, t: min(len(d), right(d, t) + 1))  # fmt: skip
    BAD.clear()
    BAD.update({3, 9})
    llm = llms[(16, True)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    off, on, _ = _compare(llm, [[21, 22, 23]], params, k=4)
    assert on[0][0] != off[0][0]


def test_ngram_proposer_lookup():
    p = NgramProposer([1, 2, 3, 4, 5, 9, 2, 3], capacity=4)
    assert p.propose(3) == [4, 5, 9]  # "2 3" seen before, followed by 4 5 9
    p.extend([7])
    assert p.propose(3) == []  # "3 7" never seen
    p.extend([1, 2, 3, 4])
    assert p.propose(2) == [5, 9]  # the longest suffix first: "1 2 3 4" -> 5 9
    q = NgramProposer([5, 6, 5, 6], capacity=8)
    assert q.propose(4) == [5, 6]  # the most recent occurrence, cut at the end


def test_flags_reach_the_decode_only(tiny_model):
    """`pdserve up` hands --speculative and --spec-k to its decodes alone; the decode's
    flags become its SpeculativeConfig; a bad value is refused by name."""
    import argparse

    from pdserve.server.launch import split_decode_flags
    from pdserve.server.serve_cli import add_cli, configs_from_args

    args = ["--page-size", "4", "--speculative", "ngram", "--spec-k=3", "--disable-overlap"]
    assert split_decode_flags(args) == (
        ["--page-size", "4", "--disable-overlap"],
        ["--speculative", "ngram", "--spec-k=3"],
    )
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["decode", "--model", str(tiny_model), "--speculative", "ngram",
                            "--spec-k", "6"])  # fmt: skip
    assert configs_from_args("decode", ns)[1].engine.speculative == SpeculativeConfig("ngram", 6)
    ns = parser.parse_args(["prefill", "--model", str(tiny_model)])
    assert configs_from_args("prefill", ns)[1].engine.speculative.mode == "off"
    with pytest.raises(SystemExit):  # the prefill has no such flag
        parser.parse_args(["prefill", "--speculative", "ngram"])
    with pytest.raises(ValueError, match="--spec-k"):
        SpeculativeConfig("ngram", 0)


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


CHI2_DF4_P001 = 18.47  # chi-square with 4 degrees of freedom: exceeded with probability 0.001


@pytest.mark.parametrize("draft", [1, 4])  # a likely and an unlikely draft token
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """On a 5-token vocabulary: the first token emitted for a one-token draft follows the
    target p whatever the draft, and the token after an accepted draft follows the next
    position's target. A verifier that keeps the draft whenever p(d) > 0 fails this."""
    import torch

    from pdserve.scheduler.spec_sampling import verify_sampled

    p0 = [0.1, 0.4, 0.2, 0.25, 0.05]
    p1 = [0.3, 0.1, 0.1, 0.2, 0.3]
    probs = torch.tensor([p0, p1])
    first, second = [0] * 5, [0] * 5
    for seed in range(4000):
        out = verify_sampled([draft], probs, seed, index=7)
        first[out[0]] += 1
        if out[0] == draft:
            second[out[1]] += 1
    assert _chi2(first, p0) < CHI2_DF4_P001, first
    assert _chi2(second, p1) < CHI2_DF4_P001, second
    always = [4000 if t == draft else 0 for t in range(5)]  # the broken verifier's counts
    assert _chi2(always, p0) > CHI2_DF4_P001


def test_sampled_requests_speculate_and_end_cleanly(llms, monkeypatch):
    """Requests that sample without a seed take the verifying step (rejection sampling):
    each ends at its max_tokens with every page back."""
    monkeypatch.setattr(speculation, "NgramProposer", Oracle)
    BAD.clear()
    llm = llms[(4, False)]
    prompts = [[31, 32, 33], [34, 35]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    off, _, _ = _compare(llm, prompts, [greedy, greedy], k=3)  # the oracle's drafts
    sampled = SamplingParams(max_tokens=12, temperature=0.7, top_k=20, ignore_eos=True)
    spec = Speculator(SpeculativeConfig(mode="ngram", k=3, max_batch=4))
    on = _run(llm, prompts, [sampled, sampled], spec)
    assert [len(t) for t, _, _ in on] == [12, 12]
    assert all(r == "length" for _, r, _ in on)
    assert spec.steps > 0 and spec.drafted > 0
