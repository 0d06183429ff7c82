"""The decode forward issues no host sync on CUDA (skipped without a GPU).

The CPU guard (tests/test_forward_sync_guard.py) patches the Python entry points;
here torch's own detector does it: every closure on the forward stream runs under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any operation that makes
the host wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

import tests.test_forward_sync_guard as guard
from pdserve.config import EngineConfig
from pdserve.kernels.stream import StreamError
from pdserve.scheduler.decode import DecodeEngine
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch's sync detector watches the device"
)


def sync_errors_in_forward(decode: DecodeEngine) -> list[int]:
    stream, count = decode.forward_stream, [0]
    plain_run = stream.run

    def run(fn: Callable[[], object]) -> None:
        def detected() -> object:
            count[0] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")

        plain_run(detected)

    stream.run = run  # type: ignore[method-assign]
    return count


def test_cuda_decode_forward_never_syncs(tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(guard, "EngineConfig", partial(EngineConfig, device="cuda"))
    prefill, decode = guard._engines(tiny_model)
    ran = sync_errors_in_forward(decode)
    try:
        tokens = guard._generate(prefill, decode)
    finally:
        decode.close()
    assert ran[0] >= guard.NEW - 1  # the prefill samples the first token
    for i, prompt in enumerate(guard.PROMPTS):
        assert tokens[str(i)] == hf_greedy(tiny_model, prompt, guard.NEW)


def test_cuda_detector_catches_a_deliberate_item(tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(guard, "EngineConfig", partial(EngineConfig, device="cuda"))
    prefill, decode = guard._engines(tiny_model)
    sync_errors_in_forward(decode)
    # a device value read on the host inside the forward closure
    decode.forward_hook = lambda step: torch.ones(1, device="cuda").sum().item()
    try:
        with pytest.raises((StreamError, RuntimeError)):
            guard._generate(prefill, decode, guard.PROMPTS[:1])
    finally:
        decode.close()
