"""Speculative decoding's policy on the decode: who drafts, how much, and when not at all
(docs/architecture.md §13). The verifying step itself is scheduler/spec_step.py.

Which steps speculate:

    --speculative off ............. none (the default)
    batch > max_batch ............. none: the overlap loop's one-token steps
    requests wait to join ......... none: a synchronous step would hold them back
    a request in the batch has
      penalties, a logit bias or a
      grammar, or samples with a
      seed or with logprobs ....... none (below)
    otherwise ..................... requests that opted in and are not backing off look
                                    up a draft (n-gram) or have the draft model draft
                                    (scheduler/draft.py); if any got one, the step verifies

Greedy: a greedy request's tokens are the argmax at each position, so a draft token is
accepted exactly when it equals that argmax, and the verified output is the output
without speculation token for token. Sampling: rejection sampling keeps the target
distribution (spec_sampling.py) but draws other tokens than the ordinary sampler, so a
request with its own seed (whose tokens are promised reproducible whatever its batch)
and one that asks for logprobs keep the ordinary step. Penalties (whose state advances
with each token) and grammars (whose mask does) keep it too.

Draft length, per request: it starts at 2 tokens, doubles (up to k) each time a
draft is taken whole and shrinks to what was kept when one is cut, so an answer that
copies its prompt soon drafts k at a time while one that rarely matches risks little.

Back-off, per request: each verification's share of accepted draft tokens feeds a
moving average, and a lookup that found nothing counts as a draft all rejected; below
LOW_ACCEPT the request skips lookups for a number of steps that doubles each time (up
to MAX_COOLDOWN) and resets once its drafts are accepted again. A rejected draft costs
the verifying forward's extra positions and the step's lost overlap, a failed lookup
the lost overlap (the in-flight step is processed before the lookup); an accepted
draft token saves a whole step.

Back-off, per batch: while requests wait to join the batch (a burst arriving, a
queue), and above `SpeculativeConfig.max_batch` running requests, no step speculates.
A decode step reads every weight once whatever its batch, so verifying k + 1
positions of one stream costs little more than one step where reading the weights
bounds it; as the batch grows the step becomes compute-bound, the verifying positions
cost as much as the tokens they may save, and the synchronous step loses the overlap
loop's hidden host time. Measured
(benchmarks/speculative.py, Qwen2.5-Coder-0.5B, 2 shared vCPUs): 16 chat streams
served 0.69x the tokens/s with speculation engaging whenever the batch was at most 4
(the ramp-up and the tail of the burst, where the small batches it slowed held back
the requests behind them); hence the waiting rule, and `--spec-max-batch` 1 by
default: a verifying step of k + 1 positions costs about two one-token steps there, so
a batch whose requests mostly fail their lookups loses while one stream copying its
prompt gains (0.26-0.44x its TPOT).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import SpeculativeConfig
from pdserve.scheduler.draft import DraftProposer, Proposal
from pdserve.scheduler.ngram import NgramProposer
from pdserve.scheduler.request import Req

LOW_ACCEPT = 0.3  # a moving acceptance below this backs the request off
EMA = 0.5  # the weight of the newest verification in the moving average
MAX_COOLDOWN = 16  # steps a request skips lookups after its drafts fail, at most


def accept_greedy(draft: list[int], targets: list[int]) -> int:
    """How many draft tokens the model accepts: the longest prefix of `draft` equal to
    the model's own greedy tokens at those positions (`targets[i]` follows the input
    that ends with draft[i - 1]). The output is then targets[: accepted + 1]."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


@dataclass
class SpecState:
    """A request's proposer and back-off, made at its first speculative look."""

    proposer: NgramProposer | None  # None: the draft model drafts (Speculator.draft)
    fed: int = 0  # outputs handed to the proposer so far
    rate: float = 0.5  # moving acceptance: one failed lookup from backing off
    cooldown: int = 0  # lookups still to skip
    backoff: int = 1  # the next cooldown
    k: int = 2  # this request's draft length now (doubles on a full acceptance)


