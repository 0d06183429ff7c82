"""The n-gram (prompt lookup) proposer: draft tokens copied from the request's own text.

The last n tokens of prompt + output are looked up in everything before them, longest
n first (MAX_N down to MIN_N); at the most recent earlier place they occur, the tokens
that followed them there are the draft. Answers that copy spans of their prompt (code
edits, summaries, quotes) get long accepted drafts; others mostly get none, and a
request whose drafts keep failing stops asking (scheduler/speculation.py).

No model and no device: a request's tokens live in a numpy buffer here, and a lookup
is a few vectorised compares over it, so its cost grows with the context but stays
far below a forward's.
"""

from __future__ import annotations

import numpy as np

MAX_N = 4  # the longest suffix looked up: fewer, surer matches
MIN_N = 2  # the shortest; a one-token match proposes too often in ordinary text


class NgramProposer:
    """One request's tokens (prompt, then each output as it is appended) and lookups."""

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self.buf = np.zeros(max(capacity, len(prompt)), dtype=np.int64)
        self.buf[: len(prompt)] = prompt
        self.size = len(prompt)

    def extend(self, tokens: list[int]) -> None:
        end = self.size + len(tokens)
        if end > self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.zeros(end, dtype=np.int64)])
        self.buf[self.size : end] = tokens
        self.size = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens to follow the sequence so far ([] when none match)."""
        seq, size = self.buf, self.size
        for n in range(MAX_N, MIN_N - 1, -1):
            starts = size - n  # candidate starts 0 .. size-n-1: each has a token after it
            if starts <= 0:
                continue
            match = seq[:starts] == seq[size - n]
            for j in range(1, n):
                match &= seq[j : starts + j] == seq[size - n + j]
            hits = np.flatnonzero(match)
            if hits.size:
                at = int(hits[-1]) + n  # where the most recent earlier occurrence continued
                return seq[at : min(at + k, size)].tolist()
        return []
