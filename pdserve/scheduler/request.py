"""Request state inside the engines (the messages they exchange with the frontend
are in `pdserve.protocol`).

A request lives in exactly one queue at a time and ends in exactly one terminal
state (`finish_reason` set, or `error` set), after which its row and pages are
released.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.model.sampling.grammar import GrammarState
from pdserve.model.sampling.penalties import PenaltyState
from pdserve.protocol import EDGE_STAMPS, EngineRequest, PrefillLogprobs, TopLogprobs
from pdserve.sampling_params import SamplingParams


class State(enum.Enum):
    # decode side
    PREALLOC = "prealloc"  # waiting for a row + KV pages
    TRANSFER = "transfer"  # row and pages reserved, waiting for the prefill's KV
    PREBUILT = "prebuilt"  # KV arrived with the first token
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages taken back; waits to resume by recompute (scheduler/grow.py)
    # prefill side (it queues in PREALLOC too)
    PREFILL = "prefill"  # row and prompt pages reserved, prompt chunks being computed
    HOLDING = "holding"  # prompt done, first token sampled; KV kept until the decode has it
    DONE = "done"


@dataclass(eq=False)
class Req:
    """One request on the decode side (the prefill side uses it too, minus decode fields)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    room: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    state: State = State.PREALLOC
    seed: int = 0  # sampling seed, filled by the engine at add_request (user's or random)
    # filled at admission (prealloc -> transfer) by the scheduler
    row: int = 0
    pages: list[int] = field(default_factory=list)
    # prefill side, filled at admission by the prefill engine: the prompt's KV slots and
    # how many prompt tokens are computed so far (advanced chunk by chunk)
    slots: torch.Tensor | None = None
    prefilled: int = 0
    prefix_hit: int = 0  # prompt tokens whose KV the prefix cache held (page-aligned)
    cache_pages: int = 0  # leading pages the prefix cache owns (acquired, then published)
    # filled by the KV source when the transfer completes
    first_token: int = -1
    first_logprob: float = 0.0
    # prefill side: what it computes for a request that asks (the prompt's logprobs chunk
    # by chunk, the first token's top k), sent to the decode with the first token
    prefill_logprobs: PrefillLogprobs | None = None
    prompt_lps: list[float] = field(default_factory=list)
    prompt_tops: list[TopLogprobs] = field(default_factory=list)
    # filled by the decode engine when it processes a finished step, one token each
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # host-side count of decode steps launched; lets the scheduler place KV without tokens
    launched_steps: int = 0
    # penalties' token history on the device (pdserve.model.sampling.penalties), made by the decode
    # at the request's first step and updated by each step's sampler; kept across preemption
    penalties: PenaltyState | None = None
    # the structured-output matcher (pdserve.model.sampling.grammar), made and advanced the same way
    grammar: GrammarState | None = None
    # decode side, filled by the scheduler: admission order (kept across preemptions: the
    # victim policy's age), times preempted, and whether its KV comes from a recompute
    admit_seq: int = 0
    preemptions: int = 0
    resume: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=lambda: {"arrive": time.time()})

    @classmethod
    def from_engine_request(cls, r: EngineRequest) -> Req:
        req = cls(
            rid=r.rid,
            prompt_ids=list(r.input_ids),
            params=r.params,
            room=r.room,
            bootstrap_host=r.bootstrap_host,
            bootstrap_port=r.bootstrap_port,
        )
        if r.received_at > 0:  # the frontend's stamp (same host as this engine)
            req.stages["arrive"] = min(r.received_at, req.stages["arrive"])
        # the router's and the frontend's (edge/stamps.py, which keeps only finite ones)
        req.stages.update((k, r.stamps[k]) for k in EDGE_STAMPS if k in r.stamps)
        return req

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def reserved_tokens(self) -> int:
        """KV slots of the longest run: the prompt and every output token but the last
        (output 0 comes from the prefill; a step writes the KV of its input token). A
        request must fit the pool whole, though it takes pages as it goes (`kv_need`)."""
        return self.prompt_len + self.params.max_tokens

    @property
    def kv_need(self) -> int:
        """KV slots the next launched step needs: those so far and the one it writes."""
        return self.prompt_len + self.launched_steps + 1

    @property
    def kv_len(self) -> int:
        """KV entries present once all launched steps have run."""
        return self.prompt_len + self.launched_steps

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None
