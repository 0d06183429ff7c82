"""Speculative rejection sampling for a request that samples: its output follows the
target distribution whatever the draft (scheduler/speculation.py says who takes it).

At each drafted position the target p (the request's temperature, top-k, top-p and
min-p applied, as the ordinary sampler does) and the proposal q the draft token d was
drawn from: d is kept with probability min(1, p(d) / q(d)); on a rejection the token
comes from the residual max(0, p - q), renormalised, and the run stops there. A token t
then comes out with probability q(t) min(1, p(t)/q(t)) + (1 - sum_s min(q(s), p(s)))
max(0, p(t) - q(t)) / sum_s max(0, p(s) - q(s)) = min(p(t), q(t)) + max(0, p(t) - q(t))
= p(t), since both sums equal 1 - sum_s min(p(s), q(s)). After a fully accepted draft
the bonus token is drawn from p at the next position.

An n-gram draft is a deterministic proposal, q one-hot at d: d is kept with
probability p(d), a rejection draws from p with d removed. The draft model
(scheduler/draft.py) draws d from its own q (the same filters on its logits), and its
q is used as such: the one-hot rule would be exact for its drafts too, but would keep
them with probability sum p(d) q(d) instead of sum min(p(d), q(d)).

The draws are seeded by (request seed, output index) like the ordinary sampler's
(model/sampling.py), but they are other draws: a request gets other tokens with
speculation on than off, from the same distribution. So only requests without a seed
of their own take this path; a seeded request keeps the ordinary step and its tokens.
"""

from __future__ import annotations

import torch

from pdserve.model.sampling.pick import filter_probs
from pdserve.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs, as model/sampling.py does
_SPEC = 0x5851F42D4C957F2D  # keeps these streams apart from the ordinary sampler's
_DRAFT = 0x2545F4914F6CDD1D  # and the draft model's draws apart from both


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] the distribution the ordinary sampler draws from."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    return torch.stack([filter_probs(row, p.top_k, p.top_p, p.min_p) for row in probs])


def verify_sampled(
    draft: list[int], probs: torch.Tensor, seed: int, index: int, q: torch.Tensor | None = None
) -> list[int]:
    """The tokens a sampled request emits for `draft`: its accepted prefix and one more.
    `probs` [len(draft) + 1, V]: the target at each verified position (target_probs);
    `q` [>= len(draft), V]: the proposal each draft token was drawn from (None: one-hot
    at the draft token); `index`: the output index of the first of them."""
    out: list[int] = []
    for j, d in enumerate(draft):
        gen = _generator(seed, index + j)
        p = probs[j]
        q_d = 1.0 if q is None else q[j, d].item()
        if torch.rand((), generator=gen).item() * q_d < p[d].item():  # u < p(d) / q(d)
            out.append(d)
            continue
        if q is None:
            rest = p.clone()
            rest[d] = 0.0
        else:
            rest = (p - q[j]).clamp_(min=0.0)
            if not rest.sum().item() > 0.0:  # p == q up to rounding: nothing left over
                rest = p
        out.append(_draw(rest, gen))
        return out
    out.append(_draw(probs[len(draft)], _generator(seed, index + len(draft))))
    return out


def draw_draft(q: torch.Tensor, seed: int, index: int) -> int:
    """The draft model's token at output index `index`, drawn from its proposal `q` [V]
    (a stream of its own, apart from the verifier's draws)."""
    gen = torch.Generator()
    gen.manual_seed(((seed * _MIX) ^ (index + 1) * _DRAFT) % (1 << 63))
    return _draw(q, gen)


def _generator(seed: int, index: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed * _MIX) ^ (index + 1) * _SPEC) % (1 << 63))
    return gen


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=gen).item())
