"""Every command-line flag and PDSERVE_* variable the docs name exists.

A flag named in README.md or docs/ is one of pdserve's (any sub-command), one of a
benchmark script's, or one of the other tools the docs show commands of (docker,
kubectl, pip, sglang-router), listed here by tool. A PDSERVE_* variable is one of the
typed registry (pdserve/envs.py) or one the deployment files define (compose, the
Dockerfile, deploy/)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pdserve import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")
VAR = re.compile(r"PDSERVE_[A-Z0-9_]+")
FOREIGN = {
    "docker": {"--build-arg", "--network", "--rm", "--volumes", "--scale", "--profile",
               "--format", "--bind"},
    "kubectl": {"--replicas", "--include", "--directory"},
    "pip": {"--find-links", "--require-hashes"},
    "sglang-router": {"--prefill-selector", "--decode-selector", "--service-discovery-port",
                      "--variant"},
}  # fmt: skip


def pdserve_flags() -> set[str]:
    flags: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(cli.build_parser())
    return flags


def script_flags() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "benchmarks").rglob("*.py"):
        found |= set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', path.read_text()))
    return found


def defined_vars() -> set[str]:
    found = set(VAR.findall((ROOT / "pdserve" / "envs.py").read_text()))
    deploy = [ROOT / "Dockerfile", ROOT / "docker-compose.yml", *(ROOT / "deploy").rglob("*")]
    for path in deploy:
        if path.is_file():
            found |= set(VAR.findall(path.read_text(errors="replace")))
    return found


def unknown_names(text: str, flags: set[str], variables: set[str]) -> list[str]:
    return sorted(
        {f for f in FLAG.findall(text) if f not in flags} | set(VAR.findall(text)) - variables
    )


def test_every_flag_and_variable_in_the_docs_exists() -> None:
    flags = pdserve_flags() | script_flags() | set().union(*FOREIGN.values())
    variables = defined_vars()
    bad = {doc.name: unknown_names(doc.read_text(), flags, variables) for doc in DOCS}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_check_finds_a_name_that_does_not_exist() -> None:
    flags, variables = pdserve_flags(), defined_vars()
    assert "--max-running-requests" in flags and "--compile" not in flags
    text = "run `pdserve serve --compile` with PDSERVE_TURBO=1 and --max-running-requests 8"
    assert unknown_names(text, flags, variables) == ["--compile", "PDSERVE_TURBO"]
