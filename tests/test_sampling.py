from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams
from pdserve.checkpoints.resolve import resolve_model
from pdserve.model.sampling.penalties import PenaltyState, adjust
from pdserve.model.sampling.pick import filter_probs, sample


def test_filters() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert filter_probs(p, 2, 1.0, 0.0).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(p, -1, 0.6, 0.0).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(p, -1, 0.5, 0.0).nonzero().flatten().tolist() == [0]
    assert filter_probs(p, -1, 1.0, 0.2).nonzero().flatten().tolist() == [0, 1, 2]


def test_seeded_sampling_is_a_function_of_seed_and_index() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    a, _ = sample(logits.clone(), params, [7, 7, 7], [0, 1, 2])
    b, _ = sample(logits.clone(), params, [7, 7, 7], [0, 1, 2])
    assert a.tolist() == b.tolist()
    draws = {tuple(sample(logits[:1].clone(), params[:1], [s], [0])[0].tolist()) for s in range(40)}
    assert len(draws) > 3  # different seeds explore the distribution


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for s in range(600):
        counts[int(sample(logits.clone(), [p], [s], [0])[0])] += 1
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.08 and abs(freq[2] - 0.1) < 0.06


def test_engine_seeded_reproducible_and_top_k_1_is_greedy(tiny_model) -> None:
    llm = LLM(tiny_model, max_total_tokens=2048, max_context=256, max_running_requests=4)
    prompts = [[11, 12, 13], [40, 41, 42, 43, 44], [7]]
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, seeded)]
    b = [o.token_ids for o in llm.generate(list(reversed(prompts)), seeded)]
    assert a == list(reversed(b))  # independent of batch composition
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [
        o.token_ids for o in llm.generate(prompts, top1)
    ]
    llm.close()


def test_logprobs_only_when_asked() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    want = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1)[:, None]).squeeze(1)
    plain = [SamplingParams(temperature=0.0)] * 3
    tokens, lp = sample(logits, plain, [0] * 3, [0] * 3)
    assert torch.equal(tokens, logits.argmax(-1)) and lp.isnan().all()  # none asked: skipped
    asked = [*plain[:2], SamplingParams(temperature=0.0, logprobs=True)]
    torch.testing.assert_close(sample(logits, asked, [0] * 3, [0] * 3)[1], want)
    torch.testing.assert_close(sample(logits, plain, [0] * 3, [0] * 3, logprobs=True)[1], want)


# ---- penalties and logit bias (vLLM's definitions) ----------------------------------------
def reference_adjust(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]):
    """vLLM's penalties and logit bias, token by token (an independent reading)."""
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        n = out.count(t)
        if t in prompt or n > 0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return x


def state_of(p: SamplingParams, prompt: list[int], out: list[int], vocab: int):
    st = PenaltyState.new(p, prompt, vocab, "cpu")
    for t in out:
        if st is not None:
            st.record(torch.tensor(t))
    return st


PENALTIES = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.0, frequency_penalty=0.8),
    SamplingParams(temperature=0.0, presence_penalty=-1.5),
    SamplingParams(
        temperature=0.0,
        frequency_penalty=0.4,
        presence_penalty=0.6,
        repetition_penalty=1.2,
        logit_bias={3: 2.5, 9: -100.0},
    ),  # fmt: skip
    SamplingParams(temperature=0.0, logit_bias={0: 5.0}),
]


def test_penalties_match_the_reference_over_the_same_logits() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 40
    for p in PENALTIES:
        for _ in range(5):
            logits = torch.randn(vocab, generator=g) * 3
            prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
            out = torch.randint(0, vocab, (8,), generator=g).tolist()
            want = torch.tensor(reference_adjust(logits.tolist(), p, prompt, out))
            got = adjust(logits, p, state_of(p, prompt, out, vocab))
            torch.testing.assert_close(got, want)


