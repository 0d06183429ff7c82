"""`pdserve prefill` and `pdserve decode`: one HTTP frontend plus its engine process.

Every engine default comes from the pdserve.config dataclasses and every server
default from ServerConfig, so each default lives in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, TransferConfig
from pdserve.server.server_config import ServerConfig

API_KEY_ENV = "PDSERVE_API_KEY"


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=_default(EngineConfig, "dtype"))
    p.add_argument("--device", default=_default(EngineConfig, "device"))
    p.add_argument("--kernel-backend", default=_default(EngineConfig, "kernel_backend"))
    p.add_argument("--attention-backend", default=_default(EngineConfig, "attention_backend"))
    p.add_argument("--seed", type=int, default=_default(EngineConfig, "seed"))
    p.add_argument("--page-size", type=int, default=_default(CacheConfig, "page_size"))
    p.add_argument("--max-total-tokens", type=int, default=_default(CacheConfig, "max_total_tokens"))  # fmt: skip
    p.add_argument("--max-context", type=int, default=_default(CacheConfig, "max_context"))
    p.add_argument("--max-running-requests", type=int,
                   default=_default(SchedulerConfig, "max_running_requests"))  # fmt: skip
    p.add_argument("--max-prefill-tokens", type=int,
                   default=_default(SchedulerConfig, "max_prefill_tokens"))  # fmt: skip
    p.add_argument("--max-queued-requests", type=int,
                   default=_default(SchedulerConfig, "max_queued_requests"))  # fmt: skip
    p.add_argument("--disable-overlap", action="store_true")


def _add_server_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the cached tiny model)")
    p.add_argument("--host", default=_default(ServerConfig, "host"))
    p.add_argument("--port", type=int, default=_default(ServerConfig, "port"))
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help=f"bearer key (or env {API_KEY_ENV})")
    p.add_argument("--max-body-bytes", type=int, default=_default(ServerConfig, "max_body_bytes"))
    p.add_argument("--engine-start-timeout", type=float,
                   default=_default(ServerConfig, "engine_start_timeout_s"))  # fmt: skip
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="debug | info | warning")
    p.add_argument("--transfer-host", default=_default(TransferConfig, "host"),
                   help="interface of the KV transfer socket")  # fmt: skip
    p.add_argument("--advertise-host", default=_default(TransferConfig, "advertise_host"))
    if role == "prefill":
        p.add_argument("--bootstrap-port", type=int,
                       default=_default(TransferConfig, "bootstrap_port"))  # fmt: skip


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    for role, text in (("prefill", "run a prefill server"), ("decode", "run a decode server")):
        p = subparsers.add_parser(role, help=text, description=text)
        _add_server_flags(p, role)
        _add_engine_flags(p)
        p.set_defaults(func=lambda args, role=role: run_server(role, args))


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from pdserve.model.make import default_model_path  # lazily: builds the model on first use

    return str(default_model_path("tiny"))


def configs_from_args(role: str, args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """(ServerConfig, EngineSpec) from parsed flags."""
    from pdserve.server.engine_proc import EngineSpec

    model = _model_path(args.model)
    engine = EngineConfig(
        model_path=model, dtype=args.dtype, device=args.device,
        kernel_backend=args.kernel_backend, attention_backend=args.attention_backend,
        seed=args.seed,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                          max_context=args.max_context),
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  max_prefill_tokens=args.max_prefill_tokens,
                                  max_queued_requests=args.max_queued_requests,
                                  disable_overlap=args.disable_overlap),
    )  # fmt: skip
    transfer = TransferConfig(
        host=args.transfer_host,
        advertise_host=args.advertise_host,
        bootstrap_port=getattr(args, "bootstrap_port", _default(TransferConfig, "bootstrap_port")),
    )
    server = ServerConfig(
        role=role, model_path=model, host=args.host, port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes, engine_start_timeout_s=args.engine_start_timeout,
        log_level=getattr(args, "log_level", "info"),
    )  # fmt: skip
    return server, EngineSpec(role=role, engine=engine, transfer=transfer)


def run_server(role: str, args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.server.app import create_app

    server, spec = configs_from_args(role, args)
    app = create_app(server, spec)
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level.lower(),
                timeout_graceful_shutdown=5)  # fmt: skip
    return 0


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
