"""Speculative rejection sampling for a request that samples: its output follows the
target distribution whatever the draft (scheduler/speculation.py says who takes it).

An n-gram draft is a deterministic proposal: at each drafted position the target p
(the request's temperature, top-k, top-p and min-p applied, as the ordinary sampler
does) accepts draft token d with probability p(d); on a rejection the token comes from
p with d removed and renormalised, and the run stops there. So a token t != d comes
out with probability (1 - p(d)) * p(t) / (1 - p(d)) = p(t), and d with p(d): exactly
p. After a fully accepted draft the bonus token is drawn from p at the next position.

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


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] the distribution the ordinary sampler draws from."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    return torch.stack([filter_probs(row, p.top_k, p.top_p, p.min_p) for row in probs])


def verify_sampled(draft: list[int], probs: torch.Tensor, seed: int, index: int) -> list[int]:
    """The tokens a sampled request emits for `draft`: its accepted prefix and one more.
    `probs` [len(draft) + 1, V]: the target at each verified position (target_probs);
    `index`: the output index of the first of them."""
    out: list[int] = []
    for j, d in enumerate(draft):
        gen = _generator(seed, index + j)
        p = probs[j]
        if torch.rand((), generator=gen).item() < p[d].item():
            out.append(d)
            continue
        rest = p.clone()
        rest[d] = 0.0
        out.append(_draw(rest, gen))
        return out
    out.append(_draw(probs[len(draft)], _generator(seed, index + len(draft))))
    return out


def _generator(seed: int, index: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed * _MIX) ^ (index + 1) * _SPEC) % (1 << 63))
    return gen


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=gen).item())
