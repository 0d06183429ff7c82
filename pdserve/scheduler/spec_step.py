"""The verifying step of speculative decoding (docs/architecture.md §13).

A synchronous step: every token of its requests is on the host (the engine processed
the in-flight step first), so each request's inputs are its last output and its draft,

    request i:  inputs  last, d1 .. dk          at positions  kv_len .. kv_len + k
                targets t0, t1 .. tk            (the model's greedy token after each input)
                output  t0 .. ta                a = accept_greedy(d, t): d1..da == t0..ta-1
                (a request that samples: rejection sampling instead, spec_sampling.py)

one forward over all of them (a decode batch of one token per position, _build), then
on the host the longest agreeing prefix and the bonus token. The KV written for inputs
past the accepted ones is garbage that the next steps overwrite position by position
(attention never reads past a request's length); the pages that held only rejected
positions go back to the allocator at once, since the forward that wrote them is done.
The next input of each request is written into the FutureMap here, behind the wait, so
an overlap step may follow this one directly.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol

import torch

from pdserve.kernels.stream import Event, Stream
from pdserve.model.forward_batch import ForwardBatch, device_tensor
from pdserve.model.runner import ModelRunner
from pdserve.model.sampling.pick import logprobs_of
from pdserve.protocol import TopLogprobs
from pdserve.scheduler import speculation
from pdserve.scheduler.decode_step import slot_of
from pdserve.scheduler.draft import Proposal
from pdserve.scheduler.future_map import FutureMap
from pdserve.scheduler.grow import _attach
from pdserve.scheduler.request import Req
from pdserve.scheduler.spec_sampling import target_probs, verify_sampled
from pdserve.scheduler.speculation import Speculator


class DecodeEngine(Protocol):
    """What this module uses of scheduler/decode.py's DecodeEngine."""

    runner: ModelRunner
    future: FutureMap
    forward_stream: Stream
    schedule_stream: Stream
    spec: Speculator | None
    steps: int
    busy_s: float

    def _append(
        self, req: Req, token: int, logprob: float, top: TopLogprobs | None = None
    ) -> None: ...
    def _wait_publishing_arrivals(self, done: Event) -> None: ...
    def _blocked(self) -> AbstractContextManager[None]: ...


def speculate(eng: DecodeEngine, batch: list[Req], proposal: Proposal) -> None:
    """Verify the proposal's drafts (one per request of `batch`, [] for none) in one
    forward and append each request's accepted tokens and its bonus token."""
    assert eng.spec is not None
    drafts = [d[: _room(eng, r, len(d))] for r, d in zip(batch, proposal.tokens)]
    fb = _build(eng.runner, batch, drafts)
    out = _run(eng, batch, drafts, fb)
    eng.steps += 1
    eng.spec.steps += 1
    eng.busy_s += out.seconds
    at = 0
    for i, (req, draft) in enumerate(zip(batch, drafts)):
        n = len(draft) + 1
        emitted = _emitted(req, draft, out.tokens[at : at + n], out.probs.get(i), proposal.q[i])
        if draft:
            eng.spec.record(req, len(draft), len(emitted) - 1)
        req.launched_steps += len(emitted)  # the KV of inputs last, d1..da is now its own
        for j, token in enumerate(emitted):
            if req.finished:  # a stop token or max_tokens inside the accepted run
                break
            eng._append(req, token, out.lps[at + j], out.tops[at + j] if out.tops else None)
        at += n
        if not req.finished:
            eng.spec.settle(req)  # the draft model's KV of rejected tokens goes too
            _trim(eng, req)
            eng.future.stash(req.row, req.output_ids[-1])  # forward stream idle: no race


def _emitted(
    req: Req,
    draft: list[int],
    targets: list[int],
    probs: torch.Tensor | None,
    q: torch.Tensor | None,
) -> list[int]:
    """The tokens a verified request emits: the accepted draft prefix and one more.
    `probs`: the target at each position of a request that samples; `q`: the draft
    model's proposal for each draft token (None: one-hot, an n-gram draft)."""
    if probs is None:  # greedy: the model's own token after each accepted input
        return targets[: speculation.accept_greedy(draft, targets) + 1]
    return verify_sampled(draft, probs, req.seed, req.launched_steps + 1, q)


