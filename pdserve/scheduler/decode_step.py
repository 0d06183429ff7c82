"""Building and launching one decode step on the forward stream.

Tokens never leave the device between steps: the step's input ids are
gathered from `FutureMap.output_tokens[rows]` on the forward stream, and its
sampled tokens are scattered back there before the host copy. So step N+1 can
be built on the host before step N's tokens are known there.

Per request in a step (host-side counters only, no tokens needed):

    input position  = prompt_len + launched_steps          (before the increment)
    KV slot written = slot of that position in req.pages
    output index    = launched_steps (after the increment)  (index 0 came from the prefill)

Host/device split: everything built from host values (positions, slots, rows, the
attention plan, the logits index) is built here on the schedule side, copied without
blocking (pinned, non_blocking on CUDA). The closure issued on the forward stream then
only issues device work: it never reads a device value on the host, so on CUDA the
host returns from `launch_step` before step N's kernels have run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kernels.stream import Event, Stream
from pdserve.model.forward_batch import ForwardBatch, device_tensor
from pdserve.model.runner import ModelRunner
from pdserve.model.sampling.grammar import GrammarState, ll_tokenizer
from pdserve.model.sampling.penalties import PenaltyState
from pdserve.model.sampling.pick import logprobs_of, pick
from pdserve.protocol import TopLogprobs
from pdserve.scheduler.future_map import FutureMap
from pdserve.scheduler.request import Req

# Called on the forward stream after sampling, before publishing (tests hold the stream here).
ForwardHook = Callable[["StepResult"], None]


@dataclass(eq=False)
class StepResult:
    """One launched step. `tokens`/`logprobs` are valid on the host once `copy_done` is set."""

    reqs: list[Req]
    out_index: list[int]  # output index each request samples in this step
    tokens: torch.Tensor  # [B] int64 host, filled on the forward stream
    logprobs: torch.Tensor  # [B] float32 host
    # [B, k] host (k: the most any request of the step asked for), None when none asked
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    copy_done: Event | None = None  # recorded by the launcher
    # NOTE: the step's device inputs, built on the schedule stream and read by the forward
    # stream. Held here until the result is processed (after copy_done), so the caching
    # allocator cannot hand their memory to new tensors while the forward still reads it.
    inputs: ForwardBatch | None = None
    timing: dict[str, float] = field(
        default_factory=dict
    )  # forward-stream start/end (perf_counter)


def step_tops(result: StepResult) -> list[TopLogprobs] | None:
    """Each request's top k of a processed step (host values; None: none asked)."""
    if result.top_values is None or result.top_ids is None:
        return None
    ids, values = result.top_ids.tolist(), result.top_values.tolist()
    return [TopLogprobs(i, v) for i, v in zip(ids, values)]


def penalty_state(req: Req, vocab: int, device: str) -> PenaltyState | None:
    """The request's penalty state, made (on the schedule side, so every later step sees
    the same one) at its first decode step from its prompt and the prefill's token."""
    if req.penalties is None and req.params.penalized:
        req.penalties = PenaltyState.new(req.params, req.prompt_ids, vocab, device)
        assert req.penalties is not None
        req.penalties.record(torch.tensor(req.first_token, device=device))
    return req.penalties


def grammar_state(req: Req, runner: ModelRunner) -> GrammarState | None:
    """The request's grammar state, made at its first decode step (the prefill's token
    consumed), then advanced by each step (launch_step)."""
    if req.grammar is None and req.params.grammar is not None:
        tok = ll_tokenizer(runner.cfg.model_path, runner.arch.vocab_size,
                           req.params.stop_token_ids)  # fmt: skip
        req.grammar = GrammarState(tok, req.params.grammar, runner.arch.vocab_size)
        req.grammar.advance(req.first_token)
    return req.grammar


