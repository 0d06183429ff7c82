"""Prefill engine against a recording sink: chunk ranges, first token, and that an
aborted request's KV stays allocated until the sink reports it released."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, prefill_budget
from pdserve.kernels.core_share import Cores
from pdserve.kvcache.pools import KVPool
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.prefill import PrefillEngine, prefill_order
from pdserve.scheduler.request import Req
from pdserve.transfer.base import SinkEvent
from tests.conftest import hf_greedy


class RecordingSink:
    """Records calls; releases only when the test says so."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, int]] = []
        self.done: dict[str, int] = {}
        self.aborted: list[str] = []
        self.pending: list[SinkEvent] = []
        self.stages: dict[str, dict] = {}

    def on_queue(self, req: Req) -> None:
        pass

    def on_admit(self, req: Req) -> None:
        pass

    def on_chunk(self, req: Req, pool: KVPool, slots: torch.Tensor, start: int, end: int) -> None:
        self.chunks.append((req.rid, start, end))

    def on_done(
        self, req: Req, first_token: int, first_logprob: float, stages: dict | None = None
    ) -> None:
        self.done[req.rid] = first_token
        self.stages[req.rid] = dict(stages or {})

    def on_abort(self, req: Req, reason: str) -> None:
        self.aborted.append(req.rid)

    def poll(self) -> list[SinkEvent]:
        out, self.pending = self.pending, []
        return out


def _engine(model, budget: int) -> tuple[PrefillEngine, RecordingSink]:
    cfg = EngineConfig(
        model_path=str(model),
        cache=CacheConfig(page_size=4, max_total_tokens=256, max_context=128),
        scheduler=SchedulerConfig(max_prefill_tokens=budget, max_running_requests=4),
    )
    sink = RecordingSink()
    return PrefillEngine(cfg, ModelRunner(cfg), sink), sink


def _req(rid: str, ids: list[int]) -> EngineRequest:
    return EngineRequest(
        rid=rid, input_ids=ids, params=SamplingParams(max_tokens=4, temperature=0.0), room=1
    )


def test_chunks_cover_the_prompt_once_and_first_token_is_greedy(tiny_model) -> None:
    engine, sink = _engine(tiny_model, budget=16)
    prompt = list(range(100, 140))  # 40 tokens: chunks of at most 16
    engine.add_request(_req("a", prompt))
    for _ in range(4):
        engine.step()
    assert sink.chunks == [("a", 0, 16), ("a", 16, 32), ("a", 32, 40)]
    assert sink.done["a"] == hf_greedy(tiny_model, prompt, 1)[0]
    st = sink.stages["a"]  # the stamps that travel to the decode, in order
    assert st["prefill_arrive"] <= st["prefill_start"] <= st["prefill_end"], st
    held = engine.stats()
    assert held["free_kv_pages"] < held["total_kv_pages"]  # KV held for the transfer
    sink.pending.append(SinkEvent("a", ok=True))
    (event,) = engine.step()
    assert event.finished and event.error is None and event.token_ids == [sink.done["a"]]
    s = engine.stats()
    assert s["free_kv_pages"] == s["total_kv_pages"] and s["free_rows"] == s["total_rows"]


def test_a_mixture_of_experts_prompt_step_meets_each_expert_with_64_tokens() -> None:
    """The default budget grows with experts / top-k (64 tokens an expert on average),
    capped at 2048, never below the device's; a budget set by the user stays a cap."""
    from types import SimpleNamespace

    from pdserve.model.arch.config import MoeSpec

    assert prefill_budget(0, "cpu", 64, 8) == 512  # OLMoE, the benchmark's preset
    assert prefill_budget(0, "cpu", 128, 8) == 1024  # Qwen3-30B-A3B
    assert prefill_budget(0, "cpu", 512, 4) == 2048  # the cap
    assert prefill_budget(0, "cpu", 8, 2) == 256  # Mixtral: the CPU default already
    assert prefill_budget(0, "cuda", 64, 8) == 4096
    assert prefill_budget(300, "cpu", 64, 8) == 300

    def budget(moe: MoeSpec | None) -> int:
        cfg = EngineConfig(model_path="m")
        eng = SimpleNamespace(cfg=cfg, runner=SimpleNamespace(arch=SimpleNamespace(moe=moe)),
                              prefilling=[], waiting=[1])  # fmt: skip
        return PrefillEngine._budget(eng)  # type: ignore[arg-type]

    assert budget(None) == 256
    assert budget(MoeSpec(64, 8, True, 512, 0, (True,))) == 512


