"""The draft-model proposer (`--speculative draft`): a second, small model on the decode
drafts k tokens per request, one forward per token, batched over the drafting requests;
the target verifies them in its one k + 1-position step (scheduler/spec_step.py).

The draft model has its own request rows and paged KV pool (scheduler/draft_load.py).
A request's draft KV, in its draft row:

    tokens  S = prompt + outputs  (n of them)          then the draft's own d1 .. dk
    KV      positions 0 .. kv_len-1 hold S's tokens    (kv_len <= n - 1 between steps)

    drafting:  catch-up   S[kv_len:n] in one forward            -> logits -> d1
               then       d1 .. d(k-1), one decode forward each -> d2 .. dk
               KV now     S, d1 .. d(k-1)                       (kv_len = n + k - 1)
    verified:  S' = S, d1 .. da, t   (a accepted, t the target's token)
               kept       positions < n + min(a, k - 1): those hold S' (kept_positions)
               released   the pages past them, at once

The first catch-up is the request's whole prompt (and any outputs so far): the draft's
prompt KV is computed here on the decode, at the request's first drafting step, never
sent by the prefill; a request that never drafts never pays it. Outputs made by ordinary
(overlap) steps meanwhile join the next catch-up.

Fences: every draft forward runs on the forward stream and is waited for before
`propose` returns, so no draft forward is ever in flight outside it. The draft rows and
pages are read by nothing else; a request's row and pages go back to the pools at once
when it ends (any terminal state: `release`), with no event to wait for.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pdserve.kvcache.pools import slots_of
from pdserve.model.forward_batch import ForwardBatch, device_tensor
from pdserve.model.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req
from pdserve.scheduler.spec_sampling import draw_draft, target_probs

# a draft forward of at most this many tokens runs as a decode batch (_batch); the
# verifying step's k + 1 positions per request are of the same order
ONE_TOKEN_ENTRIES = 32
CATCH_UP_CHUNK = 512  # tokens of one catch-up forward, at most (a long prompt's first)
RunNow = Callable[[Callable[[], None]], None]  # run on the forward stream and wait


@dataclass
class DraftSeq:
    """One request's share of the draft model's pools."""

    row: int
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions 0 .. kv_len-1 hold the request's tokens' draft KV


class Head(NamedTuple):
    """The draft model's next token for one request, after a draft forward."""

    greedy: int  # its argmax
    q: torch.Tensor | None  # [V] its proposal, for a request that samples (target_probs)


class Proposal(NamedTuple):
    """A drafting step's drafts, one per request of the batch."""

    tokens: list[list[int]]  # per request: its draft ([] for none)
    q: list[torch.Tensor | None]  # per request that samples: [k, V] the draft's proposal


def kept_positions(held: int, total: int) -> int:
    """Draft KV positions still valid after a verification: `held` positions were written
    (S, d1 .. d(k-1)), and the request now has `total` tokens (S, d1 .. da, t). Position
    n + j - 1 held d_j, which is the request's token there for j <= a; the last token
    (t or the bonus) has no draft KV yet. So n + min(a, k - 1) = min(held, total - 1)."""
    return min(held, total - 1)


