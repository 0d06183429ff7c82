"""The decode's schedule thread claims a core of the native forward's while it computes
beside an in-flight step (overlap on CPU, kernels/core_share.HostCore), and gives it back
whenever it blocks: the forward's kernels then split over one part fewer, with the same
logits. Without the release the forward would run one thread short for good, which
test_without_the_release_the_forward_never_gets_the_core_back shows."""

from __future__ import annotations

import contextlib
import ctypes
import time

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kernels.core_share import HostCore
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.decode_step import StepResult
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff
from tests.conftest import hf_greedy
from tests.test_decode_forward import _runner, _step

_RANGE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_PAR = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
)


def test_a_claim_takes_one_part_from_every_split_and_changes_no_logit(monkeypatch) -> None:
    runner = _runner("tiny", monkeypatch)
    native = runner.native_forward
    assert native is not None and native.host is runner.cores.host_core
    handed: list[int] = []

    def par_run(fn: int, args: int, n: int, parts: int) -> int:  # par.c's, on this thread
        handed.append(parts)
        _RANGE(fn)(args, 0, n)
        return 0

    recorder = _PAR(par_run)
    saved, native.plan.par_run = native.plan.par_run, ctypes.cast(recorder, ctypes.c_void_p).value
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = _step(runner, [5, 17, 2], seed=3)
        runner.prepare(batch)
        k0, v0 = runner.kv_pool.k.clone(), runner.kv_pool.v.clone()
        free = native(batch)
        assert handed and set(handed) == {2}, handed  # every split on two threads
        handed.clear()
        runner.kv_pool.k.copy_(k0)
        runner.kv_pool.v.copy_(v0)
        runner.cores.host_core.claim()
        claimed = native(batch)
        assert handed == []  # one part each: nothing handed to the workers
    finally:
        runner.cores.host_core.release()
        native.plan.par_run = saved
        torch.set_num_threads(before)
    assert torch.equal(free, claimed)


@pytest.fixture(autouse=True)
def _native(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    monkeypatch.delenv("PDSERVE_PER_CALL_DECODE", raising=False)


def _engine(model, overlap: bool) -> tuple[PrefillEngine, DecodeEngine]:
    cfg = EngineConfig(
        model_path=str(model),
        cache=CacheConfig(page_size=4, max_total_tokens=256, max_context=64),
        scheduler=SchedulerConfig(max_running_requests=2, disable_overlap=not overlap),
    )
    handoff = InProcessHandoff()
    prefill_runner = ModelRunner(cfg)
    prefill = PrefillEngine(cfg, prefill_runner, handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=prefill_runner.model), handoff.source)
    if decode.runner.native_forward is None:
        pytest.skip("the native decode forward is not built here (needs a C compiler, AVX2)")
    return prefill, decode


def _claims_seen_by_the_forward(
    model, overlap: bool, wait_s: float = 2.0
) -> tuple[list[bool], list[bool]]:
    """(for each step, whether the claim was released while the step's forward waited
    for it; after each decode.step(), whether the schedule thread held the claim)."""
    prefill, decode = _engine(model, overlap)
    host: HostCore = decode.runner.cores.host_core
    released: list[bool] = []

    def wait_for_release(step: StepResult) -> None:  # on the forward stream
        end = time.monotonic() + wait_s
        while host.claimed and time.monotonic() < end:
            time.sleep(0.001)
        released.append(not host.claimed)

    decode.forward_hook = wait_for_release
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    er = EngineRequest(rid="a", input_ids=[5, 17, 29, 333], params=params, room=7)
    prefill.add_request(er)
    decode.add_request(er)
    held_after_step: list[bool] = []
    for _ in range(200):
        prefill.step()
        decode.step()
        held_after_step.append(host.claimed)
        if not decode.has_unfinished():
            break
    decode.drain()
    decode.close()
    return released, held_after_step


def test_overlap_claims_a_core_for_host_work_and_releases_it_while_waiting(tiny_model) -> None:
    released, held = _claims_seen_by_the_forward(tiny_model, overlap=True)
    assert len(released) >= 2 and all(released), released
    assert all(held), held  # back from step(): host work, the claim is held


def test_without_overlap_nothing_is_ever_claimed(tiny_model) -> None:
    released, held = _claims_seen_by_the_forward(tiny_model, overlap=False, wait_s=0.0)
    assert released and all(released) and not any(held)


def test_without_the_release_the_forward_never_gets_the_core_back(tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(DecodeEngine, "_blocked", lambda self: contextlib.nullcontext())
    released, _ = _claims_seen_by_the_forward(tiny_model, overlap=True, wait_s=0.2)
    assert released and not any(released)


@pytest.mark.parametrize("claimed", [False, True])
def test_a_claim_changes_no_greedy_token(tiny_model, claimed) -> None:
    """transformers' greedy tokens, with the claim held for the whole run or never."""
    prefill, decode = _engine(tiny_model, overlap=True)
    decode._host = None  # the engine no longer moves the claim ...
    if claimed:
        decode.runner.cores.host_core.claim()  # ... and every kernel runs one part short
    prompt = [900, 18, 77, 2001]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    er = EngineRequest(rid="a", input_ids=prompt, params=params, room=9)
    prefill.add_request(er)
    decode.add_request(er)
    tokens: list[int] = []
    try:  # NOTE: the forward thread runs the machine's cores' threads (two on CI)
        for _ in range(200):
            prefill.step()
            for ev in decode.step():
                tokens.extend(ev.token_ids)
            if not decode.has_unfinished():
                break
        decode.drain()
    finally:
        decode.close()
    assert tokens == hf_greedy(tiny_model, prompt, 6)
