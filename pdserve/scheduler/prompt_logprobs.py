"""Prompt logprobs on the prefill: the head over every prompt position of the requests
that ask (`SamplingParams.prompt_logprobs`), and only theirs.

A prefill step reads logits at one row per request (its chunk's last token). A request
that asks has every row of its chunk read instead; the row of position p gives the
logprob of prompt token p + 1:

    chunk tokens   start ......................... end-1
    logits rows    |-- predict tokens start+1 .. end --|   (token `end` of a chunk that
                                                            ends the prompt is the first
                                                            output token: sampled, not here)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.sampling.pick import Logprobs
from pdserve.protocol import PrefillLogprobs, PromptLogprobs, TopLogprobs
from pdserve.scheduler.request import Req

SLICE_ROWS = 256  # rows per log-softmax: bounds its temporary to SLICE_ROWS x vocab floats


@dataclass(frozen=True)
class LogitRows:
    """Which of a step's tokens have their logits computed (`index`, into the T tokens),
    where each plan entry's last token lands among them (`last`), and, per plan entry
    that asked, where its chunk's rows start (`spans`: entry -> first row)."""

    index: list[int]
    last: list[int]
    spans: dict[int, int]


def logit_rows(plan: list[tuple[Req, int, int]]) -> LogitRows | None:
    """The rows to read for a step's `plan`, or None when no request of it asked (the
    step reads each entry's last token only, as it always does)."""
    if all(r.params.prompt_logprobs is None for r, _, _ in plan):
        return None
    index: list[int] = []
    last: list[int] = []
    spans: dict[int, int] = {}
    t = 0
    for i, (req, start, end) in enumerate(plan):
        if req.params.prompt_logprobs is not None:
            spans[i] = len(index)
            index.extend(range(t, t + end - start))
        else:
            index.append(t + end - start - 1)
        last.append(len(index) - 1)
        t += end - start
    return LogitRows(index, last, spans)


def record(plan: list[tuple[Req, int, int]], logits: torch.Tensor, rows: LogitRows) -> None:
    """Append each asking request's prompt logprobs of this chunk (logits: [rows, V])."""
    for i, first in rows.spans.items():
        req, start, end = plan[i]
        count = min(end, req.prompt_len - 1) - start  # rows that predict a prompt token
        k = req.params.prompt_logprobs or 0
        for lo in range(0, count, SLICE_ROWS):
            hi = min(count, lo + SLICE_ROWS)
            lsm = torch.log_softmax(logits[first + lo : first + hi], dim=-1)
            want = torch.tensor(req.prompt_ids[start + lo + 1 : start + hi + 1], device=lsm.device)
            req.prompt_lps += lsm.gather(1, want[:, None]).squeeze(1).tolist()
            if k:
                values, ids = lsm.topk(k, dim=-1)
                req.prompt_tops += [
                    TopLogprobs(a, b) for a, b in zip(ids.tolist(), values.tolist())
                ]
            else:
                req.prompt_tops += [TopLogprobs([], []) for _ in range(hi - lo)]


def carried(req: Req, first_top: TopLogprobs | None) -> PrefillLogprobs | None:
    """What goes to the decode with the first token (None when the request asked nothing)."""
    k = req.params.top_logprobs
    first_top = TopLogprobs(first_top.ids[:k], first_top.logprobs[:k]) if k and first_top else None
    prompt = None
    if req.params.prompt_logprobs is not None:
        prompt = PromptLogprobs.pack(req.prompt_lps, req.prompt_tops, req.params.prompt_logprobs)
    if prompt is None and first_top is None:
        return None
    return PrefillLogprobs(first_top=first_top, prompt=prompt)


def first_tops(lps: Logprobs, n: int) -> list[TopLogprobs | None]:
    """Each first token's top k (host values), None for all when none asked."""
    if lps.top_values is None or lps.top_ids is None:
        return [None] * n
    return [TopLogprobs(i, v) for i, v in zip(lps.top_ids.tolist(), lps.top_values.tolist())]
