"""Prefill engine: batched, chunked prefill; samples the first token; holds each
request's KV until the sink reports the decode has it (or gave up), then frees it.

    waiting --(row + prompt pages)--> prefilling (chunk by chunk) --(first token)--> holding --> freed

One step packs up to `prefill_budget(max_prefill_tokens)` prompt tokens from the admitted
prompts in `prefill_order` (shortest remaining first by default: in a burst the median
prompt's first token comes sooner; one that has waited `prefill_max_wait_ms` goes first
whatever its length); a prompt longer than the budget is split across steps (on CPU,
a prompt alone in the engine up to twice the default budget is not: `_budget`). A step
does not start a piece of a prompt that a later step can compute whole (`_plan_chunk`).
The prefill never decodes; it runs on the calling thread (no overlap needed).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from pdserve.config import EngineConfig, SchedulerConfig, prefill_budget
from pdserve.kvcache.pools import slots_of
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.rope_scaling import switch_length
from pdserve.model.runner import ModelRunner
from pdserve.model.sampling.grammar import GrammarState, NextMask, ll_tokenizer
from pdserve.model.sampling.penalties import PenaltyState
from pdserve.model.sampling.pick import logprobs_of, pick
from pdserve.protocol import EngineRequest, TokenEvent
from pdserve.scheduler import prompt_logprobs
from pdserve.scheduler.admission import admit_cached, admit_fifo, refusal, request_seed
from pdserve.scheduler.engine_stats import busy_ratio, channel_stats, pool_stats
from pdserve.scheduler.request import Req, State
from pdserve.transfer.base import KVSink

log = logging.getLogger(__name__)

LONE_STRETCH = 2  # a lone prompt's rest up to this many default budgets is not split (_budget)


class PrefillEngine:
    role = "prefill"

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, sink: KVSink) -> None:
        self.cfg = cfg
        self.runner = runner
        runner.warm_up_prefill()  # builds the native elementwise ops before any step runs
        self.sink = sink
        alloc = runner.kv_pool.allocator
        self.cache = PrefixCache(alloc) if cfg.cache.prefix_cache else None
        # longrope / dynamic: a prompt past this length turns all its keys by its own
        # length's frequencies, so its KV is no other prompt's prefix (nor theirs its)
        self.cache_within = switch_length(runner.arch.rope_scaling)
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt partly computed
        self.holding: dict[str, Req] = {}  # prompt done, KV held for the transfer
        self.reqs: dict[str, Req] = {}
        self.events: list[TokenEvent] = []
        self.publish: Callable[[list[TokenEvent]], None] | None = None  # unused (engine_api)
        self.busy_s = 0.0
        self.started = time.perf_counter()

    def add_request(self, er: EngineRequest) -> None:
        req = Req.from_engine_request(er)
        problem = self._refusal(req)
        if problem:
            req.error = problem
            req.state = State.DONE
            if all(r.room != req.room for r in self.reqs.values()):  # not a live one's room
                self.sink.on_abort(req, problem)  # the decode must not wait for this room
            self.events.append(TokenEvent(rid=req.rid, finished=True, error=problem))
            return
        self.reqs[req.rid] = req
        req.seed = request_seed(er.params.seed)
        self.waiting.append(req)
        self.sink.on_queue(req)  # a room no decode announces is dropped in seconds

    def _refusal(self, req: Req) -> str | None:
        if req.rid in self.reqs:
            return f"duplicate request id {req.rid!r}"
        limit = self.cfg.scheduler.max_queued_requests
        return refusal(req, self.runner, req.prompt_len, len(self.waiting), limit)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        req = self.reqs.get(rid)
        if req is None or req.finish_reason == "abort":
            return
        req.finish_reason = "abort"
        self.sink.on_abort(req, reason)
        if not req.row:
            self._finish(req)  # never admitted: the sink holds nothing of it
            return
        # NOTE: deferred free. The sink may still be reading this request's KV (a chunk
        # queued before the abort); its pages go back when poll() reports the release.
        # Until then it is computed no further.
        if req in self.prefilling:
            self.prefilling.remove(req)
        self.holding[req.rid] = req
        req.state = State.HOLDING

    def has_work(self) -> bool:
        if self.prefilling:
            return True
        if not self.waiting or not self.runner.req_pool.free_rows:
            return False  # waiting only for transfers to release rows and pages
        return self.runner.kv_pool.allocator.pages_for(self.waiting[0].prompt_len) <= self._free()

    def _free(self) -> int:
        """Pages admission can have: free ones and unreferenced cached ones."""
        free = self.runner.kv_pool.allocator.free_pages
        return free + (self.cache.evictable if self.cache is not None else 0)

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        self._poll_sink()
        self._admit()
        chunk = self._plan_chunk()
        cores = self.runner.cores  # a decode on this host may step aside for it (prefill first)
        cores.set_backlog(len(self.prefilling) + len(self.waiting) if chunk else 0)
        if chunk:
            self._run(chunk)
            cores.set_backlog(len(self.prefilling) + len(self.waiting))
        events, self.events = self.events, []
        return events

    def _poll_sink(self) -> None:
        for ev in self.sink.poll():
            req = self.holding.get(ev.rid) or self.reqs.get(ev.rid)
            if not ev.rid and ev.room:  # the decode refused a room not admitted here
                req = next((r for r in self.waiting if r.room == ev.room), None)
            if req is None:
                continue
            if not ev.ok and req.finish_reason != "abort":
                req.error = f"KV transfer failed: {ev.reason}"
            self._finish(req)

    def _admit(self) -> None:
        table = self.runner.req_pool.req_to_token
        if self.cache is None:
            admitted = admit_fifo(self.waiting, self.runner, lambda r: r.prompt_len)
        else:
            admitted = admit_cached(
                self.waiting, self.runner, self.cache, self.prefilling, self._cacheable
            )
        for req in admitted:
            req.state, req.prefilled = State.PREFILL, req.prefix_hit  # cached KV: computed
            slots = slots_of(req.pages, req.prompt_len, self.runner.layout.page_size)
            req.slots = slots.to(self.runner.device)
            table[req.row, : req.prompt_len] = slots.to(device=table.device, dtype=table.dtype)
            self.prefilling.append(req)
            self.sink.on_admit(req)
            if req.prefix_hit:
                # NOTE: a cached prefix's KV is final (a cached page is never written), so
                # it goes now and crosses the wire while the rest of the prompt computes,
                # rather than after the first chunk, on the first token's path.
                self.sink.on_chunk(req, self.runner.kv_pool, req.slots, 0, req.prefix_hit)

    def _plan_chunk(self) -> list[tuple[Req, int, int]]:
        """(req, start, end) prompt ranges for this step, within the token budget.

        A prompt whose rest does not fit the room left but fits a whole step waits for
        the next step rather than filling the room with a piece: the piece would lengthen
        this step, delaying the first tokens of the prompts it completes, while that
        prompt completes in the next step either way. Pieces go only to prompts longer
        than a step, and to the first prompt of a step. This shortens TTFT p50 at the same
        tokens/s; the longest prompts of a burst wait a step longer (a longer TTFT p90)."""
        budget = whole = self._budget()
        plan: list[tuple[Req, int, int]] = []
        for req in prefill_order(self.prefilling, self.cfg.scheduler, time.time()):
            if budget <= 0:
                break
            start = req.prefilled
            if plan and budget < req.prompt_len - start <= whole:
                continue  # NOTE: computed whole by a later step (never starved: aged first)
            end = min(req.prompt_len, start + budget)
            plan.append((req, start, end))
            budget -= end - start
        return plan

    def _budget(self) -> int:
        """This step's prompt tokens. The budget splits prompts so that in a burst the
        first ones finish (and start decoding) before the last; a prompt alone in the
        engine gains nothing from a split and pays one more pass over the weights. So with
        CPU's default budget a lone prompt whose rest fits in LONE_STRETCH budgets is
        computed in one step. Not on CUDA (a step's activations grow with its tokens,
        and a GPU's default budget is already large), nor under a budget set by the
        user (max_prefill_tokens): that is a hard cap, it may bound a step's memory."""
        sched = self.cfg.scheduler
        moe = self.runner.arch.moe
        experts, top_k = (moe.num_experts, moe.top_k) if moe else (0, 1)
        budget = prefill_budget(sched.max_prefill_tokens, self.cfg.device, experts, top_k)
        stretch = self.cfg.device == "cpu" and not sched.max_prefill_tokens
        if not stretch or len(self.prefilling) != 1 or self.waiting:
            return budget
        rest = self.prefilling[0].prompt_len - self.prefilling[0].prefilled
        return rest if rest <= LONE_STRETCH * budget else budget

    def _run(self, plan: list[tuple[Req, int, int]]) -> None:
        t0 = time.perf_counter()
        now = time.time()
        for req, start, _ in plan:
            if start == req.prefix_hit:  # its first chunk computes now (the queue ends here)
                req.stages["prefill_start"] = now
        batch = self._batch(plan)
        rows = prompt_logprobs.logit_rows(plan)
        if rows is not None:  # every row of the chunks whose prompt logprobs are asked for
            self.runner.prepare(batch)
            batch.last_index = torch.tensor(rows.index, device=self.runner.device)
        logits = self.runner.forward(batch)
        if rows is not None:
            prompt_logprobs.record(plan, logits, rows)
            logits = logits[rows.last]
        finished = [(i, r) for i, (r, _, end) in enumerate(plan) if end == r.prompt_len]
        if finished:
            idx = [i for i, _ in finished]
            reqs = [r for _, r in finished]
            params = [r.params for r in reqs]
            tokens = pick(
                logits[idx],
                params,
                [r.seed for r in reqs],
                [0] * len(reqs),
                states=[self._penalties(r, logits) for r in reqs],
                masks=[self._grammar(r) for r in reqs],
            )
            # the first token's logprob (and top k) travel with the KV
            lps = logprobs_of(logits[idx], tokens, params, always=True)
            logprobs = lps.chosen.tolist()
            tops = prompt_logprobs.first_tops(lps, len(reqs))
        for req, start, end in plan:
            req.prefilled = end
            assert req.slots is not None  # set at admission
            self.sink.on_chunk(req, self.runner.kv_pool, req.slots, start, end)
        for j, (_, req) in enumerate(finished):
            req.prefill_logprobs = prompt_logprobs.carried(req, tops[j])
            self._prompt_done(req, int(tokens[j]), logprobs[j])
        self.busy_s += time.perf_counter() - t0

    def _penalties(self, req: Req, logits: torch.Tensor) -> PenaltyState | None:
        """The first token's penalties see the prompt (the decode keeps its own state)."""
        return PenaltyState.new(req.params, req.prompt_ids, logits.shape[-1], logits.device)

    def _grammar(self, req: Req) -> NextMask | None:
        """A fresh matcher for the first token (the decode makes its own after it)."""
        if req.params.grammar is None:
            return None
        vocab = self.runner.arch.vocab_size
        tok = ll_tokenizer(self.runner.cfg.model_path, vocab, req.params.stop_token_ids)
        return GrammarState(tok, req.params.grammar, vocab).next_mask()

    def _batch(self, plan: list[tuple[Req, int, int]]) -> ForwardBatch:
        dev = self.runner.device
        ids: list[int] = []
        pos: list[int] = []
        locs: list[torch.Tensor] = []
        for req, start, end in plan:
            ids.extend(req.prompt_ids[start:end])
            pos.extend(range(start, end))
            assert req.slots is not None  # set at admission
            locs.append(req.slots[start:end])
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_cache_loc=torch.cat(locs).long(),
            rows=torch.tensor([r.row for r, _, _ in plan], dtype=torch.int64, device=dev),
            seq_lens=[end for _, _, end in plan],
            extend_lens=[end - start for _, start, end in plan],
            # longrope / dynamic: transformers turns a prompt by its whole length's
            # frequencies, so every chunk of it takes that length (layers/rope_scaling.py)
            rope_lens=[len(r.prompt_ids) for r, _, _ in plan],
        )

    def _prompt_done(self, req: Req, token: int, logprob: float) -> None:
        self.prefilling.remove(req)
        if self.cache is not None and self._cacheable(req):  # waiting prompts find it now
            req.cache_pages = self.cache.publish(req.prompt_ids, req.pages, req.cache_pages)
        self.holding[req.rid] = req
        req.state = State.HOLDING
        req.first_token, req.first_logprob = token, logprob
        req.output_ids.append(token)
        req.stages["prefill_end"] = time.time()
        stamps = {
            "prefill_arrive": req.stages["arrive"],
            "prefill_start": req.stages["prefill_start"],
            "prefill_end": req.stages["prefill_end"],
        }
        if "http_at" in req.stages:  # the prefill frontend's (edge/stamps.py)
            stamps["prefill_http"] = req.stages["http_at"]
        self.sink.on_done(req, token, logprob, stamps)

    def _finish(self, req: Req) -> None:
        """Terminal: free row and pages (the sink no longer reads them), emit one event."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.holding.pop(req.rid, None)
        self.reqs.pop(req.rid, None)
        req.slots = None
        if req.row:
            self.runner.req_pool.free(req.row)
            req.row = 0
        if req.pages:
            pages, req.pages = req.pages, []
            self.runner.kv_pool.allocator.free(self._uncached(req, pages))
        req.state = State.DONE
        ok = req.error is None and req.finish_reason is None
        self.events.append(
            TokenEvent(
                rid=req.rid,
                token_ids=req.output_ids[:1] if ok else [],
                finished=True,
                finish_reason="length" if ok else req.finish_reason,
                error=req.error,
                stages=dict(req.stages),
            )
        )

    def _cacheable(self, req: Req) -> bool:
        return self.cache_within is None or req.prompt_len <= self.cache_within

    def _uncached(self, req: Req, pages: list[int]) -> list[int]:
        """Hand a finished request's pages to the prefix cache; the ones it keeps not
        (a partial last page, a prefix cached already, a prompt not computed whole)."""
        if self.cache is None:
            return pages
        held = req.cache_pages
        if req.prefilled == req.prompt_len and self._cacheable(req):  # every page computed
            return self.cache.insert(req.prompt_ids, pages, held)
        self.cache.release(req.prompt_ids, pages[:held])
        return pages[held:]

    def stats(self) -> dict[str, float]:
        cache = self.cache.stats() if self.cache is not None else {}
        pools = pool_stats(self.runner)
        pools["free_kv_pages"] = self._free()  # unreferenced cached pages count as free
        pools["token_usage"] = 1 - pools["free_kv_pages"] / max(pools["total_kv_pages"], 1)
        return {
            **pools,
            **cache,
            "running": len(self.prefilling),
            "queued": len(self.waiting),
            "holding": len(self.holding),
            "forward_busy_ratio": busy_ratio(self.busy_s, self.started),
            **channel_stats(self.sink),
        }

    def close(self) -> None:
        close = getattr(self.sink, "close", None)
        if close is not None:
            close()


def prefill_order(reqs: list[Req], sched: SchedulerConfig, now: float) -> list[Req]:
    """`reqs` (in admission order) in the order a step computes them: first those that
    have waited longer than `prefill_max_wait_ms`, oldest first; then the rest, oldest
    first or ("shortest") fewest prompt tokens left first, ties in admission order."""
    cutoff = now - sched.prefill_max_wait_ms / 1e3
    aged = sorted(
        (r for r in reqs if r.stages["arrive"] <= cutoff), key=lambda r: r.stages["arrive"]
    )
    young = [r for r in reqs if r.stages["arrive"] > cutoff]
    if sched.prefill_order == "shortest":
        young.sort(key=lambda r: r.prompt_len - r.prefilled)  # stable: ties keep their order
    else:
        young.sort(key=lambda r: r.stages["arrive"])
    return aged + young
