"""Decode engine: queues, admission, and the overlap loop (docs/architecture.md §3).

Queues, in order:

    prealloc --(row + pages reserved, source.expect)--> transfer
    transfer --(KV + first token arrived)-------------> prebuilt
    prebuilt --(process_prebuilt, behind the fence)---> running --> done

    running --(pool empty: preempted, scheduler/grow.py)--> preempted
    preempted --(row + pages, ahead of new admissions)--> prebuilt (KV recomputed here)

Admission policy: a request takes pages for its prompt and its first step's slot;
a running one takes each next page just before the step that writes it
(scheduler/grow.py: growth, preemption, resume by recompute). A request that could
never fit (longer than the context, more pages than the pool has) is refused at
once; otherwise it waits in prealloc, FIFO, for rows and pages to come back.
Beyond `max_queued_requests` waiting requests, new ones are refused.

Beside the loop: the step itself (decode_step.py), speculation at launch
(spec_launch.py, spec_step.py) and Phi-3's longrope rekey at schedule (rekey.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pdserve.config import EngineConfig
from pdserve.kernels.stream import Event, make_streams
from pdserve.kvcache.pools import slots_of
from pdserve.model.arch.phi3_config import rekey_length
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.runner import ModelRunner
from pdserve.protocol import (
    EngineRequest,
    PrefillLogprobs,
    PromptLogprobs,
    TokenEvent,
    TopLogprobs,
)
from pdserve.scheduler import grow, rekey, spec_launch
from pdserve.scheduler.admission import (
    admit_fifo,
    arrival_problem,
    carried_problem,
    refusal,
    request_seed,
)
from pdserve.scheduler.decode_step import ForwardHook, StepResult, launch_step, step_tops
from pdserve.scheduler.engine_stats import TransferTotals, decode_stats
from pdserve.scheduler.future_map import FutureMap
from pdserve.scheduler.request import Req, State
from pdserve.scheduler.stop import check_stop
from pdserve.transfer.base import KVSource

log = logging.getLogger(__name__)
YIELD_POLL_S = 0.002  # how often a yielding decode looks again
ARRIVAL_POLL_S = 0.005  # while a step's forward runs, how often to look for landed KV


class DecodeEngine:
    role = "decode"

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, source: KVSource) -> None:
        self.cfg = cfg
        self.runner = runner
        runner.warm_up_decode()  # builds the native decode attention before any step runs
        self.source = source
        self.overlap = not cfg.scheduler.disable_overlap
        self.future = FutureMap(cfg.max_rows, runner.device, cfg.kernel_backend)
        self.schedule_stream, self.forward_stream = make_streams(runner.device)
        self.spec = spec_launch.speculator(self) if cfg.speculative.on else None
        self.prealloc: deque[Req] = deque()
        self.transfer: dict[str, Req] = {}
        self.prebuilt: deque[Req] = deque()
        self.running: list[Req] = []
        self.preempted: deque[Req] = deque()  # oldest admitted first (scheduler/grow.py)
        self.reqs: dict[str, Req] = {}  # every live request by rid
        self.in_flight: StepResult | None = None
        self.deferred_pages: list[tuple[Event, list[int]]] = []
        self.kept_inputs: list[tuple[Event, ForwardBatch]] = []  # recompute forwards' inputs
        self.admitted = 0  # admissions so far: the next request's admit_seq
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.running_peak = 0  # the largest batch launched
        self.rekey_at = rekey_length(runner.arch)  # Phi-3's longrope switch (rekey.py)
        self.events: list[TokenEvent] = []
        # Set by the engine process: sends events now, from inside step(), on the thread
        # that calls step(). Without it events wait for step() to return.
        self.publish: Callable[[list[TokenEvent]], None] | None = None
        self.forward_hook: ForwardHook | None = None  # tests only
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.steps = 0
        self.max_yield_s = cfg.scheduler.prefill_first_ms / 1e3
        self.yield_always = cfg.scheduler.prefill_first == "always"  # else only in a burst
        self._yield_since: float | None = None
        self.transfer_totals = TransferTotals()
        # Overlap on CPU: this thread claims a core of the forward's while it computes
        # beside it, and gives it back while it blocks (_blocked; core_share.HostCore).
        self._host = (
            runner.cores.host_core if self.overlap and runner.device.startswith("cpu") else None
        )

    # ---- requests in --------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        req = Req.from_engine_request(er)
        problem = self._refusal(req)
        if problem:
            self._emit_error(req, problem)
            if all(r.room != req.room for r in self.reqs.values()):  # not a live one's room
                self.source.reject(req, problem)  # the prefill must not hold KV for it
            return
        self.reqs[req.rid] = req
        req.seed = request_seed(er.params.seed)
        self.prealloc.append(req)
        self.source.announce(req)  # its prefill learns of this decode before any pages

    def _refusal(self, req: Req) -> str | None:
        if req.rid in self.reqs:
            return f"duplicate request id {req.rid!r}"
        limit = self.cfg.scheduler.max_queued_requests
        return refusal(req, self.runner, req.reserved_tokens, len(self.prealloc), limit)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        req.finish_reason = "abort"
        self._end(req, detail=reason)

    # ---- the loop -----------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """receive -> schedule -> launch -> process previous -> return."""
        if self._host is not None:
            self._host.claim()  # released whenever this thread blocks (_blocked)
        self._release_deferred_pages()
        self.receive()
        self._publish_pending()  # arrivals' first tokens, before _schedule waits on the fence
        batch = self._schedule()
        launched = (
            spec_launch.launch_or_speculate(self, batch)
            if batch and not self._yield_to_prefill()
            else None
        )
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self._process(previous)
        if not self.overlap and self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            self._process(done)
        events, self.events = self.events, []
        return events

    def _yield_to_prefill(self) -> bool:
        """Prefill first (kernels/core_share): while a prefill on this host holds prompts
        (with yield_always) or more prompts than this decode runs streams (a burst), skip
        this step (new requests are still admitted and their first tokens emitted), for
        at most max_yield_s in a row; then one step runs regardless."""
        cores = self.runner.cores
        floor = 0 if self.yield_always else len(self.running)
        if self.max_yield_s <= 0 or cores.peer_backlog() <= floor:
            self._yield_since = None
            return False
        now = time.monotonic()
        if self._yield_since is None:
            self._yield_since = now
        if now - self._yield_since >= self.max_yield_s:
            self._yield_since = None
            return False
        cores.yield_now()  # idle at once (after the in-flight forward's end) to peers
        with self._blocked():
            time.sleep(YIELD_POLL_S)
        return True

    @contextmanager
    def _blocked(self) -> Iterator[None]:
        """This thread blocks (on the forward stream, or asleep): its claimed core goes
        back to the in-flight forward meanwhile."""
        if self._host is None:
            yield
            return
        self._host.release()
        try:
            yield
        finally:
            self._host.claim()

    def has_work(self) -> bool:
        runnable = self.running or self.prebuilt or self.in_flight is not None
        return bool(runnable or self.deferred_pages or self._admissible())

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or self.in_flight is not None or bool(self.deferred_pages)

    def _admissible(self) -> bool:
        if self.preempted:
            head, tokens = self.preempted[0], grow.resume_tokens
        elif self.prealloc:
            head, tokens = self.prealloc[0], grow.admit_tokens
        else:
            return False
        alloc = self.runner.kv_pool.allocator
        need = alloc.pages_for(tokens(head)) + grow.headroom(self)
        return bool(self.runner.req_pool.free_rows) and need <= alloc.free_pages

    # ---- 1. receive: prealloc -> transfer, transfer -> prebuilt -------------------
    def receive(self) -> None:
        """Admit waiting requests (reserve, send Ready), then take finished transfers.
        Admission first, so a row freed by the last step can take prebuilt KV now."""
        self._admit()
        self._receive()

    def _admit(self) -> None:
        room = lambda: grow.headroom(self)  # noqa: E731
        resumed = list(admit_fifo(self.preempted, self.runner, grow.resume_tokens, room))
        for req in reversed(resumed):  # first in the prebuilt queue, oldest first
            req.state = State.PREBUILT
            self.prebuilt.appendleft(req)
        if self.preempted:
            return  # resumes go first: new requests would take the pages they wait for
        for req in admit_fifo(self.prealloc, self.runner, grow.admit_tokens, room):
            self.admitted += 1
            req.admit_seq = self.admitted
            req.state = State.TRANSFER
            req.stages["reserved"] = time.time()
            self.transfer[req.rid] = req
            slots = slots_of(req.pages, req.prompt_len, self.runner.layout.page_size)
            self.source.expect(req, self.runner.kv_pool, slots.to(self.runner.device))

    def _receive(self) -> None:
        for ev in self.source.poll():
            req = self.transfer.pop(ev.rid, None)
            if req is None:
                continue  # cancelled meanwhile
            vocab = self.runner.arch.vocab_size
            bad = arrival_problem(ev, vocab) or carried_problem(ev.prefill_logprobs, req, vocab)
            if bad:
                self.transfer_totals.failed += 1
                req.error = f"KV transfer failed: {bad}"
                self.transfer[req.rid] = req
                self._end(req)
                continue
            req.first_token, req.first_logprob = ev.first_token, ev.first_logprob
            req.stages.update(ev.stages)  # the prefill's stamps (PREFILL_STAGES)
            req.state = State.PREBUILT
            req.stages["kv_done"] = time.time()
            layout = self.runner.layout
            self.transfer_totals.completed(req, layout.num_layers * layout.token_bytes_per_layer)
            self.prebuilt.append(req)
            # The first token is known now (the prefill sampled it): emit it at once, not
            # when the request joins a step, which waits for the in-flight forward (the
            # row fence) or for room in the batch. It may end the request (a stop token,
            # max_tokens 1): _end takes it out of `prebuilt` and frees what it holds.
            req.stages["running"] = time.time()
            carried = ev.prefill_logprobs or PrefillLogprobs()
            self._append(req, req.first_token, req.first_logprob, carried.first_top,
                         carried.prompt)  # fmt: skip

    # ---- 2. schedule: merge prebuilt, drop finished --------------------------------
    def _schedule(self) -> list[Req]:
        rekey.outputs_for_rekey(self)
        self.running = [r for r in self.running if not r.finished]
        room = self.cfg.scheduler.max_running_requests - len(self.running)
        new = self.get_new_prebuilt_batch(room)
        self.running.extend(r for r in new if not r.finished)
        # A request whose launched steps already yield max_tokens outputs (the prefill's
        # token and one per step) needs no further step: its last token is in flight, and
        # one more would be a redundant forward of its row. It stays in `running` until
        # that token is processed. Only requests that end on a token (stop, EOS) still
        # run a redundant step, unknown until their tokens reach the host.
        batch = [r for r in self.running if r.launched_steps + 1 < r.params.max_tokens]
        # NOTE: growth and the fences. Each request of the batch gets the page its step
        # writes here, before launch. A redundant step writes its slot too (kv_need counts
        # every launched step), so it always lands in the request's own pages, and those
        # return to the pool only behind a forward-stream event (_free, grow.preempt).
        batch = grow.grow(self, batch)
        self.running_peak = max(self.running_peak, len(batch))
        rekey.rekey_batch(self, batch)
        return batch

    def get_new_prebuilt_batch(self, room: int) -> list[Req]:
        take = [self.prebuilt.popleft() for _ in range(min(room, len(self.prebuilt)))]
        if not take:
            return []
        if self.overlap:
            # NOTE: row-reuse race (docs/architecture.md §3). A request that finished at
            # step N still runs a redundant step N+1 on the forward stream, which reads
            # req_to_token[row] and publishes its token into output_tokens[row]. Its row
            # was freed as soon as we saw it finish, so a request taken here may own that
            # row now. Wait for the forward stream before process_prebuilt writes the row,
            # or the new request decodes from the finished request's token.
            with self._blocked():
                self.schedule_stream.wait_stream(self.forward_stream)
        self.process_prebuilt(take)
        return take

    def process_prebuilt(self, reqs: list[Req]) -> None:
        """Write each request's req_to_token row and stash its first token (emitted
        already, on arrival) as the input of its first decode step."""
        table = self.runner.req_pool.req_to_token
        ps = self.runner.layout.page_size
        for req in reqs:
            slots = slots_of(req.pages, len(req.pages) * ps, ps)
            table[req.row, : len(slots)] = slots.to(device=table.device, dtype=table.dtype)
            # the next input: the prefill's first token, or a resumed request's last output
            self.future.stash(req.row, req.output_ids[-1])
            req.state = State.RUNNING
        grow.recompute(self, [r for r in reqs if r.resume])

    # ---- 3. launch -------------------------------------------------------------------
    def _launch(self, reqs: list[Req]) -> StepResult:
        self.steps += 1
        return launch_step(
            reqs,
            self.runner,
            self.future,
            self.forward_stream,
            self.forward_hook,
            schedule=self.schedule_stream,
        )

    # ---- 4. process the previous step ------------------------------------------------
    def _process(self, result: StepResult) -> None:
        assert result.copy_done is not None
        self._wait_publishing_arrivals(result.copy_done)
        t = result.timing
        self.busy_s += t.get("end", 0.0) - t.get("start", 0.0)
        tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()
        tops = step_tops(result)
        for i, (req, tok, lp) in enumerate(zip(result.reqs, tokens, logprobs)):
            if not req.finished:  # a finished request's redundant step is discarded
                self._append(req, tok, lp, tops[i] if tops else None)

    def _wait_publishing_arrivals(self, done: Event) -> None:
        """Wait for a step's tokens. Meanwhile KV that lands has its first token sent
        at once (with any event already pending, in order), not a whole step later.
        Taking arrivals here is what receive() does at a step's start, where a forward
        may be in flight too: it touches the transfer and prebuilt queues, never the
        running batch nor a row's req_to_token (written behind the fence)."""
        if self.publish is None:
            with self._blocked():
                done.wait()
            return
        while True:
            with self._blocked():
                if done.wait(ARRIVAL_POLL_S):
                    return
            self._receive()
            self._publish_pending()

    def _publish_pending(self) -> None:
        """Send the events so far now, when the engine process set `publish`."""
        if self.publish is not None and self.events:
            events, self.events = self.events, []
            self.publish(events)

    def _append(
        self,
        req: Req,
        token: int,
        logprob: float,
        top: TopLogprobs | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> None:
        """One output token; `top`: the top k at its position (cut to the request's k),
        `prompt`: the prompt's logprobs, with the first token only."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        stop = check_stop(req, token, self.runner.arch.eos_token_ids)
        p = req.params
        ev = TokenEvent(
            rid=req.rid, token_ids=[token], logprobs=[logprob] if p.wants_logprobs else []
        )
        if p.top_logprobs and top is not None:
            ev.top_logprobs = [
                TopLogprobs(top.ids[: p.top_logprobs], top.logprobs[: p.top_logprobs])
            ]
        if p.prompt_logprobs is not None:
            ev.prompt_logprobs = prompt
        self.events.append(ev)
        if stop is not None:
            req.finish_reason, req.matched_stop = stop
            self._end(req, event=ev)

    # ---- terminal states and freeing -------------------------------------------------
    def _end(self, req: Req, event: TokenEvent | None = None, detail: str = "") -> None:
        """Move `req` to DONE from whatever queue holds it; release what it holds."""
        was = req.state
        req.state = State.DONE
        self.reqs.pop(req.rid, None)
        if self.spec is not None:
            self.spec.forget(req.rid)
        if was == State.PREALLOC:
            self.prealloc.remove(req)
            self.source.reject(req, detail or req.error or "aborted")
        elif was == State.TRANSFER:
            self.transfer.pop(req.rid, None)
            self.source.cancel(req, detail or req.error or "aborted")
        elif was == State.PREBUILT:
            self.prebuilt.remove(req)
        elif was == State.PREEMPTED:
            self.preempted.remove(req)
        self._free(req, in_batch=was == State.RUNNING)
        if event is None:
            event = TokenEvent(rid=req.rid)
            self.events.append(event)
        event.finished = True
        event.finish_reason = req.finish_reason if req.error is None else None
        event.matched_stop = req.matched_stop
        event.error = req.error
        event.stages = dict(req.stages)

    def _free(self, req: Req, in_batch: bool) -> None:
        if req.row:
            # The row is free at once: the only writer of a reused row is
            # process_prebuilt, which fences against the forward stream first.
            self.runner.req_pool.free(req.row)
            req.row = 0
        if not req.pages:
            return
        pages, req.pages = req.pages, []
        if in_batch and self.overlap:
            # NOTE: deferred free. The redundant step still writes this request's KV
            # (at position prompt_len + launched_steps - 1, inside its pages). Pages go
            # back only after everything issued on the forward stream so far is done,
            # or a new request's transferred KV could be overwritten.
            self.deferred_pages.append((self.forward_stream.record(), pages))
        else:
            self.runner.kv_pool.allocator.free(pages)

    def _release_deferred_pages(self) -> None:
        keep = []
        for event, pages in self.deferred_pages:
            if event.query():
                self.runner.kv_pool.allocator.free(pages)
            else:
                keep.append((event, pages))
        self.deferred_pages = keep
        self.kept_inputs = grow.release_inputs(self.kept_inputs)

    def _emit_error(self, req: Req, message: str) -> None:
        req.error = message
        req.state = State.DONE
        self.events.append(TokenEvent(rid=req.rid, finished=True, error=message))

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return decode_stats(self)

    def drain(self) -> None:
        """Finish in-flight work and return deferred pages (idle, tests, shutdown)."""
        if self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            self._process(done)
        with self._blocked():
            self.forward_stream.synchronize()
        self._release_deferred_pages()

    def close(self) -> None:
        self.forward_stream.close()
        self.schedule_stream.close()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
