"""One request's path through the frontend: validate -> engine -> detokenize -> stream.

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

from pdserve.netaddr import bootstrap_problem
from pdserve.protocol import EngineRequest, PromptLogprobs, TopLogprobs
from pdserve.sampling_params import SamplingParams, prompt_problem
from pdserve.server.detokenizer import TextStream
from pdserve.server.engine_client import EngineClient, EngineDead
from pdserve.server.metrics import Metrics
from pdserve.server.tokenizer import Tokenizer

ROOM_MASK = (1 << 63) - 1


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@dataclass(frozen=True)
class Bootstrap:
    """The PD fields as the router sends them (each may be one value or one per sample)."""

    host: str | list[str] | None = None
    port: int | list[int] | None = None
    room: int | list[int] | None = None

    def for_sample(self, i: int, n: int) -> tuple[int, str | None, int | None]:
        """(room, host, port) of sample `i` of `n`. A single room with n > 1 gives
        rooms room, room+1, ...: both legs derive the same, and samples never share one."""
        room = self.room
        if isinstance(room, list):
            if len(room) != n:
                raise RequestError(f"bootstrap_room has {len(room)} values for n={n}", "n")
            r = room[i]
        else:
            r = 0 if room is None else (room + i) & ROOM_MASK
        return r, *_checked(_pick(self.host, i), _pick(self.port, i))


def _pick(v, i: int):  # type: ignore[no-untyped-def]
    return v[i] if isinstance(v, list) else v


def _checked(host: str | None, port: int | None) -> tuple[str | None, int | None]:
    """A 400 naming the field for an address the decode must never connect to."""
    bad = bootstrap_problem(host, port)
    if bad is not None:
        raise RequestError(bad[1], bad[0])
    return host, port


@dataclass
class Job:
    """One parsed request, ready for the engine: what to run, and for whom."""

    prompts: list[list[int]]  # token ids of each prompt (several: a batch)
    params: SamplingParams
    n: int = 1  # samples per prompt
    rid: str | None = None
    boot: Bootstrap = field(default_factory=lambda: Bootstrap())
    stamps: dict[str, float] = field(default_factory=dict)  # edge/stamps.py arrival_stamps
    # a migrated request (the router's `resume_ids`): the output tokens its client already
    # has; the engine continues after them, the answer counts them and does not resend them
    resume: list[int] = field(default_factory=list)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]


OVERLOADED_RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full engine queue


@dataclass
class Delta:
    """New output of one sample since its previous Delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when asked, one a token
    prompt_logprobs: PromptLogprobs | None = None  # when asked, with the first token
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched: int | str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    replayed: bool = False  # the resumed tokens (Job.resume): formatters count, never send


@dataclass
class SampleResult:
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    matched: int | str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.output_ids += d.token_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.matched, self.error = d.finish_reason, d.matched, d.error
            self.stages = d.stages


@dataclass
class Frontend:
    """What every handler needs; one per server."""

    role: str
    client: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics
    max_context: int

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
    clock = _Clock(fe.metrics)
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
            yield d
    finally:
        if not done:  # the consumer went away (client disconnect): free the engine's row
            fe.client.abort(req.rid, "client disconnected")
        fe.client.release(req.rid)


class _Clock:
    """Feeds TTFT / inter-token / e2e latency of one sample into the metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.t0 = self.last = time.monotonic()
        self.n = 0
        self.metrics = metrics

    def tokens(self, k: int) -> None:
        if k == 0:
            return
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
