"""One `pdserve up` of SmolLM2 (the default model) for the whole test session, shared by
tests/test_openai_structured.py, test_quant_real.py and test_real_model.py, and one
transformers reference on the same GGUF (test_real_model.py's `Reference`), shared by
those and test_sampling.py.

The stack's flags are the union of what its users need, none of which changes what the
others see: the quantized weights (the default, named since test_quant_real.py checks
them), a log folder (that test reads the engines' logs), n-gram speculation (greedy
answers through it must still equal transformers'; requests with a grammar or penalties
never speculate) and the hermes tool-call parser (used only by requests that send tools).
The stack stops after the last test that uses it (conftest.py's teardown hook), else at
the session's end; the reference is dropped after its last user the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FIXTURES = ("smollm2_stack", "smollm2_ref")


@dataclass(frozen=True)
class SmolStack:
    url: str
    logs: Path  # prefill0.log, decode0.log, ...


_stops: dict[str, list] = {name: [] for name in FIXTURES}  # each running fixture's release
_last: dict[str, str] = {}  # fixture -> the node id of the last collected test using it


def note_users(items: list[pytest.Item]) -> None:
    for name in FIXTURES:
        users = [i.nodeid for i in items if name in getattr(i, "fixturenames", ())]
        if users:
            _last[name] = users[-1]


def after_test(nodeid: str) -> None:
    """Release each shared fixture once the last test that uses it is done."""
    for name, last in _last.items():
        if nodeid == last:
            release(name)


def release(name: str) -> None:
    while _stops[name]:
        _stops[name].pop()()


def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolStack]:
    from test_e2e_pd import free_port, spawn, stop, wait_healthy

    port, logs = free_port(), tmp_path_factory.mktemp("smollm2-logs")
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--port",
        str(port),
        "--grace-period",
        "5",
        "--max-total-tokens",
        "4096",
        "--weights",
        "quantized",
        "--log-dir",
        str(logs),
        "--speculative",
        "ngram",
        "--tool-call-parser",
        "hermes",
    ]  # fmt: skip — no --model: the default
    proc = spawn(argv, "smollm2-up")
    _stops["smollm2_stack"].append(lambda: stop(proc))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [proc], timeout_s=300.0)
        yield SmolStack(url, logs)
    finally:
        release("smollm2_stack")


def reference() -> Iterator[Any]:
    from test_real_model import Reference

    ref = Reference()
    _stops["smollm2_ref"].append(ref.drop)
    try:
        yield ref
    finally:
        release("smollm2_ref")
