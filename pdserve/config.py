"""Engine configuration: frozen dataclasses, composed. The CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Worker selection policies of the PD router (`pdserve router --policy`, `pdserve up --policy`).
# cache_aware: prefills by the prompt prefixes routed to them before (router/policy.py)
ROUTER_POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True)
class RouterFaults:
    """The router's fault settings (docs/reliability.md); flags of `pdserve router` and
    `pdserve up` alike (ROUTER_FAULT_FLAGS)."""

    migration_limit: int = 3  # times one request may move to another pair (0: never)
    stall_timeout_s: float = 30.0  # a streamed decode silent this long is given up on
    health_interval_s: float = 2.0  # the router's /health poll of every worker
    health_timeout_s: float = 3.0  # a /health slower than this marks the worker unhealthy
    max_in_flight: int = 256  # per worker; every worker of a kind full: shed (0: no limit)
    retry_after_s: int = 1  # a shed request's Retry-After


# flag -> (RouterFaults field, help); the default is appended from RouterFaults
ROUTER_FAULT_FLAGS = {
    "--migration-limit": ("migration_limit", "times a request may move to another "
                          "prefill/decode pair after a failure (0: never)"),
    "--stall-timeout": ("stall_timeout_s", "seconds a streamed decode may stay silent before "
                        "its request moves"),
    "--health-interval": ("health_interval_s", "seconds between the router's worker health "
                          "checks"),
    "--health-timeout": ("health_timeout_s", "seconds a worker's /health may take before "
                         "it counts as unhealthy"),
    "--max-in-flight": ("max_in_flight", "requests per worker beyond which it gets no more; "
                        "all full: the router sheds with 503 (0: no limit)"),
}  # fmt: skip


def add_router_fault_flags(parser: Any) -> None:
    """ROUTER_FAULT_FLAGS on an argparse parser; a flag not given stays None."""
    for flag, (dest, text) in ROUTER_FAULT_FLAGS.items():
        default = getattr(RouterFaults, dest)
        parser.add_argument(flag, dest=dest, type=type(default), default=None,
                            help=f"{text} (default {default})")  # fmt: skip


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and request rows.

    Slots are numbered `page * page_size + offset`. Page 0 is reserved as the
    padding page (its slots absorb writes of padded positions), so a pool of
    `num_pages` has `num_pages - 1` usable pages.
    """

    page_size: int = 16
    max_total_tokens: int = 65536  # KV capacity in tokens (rounded up to pages)
    # longest prompt + output of one request; 0: the model's own (max_position_embeddings,
    # a GGUF's context_length), see context_length
    max_context: int = 0
    # the prefill keeps finished prompts' full KV pages for later prompts with the same
    # prefix (kvcache/prefix_cache.py), evicting the least recently used under pressure
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        _at_least(self, 1, "page_size", "max_total_tokens")
        _at_least(self, 0, "max_context")

    def context_length(self, model_max: int | None) -> int:
        """The context served: `max_context` when set, never beyond the model's; else the
        model's own, capped by what the pool holds (one request must fit it). A request
        beyond a set context's pool is refused by its KV pages instead."""
        if self.max_context:
            return min(self.max_context, model_max or self.max_context)
        pool = (self.num_pages - 1) * self.page_size
        return min(model_max or pool, pool)

    @property
    def num_pages(self) -> int:
        return -(-self.max_total_tokens // self.page_size) + 1  # +1: padding page 0

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_context // self.page_size)


# On a 2-core CPU, 256 keeps TTFT p50 short at no loss of output tok/s: a larger budget
# makes a burst's first step long, a smaller one streams the weights more often, costing
# tok/s (benchmarks/compare.py); on CUDA a step of 4096 tokens is still short.
PREFILL_TOKENS_BY_DEVICE = {"cpu": 256, "cuda": 4096}


# A mixture-of-experts prompt step reads every expert's weights and meets each with
# budget * top_k / experts of its tokens. Below a few of the int8 GEMM's groups of 16
# rows an expert takes the per-row kernels, which cost more per token; 64 on average
# keeps almost every expert on the GEMM. Capped so that one step stays short.
MOE_ROWS_PER_EXPERT = 64
MOE_MAX_PREFILL_TOKENS = 2048


def prefill_budget(max_prefill_tokens: int, device: str, experts: int = 0, top_k: int = 1) -> int:
    """The prefill step's token budget: the configured one, else the device's default,
    raised for a mixture of `experts` routing each token to `top_k` so that a step meets
    each expert with MOE_ROWS_PER_EXPERT tokens on average."""
    if max_prefill_tokens:
        return max_prefill_tokens
    base = PREFILL_TOKENS_BY_DEVICE[device.split(":")[0]]
    moe = MOE_ROWS_PER_EXPERT * experts // max(top_k, 1)
    return max(base, min(moe, MOE_MAX_PREFILL_TOKENS))


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    # prompt tokens per prefill step; 0: PREFILL_TOKENS_BY_DEVICE (on CPU a prompt alone is
    # not split up to twice that: PrefillEngine._budget). Smaller steps let the
    # first prompts of a burst finish (and their decodes start) before the last ones.
    max_prefill_tokens: int = 0
    max_queued_requests: int = 4096  # beyond this new requests are refused
    disable_overlap: bool = False
    # prefill first (engines sharing a host through core_share): while the prefill holds
    # prompts, the decode skips steps for at most this many ms in a row and lends it its
    # cores. Those prompts reach their first token sooner, at the cost of the running
    # streams' TPOT; 0 = off.
    prefill_first_ms: int = 250
    # when the decode steps aside: "always" while the prefill holds any prompt (a new
    # prompt computes on every core; the running streams wait for it), "burst" only while
    # it holds more prompts than the decode runs streams (never in a steady state: more
    # tokens/s, first tokens later). "always" is the default: on 2 vCPUs its first tokens
    # come sooner at no loss of tokens/s (benchmarks/prefill_first.py)
    prefill_first: str = "always"
    # which admitted prompts a prefill step computes first: "shortest" (the fewest prompt
    # tokens left; a burst's median first token comes sooner, its longest prompts later)
    # or "arrival". A prompt waiting longer than prefill_max_wait_ms goes ahead of
    # every younger one in either order, so a stream of short prompts cannot starve it.
    prefill_order: str = "shortest"
    prefill_max_wait_ms: int = 10_000

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_running_requests")
        _at_least(self, 0, "max_prefill_tokens", "max_queued_requests", "prefill_first_ms")
        if self.prefill_first not in PREFILL_FIRST_MODES:
            raise ValueError(
                f"prefill_first must be one of {PREFILL_FIRST_MODES}, got {self.prefill_first!r}"
            )
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}"
            )
        if self.prefill_max_wait_ms < 0:
            raise ValueError(f"prefill_max_wait_ms must be >= 0, got {self.prefill_max_wait_ms}")


