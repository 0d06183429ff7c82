"""The `pdserve` command. Each subcommand lives with the package it drives and
registers itself through an `add_cli(subparsers)` function."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module path -> provides add_cli(subparsers); order is the order in --help
_COMMANDS = [
    "pdserve.checkpoints.presets",
    "pdserve.checkpoints.export",
    "pdserve.server.serve_cli",
    "pdserve.router.cli",
    "pdserve.server.launch",
    "pdserve.server.secrets_cli",
    "pdserve.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode-disaggregated LLM server.",
    )
    parser.add_argument("--log-level", default="info", help="debug | info | warning | error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _COMMANDS:
        # an import error propagates: a subcommand must never vanish into "invalid choice"
        importlib.import_module(mod).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
