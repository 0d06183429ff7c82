"""An arrival's first token leaves the decode when its KV lands, not a step later.

The prefill sampled the first token; it travels with the KV. Before the request can
join a step, the decode must wait for the forward in flight (the row fence of DESIGN
§3) and for room in the batch, but the token itself needs neither. Here the forward
in flight is held on the forward stream while request Y's KV arrives: the step() that
sees the arrival must return Y's first token while the forward is still held. (Emitted
at admission into the batch instead, step() blocks in the fence until the hold times
out, and the assertion on `forward_done` fails.) Y's tokens still equal transformers'.

Under an engine process the decode also looks for landed KV while it waits for a
step's forward, and sends the first token through `publish` from inside step(): the
second test lands Y's KV while a step() is blocked on the held forward.
"""

from __future__ import annotations

import threading
import time

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


def test_first_token_is_out_while_the_forward_in_flight_is_held(tiny_model) -> None:
    h = _Held(tiny_model)
    h.start()
    h.prefill_y()
    events = h.decode.step()  # sees Y's KV
    assert not h.forward_done.is_set(), "step() waited for the forward in flight"
    assert [ev.token_ids for ev in events if ev.rid == "y"] == [hf_greedy(tiny_model, Y_PROMPT, 1)]
    h.collect(events)
    h.finish(tiny_model)


def test_first_token_is_published_from_inside_a_step_waiting_on_the_forward(tiny_model) -> None:
    h = _Held(tiny_model)
    published: list[TokenEvent] = []
    y_out = threading.Event()

    def publish(events: list[TokenEvent]) -> None:
        published.extend(events)
        if any(ev.rid == "y" for ev in events):
            y_out.set()

    h.decode.publish = publish
    h.start()
    waiting = threading.Thread(target=lambda: h.collect(h.decode.step()))
    waiting.start()  # launches one more step, then waits for the held one's tokens
    time.sleep(0.2)  # (the KV must land after that step() looked for it at its start)
    assert waiting.is_alive() and not h.forward_done.is_set()
    h.prefill_y()
    assert y_out.wait(timeout=HOLD_S / 2), "no first token while the step waits"
    assert not h.forward_done.is_set(), "published only after the forward"
    want = hf_greedy(tiny_model, Y_PROMPT, 1)
    assert [ev.token_ids for ev in published if ev.rid == "y"] == [want]
    h.collect(published)
    h.release.set()
    waiting.join(timeout=HOLD_S)
    assert not waiting.is_alive()
    h.finish(tiny_model)
