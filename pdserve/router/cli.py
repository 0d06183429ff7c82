"""`pdserve router`: the PD router in front of prefill and decode servers."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pdserve.config import ROUTER_POLICIES, add_router_fault_flags


def add_cli(sub: Any) -> None:
    p = sub.add_parser("router", help="PD router in front of prefill and decode servers")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        required=True,
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill URL [bootstrap port]; repeat",
    )
    p.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="decode URL; repeat"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=ROUTER_POLICIES, default="round_robin")
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer key required on every route but /health, and sent to the workers "
        "(else $PDSERVE_API_KEY)",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the API key (for a scraper on a trusted network)",
    )
    add_router_fault_flags(p)
    p.add_argument(
        "--no-web-ui",
        action="store_true",
        help="do not serve the web console (GET / and /console/*)",
    )
    p.add_argument(
        "--pd-disaggregation", action="store_true", help="accepted for sglang-router parity"
    )
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from pdserve.edge.listen import serve  # lazy: keeps --help quick
    from pdserve.router.app import config_from_args, create_app

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"pdserve router: {e}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per worker health poll
    app = create_app(cfg)  # a loop that dies sets state.fatal: uvicorn is asked to stop
    state = app.state.router
    serve(app, host=cfg.host, port=cfg.port, api_key=cfg.api_key, what="pdserve router",
          log_level="warning", stop_when=lambda: state.fatal is not None)  # fmt: skip
    if state.fatal is not None:
        raise SystemExit(f"pdserve router: {state.fatal}")
    return 0
