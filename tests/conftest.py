"""Shared fixtures: reference checkpoints made once per session, and the
`transformers` greedy reference (the correctness oracle nobody here wrote)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest
import qwen_stack as qwen
import smollm2_stack as smol
import torch

# Every test process uses one model cache beside the repository's test run,
# so the servers started by tests find the same checkpoints.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The suite runs what is served: decode engines build (once, into the cache above) and
# use the native CPU decode attention; tests/test_native_decode.py also runs the
# portable path and the fallback without a C compiler.


@cache
def model_path(preset: str) -> Path:
    from pdserve.checkpoints.presets import default_model_path

    return default_model_path(preset)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return model_path("tiny")


@cache
def _hf_model(path: str):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m


def hf_greedy(path: str | Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping early at EOS."""
    return greedy_of(_hf_model(str(path)), prompt, max_new_tokens)


def greedy_of(m, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`m.generate` greedy (a loaded transformers model), never stopping early at EOS."""
    with torch.no_grad():
        out = m.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_pools_free(llm) -> None:
    for role, s in llm.stats().items():
        assert s["free_rows"] == s["total_rows"], (role, s)
        assert s["free_kv_pages"] == s["total_kv_pages"], (role, s)


@pytest.fixture(scope="session")
def console_driver():
    """One headless Chromium for the console's browser tests (tests/console_browser.py);
    skips when Chromium is not installed."""
    from console_browser import start_driver

    d = start_driver()
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="session")
def console_shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the console's screenshots go: $PDSERVE_CONSOLE_SCREENSHOTS, else a temp folder."""
    out = os.environ.get("PDSERVE_CONSOLE_SCREENSHOTS")
    path = Path(out) if out else tmp_path_factory.mktemp("console")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def qwen_stack(tmp_path_factory: pytest.TempPathFactory):
    """One `pdserve up` of Qwen2.5-Coder-0.5B for every test that asks (tests/qwen_stack.py)."""
    yield from qwen.start(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory: pytest.TempPathFactory):
    """One `pdserve up` of SmolLM2 for every test that asks (tests/smollm2_stack.py)."""
    yield from smol.start(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_ref():
    """transformers on SmolLM2's GGUF, loaded once for every test that asks."""
    yield from smol.reference()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    qwen.note_users(items)
    smol.note_users(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield
    qwen.after_test(item.nodeid)
    smol.after_test(item.nodeid)
