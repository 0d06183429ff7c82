"""Phi-3's longrope switch on the decode (arch/phi3_config.rekey_length).

Phi3ForCausalLM.generate drops its cache when a sequence first passes longrope's
original context (`at`) and runs the whole sequence again, every position then turned
by the long factors. The decode does the same for each request, by the position p of
the step about to launch (p = prompt_len + launched_steps):

    p <  at ....... short-factor keys; one-token steps only (`short_keys`): a
                    speculative step could pass `at` without the rekey
    p == at ....... before the step: its outputs up to p - 1 on the host
                    (`outputs_for_rekey`), then the KV of positions 0 .. p - 1 rebuilt
                    by one extend forward turned as a sequence of p + 1 (`rekey`)
    p >  at ....... long-factor keys, as transformers' own from then on

A prompt already past `at` was prefilled with the long factors and needs none of this.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.scheduler import grow
from pdserve.scheduler.request import Req


class DecodeEngine(grow.DecodeEngine, Protocol):
    """What this module uses of scheduler/decode.py's DecodeEngine."""

    rekey_at: int | None  # rekey_length of the served model


def outputs_for_rekey(eng: DecodeEngine) -> None:
    """Process the in-flight step first where a request about to be rekeyed lacks
    an output it needs on the host (with one step in flight it never does)."""
    at = eng.rekey_at
    if at is None or eng.in_flight is None:
        return
    for req in eng.running:
        p = req.prompt_len + req.launched_steps
        if req.prompt_len <= at == p and len(req.output_ids) < p - req.prompt_len:
            done, eng.in_flight = eng.in_flight, None
            eng._process(done)
            return


def rekey_batch(eng: DecodeEngine, batch: list[Req]) -> None:
    """A request of `batch` whose step is at the switch gets its earlier keys rebuilt
    first, on the forward stream ahead of the step."""
    at = eng.rekey_at
    if at is None:
        return
    for req in batch:
        if req.prompt_len <= at == req.prompt_len + req.launched_steps:
            rekey(eng, req)


def short_keys(eng: DecodeEngine, batch: list[Req]) -> bool:
    """A request of the batch has not passed the switch yet: it steps one token at a
    time (a speculative step could pass the switch without the rekey)."""
    at = eng.rekey_at
    return at is not None and any(r.prompt_len + r.launched_steps <= at for r in batch)


def rekey(eng: DecodeEngine, req: Req) -> None:
    """Rebuild the KV of every position before the step about to launch (position p) as
    one forward over p + 1 tokens computes it. The step itself then writes position p as
    that forward would. Precondition: the outputs up to position p - 1 are on the host."""
    p = req.prompt_len + req.launched_steps
    tokens = req.prompt_ids + req.output_ids[: p - req.prompt_len]
    assert len(tokens) == p, (len(tokens), p)
    grow.extend(eng, req, tokens, p + 1)
