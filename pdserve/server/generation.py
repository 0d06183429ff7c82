"""One request's path through the frontend: engine -> detokenize -> stream (the types it
hands the routes are in jobs.py).

    route ── parse ──▶ Job ── Frontend.start ──▶ EngineRequest per sample (own rid, own room)
                                       ◀─ merged run_sample ── Delta per engine event
    route ── a formatter (OpenAI or native) turns the Deltas into the response

Sample `i` of prompt `p` is choice `p * n + i`; its engine request gets seed + i (when
seeded) and its own bootstrap room.

A sample's generator always ends the engine request: on a stop-string match
and when the consumer goes away (client disconnect cancels it) it sends Abort,
so the engine frees the request's row and pages.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams, prompt_problem
from pdserve.server.activity import Activity
from pdserve.server.detokenizer import TextStream
from pdserve.server.engine_client import EngineClient, EngineDead
from pdserve.server.jobs import (
    Bootstrap,
    Delta,
    Job,
    RequestError,
    SampleResult,
)
from pdserve.server.metrics import Metrics
from pdserve.server.tokenizer import Tokenizer


@dataclass
class Frontend:
    """What every handler needs; one per server."""

    role: str
    client: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics
    max_context: int
    activity: Activity = field(default_factory=Activity)  # the console's view (GET /stats)

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def start(self, job: Job) -> tuple[list[EngineRequest], AsyncIterator[Delta]]:
        """The job's engine requests (one per choice) and their merged Deltas. Raises
        RequestError for bad parameters, EngineDead when the engine is gone."""
        reqs: list[EngineRequest] = []
        base = job.rid or self.new_rid()
        params = self._resumed(job)
        for p, ids in enumerate(job.prompts):
            rid = base if len(job.prompts) == 1 else f"{base}-p{p}"
            reqs += self.build_requests(ids + job.resume, params, job.n, rid, job.boot,
                                        job.stamps, first=p * job.n, total=job.choices)  # fmt: skip
        if not self.client.alive:
            raise EngineDead(str(self.client.error))
        self.metrics.prompt_tokens.inc(sum(len(r.input_ids) for r in reqs))
        gens = [run_sample(self, r, i, job.resume) for i, r in enumerate(reqs)]
        return reqs, merge(gens)

    def _resumed(self, job: Job) -> SamplingParams:
        """The job's params with max_tokens less its resumed tokens; RequestError for a
        resume that cannot continue exactly (several choices) or cannot be served."""
        if not job.resume:
            return job.params
        if job.choices != 1:
            raise RequestError("resume_ids needs a single prompt and n=1", "resume_ids")
        vocab = self.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in job.resume):
            raise RequestError(f"resume_ids must be token ids below {vocab}", "resume_ids")
        left = job.params.max_tokens - len(job.resume)
        if left < 1:
            raise RequestError("resume_ids has max_tokens tokens or more", "resume_ids")
        return msgspec.structs.replace(job.params, max_tokens=left)

    async def complete(self, job: Job) -> list[SampleResult]:
        """The job run to its end: one SampleResult per choice (what start() streams)."""
        _, gen = self.start(job)
        return await collect(gen, job.choices)

    def check_prompt(self, ids: list[int], max_tokens: int | None,
                     prompt_top: int | None = None) -> int:  # fmt: skip
        """Validate a prompt (and the size of its logprobs when `prompt_top` asks for them);
        return max_tokens (defaulting to the rest of the context)."""
        wanted = max(1, self.max_context - len(ids)) if max_tokens is None else max_tokens
        problem = prompt_problem(ids, self.tokenizer.vocab_size, self.max_context, wanted,
                                 prompt_top)  # fmt: skip
        if problem is not None:
            raise RequestError(problem[1], problem[0])
        return wanted

    def build_requests(
        self,
        ids: list[int],
        params: SamplingParams,
        n: int,
        rid: str | None,
        boot: Bootstrap,
        stamps: dict[str, float] | None = None,
        first: int = 0,
        total: int | None = None,
    ) -> list[EngineRequest]:
        """One EngineRequest per sample; sample i gets seed + i (when seeded) and room
        number `first + i` of `total` (default n). `stamps`: edge/stamps.py arrival_stamps
        of the HTTP request."""
        try:
            params.validate(self.tokenizer.vocab_size)
        except ValueError as e:  # the message starts with the field's name
            name = str(e).split(" ", 1)[0]
            raise RequestError(
                str(e), name if name in SamplingParams.__struct_fields__ else None
            ) from e
        if not params.ignore_eos:  # the model's end-of-sequence ids end a sample too
            eos = sorted(set(params.stop_token_ids + self.tokenizer.eos_token_ids))
            params = msgspec.structs.replace(params, stop_token_ids=eos)
        base = rid or self.new_rid()
        out = []
        for i in range(n):
            room, host, port = boot.for_sample(first + i, total or n)
            p = params
            if n > 1 and params.seed is not None:
                p = msgspec.structs.replace(params, seed=params.seed + i)
            r = base if n == 1 else f"{base}-{i}"
            out.append(EngineRequest(rid=r, input_ids=ids, params=p, room=room,
                                     bootstrap_host=host, bootstrap_port=port,
                                     received_at=time.time(), stamps=dict(stamps or {}),
                                     group=base if n > 1 else None))  # fmt: skip
        return out


async def run_sample(
    fe: Frontend, req: EngineRequest, index: int, resume: list[int] | None = None
) -> AsyncIterator[Delta]:
    """Stream one sample; with `resume` (the tokens a migrated request's client has), a
    first Delta marked `replayed` carries them, so the text after them comes out as it
    did on the worker that made them. Raises EngineDead if the engine is gone at
    submission."""
    q = fe.client.submit(req)
    # the tokenizers library's own decode (skips special tokens, as Tokenizer.decode does)
    text = TextStream(fe.tokenizer.hf.decode, fe.tokenizer.byte_piece_ids, req.params.stop)
    clock = _Clock(fe.metrics, fe.activity)
    done = False
    try:
        if resume:
            yield Delta(index, text.step(list(resume), False), list(resume), replayed=True)
        while not done:
            ev = await q.get()
            clock.tokens(len(ev.token_ids))
            d = Delta(index, text.step(ev.token_ids, ev.finished), ev.token_ids, ev.logprobs,
                      ev.top_logprobs, ev.prompt_logprobs)  # fmt: skip
            if text.matched is not None and not ev.finished:  # cut here, stop the engine
                fe.client.abort(req.rid, "stop string matched")
                d.finished, d.finish_reason, d.matched = True, "stop", text.matched
            elif ev.finished:
                reason = "stop" if text.matched is not None else ev.finish_reason
                d.finished, d.finish_reason, d.error = True, reason, ev.error
                d.matched = text.matched if text.matched is not None else ev.matched_stop
                d.stages = ev.stages
            done = d.finished
            if done:
                clock.finish(fe.metrics, "error" if d.error else (d.finish_reason or "stop"))
                fe.activity.finish(len(req.input_ids), clock.n, d.finish_reason, d.stages)
            yield d
    finally:
        if not done:  # the consumer went away (client disconnect): free the engine's row
            fe.client.abort(req.rid, "client disconnected")
        fe.client.release(req.rid)


class _Clock:
    """Feeds TTFT / inter-token / e2e latency of one sample into the metrics."""

    def __init__(self, metrics: Metrics, activity: Activity) -> None:
        self.t0 = self.last = time.monotonic()
        self.n = 0
        self.metrics = metrics
        self.activity = activity

    def tokens(self, k: int) -> None:
        if k == 0:
            return
        self.activity.tokens(k)
        now = time.monotonic()
        if self.n == 0:
            self.metrics.ttft.observe(now - self.t0)
        else:
            for _ in range(k):
                self.metrics.itl.observe((now - self.last) / k)
        self.n += k
        self.last = now

    def finish(self, metrics: Metrics, outcome: str) -> None:
        metrics.e2e.observe(time.monotonic() - self.t0)
        metrics.generation_tokens.inc(self.n)
        metrics.requests.labels(outcome=outcome).inc()


async def merge(gens: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Interleave the samples' deltas as they come. Closing this generator cancels
    every sample (each then aborts its engine request)."""
    q: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(g: AsyncIterator[Delta]) -> None:
        try:
            async for d in g:
                await q.put(d)
            await q.put(None)
        except Exception as e:
            await q.put(e)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        live = len(tasks)
        while live:
            item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(gen: AsyncIterator[Delta], n: int) -> list[SampleResult]:
    results = [SampleResult(i) for i in range(n)]
    async for d in gen:
        results[d.index].add(d)
    return results
