"""Per-request sampling parameters (shared by the offline API, servers and engines)."""

from __future__ import annotations

import math

import msgspec

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# Prompt logprobs travel to the decode in the KV transfer's KVDone header (64 KiB at
# most): 4 + 8 k bytes a prompt token, packed (protocol.PromptLogprobs)
MAX_PROMPT_LOGPROBS_BYTES = 56 * 1024


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy (top_k == 1 gives the same tokens through the sampler). `seed` makes sampling a pure
    function of (seed, output index, logits), so it is reproducible across batch
    compositions and across the prefill/decode split.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    # the k most likely tokens' logprobs at each output position (0..MAX_TOP_LOGPROBS); k > 0
    # implies `logprobs`
    top_logprobs: int = 0
    # the prompt tokens' logprobs with the top k at each prompt position (the prefill computes
    # the head over every prompt position for such a request only); None: off
    prompt_logprobs: int | None = None
    # vLLM's definitions (pdserve.model.sampling.penalties): off at 0, 0, 1 and empty
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # an llguidance grammar (JSON text; pdserve.model.sampling.grammar) every output token must follow
    grammar: str | None = None
    # False: this request never speculates on a decode that does (--speculative); the
    # tokens are the same either way, only their pace differs
    speculative: bool = True

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a user-facing message on invalid values."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bad_bias = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
        if bad_bias:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad_bias[0]}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids outside the vocabulary: {bad}")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids outside the vocabulary: {bad}")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Penalties need the request's token history (pdserve.model.sampling.penalties)."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias) or self.grammar is not None


def prompt_problem(
    ids: list[int], vocab_size: int, max_context: int, max_tokens: int,
    prompt_top: int | None = None,
) -> tuple[str, str] | None:  # fmt: skip
    """(param, message) when a prompt with `max_tokens` output tokens can never be served,
    else None. The one rule set: the frontends answer it with a 400, the engines refuse
    with it (a request that skipped a frontend, e.g. the offline LLM)."""
    if not ids:
        return "prompt", "the prompt is empty"
    if any(not 0 <= t < vocab_size for t in ids):
        return "prompt", "prompt token ids outside the vocabulary"
    if len(ids) >= max_context:
        return "prompt", f"prompt has {len(ids)} tokens; the context length is {max_context}"
    if len(ids) + max_tokens > max_context:
        return "max_tokens", (
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length {max_context}"
        )
    problem = prompt_logprobs_problem(len(ids), prompt_top)
    return None if problem is None else ("logprobs", problem)


def prompt_logprobs_problem(prompt_len: int, k: int | None) -> str | None:
    """Why a prompt's logprobs with the top `k` cannot be carried (None if they can)."""
    if k is None:
        return None
    size = (prompt_len - 1) * (4 + 8 * k)
    if size <= MAX_PROMPT_LOGPROBS_BYTES:
        return None
    most = MAX_PROMPT_LOGPROBS_BYTES // (4 + 8 * k) + 1
    return (f"prompt logprobs with the top {k} are served for prompts of at most {most} "
            f"tokens (got {prompt_len}); ask for fewer top logprobs")  # fmt: skip
