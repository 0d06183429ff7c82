"""KV pages on demand in the decode: growth before launch, preemption, resume by recompute.

A running request holds the pages of the KV it has plus the slot its next launched
step writes (`Req.kv_need`); admission gives a new one its prompt's pages and that
slot. Before each launch `grow` hands every request of the batch the page its step
writes, on the schedule side: never inside a forward.

    pool has a page ............ the request takes it; its row gets the page's slots
    pool is empty .............. 1. process the in-flight step now (its finished
                                    requests return their pages), wait for the
                                    forward stream, retry
                                 2. preempt the most recently admitted request
                                    (running or prebuilt; the needy one itself when it
                                    is the youngest), wait for the forward stream so
                                    its pages come back, retry

Victim policy: most recently admitted first (`Req.admit_seq`, kept across preemptions),
so the oldest request always makes progress and none starves. A preempted request
waits in `preempted` (oldest first) and resumes ahead of new admissions: it gets a row
and the pages of prompt + generated tokens, goes through the prebuilt queue (and its
row fence), and its KV is recomputed on this engine by one extend forward of prompt +
outputs but the last (no second transfer). The last output is its next input, as the
prefill's first token is for a new request. Its sampling state is the request's own
(seed, output index = launched_steps, outputs so far), all kept, so a resumed request
samples what an uninterrupted one would.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from pdserve.kernels.stream import Event, Stream
from pdserve.kvcache.pools import slots_of
from pdserve.model.forward_batch import ForwardBatch, device_tensor
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.decode_step import StepResult
from pdserve.scheduler.request import Req, State


class DecodeEngine(Protocol):
    """What this module uses of scheduler/decode.py's DecodeEngine."""

    runner: ModelRunner
    running: list[Req]
    prebuilt: deque[Req]
    transfer: dict[str, Req]
    preempted: deque[Req]
    in_flight: StepResult | None
    deferred_pages: list[tuple[Event, list[int]]]
    kept_inputs: list[tuple[Event, ForwardBatch]]
    forward_stream: Stream
    schedule_stream: Stream
    preemptions: int
    recomputed_tokens: int

    def _process(self, result: StepResult) -> None: ...
    def _blocked(self) -> AbstractContextManager[None]: ...
    def _release_deferred_pages(self) -> None: ...


def admit_tokens(req: Req) -> int:
    """KV slots a request takes at admission: the prompt (transferred) and the slot of
    its first decode step."""
    return req.prompt_len + 1


def resume_tokens(req: Req) -> int:
    """KV slots a preempted request takes to resume: all it had, and the next step's."""
    return req.kv_need


def headroom(eng: DecodeEngine) -> int:
    """Pages admission leaves free: one step's growth for every request holding pages,
    so a burst of admissions does not force the running batch into preemption at once."""
    return len(eng.running) + len(eng.prebuilt) + len(eng.transfer)


def grow(eng: DecodeEngine, batch: list[Req]) -> list[Req]:
    """Give each request of `batch` the pages its next step writes, oldest first,
    preempting when the pool is empty. Returns the requests still to launch."""
    alloc = eng.runner.kv_pool.allocator
    ps = eng.runner.layout.page_size
    for req in sorted(batch, key=lambda r: r.admit_seq):
        while req.state is State.RUNNING and not req.finished and len(req.pages) * ps < req.kv_need:
            got = alloc.alloc(alloc.pages_for(req.kv_need) - len(req.pages))
            if got is None:
                _make_room(eng)
                continue
            _attach(eng, req, got)
    return [r for r in batch if r.state is State.RUNNING and not r.finished]


def _attach(eng: DecodeEngine, req: Req, pages: list[int]) -> None:
    """Append `pages` to a running request and write their slots into its row.
    NOTE: no fence needed here. The row is this running request's own (process_prebuilt
    wrote it behind the row-reuse fence), and the entries written lie past every
    position a launched step of it reads (< kv_need - 1); the step that reads them is
    launched after this write and its stream waits for the schedule stream."""
    ps = eng.runner.layout.page_size
    start = len(req.pages) * ps
    req.pages.extend(pages)
    table = eng.runner.req_pool.req_to_token
    slots = slots_of(pages, len(pages) * ps, ps)
    table[req.row, start : start + len(slots)] = slots.to(device=table.device, dtype=table.dtype)


