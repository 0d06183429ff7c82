"""`pdserve export-model`: write the folder pdserve serves for a model name into a folder.

For deployments that share one model folder between servers (the compose `model`
service, a Kubernetes init container): `--model` takes what `--model` of the servers
takes (smollm2, a preset, FILE.gguf, a folder), resolved and converted once
(resolve.py), then copied to `--out`. Re-running with the same model leaves `--out` as
it is; another model replaces it (built beside it, then renamed into place).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pdserve.checkpoints.gguf.error import GGUFError
from pdserve.checkpoints.gguf.tokenizer import GGUFTokenizerError
from pdserve.checkpoints.resolve import DEFAULT_MODEL, resolve_model

# What a user can fix (a file pdserve refuses, a path or package that is missing): one
# line on stderr and exit status 1. Anything else is a bug and keeps its traceback.
USER_ERRORS = (GGUFError, GGUFTokenizerError, FileNotFoundError, NotADirectoryError)

MARKER = ".pdserve-export"  # holds the --model value the folder was exported from


def export_model(spec: str, out: str | Path) -> Path:
    """Copy the served folder of `spec` to `out`; returns `out`."""
    out = Path(out)
    if (out / MARKER).is_file() and (out / MARKER).read_text() == spec:
        return out
    src = resolve_model(spec).path
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / MARKER).write_text(spec)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _cli(args: argparse.Namespace) -> int:
    try:
        path = export_model(args.model, args.out)
    except USER_ERRORS as e:
        print(f"pdserve export-model: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.model!r} to {path}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register `pdserve export-model`."""
    parser = subparsers.add_parser(
        "export-model",
        help="write the folder pdserve serves for a model name (smollm2, a preset, a GGUF)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: pdserve export-model --model smollm2 --out /models/model",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--out", required=True, help="output folder (replaced if it differs)")
    parser.set_defaults(func=_cli)
