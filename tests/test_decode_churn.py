"""Churn: 200 requests with random prompt and output lengths arrive while others
run, through few rows, so rows and pages are reused many times. Greedy tokens
must equal transformers' with overlap on and off; pools end fully free."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff

N_REQUESTS = 200


def _workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 4096) for _ in range(rng.randint(1, 40))], rng.randint(1, 12))
        for _ in range(N_REQUESTS)
    ]


def _hf(model):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()


def _first_mismatch(m, prompt: list[int], toks: list[int]) -> int | None:
    """Index of the first token of `toks` that is not transformers' greedy choice."""
    with torch.no_grad():
        logits = m(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
    best = logits.argmax(-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(best, toks)) if a != b), None)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return _hf(tiny_model)


def _run(model, work, overlap: bool) -> tuple[dict[int, list[int]], DecodeEngine, dict]:
    def cfg(rows: int) -> EngineConfig:
        return EngineConfig(
            model_path=str(model),
            cache=CacheConfig(page_size=4, max_total_tokens=1024, max_context=64),
            scheduler=SchedulerConfig(
                max_running_requests=rows, disable_overlap=not overlap, max_prefill_tokens=64
            ),
        )

    handoff = InProcessHandoff()
    pr = ModelRunner(cfg(6))
    prefill = PrefillEngine(cfg(6), pr, handoff.sink)
    decode = DecodeEngine(cfg(5), ModelRunner(cfg(5), model=pr.model), handoff.source)
    out: dict[int, list[int]] = {}
    finished = set()
    pending = list(enumerate(work))
    while len(finished) < len(work):
        for _ in range(2):  # a couple of arrivals per iteration, while others run
            if pending:
                i, (prompt, n) = pending.pop(0)
                er = EngineRequest(
                    rid=str(i),
                    input_ids=prompt,
                    params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                    room=i + 1,
                )
                prefill.add_request(er)
                decode.add_request(er)
        prefill.step()
        for ev in decode.step():
            assert ev.error is None, ev.error
            out.setdefault(int(ev.rid), []).extend(ev.token_ids)
            if ev.finished:
                finished.add(int(ev.rid))
    decode.drain()
    while prefill.has_unfinished():
        prefill.step()
    return out, decode, prefill.stats()


@pytest.mark.parametrize("overlap", [True, False])
def test_churn_matches_reference(tiny_model, hf_model, overlap: bool) -> None:
    work = _workload()
    out, decode, pstats = _run(tiny_model, work, overlap)
    assert all(len(out[i]) == n for i, (_, n) in enumerate(work))
    mismatches = [
        i for i, (p, _) in enumerate(work) if _first_mismatch(hf_model, p, out[i]) is not None
    ]
    assert not mismatches, f"{len(mismatches)} requests differ, first {mismatches[:5]}"
    s = decode.stats()
    assert s["free_rows"] == s["total_rows"] and s["free_kv_pages"] == s["total_kv_pages"]
    assert pstats["free_rows"] == pstats["total_rows"]
    assert pstats["free_kv_pages"] == pstats["total_kv_pages"]
    assert decode.runner.req_pool.handouts[1] > 10  # rows really were reused
    decode.close()


def test_overlap_is_real(tiny_model) -> None:
    """Step N+1 is launched (built on the host) before step N's forward has ended."""
    work = [([5 + i, 6, 7, 8], 24) for i in range(5)]
    handoff = InProcessHandoff()
    cfg = EngineConfig(
        model_path=str(tiny_model),
        cache=CacheConfig(page_size=4, max_total_tokens=1024, max_context=64),
    )
    pr = ModelRunner(cfg)
    prefill = PrefillEngine(cfg, pr, handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=pr.model), handoff.source)
    launches: list[tuple[float, object]] = []
    original = decode._launch

    def record_launch(reqs):
        result = original(reqs)
        launches.append((time.perf_counter(), result))
        return result

    decode._launch = record_launch  # type: ignore[method-assign]
    for i, (prompt, n) in enumerate(work):
        er = EngineRequest(
            rid=str(i),
            input_ids=prompt,
            params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            room=i + 1,
        )
        prefill.add_request(er)
        decode.add_request(er)
    while decode.has_unfinished() or prefill.has_unfinished():
        prefill.step()
        decode.step()
    decode.drain()
    overlapped = sum(
        1 for (_, prev), (t_next, _) in zip(launches, launches[1:]) if t_next < prev.timing["end"]
    )
    assert overlapped >= len(launches) // 2, (
        f"only {overlapped} of {len(launches)} steps overlapped"
    )
    decode.close()