def test_sample_applies_them_per_request_and_counts_the_sampled_token() -> None:
    g = torch.Generator().manual_seed(2)
    vocab = 30
    logits = torch.randn(len(PENALTIES) + 1, vocab, generator=g)
    params = [*PENALTIES, SamplingParams(temperature=0.0)]  # the last one: untouched
    prompt, out = [1, 2, 3], [4, 4, 5]
    states = [state_of(p, prompt, out, vocab) for p in params]
    tokens, lp = sample(logits.clone(), params, [0] * len(params), [3] * len(params),
                        logprobs=True, states=states)  # fmt: skip
    for i, p in enumerate(params):
        want = torch.tensor(reference_adjust(logits[i].tolist(), p, prompt, out)).argmax()
        assert int(tokens[i]) == int(want)
        st = states[i]
        if st is not None:  # the sampled token now counts as an output
            assert st.counts[int(tokens[i])] == out.count(int(tokens[i])) + 1
    # logprobs stay those of the model's distribution
    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(lp, raw)


def test_seeded_penalized_sampling_is_reproducible() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, seed=5, frequency_penalty=1.0, repetition_penalty=1.1)
    runs = []
    for _ in range(2):
        st = [state_of(p, [1, 2], [7, 7], 50) for _ in range(2)]
        runs.append(sample(logits.clone(), [p, p], [5, 5], [2, 2], states=st)[0].tolist())
    assert runs[0] == runs[1]


def test_penalized_greedy_equals_transformers_on_smollm2(smollm2_ref) -> None:
    """SmolLM2 offline (prefill -> KV -> decode): greedy tokens under penalties and bias
    equal transformers' generate with its repetition-penalty and sequence-bias processors
    (vLLM's definitions coincide with those) and frequency/presence written out. Slow
    (loading the engines): one prompt, short answers."""
    import transformers
    from test_real_model import CONVERSATIONS, prompt_ids

    from pdserve.server.tokenizer import Tokenizer

    class FrequencyPresence(transformers.LogitsProcessor):
        def __init__(self, p: SamplingParams, prompt_len: int) -> None:
            self.p, self.n = p, prompt_len

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            counts = torch.bincount(input_ids[0, self.n :], minlength=scores.shape[-1]).float()
            return (
                scores - self.p.frequency_penalty * counts - self.p.presence_penalty * (counts > 0)
            )

    ref = smollm2_ref  # transformers on the same GGUF, loaded once (tests/smollm2_stack.py)
    tok = Tokenizer(resolve_model("smollm2").path)
    prompts = [prompt_ids(tok, CONVERSATIONS[0])]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            ignore_eos=True,
            frequency_penalty=1.2,
            presence_penalty=0.5,
            logit_bias={tok.encode("The", False)[0]: 4.0},
        ),  # fmt: skip
    ]
    llm = LLM()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        plain = [o.token_ids for o in llm.generate(prompts, greedy)]
        for p in cases:
            for prompt, out, unpenalized in zip(prompts, llm.generate(prompts, p), plain):
                procs = transformers.LogitsProcessorList([
                    transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}) if p.logit_bias else None,
                    transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty),
                    FrequencyPresence(p, len(prompt)),
                ])  # fmt: skip
                procs = transformers.LogitsProcessorList([x for x in procs if x is not None])
                with torch.no_grad():
                    want = ref.model.generate(torch.tensor([prompt]), max_new_tokens=p.max_tokens,
                                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                              do_sample=False, eos_token_id=None, pad_token_id=0,
                                              logits_processor=procs)[0, len(prompt):].tolist()  # fmt: skip
                assert out.token_ids == want, (p, out.token_ids, want)
                assert out.token_ids != unpenalized  # the penalties did change the answer
    finally:
        llm.close()


