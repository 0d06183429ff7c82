"""The row-reuse race of docs/architecture.md §3, provoked for real on the CPU streams.

Request X ends on a stop token at step N (its 4th output); the scheduler sees that
while step N+1, which still contains X (a redundant forward), runs on the forward
stream. (A request that ends at max_tokens runs no redundant step: the scheduler
knows in advance; so X ends on a token, as on EOS.)
X's row is freed at once and handed to request Y, whose KV is already there
(prebuilt). The forward hook holds the redundant step between sampling and
publishing until Y's process_prebuilt has run (or 1 s passed). Without the
fence, process_prebuilt stashes Y's first token into output_tokens[row], then
the held step publishes X's redundant token over it, and Y decodes from X's
token: its output differs from the reference.

To see the fence matter, delete the `self.schedule_stream.wait_stream(...)` line
in DecodeEngine.get_new_prebuilt_batch: test_prebuilt_waits_for_forward fails.
test_without_fence_the_race_corrupts_tokens does the same by replacing the fence
with a no-op, so the suite shows both sides every run.
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

X_PROMPT, X_TOKENS = [17, 29, 333, 41, 5], 4
Y_PROMPT, Y_TOKENS = [900, 18, 77, 2001, 64, 9, 1200], 8


def params_of(model, rid: str) -> SamplingParams:
    """Y runs to max_tokens; X stops on its X_TOKENS-th greedy token (first seen there)."""
    if rid == "y":
        return SamplingParams(max_tokens=Y_TOKENS, temperature=0.0, ignore_eos=True)
    x = hf_greedy(model, X_PROMPT, X_TOKENS)
    assert x[-1] not in x[:-1], "X's stop token would end it early: pick another prompt"
    stop = [x[-1]]
    return SamplingParams(
        max_tokens=4 * X_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=stop
    )


def is_redundant(step: StepResult) -> bool:
    """The step that computes a token of X past its stop token."""
    return any(r.rid == "x" and i >= X_TOKENS for r, i in zip(step.reqs, step.out_index))


def _engines(model) -> tuple[PrefillEngine, DecodeEngine]:
    def cfg(rows: int) -> EngineConfig:
        return EngineConfig(
            model_path=str(model),
            cache=CacheConfig(page_size=4, max_total_tokens=512, max_context=64),
            scheduler=SchedulerConfig(max_running_requests=rows),
        )

    handoff = InProcessHandoff()
    prefill_runner = ModelRunner(cfg(4))
    prefill = PrefillEngine(cfg(4), prefill_runner, handoff.sink)
    # one decode row: Y can only run in the row X leaves behind
    decode = DecodeEngine(cfg(1), ModelRunner(cfg(1), model=prefill_runner.model), handoff.source)
    return prefill, decode


def _run_race(model, fence: bool) -> tuple[list[int], bool]:
    prefill, decode = _engines(model)
    written = threading.Event()
    held = threading.Event()

    def hold_redundant_step(step: StepResult) -> None:
        if is_redundant(step):
            held.set()
            written.wait(timeout=1.0)  # with the fence the scheduler waits for us instead

    original = decode.process_prebuilt

    def process_prebuilt(reqs) -> None:
        original(reqs)
        if any(r.rid == "y" for r in reqs):  # NOTE: X passes through here first, at arrival
            written.set()

    decode.forward_hook = hold_redundant_step
    decode.process_prebuilt = process_prebuilt  # type: ignore[method-assign]
    if not fence:
        decode.schedule_stream.wait_stream = lambda other: None  # type: ignore[method-assign]

    for rid, prompt in (("x", X_PROMPT), ("y", Y_PROMPT)):
        er = EngineRequest(
            rid=rid, input_ids=prompt, params=params_of(model, rid), room=hash(rid) & 0xFFFF
        )
        prefill.add_request(er)
        decode.add_request(er)
    tokens: dict[str, list[int]] = {"x": [], "y": []}
    finished: set[str] = set()
    for _ in range(500):
        prefill.step()
        for ev in decode.step():
            tokens[ev.rid].extend(ev.token_ids)
            if ev.finished:
                finished.add(ev.rid)
        if finished == {"x", "y"}:
            break
    decode.drain()
    stats = decode.stats()
    assert (
        stats["free_rows"] == stats["total_rows"]
        and stats["free_kv_pages"] == stats["total_kv_pages"]
    )
    assert len(tokens["x"]) == X_TOKENS
    decode.close()
    return tokens["y"], held.is_set()


def test_prebuilt_waits_for_forward(tiny_model) -> None:
    y, held = _run_race(tiny_model, fence=True)
    assert held, "the redundant step was never held: the test did not set up the race"
    assert y == hf_greedy(tiny_model, Y_PROMPT, Y_TOKENS)


def test_without_fence_the_race_corrupts_tokens(tiny_model) -> None:
    y, held = _run_race(tiny_model, fence=False)
    assert held
    assert y != hf_greedy(tiny_model, Y_PROMPT, Y_TOKENS), "race not provoked"


def test_requests_ending_at_max_tokens_run_no_redundant_step(tiny_model) -> None:
    """The scheduler knows when a request reaches max_tokens: its last step is the
    last one it joins, so no forward computes a token past it (overlap on)."""
    prefill, decode = _engines(tiny_model)
    seen: list[tuple[str, int, int]] = []
    decode.forward_hook = lambda step: seen.extend(
        (r.rid, i, r.params.max_tokens) for r, i in zip(step.reqs, step.out_index)
    )
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for rid, (prompt, n) in {"a": (X_PROMPT, 5), "b": (Y_PROMPT, 3)}.items():
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        er = EngineRequest(rid=rid, input_ids=prompt, params=params, room=hash(rid) & 0xFFFF)
        prefill.add_request(er)
        decode.add_request(er)
    for _ in range(500):
        prefill.step()
        for ev in decode.step():
            tokens[ev.rid].extend(ev.token_ids)
        if not (prefill.has_unfinished() or decode.has_unfinished()):
            break
    decode.close()
    assert decode.overlap and seen, "no decode step ran"
    assert all(i < n for _, i, n in seen), f"a step past max_tokens: {seen}"
    assert tokens == {
        "a": hf_greedy(tiny_model, X_PROMPT, 5),
        "b": hf_greedy(tiny_model, Y_PROMPT, 3),
    }