class DraftProposer:
    def __init__(self, runner: ModelRunner, run_now: RunNow) -> None:
        """`runner`: the draft model with its own pools; `run_now(fn)`: run `fn` on the
        decode's forward stream and wait for it."""
        self.runner = runner
        self.run_now = run_now
        self.seqs: dict[str, DraftSeq] = {}
        self.forwards = 0
        self.seconds = 0.0  # the draft forwards' wall time, waits included
        self.catch_up_tokens = 0

    # ---- drafting -------------------------------------------------------------------
    def propose(self, reqs: list[Req], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens for reqs[i] (0: none wanted); fewer where the draft
        pool or its context has no room for them."""
        tokens: list[list[int]] = [[] for _ in reqs]
        room = {i: self._reserve(r, k) for i, (r, k) in enumerate(zip(reqs, ks)) if k > 0}
        live = [i for i, k in room.items() if k > 0]
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live if not reqs[i].params.greedy}
        heads = self._catch_up([reqs[i] for i in live]) if live else []
        while live:
            for i, (greedy, q) in zip(live, heads):
                r = reqs[i]
                index = len(r.output_ids) + len(tokens[i])  # the output index it would take
                tokens[i].append(self._pick(r, greedy, q, index))
                if q is not None:
                    qs[i].append(q)
            live = [i for i in live if len(tokens[i]) < room[i]]
            if live:  # the token just drafted is the next input
                parts = [(self.seqs[reqs[i].rid], tokens[i][-1:]) for i in live]
                heads = self._forward(parts, [reqs[i].params for i in live])
        q_of: list[torch.Tensor | None] = [None] * len(reqs)
        for i, rows in qs.items():
            q_of[i] = torch.stack(rows)
        return Proposal(tokens, q_of)

    def _pick(self, req: Req, greedy: int, q: torch.Tensor | None, index: int) -> int:
        """The draft's token: its argmax for a greedy request, else a draw from its q."""
        return greedy if q is None else draw_draft(q, req.seed, index)

    def _catch_up(self, reqs: list[Req]) -> list[Head]:
        """Extend each request's draft KV over all its tokens; the draft's choice after
        them. A long catch-up (a prompt) runs its head alone first, CATCH_UP_CHUNK tokens
        a forward, whose logits nobody reads."""
        tails = []
        for r in reqs:
            seq, ids = self.seqs[r.rid], r.prompt_ids + r.output_ids
            # settle() left only the request's own tokens' KV, never its last token's
            assert seq.kv_len < len(ids), (r.rid, seq.kv_len, len(ids))
            self.catch_up_tokens += len(ids) - seq.kv_len
            while len(ids) - seq.kv_len > CATCH_UP_CHUNK:
                chunk = ids[seq.kv_len : seq.kv_len + CATCH_UP_CHUNK]
                self._forward([(seq, chunk)], [None])
            tails.append((seq, ids[seq.kv_len :]))
        return self._forward(tails, [r.params for r in reqs])

    def _forward(
        self, parts: list[tuple[DraftSeq, list[int]]], params: list[SamplingParams | None]
    ) -> list[Head]:
        """One draft forward appending each part's tokens to its request's draft KV; per
        part the argmax after its last token, and the draft's proposal q there where its
        request samples."""
        fb, last = self._batch(parts)
        runner, heads = self.runner, []

        def forward() -> None:
            logits = runner.forward(fb)[last]
            greedy = runner.model.ops.argmax(logits).tolist()
            for x, p in enumerate(params):
                q = None if p is None or p.greedy else target_probs(logits[x : x + 1], p)[0]
                heads.append(Head(greedy[x], None if q is None else q.cpu()))

        start = time.perf_counter()
        self.run_now(forward)
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        for seq, ids in parts:
            seq.kv_len += len(ids)
        return heads

    def _batch(self, parts: list[tuple[DraftSeq, list[int]]]) -> tuple[ForwardBatch, list[int]]:
        """Each part's tokens at its request's next draft positions, and the logits row
        of each part's last token. Up to ONE_TOKEN_ENTRIES tokens in all (the drafting
        steps, a catch-up after a verification) form a decode batch of one token per
        position, a part's tokens sharing its row as the verifying step's do (the native
        one-call forward takes it; each token sees the KV of those before it, written in
        the same forward); more (a prompt) form an extend batch."""
        ps, dev = self.runner.layout.page_size, self.runner.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, toks in parts:
            ids += toks
            pos = range(seq.kv_len, seq.kv_len + len(toks))
            positions += pos
            slots += [seq.pages[p // ps] * ps + p % ps for p in pos]
        ends = list(itertools.accumulate(len(toks) for _, toks in parts))
        if len(ids) <= ONE_TOKEN_ENTRIES:  # a decode batch: one entry per token
            rows = [seq.row for seq, toks in parts for _ in toks]
            seq_lens, extend = [p + 1 for p in positions], [1] * len(ids)
            last = [e - 1 for e in ends]
        else:
            rows = [seq.row for seq, _ in parts]
            seq_lens = [seq.kv_len + len(toks) for seq, toks in parts]
            extend, last = [len(toks) for _, toks in parts], list(range(len(parts)))
        fb = ForwardBatch(
            input_ids=device_tensor(ids, torch.int64, dev),
            positions=device_tensor(positions, torch.int64, dev),
            out_cache_loc=device_tensor(slots, torch.int64, dev),
            rows=device_tensor(rows, torch.int64, dev),
            seq_lens=seq_lens,
            extend_lens=extend,
            host_rows=rows,
        )
        self.runner.prepare(fb)
        return fb, last

    # ---- the draft pools -------------------------------------------------------------
    def _reserve(self, req: Req, k: int) -> int:
        """Draft tokens `req` can have now, at most k: a draft row, and the pages of its
        draft KV through d(k-1) (its n tokens and k - 1 drafted ones)."""
        n = req.prompt_len + len(req.output_ids)
        seq = self.seqs.get(req.rid)
        if seq is None:
            row = self.runner.req_pool.alloc()
            if row is None:
                return 0
            seq = self.seqs[req.rid] = DraftSeq(row)
        alloc, ps = self.runner.kv_pool.allocator, self.runner.layout.page_size
        slots = (len(seq.pages) + alloc.free_pages) * ps
        k = min(k, slots - n + 1, self.runner.req_pool.max_context - n + 1)
        if k < 1:
            return 0
        need = alloc.pages_for(n + k - 1) - len(seq.pages)
        if need > 0:
            got = alloc.alloc(need)
            assert got is not None, "counted free above"
            self._attach(seq, got)
        return k

    def _attach(self, seq: DraftSeq, pages: list[int]) -> None:
        """Append `pages` to the request's draft pages and write their slots into its
        draft row (no draft forward is in flight: module docstring)."""
        ps = self.runner.layout.page_size
        table = self.runner.req_pool.req_to_token
        start = len(seq.pages) * ps
        seq.pages.extend(pages)
        end = min(start + len(pages) * ps, table.shape[1])
        slots = slots_of(pages, end - start, ps)
        table[seq.row, start:end] = slots.to(device=table.device, dtype=table.dtype)

    def settle(self, req: Req) -> None:
        """After a verification: keep the draft KV that holds the request's tokens and
        give the pages past it back at once (kept_positions)."""
        seq = self.seqs.get(req.rid)
        if seq is None:
            return
        seq.kv_len = kept_positions(seq.kv_len, req.prompt_len + len(req.output_ids))
        alloc = self.runner.kv_pool.allocator
        keep = alloc.pages_for(seq.kv_len)
        if len(seq.pages) > keep:
            alloc.free(seq.pages[keep:])
            del seq.pages[keep:]

    def release(self, rid: str) -> None:
        """The request ended (any terminal state): its draft row and pages, at once."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        self.runner.req_pool.free(seq.row)
        if seq.pages:
            self.runner.kv_pool.allocator.free(seq.pages)

    def stats(self) -> dict[str, float]:
        rows, pages = self.runner.req_pool, self.runner.kv_pool.allocator
        return {
            "spec_draft_forwards": self.forwards,
            "spec_draft_seconds": self.seconds,
            "spec_draft_catch_up_tokens": self.catch_up_tokens,
            "spec_draft_free_rows": rows.free_rows,
            "spec_draft_total_rows": rows.total_rows,
            "spec_draft_free_kv_pages": pages.free_pages,
            "spec_draft_total_kv_pages": pages.total_pages,
        }
