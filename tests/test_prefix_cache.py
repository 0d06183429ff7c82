"""The prefill's prefix cache (kvcache/prefix_cache.py).

A property test drives the cache and its page allocator with random acquires,
publishes, finishes (inserts), releases and evictions against a plain reference model (a dict
from whole token prefixes to pages): matches agree with the model, no page in use
(held by a live request, acquired or private) is ever evicted or handed out twice,
and every page is accounted for. Then the engines: prompts sharing prefixes get
transformers' greedy tokens with the cache hit, under eviction pressure too."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kvcache.pools import PageAllocator
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff

PS = 2  # tokens per page
NUM_PAGES = 13  # 12 usable


class Model:
    """The reference: the pages of whole prefixes, and who holds what."""

    def __init__(self) -> None:
        self.cached: dict[tuple[int, ...], int] = {}  # prefix (whole pages) -> page
        self.refs: dict[int, int] = {}  # cached page -> live requests reading it

    def match(self, tokens: list[int], limit: int) -> list[int]:
        out = []
        for i in range(1, min(len(tokens), limit) // PS + 1):
            page = self.cached.get(tuple(tokens[: i * PS]))
            if page is None:
                break
            out.append(page)
        return out


def _check(cache: PrefixCache, alloc: PageAllocator, model: Model, live: dict) -> None:
    free = {p for p in range(1, NUM_PAGES) if alloc._pages._free[p]}
    private = [p for _, hit, own in live.values() for p in own]
    held = [p for _, hit, own in live.values() for p in hit]
    cached = set(model.cached.values())
    assert len(private) == len(set(private)), "a page handed out twice"
    assert not set(private) & (free | cached), "a private page is free or cached"
    assert set(held) <= cached and not set(held) & free, "a page in use was evicted"
    assert free | cached | set(private) == set(range(1, NUM_PAGES)), "a page leaked"
    assert cache.referenced() == {p for p, n in model.refs.items() if n > 0}
    assert cache.pages == len(cached)
    assert cache.evictable == sum(1 for p in cached if model.refs.get(p, 0) == 0)


op = st.tuples(st.sampled_from(["start", "publish", "finish", "abandon", "evict"]),
               st.integers(0, 7))  # fmt: skip
# prompts are prefixes of a few sequences that share beginnings, so prefixes collide
BASES = ([0, 1, 0, 1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 1, 1, 0, 1])
prompt = st.builds(lambda b, n: BASES[b][:n], st.integers(0, 2), st.integers(1, 9))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(op, prompt), max_size=40))
def test_cache_against_a_reference_model(ops) -> None:
    alloc = PageAllocator(NUM_PAGES, PS)
    cache = PrefixCache(alloc)
    model = Model()
    live: dict[int, tuple[list[int], list[int], list[int]]] = {}  # id -> tokens, hit, own
    for n, ((kind, k), tokens) in enumerate(ops):
        if kind == "start":  # admission: acquire the cached prefix, allocate the rest
            hit = cache.acquire(tokens, len(tokens) - 1)
            assert hit == model.match(tokens, len(tokens) - 1)
            need = alloc.pages_for(len(tokens)) - len(hit)
            if need > alloc.free_pages:
                cache.evict(need - alloc.free_pages)
                _drop_evicted(cache, model)
            own = alloc.alloc(need)
            if own is None:
                cache.release(tokens, hit)
            else:
                for p in hit:
                    model.refs[p] = model.refs.get(p, 0) + 1
                live[n] = (tokens, hit, own)
        elif live and kind == "publish":  # the prompt computed, the request still live
            rid = sorted(live)[k % len(live)]
            tokens, hit, own = live[rid]
            held = cache.publish(tokens, hit + own, len(hit))
            want = len(hit)
            while want < len(hit + own) and len(tokens) >= (want + 1) * PS:
                if tuple(tokens[: (want + 1) * PS]) in model.cached:
                    break
                model.cached[tuple(tokens[: (want + 1) * PS])] = (hit + own)[want]
                model.refs[(hit + own)[want]] = 1
                want += 1
            assert held == want
            live[rid] = (tokens, (hit + own)[:held], (hit + own)[held:])
        elif live and kind in ("finish", "abandon"):
            rid = sorted(live)[k % len(live)]
            tokens, hit, own = live.pop(rid)
            for p in hit:
                model.refs[p] -= 1
            if kind == "finish":  # the prompt computed whole: its full pages join
                rest = cache.insert(tokens, hit + own, len(hit))
                for i, page in enumerate(hit + own):
                    key = tuple(tokens[: (i + 1) * PS])
                    if len(key) == (i + 1) * PS and key not in model.cached and page not in rest:
                        model.cached[key] = page
            else:
                cache.release(tokens, hit)
                rest = own
            alloc.free(rest)
        elif kind == "evict":
            before = cache.pages
            freed = cache.evict(k)
            assert freed == before - cache.pages and freed <= k
            _drop_evicted(cache, model)
        _check(cache, alloc, model, live)


def _drop_evicted(cache: PrefixCache, model: Model) -> None:
    """The model forgets the pages the cache let go (it checks they were unreferenced)."""
    kept = {n.page for n in cache._nodes.values()}
    for key, page in list(model.cached.items()):
        if page not in kept:
            assert model.refs.get(page, 0) == 0, f"evicted page {page} is in use"
            del model.cached[key]
            model.refs.pop(page, None)


# ---- the engines ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    return m.eval()


def _greedy_ok(m, prompt: list[int], toks: list[int]) -> bool:
    with torch.no_grad():
        logits = m(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist() == toks


def _serve(model, prompts: list[list[int]], prefill_tokens: int, cache: bool = True):
    """Each prompt after the one before has finished (a conversation's turns)."""

    def cfg(tokens: int) -> EngineConfig:
        return EngineConfig(
            model_path=str(model),
            cache=CacheConfig(
                page_size=4, max_total_tokens=tokens, max_context=256, prefix_cache=cache
            ),
            scheduler=SchedulerConfig(max_running_requests=4, max_prefill_tokens=32),
        )

    handoff = InProcessHandoff()
    sent: dict[str, list[tuple[int, int]]] = {}  # the ranges each prompt's KV went out in
    hits: dict[str, int] = {}
    on_chunk = handoff.sink.on_chunk

    def record(req, pool, slots, start: int, end: int) -> None:
        sent.setdefault(req.rid, []).append((start, end))
        hits[req.rid] = req.prefix_hit
        on_chunk(req, pool, slots, start, end)

    handoff.sink.on_chunk = record  # type: ignore[method-assign]
    pr = ModelRunner(cfg(prefill_tokens))
    prefill = PrefillEngine(cfg(prefill_tokens), pr, handoff.sink)
    decode = DecodeEngine(cfg(1024), ModelRunner(cfg(1024), model=pr.model), handoff.source)
    outs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        er = EngineRequest(rid=str(i), input_ids=prompt, params=params, room=i + 1)
        prefill.add_request(er)
        decode.add_request(er)
        toks: list[int] = []
        done = False
        for _ in range(500):
            prefill.step()
            for ev in decode.step():
                assert ev.error is None, ev.error
                toks.extend(ev.token_ids)
                done = done or ev.finished
            if done and not prefill.has_unfinished():
                break
        assert done
        outs.append(toks)
    for i, prompt in enumerate(prompts):  # the sink contract: the whole prompt, in order
        ends = [0] + [end for _, end in sent[str(i)]]
        assert [start for start, _ in sent[str(i)]] == ends[:-1] and ends[-1] == len(prompt)
        if hits[str(i)]:  # a cached prefix goes out alone, at admission, before the rest
            assert sent[str(i)][0] == (0, hits[str(i)]), (sent[str(i)], hits[str(i)])
    decode.drain()
    for s in (prefill.stats(), decode.stats()):
        assert s["free_rows"] == s["total_rows"] and s["free_kv_pages"] == s["total_kv_pages"], s
    decode.close()
    return outs, prefill.stats()


def _turns(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 4096) for _ in range(37)]
    prompts, history = [], list(system)
    for _ in range(n):
        history += [rng.randrange(3, 4096) for _ in range(rng.randint(3, 11))]
        prompts.append(list(history))
        history += [rng.randrange(3, 4096) for _ in range(5)]  # the "answer"
    return prompts


def test_shared_prefixes_hit_and_match_transformers(tiny_model, hf_model) -> None:
    prompts = _turns(0, 5) + _turns(1, 3)
    outs, s = _serve(tiny_model, prompts, prefill_tokens=1024)
    assert all(_greedy_ok(hf_model, p, t) for p, t in zip(prompts, outs))
    assert s["prefix_cache_hit_tokens"] >= 4 * 36 + 2 * 36  # each later turn hits its history
    assert s["prefix_cache_evictions"] == 0
    off, s_off = _serve(tiny_model, prompts, prefill_tokens=1024, cache=False)
    assert off == outs and "prefix_cache_hit_tokens" not in s_off


def test_eviction_under_pressure_keeps_tokens_right(tiny_model, hf_model) -> None:
    rng = random.Random(3)
    prompts = [t for seed in range(4) for t in _turns(seed, 2)]
    rng.shuffle(prompts)
    # 32 pages of 4: room for one or two prompts' pages at a time besides the cache
    outs, s = _serve(tiny_model, prompts, prefill_tokens=128)
    assert s["prefix_cache_evictions"] > 0
    assert all(_greedy_ok(hf_model, p, t) for p, t in zip(prompts, outs))