def _make_room(eng: DecodeEngine) -> None:
    """Free at least one page or preempt one request (so `grow`'s loop ends)."""
    if eng.in_flight is not None:
        done, eng.in_flight = eng.in_flight, None
        eng._process(done)  # finished requests hand their pages back (deferred)
        settle(eng)
        return
    victim = max(_candidates(eng), key=lambda r: r.admit_seq)
    preempt(eng, victim)
    settle(eng)


def _candidates(eng: DecodeEngine) -> list[Req]:
    running = [r for r in eng.running if r.state is State.RUNNING and not r.finished]
    return running + list(eng.prebuilt)


def preempt(eng: DecodeEngine, victim: Req) -> None:
    """Take `victim`'s row and pages back; it waits in `preempted` to resume."""
    # every launched step of it was processed (_make_room runs the in-flight one first)
    assert victim.launched_steps == len(victim.output_ids) - 1, (victim.rid, victim.launched_steps)
    if victim.state is State.PREBUILT:
        eng.prebuilt.remove(victim)
    else:
        eng.running.remove(victim)
    eng.runner.req_pool.free(victim.row)  # the row fence guards its reuse (process_prebuilt)
    pages, victim.row, victim.pages = victim.pages, 0, []
    # NOTE: deferred free (docs/architecture.md §9). A recompute forward of it may still be queued on
    # the forward stream and write these pages; they go back once the stream has passed
    # everything issued so far (settle), never while a launched step may write them.
    eng.deferred_pages.append((eng.forward_stream.record(), pages))
    victim.state, victim.resume = State.PREEMPTED, True
    victim.preemptions += 1
    eng.preemptions += 1
    keys = [r.admit_seq for r in eng.preempted]
    eng.preempted.insert(bisect.bisect(keys, victim.admit_seq), victim)


def settle(eng: DecodeEngine) -> None:
    """Wait for the forward stream, then return every deferred page to the pool."""
    with eng._blocked():
        eng.forward_stream.synchronize()
    eng._release_deferred_pages()


def recompute(eng: DecodeEngine, reqs: list[Req]) -> None:
    """Issue, on the forward stream, the extend forward that rebuilds the KV of resumed
    requests (their rows are written). The inputs stay referenced until it has run."""
    for req in reqs:
        tokens = req.prompt_ids + req.output_ids[:-1]
        assert len(tokens) == req.prompt_len + req.launched_steps
        extend(eng, req, tokens, len(tokens))
        req.resume = False


def extend(eng: DecodeEngine, req: Req, tokens: list[int], rope_len: int) -> None:
    """Issue one extend forward of `tokens` into `req`'s row and pages (positions 0 ..
    n - 1), turned as a sequence of `rope_len` tokens (recompute: n; scheduler/rekey.py:
    n + 1). The inputs stay referenced until it has run."""
    runner = eng.runner
    dev, ps = runner.device, runner.layout.page_size
    n = len(tokens)
    batch = ForwardBatch(
        input_ids=device_tensor(tokens, torch.int64, dev),
        positions=device_tensor(list(range(n)), torch.int64, dev),
        out_cache_loc=slots_of(req.pages, n, ps).to(dev),
        rows=device_tensor([req.row], torch.int64, dev),
        seq_lens=[n],
        extend_lens=[n],
        host_rows=[req.row],
        rope_lens=None if rope_len == n else [rope_len],
    )
    runner.prepare(batch)
    # NOTE: the row and the inputs were written on the schedule stream.
    eng.forward_stream.wait_stream(eng.schedule_stream)
    eng.forward_stream.run(_forward_of(runner, batch))
    eng.kept_inputs.append((eng.forward_stream.record(), batch))
    eng.recomputed_tokens += n


def _forward_of(runner: ModelRunner, batch: ForwardBatch) -> Callable[[], None]:
    def forward() -> None:
        runner.forward(batch)  # the logits are not needed: the next input is known

    return forward


def release_inputs(kept: list[tuple[Event, ForwardBatch]]) -> list[tuple[Event, ForwardBatch]]:
    """The recompute inputs still needed (their forward has not run yet)."""
    return [(ev, b) for ev, b in kept if not ev.query()]