def _room(eng: DecodeEngine, req: Req, want: int) -> int:
    """Draft tokens whose KV slots `req` holds or can take now (no preemption for a
    draft: it shrinks instead)."""
    if want == 0:
        return 0
    alloc, ps = eng.runner.kv_pool.allocator, eng.runner.layout.page_size
    need = alloc.pages_for(req.kv_len + want + 1) - len(req.pages)
    if need > 0:
        got = alloc.alloc(need)
        if got is not None:
            _attach(eng, req, got)  # type: ignore[arg-type]
    return min(want, len(req.pages) * ps - req.kv_len - 1)


def _trim(eng: DecodeEngine, req: Req) -> None:
    """Give back at once the pages past the slot of the request's next step."""
    alloc = eng.runner.kv_pool.allocator
    keep = alloc.pages_for(req.kv_need)
    if len(req.pages) > keep:
        alloc.free(req.pages[keep:])
        del req.pages[keep:]


def _build(runner: ModelRunner, batch: list[Req], drafts: list[list[int]]) -> ForwardBatch:
    """A decode batch of one token per verified position: the k + 1 tokens of request i
    share its row, each with its own position and length. Every attention backend writes
    the step's KV before it attends, so the token at kv_len + j sees the drafts before it
    written in this same forward, and the step runs the decode's fast path (the native
    one-call forward, CUDA graphs) with the head at every position."""
    ps, dev = runner.layout.page_size, runner.device
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for req, draft in zip(batch, drafts):
        ids += [req.output_ids[-1], *draft]
        positions += _positions(req, draft)
        rows += [req.row] * (len(draft) + 1)
    slots = [slot_of(r, p, ps) for r, d in zip(batch, drafts) for p in _positions(r, d)]
    fb = ForwardBatch(
        input_ids=device_tensor(ids, torch.int64, dev),
        positions=device_tensor(positions, torch.int64, dev),
        out_cache_loc=device_tensor(slots, torch.int64, dev),
        rows=device_tensor(rows, torch.int64, dev),
        seq_lens=[p + 1 for p in positions],
        extend_lens=[1] * len(ids),
        host_rows=rows,
    )
    runner.prepare(fb)  # a decode batch: the logits of every token
    return fb


def _positions(req: Req, draft: list[int]) -> range:
    return range(req.kv_len, req.kv_len + len(draft) + 1)


class Verified(NamedTuple):
    """A verifying forward's results on the host, one entry per position."""

    tokens: list[int]  # the greedy token
    lps: list[float]  # its logprob (NaN where nobody asked)
    tops: list[TopLogprobs] | None  # the top k (None when nobody asked)
    probs: dict[int, torch.Tensor]  # request i that samples -> its target at its positions
    seconds: float  # the forward's


def _run(
    eng: DecodeEngine, batch: list[Req], drafts: list[list[int]], fb: ForwardBatch
) -> Verified:
    """The forward on the forward stream, waited for."""
    runner = eng.runner
    params = [r.params for r, d in zip(batch, drafts) for _ in range(len(d) + 1)]
    t = len(params)
    k = max(p.top_logprobs for p in params)
    out_tokens = torch.empty(t, dtype=torch.int64)
    out_lps = torch.empty(t, dtype=torch.float32)
    top_v = torch.empty(t, k, dtype=torch.float32) if k else None
    top_i = torch.empty(t, k, dtype=torch.int64) if k else None
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    timing: list[float] = []

    def forward() -> None:
        start = time.perf_counter()
        logits = runner.forward(fb)
        tokens = runner.model.ops.argmax(logits)
        lps = logprobs_of(logits, tokens, params)
        for i in sampled:
            rows = logits[starts[i] : starts[i + 1]]
            probs[i] = target_probs(rows, batch[i].params).cpu()
        out_tokens.copy_(tokens)
        out_lps.copy_(lps.chosen)
        if top_v is not None and top_i is not None:
            assert lps.top_values is not None and lps.top_ids is not None
            top_v.copy_(lps.top_values)
            top_i.copy_(lps.top_ids)
        timing.append(time.perf_counter() - start)

    eng.forward_stream.wait_stream(eng.schedule_stream)  # the inputs were copied there
    eng.forward_stream.run(forward)
    eng._wait_publishing_arrivals(eng.forward_stream.record())
    tops = None
    if top_v is not None and top_i is not None:
        tops = [TopLogprobs(i, v) for i, v in zip(top_i.tolist(), top_v.tolist())]
    return Verified(out_tokens.tolist(), out_lps.tolist(), tops, probs, sum(timing))