@dataclass
class Speculator:
    cfg: SpeculativeConfig
    draft: DraftProposer | None = None  # --speculative draft; else n-gram lookups
    states: dict[str, SpecState] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    lookups: int = 0  # steps that looked for drafts (each gave up its overlap)
    empty_lookups: int = 0  # of which found none (the step then ran one token each)

    def batch_may(self, batch: list[Req], waiting: bool) -> bool:
        """Whether this batch may speculate (the per-batch rules); ticks cooldowns.
        `waiting`: requests wait to join the batch (admission, KV transfer, prebuilt)."""
        if waiting or len(batch) > self.cfg.max_batch or not all(_plain(r) for r in batch):
            return False
        wants = False
        for r in batch:
            st = self.states.get(r.rid)
            if st is not None and st.cooldown > 0:
                st.cooldown -= 1
            elif r.params.speculative:
                wants = True
        return wants

    def drafts(self, batch: list[Req]) -> Proposal:
        """Each request's draft ([] for none): at most k tokens, and fewer than it still
        has to produce (a verification yields accepted + 1 tokens)."""
        wants = [self._want(r) for r in batch]
        if self.draft is not None:
            out = self.draft.propose(batch, wants)
        else:
            out = Proposal([self._lookup(r, k) for r, k in zip(batch, wants)], [None] * len(batch))
        for r, k, draft in zip(batch, wants, out.tokens):
            if k and not draft:  # a lookup that finds nothing still cost the step its overlap
                self._judge(self.states[r.rid], 0.0)
        self.lookups += 1
        self.empty_lookups += not any(out.tokens)
        return out

    def _want(self, r: Req) -> int:
        """How many draft tokens `r` asks for now (0: none)."""
        st = self.states.get(r.rid)
        left = r.params.max_tokens - len(r.output_ids) - 1
        if not r.params.speculative or left < 1 or (st is not None and st.cooldown > 0):
            return 0
        if st is None:
            cap = r.prompt_len + r.params.max_tokens
            ngram = None if self.draft is not None else NgramProposer(r.prompt_ids, cap)
            st = self.states[r.rid] = SpecState(ngram)
        return min(st.k, self.cfg.k, left)

    def _lookup(self, r: Req, k: int) -> list[int]:
        """Up to k n-gram draft tokens for `r`."""
        st = self.states.get(r.rid)
        if not k or st is None or st.proposer is None:
            return []
        st.proposer.extend(r.output_ids[st.fed :])
        st.fed = len(r.output_ids)
        return st.proposer.propose(k)

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """One verification's outcome for `req` (drafted > 0)."""
        self.drafted += drafted
        self.accepted += accepted
        st = self.states[req.rid]
        # a draft taken whole earns a longer one; a cut one, as long as what was kept
        st.k = min(2 * st.k, self.cfg.k) if accepted == drafted else max(1, accepted)
        self._judge(st, accepted / drafted)

    @staticmethod
    def _judge(st: SpecState, rate: float) -> None:
        """Fold one lookup's outcome into the moving acceptance; back off below LOW_ACCEPT."""
        st.rate = (1 - EMA) * st.rate + EMA * rate
        if st.rate >= LOW_ACCEPT:
            st.backoff = 1
            return
        st.cooldown, st.backoff = st.backoff, min(2 * st.backoff, MAX_COOLDOWN)
        st.rate = LOW_ACCEPT  # one good draft after the cooldown lifts it again

    def settle(self, req: Req) -> None:
        """After `req`'s verification: its draft KV cut back to its tokens."""
        if self.draft is not None:
            self.draft.settle(req)

    def forget(self, rid: str) -> None:
        """The request ended (any terminal state): its state and draft KV go."""
        self.states.pop(rid, None)
        if self.draft is not None:
            self.draft.release(rid)

    def stats(self) -> dict[str, float]:
        return {
            "spec_drafted_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_steps": self.steps,
            "spec_lookups": self.lookups,
            "spec_empty_lookups": self.empty_lookups,
            **(self.draft.stats() if self.draft is not None else {}),
        }


def _plain(r: Req) -> bool:
    """Speculation keeps this request's output: greedy (the same tokens), or sampling
    without a seed of its own and without logprobs (the same distribution,
    spec_sampling.py), and in both cases nothing that changes the logits step by step."""
    p = r.params
    if p.adjusts_logits:
        return False
    return p.greedy or (p.seed is None and not p.wants_logprobs)