def test_grammar_masks_each_step_with_overlap_on_and_off(tiny_model) -> None:
    """A random model under a grammar whose allowed tokens change every step: a mask one
    step stale (applied before the previous token was consumed) would let a token the
    grammar refuses through, and the answer would not be the grammar's one string."""
    from pdserve.server.structured import regex_grammar

    grammar = regex_grammar("(abc ){3}xyz", "regex")
    outs = []
    for overlap_off in (False, True):
        llm = LLM(tiny_model, max_total_tokens=2048, max_context=256, max_running_requests=4,
                  disable_overlap=overlap_off)  # fmt: skip
        try:
            params = [SamplingParams(max_tokens=40, temperature=t, seed=9, grammar=grammar,
                                     stop_token_ids=[0, 2]) for t in (0.0, 1.0)]  # fmt: skip
            outs.append([llm.generate([[11, 12, 13]], p)[0] for p in params])
        finally:
            llm.close()
    for run in outs:
        for o in run:
            assert llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) == "abc abc abc xyz"
            assert o.token_ids[-1] in (0, 2)  # then the end: the grammar allows nothing else
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_penalties_and_grammar_resume_after_preemption(tiny_model) -> None:
    """A decode pool far too small preempts and recomputes requests over and over; their
    penalty counts and grammar matchers live with the request, so each yields the tokens
    of an uninterrupted run (tests/test_preempt.py's harness, with penalties and grammars)."""
    import msgspec
    from test_preempt import _workload, run

    from pdserve.server.structured import regex_grammar

    grammar = regex_grammar("[a-z ]+", "regex")
    work = []
    for i, (prompt, p) in enumerate(_workload(1)):
        # strong penalties: the tiny random model's logits are peaked
        extra: dict = ({"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 3.0}
                       if i % 2 else {"grammar": grammar, "presence_penalty": 2.0})  # fmt: skip
        work.append((prompt, msgspec.structs.replace(p, **extra)))
    roomy, decode = run(tiny_model, work, decode_tokens=1024)
    assert decode.preemptions == 0
    tight, decode = run(tiny_model, work, decode_tokens=96)
    assert decode.stats()["preemptions"] >= 5
    assert tight == roomy


# ---- the batched draw (pick.inverse_cdf) -----------------------------------------------
def _reference_draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose float64 running sum passes u * total, one row at a time."""
    out = []
    for row, x in zip(w.to(torch.float64), u.tolist()):
        cum = row.cumsum(0)
        out.append(int(torch.searchsorted(cum, x * cum[-1], right=True)))
    return torch.tensor(out)


def test_the_batched_draw_is_the_inverse_cdf_of_each_row() -> None:
    """Two levels (blocks of 1024, then inside the block) give the index a float64 running
    sum over the whole row gives, for vocabularies not a multiple of the block."""
    from pdserve.model.sampling.pick import inverse_cdf

    g = torch.Generator().manual_seed(3)
    for v in (7, 1024, 3000, 151936):
        w = torch.softmax(torch.randn(12, v, generator=g) * 3, dim=-1)
        w[:, ::7] = 0.0  # zero-weight tokens, as a top-p filter leaves them
        u = torch.rand(12, generator=g, dtype=torch.float64)
        assert inverse_cdf(w, u).tolist() == _reference_draw(w, u).tolist()


def test_the_batched_draw_never_picks_a_zero_weight_token() -> None:
    """u just below 1: the last token of positive weight, also where the float32 block
    sums and the float64 sum inside a block disagree in the last bits (weights of 0.1,
    not exact in binary), and where whole blocks past it weigh nothing."""
    from pdserve.model.sampling.pick import inverse_cdf

    w = torch.zeros(3, 4096)
    w[0, :1034] = 0.1  # the last positive: 1033, inside the second block
    w[1, :2048] = 0.1  # 2047, a block's last token
    w[2, 5] = 1.0  # one token
    u = torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64)
    picked = inverse_cdf(w, u)
    assert picked.tolist() == [1033, 2047, 5]
    assert inverse_cdf(w, torch.zeros(3, dtype=torch.float64)).tolist() == [0, 0, 5]
