"""Token selection for a batch of requests with their own sampling parameters.

Random sampling is a pure function of (seed, output index, logits): the noise
for output token j of a request comes from a generator seeded with
(seed, j). So a seeded request gives the same tokens whatever it is batched
with, with overlap on or off, and across the prefill/decode split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pdserve.model.sampling.grammar import NextMask, apply_mask
from pdserve.model.sampling.penalties import PenaltyState, adjust
from pdserve.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant to spread (seed, index) pairs


class Logprobs(NamedTuple):
    """The model's log-softmax read at the sampled tokens, and its top k (k of the request
    that asked the most; each request keeps its own first k)."""

    chosen: torch.Tensor  # [B] float32 (NaN where nobody asked)
    top_values: torch.Tensor | None  # [B, k] float32, most likely first; None: k == 0
    top_ids: torch.Tensor | None  # [B, k] int64


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    out_index: list[int],
    logprobs: bool | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    states: list[PenaltyState | None] | None = None,
    masks: list[NextMask | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (tokens [B] int64, logprobs [B] float32): `pick` then
    `logprobs_of` without the top k (arguments as theirs)."""
    tokens = pick(logits, params, seeds, out_index, argmax, states, masks)
    return tokens, logprobs_of(logits, tokens, params, bool(logprobs), top=False).chosen


def pick(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    out_index: list[int],
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    states: list[PenaltyState | None] | None = None,
    masks: list[NextMask | None] | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 -> tokens [B] int64.

    `seeds[i]` is request i's seed (the engine fills one in when the user gave
    none); `out_index[i]` the index of the token being sampled in its output.
    `argmax`: the greedy pick, [B, V] -> [B] as logits.argmax(-1) (the model's ops,
    pdserve.model.layers.ops; torch's when None).
    `states[i]`: request i's penalty state (penalties.py), read for its penalties and
    given the sampled token; None for a request without penalties.
    `masks[i]`: request i's grammar mask (grammar.py), waited for here, after the
    forward (the caller advances the grammar with the sampled token).
    """
    picked = logits
    if any(p.adjusts_logits for p in params):
        picked = logits.clone()
        for i, p in enumerate(params):
            if p.adjusts_logits:
                picked[i] = adjust(logits[i], p, states[i] if states else None)
            m = masks[i] if masks else None
            if m is not None:
                apply_mask(picked[i], m.get())
    tokens = picked.argmax(dim=-1) if argmax is None else argmax(picked)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_one(picked[i], p, seeds[i], out_index[i])
    for i, st in enumerate(states or ()):
        if st is not None:
            st.record(tokens[i])
    return tokens


def logprobs_of(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    params: list[SamplingParams],
    always: bool = False,
    top: bool = True,
) -> Logprobs:
    """The logprobs of the model's distribution (before temperature and filters) at
    `tokens`, and (`top`) the top k of the request that asked the most. They cost a
    log-softmax over [B, V] (as much as the argmax again) and a top-k, so they are
    computed only when some request of the batch asked (`SamplingParams.logprobs`,
    `top_logprobs`): a batch where none did pays nothing. `always`: the chosen ones
    regardless (NaN otherwise)."""
    k = max((p.top_logprobs for p in params), default=0) if top else 0
    if not (always or k or any(p.wants_logprobs for p in params)):
        return Logprobs(torch.full(tokens.shape, float("nan"), device=logits.device), None, None)
    # log-softmax read at a few tokens only: logits minus their logsumexp (the top k of
    # the logits are those of the log-softmax), no [B, V] result written
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, tokens[:, None]) - lse).squeeze(1)
    if k == 0:
        return Logprobs(chosen, None, None)
    values, ids = logits.topk(k, dim=-1)
    return Logprobs(chosen, values - lse, ids)


def _sample_one(logits: torch.Tensor, p: SamplingParams, seed: int, index: int) -> torch.Tensor:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    probs = filter_probs(probs, p.top_k, p.top_p, p.min_p)
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) % (1 << 63))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential-race trick)
    return (probs / noise).argmax()  # stays on the device: no host sync in the forward


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k, outside the top-p nucleus, or below min_p * max."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0 and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        keep &= probs >= kth
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of strictly more likely tokens
        in_nucleus = torch.zeros_like(keep)
        in_nucleus[order] = before < top_p
        keep &= in_nucleus
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    return torch.where(keep, probs, torch.zeros_like(probs))
