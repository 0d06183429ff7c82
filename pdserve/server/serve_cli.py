"""`pdserve prefill` and `pdserve decode`: one HTTP frontend plus its engine process.

The flags (serve_flags.py) into a ServerConfig and an EngineSpec, then the app served
until it is stopped or its engine dies.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TransferConfig,
)
from pdserve.envs import ENV
from pdserve.server.serve_flags import (
    add_decode_flags,
    add_engine_flags,
    add_server_flags,
    config_from_flags,
)
from pdserve.server.server_config import ServerConfig


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    for role, text in (("prefill", "run a prefill server"), ("decode", "run a decode server")):
        p = subparsers.add_parser(role, help=text, description=text)
        add_server_flags(p, role)
        add_engine_flags(p)
        if role == "decode":
            add_decode_flags(p)
        p.set_defaults(func=lambda args, role=role: run_server(role, args))


def configs_from_args(role: str, args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """(ServerConfig, EngineSpec) from parsed flags."""
    from pdserve.checkpoints.resolve import resolve_model  # lazily: may convert or build the model
    from pdserve.protocol import EngineSpec

    resolved = resolve_model(args.model)
    model = str(resolved.path)
    engine = config_from_flags(
        EngineConfig,
        args,
        model_path=model,
        cache=config_from_flags(CacheConfig, args),
        scheduler=config_from_flags(SchedulerConfig, args),
        speculative=_speculative(args),
    )
    transfer = config_from_flags(TransferConfig, args)
    server = config_from_flags(
        ServerConfig,
        args,
        role=role,
        model_path=model,
        served_model_name=args.served_model_name or resolved.name,
        api_key=args.api_key or ENV.API_KEY.get(),
        metrics_public=args.metrics_public or ENV.METRICS_PUBLIC.get() == "1",
    )
    return server, EngineSpec(role=role, engine=engine, transfer=transfer)


def _speculative(args: argparse.Namespace) -> SpeculativeConfig:
    if not hasattr(args, "speculative"):  # a prefill: it samples the first token only
        return SpeculativeConfig()
    spec = SpeculativeConfig(mode=args.speculative, k=args.spec_k, max_batch=args.spec_max_batch,
                             draft_model=args.draft_model,
                             draft_max_tokens=args.draft_max_tokens)  # fmt: skip
    if not spec.draft_model:
        return spec
    from pdserve.checkpoints.resolve import resolve_model  # may convert or build the model

    try:  # resolved like --model: a short name or a GGUF file becomes its folder
        draft = resolve_model(spec.draft_model)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--draft-model {spec.draft_model}: {e}") from None
    return dataclasses.replace(spec, draft_model=str(draft.path))


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
    drain = app.state.drain
    serve(app, host=server.host, port=server.port, api_key=server.api_key, what=f"pdserve {role}",
          sock=sock, log_level=server.log_level.lower(), timeout_graceful_shutdown=3,
          stop_when=lambda: engine_died() or drain.done(), on_sigterm=drain.start)  # fmt: skip
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
