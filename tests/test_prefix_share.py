"""Prompts that arrive together share their prefix's computation on the prefill: the
n samples of one request (and a burst on one system prompt) compute the common pages
once. The first prompt publishes its full pages to the prefix cache as soon as its KV
is computed (PrefixCache.publish), and the prompts behind it wait at admission for
that instead of computing the same pages beside it."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kvcache.pools import PageAllocator
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff

PAGE = 4


def _cfg(model, tokens: int, cache: bool = True) -> EngineConfig:
    return EngineConfig(
        model_path=str(model),
        cache=CacheConfig(
            page_size=PAGE, max_total_tokens=tokens, max_context=256, prefix_cache=cache
        ),  # fmt: skip
        scheduler=SchedulerConfig(max_running_requests=8, max_prefill_tokens=32),
    )


def _serve_together(model, prompts: list[list[int]], cache: bool = True):
    """All prompts added at once; (greedy tokens per prompt, prefill stats, prompt
    tokens the prefill computed)."""
    handoff = InProcessHandoff()
    sent: dict[str, list[tuple[int, int]]] = {}
    on_chunk = handoff.sink.on_chunk

    def record(req, pool, slots, start: int, end: int) -> None:
        sent.setdefault(req.rid, []).append((start, end))
        on_chunk(req, pool, slots, start, end)

    handoff.sink.on_chunk = record  # type: ignore[method-assign]
    pr = ModelRunner(_cfg(model, 512, cache))
    prefill = PrefillEngine(_cfg(model, 512, cache), pr, handoff.sink)
    computed = 0
    run = prefill._run

    def counting(plan) -> None:  # type: ignore[no-untyped-def]
        nonlocal computed
        computed += sum(end - start for _, start, end in plan)
        run(plan)

    prefill._run = counting  # type: ignore[method-assign]
    decode = DecodeEngine(_cfg(model, 1024), ModelRunner(_cfg(model, 1024), model=pr.model),
                          handoff.source)  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        er = EngineRequest(rid=str(i), input_ids=p, params=params, room=i + 1)
        prefill.add_request(er)
        decode.add_request(er)
    toks: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(500):
        prefill.step()
        for ev in decode.step():
            assert ev.error is None, ev.error
            toks[ev.rid].extend(ev.token_ids)
            if ev.finished:
                done.add(ev.rid)
        if len(done) == len(prompts) and not prefill.has_unfinished():
            break
    assert len(done) == len(prompts)
    for i, p in enumerate(prompts):  # the decode still gets each whole prompt, in order
        ends = [0] + [end for _, end in sent[str(i)]]
        assert [s for s, _ in sent[str(i)]] == ends[:-1] and ends[-1] == len(p)
    decode.drain()
    stats = prefill.stats()
    assert stats["free_kv_pages"] == stats["total_kv_pages"], stats
    decode.close()
    return [toks[str(i)] for i in range(len(prompts))], stats, computed


def _greedy(m, prompt: list[int], n: int) -> list[int]:
    out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                     dtype=torch.long), max_new_tokens=n, do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    return m.eval()


def test_n_samples_compute_the_prompt_once(tiny_model, hf_model) -> None:
    """Four samples of a 50-token prompt: 50 + 3 * 2 prompt tokens computed (each later
    sample computes only past the last full page it can take), not 4 * 50. Fails
    without the wait at admission (each sample computes the whole prompt)."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, 4096) for _ in range(50)]
    outs, stats, computed = _serve_together(tiny_model, [prompt] * 4)
    shared = (len(prompt) - 1) // PAGE * PAGE
    assert stats["prefix_cache_hit_tokens"] == 3 * shared
    assert computed == len(prompt) + 3 * (len(prompt) - shared)
    with torch.no_grad():
        want = _greedy(hf_model, prompt, 5)
    assert outs == [want] * 4
    off, _, computed_off = _serve_together(tiny_model, [prompt] * 4, cache=False)
    assert off == outs and computed_off == 4 * len(prompt)


def test_a_burst_on_one_system_prompt_shares_it(tiny_model, hf_model) -> None:
    rng = random.Random(1)
    system = [rng.randrange(3, 4096) for _ in range(33)]
    prompts = [system + [rng.randrange(3, 4096) for _ in range(rng.randint(1, 9))]
               for _ in range(3)]  # fmt: skip
    outs, stats, computed = _serve_together(tiny_model, prompts)
    assert stats["prefix_cache_hit_tokens"] == 2 * 32
    assert computed == sum(map(len, prompts)) - 2 * 32
    with torch.no_grad():
        assert outs == [_greedy(hf_model, p, 5) for p in prompts]


def test_publish_keeps_pages_referenced_until_the_request_ends() -> None:
    alloc = PageAllocator(16, PAGE)
    cache = PrefixCache(alloc)
    tokens = list(range(10))  # two full pages and a partial one
    pages = alloc.alloc(3)
    assert pages is not None
    assert cache.publish(tokens, pages, 0) == 2
    assert cache.evictable == 0 and cache.evict(5) == 0  # the request still reads them
    other = cache.acquire(tokens, 9)
    assert other == pages[:2]
    assert cache.insert(tokens, pages, 2) == pages[2:]  # the request ends
    cache.release(tokens, other)
    assert cache.evictable == 2 and cache.evict(5) == 2
    first, second = alloc.alloc(3), alloc.alloc(3)  # the same prompt computed twice
    assert first is not None and second is not None
    assert cache.publish(tokens, first, 0) == 2
    assert cache.publish(tokens, second, 0) == 0  # its prefix is cached: it keeps its pages
    assert cache.insert(tokens, second, 0) == second
    assert cache.insert(tokens, first, 2) == first[2:]
