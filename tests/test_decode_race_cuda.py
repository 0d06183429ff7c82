"""The row-reuse race of docs/architecture.md §3 on CUDA streams (skipped without a GPU).

Same scenario as tests/test_decode_race.py, but on CUDA the forward work is issued
from the scheduler thread, so holding the host would hold the scheduler too. The race
is provoked on the device instead: the redundant step of X enqueues a ~0.2 s
`torch.cuda._sleep` on the forward stream between sampling and publishing. Without the
fence, process_prebuilt's writes on the schedule stream run during that sleep and the
delayed publish overwrites Y's first token; with it, the schedule stream waits.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import tests.test_decode_race as race
from pdserve.config import EngineConfig
from pdserve.protocol import EngineRequest
from pdserve.scheduler.decode_step import StepResult
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the race runs on CUDA streams"
)
SLEEP_CYCLES = 300_000_000  # ~0.2 s at 1.5 GHz: far longer than a tiny-model step


def _run_race_cuda(model, monkeypatch, fence: bool) -> tuple[list[int], bool]:
    monkeypatch.setattr(race, "EngineConfig", partial(EngineConfig, device="cuda"))
    prefill, decode = race._engines(model)
    held = []

    def delay_redundant_publish(step: StepResult) -> None:
        if race.is_redundant(step):
            held.append(True)
            torch.cuda._sleep(SLEEP_CYCLES)  # on the forward stream: delays the publish

    decode.forward_hook = delay_redundant_publish
    if not fence:
        decode.schedule_stream.wait_stream = lambda other: None  # type: ignore[method-assign]
    for rid, prompt in (("x", race.X_PROMPT), ("y", race.Y_PROMPT)):
        params = race.params_of(model, rid)
        er = EngineRequest(rid=rid, input_ids=prompt, params=params, room=hash(rid) & 0xFFFF)
        prefill.add_request(er)
        decode.add_request(er)
    tokens: dict[str, list[int]] = {"x": [], "y": []}
    finished: set[str] = set()
    for _ in range(500):
        prefill.step()
        for ev in decode.step():
            tokens[ev.rid].extend(ev.token_ids)
            finished.update([ev.rid] if ev.finished else [])
        if finished == {"x", "y"}:
            break
    decode.drain()
    stats = decode.stats()
    assert stats["free_rows"] == stats["total_rows"]
    assert stats["free_kv_pages"] == stats["total_kv_pages"]
    decode.close()
    return tokens["y"], bool(held)


def test_prebuilt_waits_for_forward_on_cuda(tiny_model, monkeypatch) -> None:
    y, held = _run_race_cuda(tiny_model, monkeypatch, fence=True)
    assert held, "the redundant step never ran: the test did not set up the race"
    assert y == hf_greedy(tiny_model, race.Y_PROMPT, race.Y_TOKENS)


def test_without_fence_the_race_corrupts_tokens_on_cuda(tiny_model, monkeypatch) -> None:
    y, held = _run_race_cuda(tiny_model, monkeypatch, fence=False)
    assert held
    assert y != hf_greedy(tiny_model, race.Y_PROMPT, race.Y_TOKENS), "race not provoked"
