"""Speculation's place in the decode loop (docs/architecture.md §13): at launch, an
overlap step or a synchronous speculative one.

    no speculator, a request before Phi-3's switch (rekey.short_keys),
    or the batch may not speculate (Speculator.batch_may) ......... overlap step
    otherwise: process the in-flight step (drafts need every token
    of the batch on the host), look up drafts
        none found .............................................. overlap step
        some found .............................................. verifying step
                                                                  (spec_step.py), done
                                                                  before step() returns

The draft model's forwards run through `forward_now`, on the forward stream, waited for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

from pdserve.config import EngineConfig
from pdserve.scheduler import rekey, spec_step
from pdserve.scheduler.decode_step import StepResult
from pdserve.scheduler.draft import DraftProposer
from pdserve.scheduler.draft_load import load_draft
from pdserve.scheduler.request import Req
from pdserve.scheduler.speculation import Speculator


class DecodeEngine(spec_step.DecodeEngine, rekey.DecodeEngine, Protocol):
    """What this module uses of scheduler/decode.py's DecodeEngine."""

    cfg: EngineConfig
    prealloc: deque[Req]

    def _launch(self, reqs: list[Req]) -> StepResult: ...


def speculator(eng: DecodeEngine) -> Speculator:
    """--speculative: n-gram lookups, or the draft model with its own pools."""
    cfg = eng.cfg
    if cfg.speculative.mode != "draft":
        return Speculator(cfg.speculative)
    draft = DraftProposer(load_draft(cfg, eng.runner), partial(forward_now, eng))
    return Speculator(cfg.speculative, draft)


def forward_now(eng: DecodeEngine, fn: Callable[[], None]) -> None:
    """Run `fn` on the forward stream and wait for it (the draft model's forwards;
    landing KV has its first token sent meanwhile)."""
    # NOTE: the inputs were written on the schedule stream
    eng.forward_stream.wait_stream(eng.schedule_stream)
    eng.forward_stream.run(fn)
    eng._wait_publishing_arrivals(eng.forward_stream.record())


def launch_or_speculate(eng: DecodeEngine, batch: list[Req]) -> StepResult | None:
    """An overlap step, or a synchronous speculative one (scheduler/speculation.py):
    drafts need every token of the batch on the host, so the in-flight step is
    processed first. None when the step ran here."""
    waiting = bool(eng.prealloc or eng.transfer or eng.prebuilt or eng.preempted)
    spec = eng.spec
    if spec is None or rekey.short_keys(eng, batch) or not spec.batch_may(batch, waiting):
        return eng._launch(batch)
    if eng.in_flight is not None:
        done, eng.in_flight = eng.in_flight, None
        eng._process(done)
    batch = [r for r in batch if not r.finished]
    proposal = spec.drafts(batch)
    if not any(proposal.tokens):
        return eng._launch(batch) if batch else None
    spec_step.speculate(eng, batch, proposal)
    return None
