"""Checks both engines run before queueing a request: refuse what can never be served."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterator

from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.model.runner import ModelRunner
from pdserve.protocol import QUEUE_FULL, PrefillLogprobs
from pdserve.sampling_params import prompt_problem
from pdserve.scheduler.request import Req
from pdserve.transfer.base import SourceEvent


def refusal(
    req: Req, runner: ModelRunner, kv_tokens: int, queued: int, max_queued: int
) -> str | None:
    """A user-facing reason to refuse `req` at once, or None to queue it.

    `kv_tokens`: KV slots the engine will reserve for it; `queued`: requests already waiting.
    """
    try:
        req.params.validate(runner.arch.vocab_size)
    except ValueError as e:
        return str(e)
    problem = prompt_problem(req.prompt_ids, runner.arch.vocab_size, runner.max_context,
                             req.params.max_tokens, req.params.prompt_logprobs)  # fmt: skip
    if problem is not None:
        return problem[1]
    alloc = runner.kv_pool.allocator
    if alloc.pages_for(kv_tokens) > alloc.total_pages:
        return (
            f"request needs {alloc.pages_for(kv_tokens)} KV pages; the pool has {alloc.total_pages}"
        )
    if queued >= max_queued:
        return QUEUE_FULL
    return None


def admit_fifo(
    queue: deque[Req],
    runner: ModelRunner,
    tokens: Callable[[Req], int],
    headroom: Callable[[], int] = lambda: 0,
) -> Iterator[Req]:
    """Pop requests off the head of `queue` while a row and `tokens(req)` KV slots are
    free, leaving at least `headroom()` pages free; each popped request owns its row and
    pages. FIFO: when the head does not fit, it waits for pages to come back and nothing
    overtakes it."""
    rows, alloc = runner.req_pool, runner.kv_pool.allocator
    while queue and rows.free_rows:
        need = alloc.pages_for(tokens(queue[0]))
        if need + headroom() > alloc.free_pages:
            return
        pages = alloc.alloc(need)
        if pages is None:
            return
        req = queue.popleft()
        req.row, req.pages = rows.alloc() or 0, pages
        yield req


def admit_cached(
    queue: deque[Req],
    runner: ModelRunner,
    cache: PrefixCache,
    computing: list[Req],
    cacheable: Callable[[Req], bool],
) -> Iterator[Req]:
    """admit_fifo for a prefill with a prefix cache: each popped request owns its row,
    the cached pages of its longest cached prefix (referenced: `prefix_hit` tokens,
    at least one prompt token left to compute, whose logits give the first token) and
    new pages for the rest, made by evicting unreferenced cached pages if need be.

    The head waits while a prompt being computed (`computing`) shares more full pages
    with it than the cache holds, and at least half of the head: that prompt publishes
    them when done (PrefixCache.publish), so prompts arriving together -- the n samples
    of a request, a burst on one long system prompt -- compute their shared prefix
    once, not once each. (Sharing less, the wait would cost the head more time to its
    first token than the pages save.)"""
    rows, alloc = runner.req_pool, runner.kv_pool.allocator
    while queue and rows.free_rows:
        req = queue[0]
        # a request asking for prompt logprobs computes its whole prompt (the head over it)
        # `cacheable`: whether the prompt may take cached pages at all
        limit = req.prompt_len - 1 if req.params.prompt_logprobs is None else 0
        limit = limit if cacheable(req) else 0
        hit = cache.acquire(req.prompt_ids, limit)  # NOTE: before evict
        if limit and any(_worth_waiting(req, r, len(hit), alloc.page_size) for r in computing):
            cache.release(req.prompt_ids, hit)
            return
        need = alloc.pages_for(req.prompt_len) - len(hit)
        if need > alloc.free_pages:
            cache.evict(need - alloc.free_pages)
        pages = alloc.alloc(need)
        if pages is None:
            cache.release(req.prompt_ids, hit)
            return
        queue.popleft()
        cache.count(req.prompt_len, len(hit))
        req.row, req.pages = rows.alloc() or 0, hit + pages
        req.prefix_hit = len(hit) * alloc.page_size
        req.cache_pages = len(hit)
        yield req


def _worth_waiting(req: Req, other: Req, hit: int, page_size: int) -> bool:
    shared = _shared_pages(req, other, page_size)
    return shared > hit and 2 * shared * page_size >= req.prompt_len


def _shared_pages(req: Req, other: Req, page_size: int) -> int:
    """Full pages of `other`'s prompt that `req` could take from the cache once cached
    (`req` keeps at least one token to compute)."""
    limit = min((req.prompt_len - 1) // page_size, other.prompt_len // page_size)
    a, b = req.prompt_ids, other.prompt_ids
    for i in range(limit):
        if a[i * page_size : (i + 1) * page_size] != b[i * page_size : (i + 1) * page_size]:
            return i
    return limit


def request_seed(seed: int | None) -> int:
    """The user's seed, or a fresh random one (sampling is a function of seed and index)."""
    return seed if seed is not None else random.getrandbits(62)


def arrival_problem(ev: SourceEvent, vocab_size: int) -> str:
    """Why a finished transfer cannot be used ("" if it can): it failed, or its first
    token (sampled by a peer) is no token of this model."""
    if not ev.ok:
        return ev.reason
    if not 0 <= ev.first_token < vocab_size:
        return f"first token {ev.first_token} outside the vocabulary (size {vocab_size})"
    if not math.isfinite(ev.first_logprob):
        return f"first token logprob {ev.first_logprob} is not finite"
    return ""


def carried_problem(carried: PrefillLogprobs | None, req: Req, vocab_size: int) -> str:
    """Why the logprobs a peer computed for `req` cannot be used ("" if they can): what
    the request asked for is missing, or their shape or token ids are wrong."""
    p = req.params
    first = carried.first_top if carried else None
    prompt = carried.prompt if carried else None
    if p.top_logprobs and (first is None or len(first.ids) < p.top_logprobs):
        return f"the prefill sent no top {p.top_logprobs} logprobs of the first token"
    tops = [first] if first else []
    values: list[float] = []
    if p.prompt_logprobs is not None:
        try:
            values, top = prompt.unpack() if prompt else ([], [])
        except ValueError as e:
            return str(e)
        if prompt is None or len(values) != req.prompt_len - 1 or prompt.k != p.prompt_logprobs:
            return "the prefill sent no prompt logprobs for each prompt token"
        tops += top
    for t in tops:
        if len(t.ids) != len(t.logprobs) or any(not 0 <= i < vocab_size for i in t.ids):
            return "top logprobs from the prefill hold token ids outside the vocabulary"
        values += t.logprobs
    if not all(math.isfinite(v) for v in values):  # they reach JSON, which has no NaN
        return "logprobs from the prefill are not all finite"
    return ""
