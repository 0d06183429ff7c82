"""Building an engine's model reads its config one way: config.json is opened in one
place for a whole ModelRunner build, and while the config is read (registry.load_arch)
no file is entered more than twice.

A visit is counted as in tests/test_walk_completion.py (a function of a file called
from a function of another pdserve file), except that the calls one frame makes into
one file are one visit: a reader that asks a rules module five questions uses it once,
while A -> B -> A -> B (readers calling each other back and forth) enters each twice.
"""

from __future__ import annotations

import builtins
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from test_walk_completion import PKG, Walk, _pdserve_file

from pdserve.config import CacheConfig, EngineConfig
from pdserve.model.arch import registry
from pdserve.model.runner import ModelRunner
from tests.conftest import model_path

MAX_VISITS = 2


class MergedWalk(Walk):
    def __init__(self) -> None:
        super().__init__()
        self._entered: set[tuple[int, str]] = set()  # (caller frame, file) seen

    def profile(self, frame: FrameType, event: str, _: Any) -> None:
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(PKG):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PKG):
            caller = caller.f_back
        if caller is None or _pdserve_file(caller) == name:
            return
        key = (id(caller), name)
        if key not in self._entered:
            self._entered.add(key)
            self._started[id(caller)] = caller  # keep it alive: ids stay unique
            self.visits.append((name[len(PKG) :], frame.f_code.co_name))


def config_opens(build: Any) -> Counter[str]:
    """Which pdserve file opened a config.json during `build()` (file: count)."""
    opened, real_open = Counter[str](), builtins.open

    def spy_open(file: Any, *args: Any, **kw: Any) -> Any:
        if Path(str(file)).name == "config.json":
            opened[sys._getframe(1).f_code.co_filename[len(PKG) :]] += 1
        return real_open(file, *args, **kw)

    builtins.open = spy_open
    try:
        build()
    finally:
        builtins.open = real_open
    return opened


def test_an_engine_build_opens_config_once() -> None:
    cfg = EngineConfig(model_path=str(model_path("tiny")), cache=CacheConfig(max_total_tokens=1024))
    assert config_opens(lambda: ModelRunner(cfg)) == {"model/arch/config.py": 1}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-llama3"])
def test_reading_a_config_walks_one_way(preset: str) -> None:
    path = model_path(preset)
    registry.load_arch(path)  # once untraced: first-use caches are not part of the walk
    walk = MergedWalk()
    sys.setprofile(walk.profile)
    try:
        registry.load_arch(path)
    finally:
        sys.setprofile(None)
    counts = walk.counts()
    assert {"model/arch/config.py", "model/arch/rules.py"} <= set(counts), walk.path()
    bouncing = {f: n for f, n in counts.items() if n > MAX_VISITS}
    assert not bouncing, f"entered more than {MAX_VISITS} times: {bouncing}\n{walk.path()}"
