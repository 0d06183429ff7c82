"""Structured output: a grammar (llguidance) constrains each sampled token.

A request's `SamplingParams.grammar` is an llguidance grammar (JSON text: a JSON schema,
a regex or a Lark grammar, made by the frontend). Its `GrammarState` holds a matcher and
the allowed-token bitmask of the *next* token; the sampler sets every other logit to
-inf before picking.

Off the forward's critical path (decode): step N's token is consumed and the mask of
step N+1 is computed on a worker thread as soon as step N's tokens reach the host,
while step N+1's forward runs; step N+1's sampler waits for that mask only then:

    forward stream:  [fwd N | sample N] [fwd N+1 ........ | wait mask | sample N+1]
    grammar worker:              copy N ─▶ consume tok N, fill mask N+1 ─┘
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.torch as llgt
import torch

from pdserve.kernels.stream import Event

_tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
_lock = threading.Lock()
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-grammar")


def ll_tokenizer(model_dir: str, vocab: int, eos: list[int]) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance reads it (built once per process, ~1 s)."""
    key = (model_dir, vocab)
    with _lock:
        if key not in _tokenizers:
            text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
            _tokenizers[key] = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos or None)
        return _tokenizers[key]


def grammar_problem(grammar: str, tok: llguidance.LLTokenizer | None = None) -> str | None:
    """Why llguidance cannot compile `grammar`, or None."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    return "; ".join(messages) or "invalid grammar" if is_error else None


class GrammarState:
    """One request's matcher and the bitmask of its next token (host, int32 words)."""

    def __init__(self, tok: llguidance.LLTokenizer, grammar: str, vocab: int) -> None:
        self.matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        self.vocab = vocab
        self.mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        self.eos = list(tok.eos_tokens)
        self.pending: Future[None] | None = None  # the worker filling `mask`
        self._fill()

    def _fill(self) -> None:
        if self.matcher.is_error():  # nothing is allowed any more: only the end
            self.mask.zero_()
            for t in self.eos:
                self.mask[0, t // 32] |= 1 << (t % 32)
            return
        llgt.fill_next_token_bitmask(self.matcher, self.mask, 0)

    def advance(self, token: int) -> None:
        """Consume a sampled token and compute the next mask (on the caller's thread)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
        self._fill()

    def advance_later(self, tokens: torch.Tensor, i: int, copied: Event) -> None:
        """advance(tokens[i]) on the worker thread once `copied` (the host copy of the
        step's tokens) is done; `ready_mask()` waits for it."""

        def run() -> None:
            copied.wait()
            self.advance(int(tokens[i]))

        self.pending = _worker.submit(run)

    def next_mask(self) -> NextMask:
        """The mask of the token a step being built now samples (the updates submitted so
        far, not later ones: a later update waits for this step's own tokens)."""
        return NextMask(self, self.pending)


@dataclass(eq=False)
class NextMask:
    state: GrammarState
    pending: Future[None] | None

    def get(self) -> torch.Tensor:
        """The bitmask [1, words], once the update it depends on is done."""
        if self.pending is not None:
            self.pending.result()
        return self.state.mask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set the logits [V] of tokens the bitmask [1, words] forbids to -inf (in place);
    bit t % 32 of word t // 32 allows token t."""
    m = mask[0].to(logits.device, non_blocking=True)
    bits = (m[:, None] >> _BITS.to(logits.device)) & 1
    allowed = bits.flatten()[: logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
