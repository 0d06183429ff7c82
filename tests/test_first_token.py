"""An arrival's first token leaves the decode when its KV lands, not a step later.

The prefill sampled the first token; it travels with the KV. Before the request can
join a step, the decode must wait for the forward in flight (the row fence of DESIGN
§3) and for room in the batch, but the token itself needs neither. Here the forward
in flight is held on the forward stream while request Y's KV arrives: the step() that
sees the arrival must return Y's first token while the forward is still held. (Emitted
at admission into the batch instead, step() blocks in the fence until the hold times
out, and the assertion on `forward_done` fails.) Y's tokens still equal transformers'.
"""

from __future__ import annotations

import threading

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
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


def test_first_token_is_out_while_the_forward_in_flight_is_held(tiny_model) -> None:
    cfg = EngineConfig(
        model_path=str(tiny_model),
        cache=CacheConfig(page_size=4, max_total_tokens=512, max_context=64),
        scheduler=SchedulerConfig(max_running_requests=2),
    )
    handoff = InProcessHandoff()
    prefill = PrefillEngine(cfg, ModelRunner(cfg), handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=prefill.runner.model), handoff.source)
    assert decode.overlap, "the fence under test exists only with overlap"
    gate, in_forward, release = threading.Event(), threading.Event(), threading.Event()
    forward_done = threading.Event()

    def hold(step: StepResult) -> None:
        if gate.is_set():
            gate.clear()
            in_forward.set()
            release.wait(timeout=HOLD_S)
            forward_done.set()

    decode.forward_hook = hold
    tokens: dict[str, list[int]] = {"x": [], "y": []}

    def collect(events) -> None:  # type: ignore[no-untyped-def]
        for ev in events:
            tokens[ev.rid].extend(ev.token_ids)

    x = _request("x", X_PROMPT, 40)
    prefill.add_request(x)
    decode.add_request(x)
    while len(tokens["x"]) < 3:  # X decodes
        prefill.step()
        collect(decode.step())
    y = _request("y", Y_PROMPT, Y_TOKENS)
    prefill.add_request(y)
    decode.add_request(y)
    collect(decode.step())  # Y admitted: its pages reserved, its KV expected
    if decode.in_flight is not None:  # past its hook before the gate opens
        assert decode.in_flight.copy_done is not None
        decode.in_flight.copy_done.wait()
    gate.set()
    collect(decode.step())  # launches the step that the hook holds
    assert in_forward.wait(timeout=HOLD_S), "the forward was never held"
    while prefill.prefilling or prefill.waiting:  # Y's prompt, its KV handed over
        prefill.step()
    events = decode.step()  # sees Y's KV
    assert not forward_done.is_set(), "step() waited for the forward in flight"
    assert [ev.token_ids for ev in events if ev.rid == "y"] == [hf_greedy(tiny_model, Y_PROMPT, 1)]
    collect(events)
    release.set()
    for _ in range(500):
        collect(decode.step())
        if len(tokens["y"]) == Y_TOKENS and len(tokens["x"]) == 40:
            break
    assert tokens["y"] == hf_greedy(tiny_model, Y_PROMPT, Y_TOKENS)
    assert tokens["x"] == hf_greedy(tiny_model, X_PROMPT, 40)
    decode.drain()
    stats = decode.stats()
    assert stats["free_rows"] == stats["total_rows"]
    decode.close()