def test_default_budget_follows_the_device(tiny_model) -> None:
    assert prefill_budget(0, "cpu") == 256 and prefill_budget(0, "cuda:1") == 4096
    assert prefill_budget(100, "cpu") == 100
    cfg = EngineConfig(
        model_path=str(tiny_model),
        cache=CacheConfig(page_size=4, max_total_tokens=1024, max_context=512),
        scheduler=SchedulerConfig(max_running_requests=4),  # the CPU default: 256-token steps
    )
    sink = RecordingSink()
    engine = PrefillEngine(cfg, ModelRunner(cfg), sink)
    engine.add_request(_req("a", list(range(3, 103))))  # 100 tokens: one step
    # 200, sharing no page with "a" (a cached prefix would go out alone): a whole step, the next
    engine.add_request(_req("b", list(range(202, 2, -1))))
    engine.step()
    assert sink.chunks == [("a", 0, 100)]
    engine.step()
    assert sink.chunks == [("a", 0, 100), ("b", 0, 200)]


def test_a_step_starts_no_piece_of_a_prompt_a_later_step_computes_whole(tiny_model) -> None:
    """Room left in a step goes to the shorter prompts that fit whole, then to a prompt
    longer than a step; never to a piece of one that fits the next step."""
    engine, sink = _engine(tiny_model, budget=16)
    engine.add_request(_req("a", list(range(3, 9))))  # 6 tokens
    engine.add_request(_req("b", list(range(3, 15))))  # 12: 10 left after a, fits a step
    engine.add_request(_req("c", list(range(3, 43))))  # 40: longer than a step
    engine.step()
    assert sink.chunks == [("a", 0, 6), ("c", 0, 10)]
    engine.step()
    assert sink.chunks[2:] == [("b", 0, 12), ("c", 10, 14)]
    engine.step()
    engine.step()
    assert sink.chunks[4:] == [("c", 14, 30), ("c", 30, 40)]
    assert set(sink.done) == {"a", "b", "c"}


def test_a_lone_prompt_is_not_split_under_the_cpu_default_budget(tiny_model) -> None:
    """The default 256-token budget splits prompts that share the engine; one alone is
    computed whole up to LONE_STRETCH budgets (512), and split past that. The rest of a
    split prompt, once alone, is computed whole too. First tokens stay greedy."""
    cfg = EngineConfig(
        model_path=str(tiny_model),
        cache=CacheConfig(page_size=4, max_total_tokens=2048, max_context=1024),
        scheduler=SchedulerConfig(max_running_requests=4),
    )
    sink = RecordingSink()
    engine = PrefillEngine(cfg, ModelRunner(cfg), sink)
    lone = list(range(3, 403))  # 400 tokens, alone: one step
    engine.add_request(_req("a", lone))
    engine.step()
    assert sink.chunks == [("a", 0, 400)]
    assert sink.done["a"] == hf_greedy(tiny_model, lone, 1)[0]
    sink.chunks.clear()
    # prompts sharing no page with the ones before (the prefix cache would shorten them)
    engine.add_request(_req("b", list(range(1000, 1600))))  # 600 > 512: split, then its rest whole
    engine.step()
    engine.step()
    assert sink.chunks == [("b", 0, 256), ("b", 256, 600)]
    sink.chunks.clear()
    engine.add_request(_req("c", list(range(2000, 2100))))  # two prompts: the budget holds
    engine.add_request(_req("d", list(range(2200, 2600))))
    engine.step()
    engine.step()
    assert sink.chunks == [("c", 0, 100), ("d", 0, 156), ("d", 156, 400)]


def test_abort_keeps_kv_until_the_sink_releases_it(tiny_model) -> None:
    engine, sink = _engine(tiny_model, budget=8)
    engine.add_request(_req("a", list(range(10, 50))))
    engine.step()  # first chunk computed and handed to the sink
    engine.abort("a")
    assert sink.aborted == ["a"]
    for _ in range(3):
        assert engine.step() == []  # no further chunks, no terminal event yet
    assert sink.chunks == [("a", 0, 8)]
    s = engine.stats()
    assert s["free_kv_pages"] < s["total_kv_pages"], "freed while the sink may still read it"
    sink.pending.append(SinkEvent("a", ok=False, reason="aborted"))
    (event,) = engine.step()
    assert event.finished and event.finish_reason == "abort" and event.error is None
    s = engine.stats()
    assert s["free_kv_pages"] == s["total_kv_pages"] and s["free_rows"] == s["total_rows"]


