"""The decode forward never waits on the host (issue: a forward that never waits).

On CUDA, a closure on the forward stream that reads a device value on the host
(`.item()`, `.tolist()`, `int(t)`, ...) or builds a tensor from host data
(`torch.tensor(..., device=...)`, a synchronous host-to-device copy) blocks the
scheduler thread until the device catches up, and the overlap is gone. No GPU
runs here, so the CPU run guards the same property: every closure issued on the
decode's forward stream runs under a guard that raises on each of those calls.

The guard is shown to bite: a deliberate `.item()` in the forward (through the
forward hook) is caught, and so is the attention plan built inside the closure
again instead of on the schedule side.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kernels.stream import StreamError
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff
from tests.conftest import hf_greedy


class HostSyncError(AssertionError):
    """A forward-stream closure read a device value on the host or copied host data in."""


_guarded = threading.local()  # .active: True while a forward closure runs in this thread
_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _raise_when_active(name: str, fn: Callable) -> Callable:
    def guarded(*args, **kwargs):
        if getattr(_guarded, "active", False):
            raise HostSyncError(f"host sync inside the forward closure: {name}")
        return fn(*args, **kwargs)

    return guarded


@contextmanager
def host_sync_guard() -> Iterator[None]:
    """Patch the host-sync entry points; they raise only in a thread whose
    `_guarded.active` is set (the forward worker, inside a closure)."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    saved_tensor = torch.tensor
    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, _raise_when_active(f"Tensor.{name}", fn))
        torch.tensor = _raise_when_active("torch.tensor", saved_tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = saved_tensor


def guard_forward_stream(decode: DecodeEngine) -> list[int]:
    """Run every closure issued on the decode's forward stream under the guard.
    Returns a one-element counter of guarded closures (so a test sees they ran)."""
    stream, count = decode.forward_stream, [0]
    plain_run = stream.run

    def run(fn: Callable[[], object]) -> None:
        def guarded() -> object:
            _guarded.active = True
            try:
                count[0] += 1
                return fn()
            finally:
                _guarded.active = False

        plain_run(guarded)

    stream.run = run  # type: ignore[method-assign]
    return count


PROMPTS = [[17, 29, 333, 41, 5], [900, 18, 77, 2001, 64, 9, 1200], [3, 1000]]
NEW = 6


def _engines(model) -> tuple[PrefillEngine, DecodeEngine]:
    cfg = EngineConfig(
        model_path=str(model),
        cache=CacheConfig(page_size=4, max_total_tokens=512, max_context=64),
        scheduler=SchedulerConfig(max_running_requests=4),
    )
    handoff = InProcessHandoff()
    prefill_runner = ModelRunner(cfg)
    prefill = PrefillEngine(cfg, prefill_runner, handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=prefill_runner.model), handoff.source)
    return prefill, decode


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _generate(
    prefill: PrefillEngine,
    decode: DecodeEngine,
    prompts=PROMPTS,
    params: SamplingParams | list[SamplingParams] = GREEDY,
) -> dict[str, list]:
    """Greedy (or `params`: one for all, or one a prompt) tokens of each prompt, by rid."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, each, strict=True)):
        er = EngineRequest(rid=str(i), input_ids=prompt, params=p, room=i + 1)
        prefill.add_request(er)
        decode.add_request(er)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(400):
        prefill.step()
        for ev in decode.step():
            tokens[ev.rid].extend(ev.token_ids)
            assert ev.error is None, ev.error
            done |= {ev.rid} if ev.finished else set()
        if len(done) == len(prompts):
            break
    decode.drain()
    return tokens


def test_decode_forward_has_no_host_sync(tiny_model) -> None:
    prefill, decode = _engines(tiny_model)
    ran = guard_forward_stream(decode)
    try:
        with host_sync_guard():
            tokens = _generate(prefill, decode)
    finally:
        decode.close()
    # the prefill samples the first token; NEW - 1 decode steps sample the rest
    assert ran[0] >= NEW - 1, "the guarded forward closures never ran"
    for i, prompt in enumerate(PROMPTS):
        assert tokens[str(i)] == hf_greedy(tiny_model, prompt, NEW)


def test_sampled_decode_has_no_host_sync(tiny_model) -> None:
    """Temperature, top-k, top-p and min-p sampling stay on the device too; seeded, the
    guarded run gives the tokens of an unguarded one."""
    params = SamplingParams(
        max_tokens=NEW, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=5, ignore_eos=True
    )
    runs = []
    for guarded in (False, True):
        prefill, decode = _engines(tiny_model)
        if guarded:
            guard_forward_stream(decode)
        try:
            with host_sync_guard():
                runs.append(_generate(prefill, decode, PROMPTS, params))
        finally:
            decode.close()
    assert runs[0] == runs[1] and all(len(t) == NEW for t in runs[1].values())


def test_guard_catches_a_deliberate_item(tiny_model) -> None:
    prefill, decode = _engines(tiny_model)
    guard_forward_stream(decode)
    decode.forward_hook = lambda step: step.tokens[0].item()  # a host read in the closure
    try:
        with host_sync_guard(), pytest.raises(StreamError) as err:
            _generate(prefill, decode, PROMPTS[:1])
    finally:
        decode.close()
    assert isinstance(err.value.__cause__, HostSyncError), err.value.__cause__


def test_guard_catches_inputs_built_inside_the_forward(tiny_model) -> None:
    """Skip the schedule-side prepare: the forward builds its attention plan itself
    (`torch.tensor` from host lists), as it did before this guard existed."""
    prefill, decode = _engines(tiny_model)
    guard_forward_stream(decode)
    real_prepare = decode.runner.prepare

    def prepare_only_inside_the_forward(batch) -> None:
        if threading.current_thread() is not threading.main_thread():
            real_prepare(batch)  # the forward's own fallback, now inside the closure

    decode.runner.prepare = prepare_only_inside_the_forward  # type: ignore[method-assign]
    try:
        with host_sync_guard(), pytest.raises(StreamError) as err:
            _generate(prefill, decode, PROMPTS[:1])
    finally:
        decode.close()
    assert isinstance(err.value.__cause__, HostSyncError), err.value.__cause__
