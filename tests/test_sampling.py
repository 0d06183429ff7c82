from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams
from pdserve.model.sampling import filter_probs, sample


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
