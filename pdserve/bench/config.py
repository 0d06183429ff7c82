"""What one benchmark run does: a frozen dataclass the CLI takes its defaults from."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("native", "openai", "openai-chat")
DATASETS = ("random", "sharegpt", "shared-prefix")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class BenchConfig:
    """One load-test run against one server.

    Lengths are in tokens (exact with `tokenizer` or token ids; approximate
    with words otherwise). `request_rate == inf` sends every request at once
    (bounded only by `max_concurrency`).
    """

    base_url: str = "http://127.0.0.1:8000"
    backend: str = "openai"
    model: str | None = None  # None: ask GET /v1/models (OpenAI backends)
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    tokenizer: str | None = None  # folder holding tokenizer.json
    num_prompts: int = 100
    num_warmup: int = 0
    request_rate: float = math.inf
    arrival: str = "poisson"
    max_concurrency: int | None = None
    random_input_len: tuple[int, int] = (128, 512)  # inclusive range
    random_output_len: tuple[int, int] = (128, 512)
    random_tokens_as_ids: bool = False
    vocab_size: int | None = None  # range of random token ids; None: tokenizer's or 1000
    shared_prefix_groups: int = 4
    shared_prefix_prompts_per_group: int | None = None  # None: ceil(num_prompts / groups)
    shared_prefix_len: int = 256
    shared_prefix_suffix_len: int = 64
    temperature: float = 0.0
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout: float = 600.0  # seconds, whole request
    disable_progress: bool = False
    details: bool = False

    def validate(self) -> None:
        """Raise ValueError with a user-facing message on an impossible setting."""
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        if self.random_tokens_as_ids and self.backend == "openai-chat":
            raise ValueError("--random-tokens-as-ids cannot be used with openai-chat")
        if self.num_prompts < 1 or self.num_warmup < 0:
            raise ValueError("--num-prompts must be >= 1 and --num-warmup >= 0")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        for name in ("random_input_len", "random_output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got ({lo}, {hi})")
        if (
            min(self.shared_prefix_groups, self.shared_prefix_len, self.shared_prefix_suffix_len)
            < 1
        ):
            raise ValueError("--shared-prefix-groups, -len and -suffix-len must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError("--vocab-size must be >= 1")
        if self.timeout <= 0:
            raise ValueError("--timeout must be > 0")
