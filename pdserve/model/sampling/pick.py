"""Token selection for a batch of requests with their own sampling parameters.

Random sampling is a pure function of (seed, output index, logits): the uniform
draw for output token j of a request comes from a generator seeded with
(seed, j), and picks the token where the running sum of the probabilities
passes it (inverse_cdf; the batch's rows at once). So a seeded request gives
the same tokens whatever it is batched with, with overlap on or off, and
across the prefill/decode split.
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
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) == len(params):  # every row drawn: no argmax, no copy of the rows
        tokens = _sample_rows(picked, params, seeds, out_index)
    else:
        tokens = picked.argmax(dim=-1) if argmax is None else argmax(picked)
        if rows:
            tokens[rows] = _sample_rows(picked[rows], [params[i] for i in rows],
                                        [seeds[i] for i in rows],
                                        [out_index[i] for i in rows])  # fmt: skip
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


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], out_index: list[int]
) -> torch.Tensor:
    """One draw per row of logits [S, V] (row i: params[i], its seed and output index):
    the first token whose cumulative probability passes u * (the row's total), u ~ U[0, 1)
    from the row's own (seed, index) generator. Batched: a step's cost does not grow by a
    vocabulary-wide random draw per row, as an exponential race's would."""
    temps = torch.empty(len(params), 1, device=logits.device)
    for i, p in enumerate(params):  # fills, not torch.tensor: no host-to-device copy
        temps[i].fill_(p.temperature)
    probs = torch.softmax(logits / temps, dim=-1)
    for i, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            probs[i] = filter_probs(probs[i], p.top_k, p.top_p, p.min_p)
    u = torch.stack([_uniform(s, j, logits.device) for s, j in zip(seeds, out_index)])
    return inverse_cdf(probs, u)


_BLOCK = 1024  # tokens a block of the two-level cumulative sum


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w [S, V] >= 0, each row's sum positive; u [S] float64 in [0, 1) -> [S] the first
    index whose cumulative weight passes u * (the row's sum): a draw from w / sum(w).

    In two levels (a float32 running sum over 150k tokens would move the tail tokens'
    share): the sums of blocks of _BLOCK tokens, their running sum, the block the target
    falls in, then the running sum inside that block alone. Never an index of zero
    weight: rounding between the two levels is clamped to the block's last positive one."""
    v = w.shape[1]
    full = v // _BLOCK
    parts = [w[:, : full * _BLOCK].unflatten(-1, (full, _BLOCK)).sum(-1)]
    if v % _BLOCK:
        parts.append(w[:, full * _BLOCK :].sum(-1, keepdim=True))
    # a block's own sum in float32 (vectorized, its error ~1e-7 of the block's share),
    # the running sum over blocks and inside a block in float64
    block = torch.cat(parts, dim=1).to(torch.float64)  # [S, blocks]
    cb = block.cumsum(-1)
    total = cb[:, -1:]
    # u < 1, so u * total < total but for rounding, which the clamp undoes
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(cb, target, right=True).clamp_(max=block.shape[1] - 1)  # [S, 1]
    cols = j * _BLOCK + torch.arange(_BLOCK, device=w.device)
    vals = w.gather(1, cols.clamp(max=v - 1)) * (cols < v)
    inner = vals.to(torch.float64).cumsum(-1) + (cb.gather(1, j) - block.gather(1, j))
    k = torch.searchsorted(inner, target, right=True)
    last = _BLOCK - 1 - (vals > 0).flip(-1).to(torch.float32).argmax(-1, keepdim=True)
    return (j * _BLOCK + torch.minimum(k, last)).squeeze(1)  # on the device: no host sync


def _uniform(seed: int, index: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) in float64, a pure function of (seed, index)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) % (1 << 63))
    return torch.rand((), generator=gen, dtype=torch.float64, device=device)


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