def slot_of(req: Req, pos: int, page_size: int) -> int:
    return req.pages[pos // page_size] * page_size + pos % page_size


def build_batch(reqs: list[Req], page_size: int, device: str) -> tuple[ForwardBatch, list[int]]:
    """Advance each request by one launched step and describe the step's forward."""
    positions, slots, out_index = [], [], []
    for r in reqs:
        pos = r.prompt_len + r.launched_steps
        positions.append(pos)
        slots.append(slot_of(r, pos, page_size))
        r.launched_steps += 1
        out_index.append(r.launched_steps)
    rows = [r.row for r in reqs]
    batch = ForwardBatch(
        input_ids=torch.empty(0, dtype=torch.int64, device=device),  # resolved on the stream
        positions=device_tensor(positions, torch.int64, device),
        out_cache_loc=device_tensor(slots, torch.int64, device),
        rows=device_tensor(rows, torch.int64, device),
        seq_lens=[p + 1 for p in positions],
        extend_lens=[1] * len(reqs),
        host_rows=rows,
    )
    return batch, out_index


def launch_step(
    reqs: list[Req],
    runner: ModelRunner,
    future: FutureMap,
    stream: Stream,
    hook: ForwardHook | None = None,
    schedule: Stream | None = None,
) -> StepResult:
    """Issue resolve -> forward -> sample -> publish -> host copy on `stream` (the
    forward stream); `schedule` is the stream this thread issues on (the inputs' copies)."""
    batch, out_index = build_batch(reqs, runner.layout.page_size, runner.device)
    future.check_rows(batch.rows_on_host())
    runner.prepare(batch)
    n = len(reqs)
    pin = runner.device.startswith("cuda")
    result = StepResult(
        reqs=list(reqs),
        out_index=out_index,
        tokens=torch.empty(n, dtype=torch.int64, pin_memory=pin),
        logprobs=torch.empty(n, dtype=torch.float32, pin_memory=pin),
        inputs=batch,
    )
    params = [r.params for r in reqs]
    k = max(p.top_logprobs for p in params)
    if k:  # the top k's host buffers, only for a step where some request asked
        result.top_values = torch.empty(n, k, dtype=torch.float32, pin_memory=pin)
        result.top_ids = torch.empty(n, k, dtype=torch.int64, pin_memory=pin)
    req_seeds = [r.seed for r in reqs]
    states = [penalty_state(r, runner.arch.vocab_size, runner.device) for r in reqs]
    grammars = [grammar_state(r, runner) for r in reqs]
    masks = [None if g is None else g.next_mask() for g in grammars]  # before advance_later
    argmax = runner.model.ops.argmax

    def forward() -> None:
        result.timing["start"] = time.perf_counter()
        batch.input_ids = future.resolve(batch.rows, batch.host_rows)
        logits = runner.forward(batch)
        tokens = pick(logits, params, req_seeds, out_index, argmax=argmax,
                      states=states, masks=masks)  # fmt: skip
        lps = logprobs_of(logits, tokens, params)
        if hook is not None:
            hook(result)
        future.publish(batch.rows, tokens)
        result.tokens.copy_(tokens, non_blocking=pin)
        result.logprobs.copy_(lps.chosen, non_blocking=pin)
        if result.top_values is not None and result.top_ids is not None:
            assert lps.top_values is not None and lps.top_ids is not None
            result.top_values.copy_(lps.top_values, non_blocking=pin)
            result.top_ids.copy_(lps.top_ids, non_blocking=pin)
        result.timing["end"] = time.perf_counter()

    if schedule is not None:
        # NOTE: the inputs were copied on the schedule stream; the forward stream must not
        # read them before those copies land (a no-op on CPU, where they are done already).
        stream.wait_stream(schedule)
    stream.run(forward)
    result.copy_done = done = stream.record()
    for i, g in enumerate(grammars):
        if g is not None:  # the next step's mask, computed while that step's forward runs
            g.advance_later(result.tokens, i, done)
    return result