PREFILL_FIRST_MODES = ("burst", "always")
PREFILL_ORDERS = ("shortest", "arrival")


SPECULATIVE_MODES = ("off", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on the decode engine (scheduler/speculation.py,
    docs/architecture.md §13). "ngram": drafts looked up in the request's own prompt and
    output; "draft": drafts from a second, small model of the same vocabulary
    (scheduler/draft.py); either verified k + 1 positions in one forward."""

    mode: str = "off"
    k: int = 8  # draft tokens proposed per request and step, at most (benchmarks/speculative.py)
    # a batch of more running requests than this does not speculate (the overlap loop's
    # one-token steps win there); 0: never. The measured rule is in scheduler/speculation.py
    max_batch: int = 1
    # "draft": the draft model's folder or GGUF file, resolved like --model (the CLI
    # resolves a short name to its folder before it gets here)
    draft_model: str = ""
    # "draft": KV capacity of the draft model's own pool in tokens; 0: the decode's
    # --max-total-tokens (a request whose draft KV does not fit drafts nothing)
    draft_max_tokens: int = 0

    def __post_init__(self) -> None:
        _one_of(self, "mode", SPECULATIVE_MODES)
        if not 1 <= self.k <= 16:
            raise ValueError(f"k (--spec-k) must be in [1, 16], got {self.k}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch (--spec-max-batch) must be >= 0, got {self.max_batch}")
        _at_least(self, 0, "draft_max_tokens")
        if self.mode == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model (the drafting model)")
        if self.mode != "draft" and self.draft_model:
            raise ValueError(
                f"--draft-model is only for --speculative draft, not --speculative {self.mode}"
            )
        if self.mode != "draft" and self.draft_max_tokens:
            raise ValueError(
                f"--draft-max-tokens is only for --speculative draft, not --speculative {self.mode}"
            )

    @property
    def on(self) -> bool:
        return self.mode != "off" and self.max_batch > 0


DTYPES = ("float32", "bfloat16", "float16")  # weights and KV; model/runner.py maps them
WEIGHTS = ("quantized", "float32")  # a GGUF's projections on the CPU (model/weights.py)
QUANT_ACTIVATIONS = ("float", "int8")  # what --weights quantized's blocks meet (model/weights.py)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # a GGUF model on the CPU: "quantized" computes its projections from the file's blocks
    # (model/quant_weights.py), "float32" from the converted folder's float32 weights; a
    # Hugging Face folder and CUDA always take the folder's weights
    weights: str = "quantized"
    # with --weights quantized: "float" computes "de-quantize, then the float32 matmul";
    # "int8" quantizes each projection's input to 8 bits per block and takes integer dot
    # products (kernels/native/quant_int8.h), as llama.cpp does: faster, and not equal to
    # the float path (docs/models.md states what it equals)
    quant_activations: str = "float"
    device: str = "cpu"  # cpu | cuda
    kernel_backend: str = "torch"  # torch | triton (FutureMap kernels)
    attention_backend: str = "auto"  # auto | torch | triton
    num_threads: int = 0  # torch intra-op threads of the engine process (0: torch's default)
    # build the native CPU decode attention with the machine's C compiler (cached under the
    # cache dir); PDSERVE_DISABLE_COMPILE=1 turns it off whatever this says
    compile: bool = True
    # CUDA: replay the decode forward from CUDA graphs captured at start-up, one per
    # batch-size bucket (model/cuda_graph.py); False launches its kernels one by one
    cuda_graph: bool = True
    # "PATH:SLOT:ENGINES": borrow idle peer engines' cores on this host (kernels/core_share.py);
    # `pdserve up` sets it when it chooses the thread counts
    core_share: str = ""
    # added to the engine process's niceness at start (os.nice; 0: unchanged). `pdserve up`
    # gives a decode that shares its host with a prefill DECODE_NICE: the prefill, whose
    # step holds back first tokens, then wins the contended core (launch.py)
    nice: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        _at_least(self, 0, "num_threads")
        # NOTE: backends are refused by name where they are built (kernels/future_map.py,
        # model/attention/registry.py); dtype is checked here because DTYPES is the list
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "weights", WEIGHTS)
        _one_of(self, "quant_activations", QUANT_ACTIVATIONS)
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def max_rows(self) -> int:
        return self.scheduler.max_running_requests + 1  # +1: padding row 0


@dataclass(frozen=True)
class TransferConfig:
    """The prefill<->decode KV channel (docs/architecture.md §5). KVSender and KVReceiver
    take it whole; each field is set by its flag (flag_of)."""

    # interface the bootstrap (prefill) / data (decode) socket binds
    transfer_host: str = "127.0.0.1"
    bootstrap_port: int = 8998  # prefill side
    advertise_host: str = "127.0.0.1"  # address peers connect to; "auto": this host's IP
    data_port: int = 0  # decode side: KV data socket port (0: any free port)
    # A live peer heartbeats, so a dead one is found within heartbeat_timeout_s; these
    # two bound how long a *live but overloaded* peer may keep a request queued.
    kv_ready_timeout_s: float = 300.0  # prefill: wait this long for the decode's Ready
    # Both sides: a room must be tied to the other side within this. The prefill frees a
    # room no decode announced (the decode announces a request as soon as it arrives);
    # the decode frees the pages of a Ready no prefill claimed. A live but slow other
    # side is then covered by heartbeats and the two timeouts above.
    kv_bootstrap_timeout_s: float = 10.0
    # decode: wait this long for a request's KV; prefill: for the decode's Ack of a KVDone
    kv_timeout_s: float = 300.0
    heartbeat_interval_s: float = 1.0  # heartbeat period, both ways (prefill <-> decode)
    heartbeat_timeout_s: float = 5.0  # either side fails the other's rooms after this silence
    # One cluster CURVE keypair (a zmq.auth `.key_secret` file) encrypts and authenticates
    # the channel; None falls back to PDSERVE_CURVE_PUBLIC/SECRET, else no CURVE.
    curve_secret_key_file: str | None = None


def flag_of(field_name: str) -> str:
    """The command-line flag that sets a config field: one name from the flag to the
    field, a unit suffix `_s` dropped (`kv_timeout_s` <- `--kv-timeout`)."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def _at_least(cfg: object, low: int, *names: str) -> None:
    """ValueError naming the first field among `names` below `low` (a flag of that name)."""
    for name in names:
        value = getattr(cfg, name)
        if value < low:
            raise ValueError(f"{name} ({flag_of(name)}) must be >= {low}, got {value}")


def _one_of(cfg: object, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