def test_rejected_prompt_is_reported_to_the_sink(tiny_model) -> None:
    engine, sink = _engine(tiny_model, budget=16)
    engine.add_request(_req("long", list(range(3, 200))))  # longer than the context
    (event,) = engine.step()
    assert event.finished and event.error and "context length" in event.error
    assert sink.aborted == ["long"]  # the decode must learn the room will never come


def _waiting(rid: str, length: int, arrive: float, prefilled: int = 0) -> Req:
    req = Req.from_engine_request(_req(rid, list(range(3, 3 + length))))
    req.stages["arrive"], req.prefilled = arrive, prefilled
    return req


def test_prefill_order_shortest_left_first_aged_ahead() -> None:
    now = 1000.0
    a = _waiting("a", 300, now - 3.0)
    b = _waiting("b", 50, now - 2.0)
    c = _waiting("c", 200, now - 1.0, prefilled=180)  # 20 tokens left
    d = _waiting("d", 50, now - 0.5)  # ties with b: admission order
    reqs = [a, b, c, d]
    shortest = SchedulerConfig(prefill_max_wait_ms=10_000)
    assert [r.rid for r in prefill_order(reqs, shortest, now)] == ["c", "b", "d", "a"]
    arrival = SchedulerConfig(prefill_order="arrival")
    assert [r.rid for r in prefill_order([d, c, b, a], arrival, now)] == ["a", "b", "c", "d"]
    aged = SchedulerConfig(prefill_max_wait_ms=1500)  # a and b have waited longer
    assert [r.rid for r in prefill_order(reqs, aged, now)] == ["a", "b", "c", "d"]


def test_prefill_order_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_order must be one of"):
        SchedulerConfig(prefill_order="random")
    with pytest.raises(ValueError, match="prefill_max_wait_ms"):
        SchedulerConfig(prefill_max_wait_ms=-1)


def test_a_short_prompt_overtakes_a_long_one_in_the_same_step(tiny_model) -> None:
    """Shortest first (the default): a 10-token prompt queued behind a 60-token one is
    computed in the first step and reaches its first token there; "arrival" spends the
    first 32-token steps on the long one. Both first tokens are the greedy ones."""
    long, short = list(range(100, 160)), list(range(5, 15))
    for order, first in (("shortest", [("s", 0, 10), ("l", 0, 22)]), ("arrival", [("l", 0, 32)])):
        cfg = EngineConfig(
            model_path=str(tiny_model),
            cache=CacheConfig(page_size=4, max_total_tokens=256, max_context=128),
            scheduler=SchedulerConfig(max_prefill_tokens=32, prefill_order=order),
        )
        sink = RecordingSink()
        engine = PrefillEngine(cfg, ModelRunner(cfg), sink)
        engine.add_request(_req("l", long))
        engine.add_request(_req("s", short))
        engine.step()
        assert sink.chunks == first, order
        assert ("s" in sink.done) == (order == "shortest")
        for _ in range(4):
            engine.step()
        assert sink.done == {
            "l": hf_greedy(tiny_model, long, 1)[0],
            "s": hf_greedy(tiny_model, short, 1)[0],
        }


class _ShareThatFreesUp:
    """A core share whose peer steps aside while a forward runs: after the second
    re-read between layers it reports two threads instead of one."""

    def __init__(self) -> None:
        self.applied: list[int] = []
        self.reads = 0

    def begin(self) -> int:
        return 1

    def threads(self) -> int:
        self.reads += 1
        return 2 if self.reads >= 2 else 1

    def apply(self, threads: int) -> None:
        self.applied.append(threads)

    def end(self) -> None:
        pass

    def set_backlog(self, prompts: int) -> None:
        pass


def test_a_forward_takes_cores_a_peer_frees_between_layers(tiny_model) -> None:
    """ModelRunner.forward reads the core share again before every layer but the first,
    so cores the decode lends mid-prompt are used from the next layer on; same tokens."""
    engine, sink = _engine(tiny_model, budget=64)
    share = _ShareThatFreesUp()
    engine.runner.cores = Cores(share)  # type: ignore[arg-type]
    prompt = list(range(100, 130))
    engine.add_request(_req("a", prompt))
    engine.step()
    layers = engine.runner.model.arch.num_layers
    assert layers >= 3
    assert share.applied == [1, 1] + [2] * (layers - 2)  # begin(), then once per later layer
    assert sink.done["a"] == hf_greedy(tiny_model, prompt, 1)[0]
