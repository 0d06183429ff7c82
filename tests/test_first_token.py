"""An arrival's first token leaves the decode when its KV lands, not a step later.

The prefill sampled the first token; it travels with the KV. Before the request can
join a step, the decode must wait for the forward in flight (the row fence of
docs/architecture.md §3) and for room in the batch, but the token itself needs
neither. Here the forward in flight is held on the forward stream while request Y's KV
arrives: the step() that
sees the arrival must send Y's first token (through `publish`, as under an engine
process) while the forward is still held, whether the KV landed before that step()
started (it publishes before waiting on the fence) or while it waits on the forward
(it polls for landed KV). Emitted at admission into the batch instead, or only when
step() returns, the token waits for the hold to end and the test fails. Y's tokens
still equal transformers'.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest, TokenEvent
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.decode_step import StepResult
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff
from tests.conftest import hf_greedy

X_PROMPT, Y_PROMPT = [17, 29, 333, 41, 5], [900, 18, 77, 2001, 64, 9, 1200]
Y_TOKENS = 6
HOLD_S = 5.0


def _request(rid: str, prompt: list[int], n: int) -> EngineRequest:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid=rid, input_ids=prompt, params=params, room=hash(rid) & 0xFFFF)


class _Held:
    """Prefill + decode over an in-process handoff; X decodes, then Y is admitted (its
    KV expected, not computed) and the next forward launched is held on the forward
    stream until `release` is set."""

    def __init__(self, tiny_model) -> None:  # type: ignore[no-untyped-def]
        cfg = EngineConfig(
            model_path=str(tiny_model),
            cache=CacheConfig(page_size=4, max_total_tokens=512, max_context=64),
            scheduler=SchedulerConfig(max_running_requests=2),
        )
        handoff = InProcessHandoff()
        self.prefill = PrefillEngine(cfg, ModelRunner(cfg), handoff.sink)
        runner = ModelRunner(cfg, model=self.prefill.runner.model)
        self.decode = DecodeEngine(cfg, runner, handoff.source)
        assert self.decode.overlap, "the fence under test exists only with overlap"
        self.gate, self.in_forward = threading.Event(), threading.Event()
        self.release, self.forward_done = threading.Event(), threading.Event()
        self.decode.forward_hook = self._hold
        self.tokens: dict[str, list[int]] = {"x": [], "y": []}

    def _hold(self, step: StepResult) -> None:
        if self.gate.is_set():
            self.gate.clear()
            self.in_forward.set()
            self.release.wait(timeout=HOLD_S)
            self.forward_done.set()

    def collect(self, events) -> None:  # type: ignore[no-untyped-def]
        for ev in events:
            self.tokens[ev.rid].extend(ev.token_ids)

    def start(self) -> None:
        prefill, decode = self.prefill, self.decode
        x = _request("x", X_PROMPT, 40)
        prefill.add_request(x)
        decode.add_request(x)
        while len(self.tokens["x"]) < 3:  # X decodes
            prefill.step()
            self.collect(decode.step())
        y = _request("y", Y_PROMPT, Y_TOKENS)
        prefill.add_request(y)
        decode.add_request(y)
        self.collect(decode.step())  # Y admitted: its pages reserved, its KV expected
        if decode.in_flight is not None:  # past its hook before the gate opens
            assert decode.in_flight.copy_done is not None
            decode.in_flight.copy_done.wait()
        self.gate.set()
        self.collect(decode.step())  # launches the step that the hook holds
        assert self.in_forward.wait(timeout=HOLD_S), "the forward was never held"

    def prefill_y(self) -> None:
        while self.prefill.prefilling or self.prefill.waiting:  # Y's KV handed over
            self.prefill.step()

    def finish(self, tiny_model) -> None:  # type: ignore[no-untyped-def]
        self.release.set()
        tokens, decode = self.tokens, self.decode
        for _ in range(500):
            self.collect(decode.step())
            if len(tokens["y"]) == Y_TOKENS and len(tokens["x"]) == 40:
                break
        assert tokens["y"] == hf_greedy(tiny_model, Y_PROMPT, Y_TOKENS)
        assert tokens["x"] == hf_greedy(tiny_model, X_PROMPT, 40)
        decode.drain()
        stats = decode.stats()
        assert stats["free_rows"] == stats["total_rows"]
        decode.close()


@pytest.mark.parametrize("lands", ["before the step", "while the step waits"])
def test_first_token_is_published_while_the_forward_in_flight_is_held(tiny_model, lands) -> None:
    h = _Held(tiny_model)
    want = hf_greedy(tiny_model, Y_PROMPT, 1)
    y_out = threading.Event()

    def publish(events: list[TokenEvent]) -> None:
        h.collect(events)
        if any(ev.rid == "y" for ev in events):
            y_out.set()

    h.decode.publish = publish  # as the engine process sets it
    h.start()
    if lands == "before the step":
        h.prefill_y()  # step() sees the KV at its start, then waits on the fence
    waiting = threading.Thread(target=lambda: h.collect(h.decode.step()))
    waiting.start()
    if lands == "while the step waits":
        time.sleep(0.2)  # past the step's start: it is blocked on the held forward
        assert waiting.is_alive() and not h.forward_done.is_set()
        h.prefill_y()
    assert y_out.wait(timeout=HOLD_S / 2), "no first token while the forward is held"
    assert not h.forward_done.is_set(), "published only after the forward"
    assert h.tokens["y"] == want
    h.release.set()
    waiting.join(timeout=HOLD_S)
    assert not waiting.is_alive()
    h.finish(tiny_model)
