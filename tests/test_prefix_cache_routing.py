"""Cache-aware routing (router/policy.py): a conversation's later turns go to the prefill
that computed its earlier ones, new conversations spread over the prefills, load
imbalance wins over the cache, and the router's picture of each cache stays bounded."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.router.policy import BLOCK, CacheAware, PrefixTrie, prefix_key
from pdserve.router.workers import WorkerPool


@dataclass
class W:
    url: str
    in_flight: int = 0


def _chat(system: str, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for t in range(turns):
        msgs += [
            {"role": "user", "content": f"question {t}"},
            {"role": "assistant", "content": "ok"},
        ]
    return msgs + [{"role": "user", "content": "and now?"}]


def test_prefix_keys_grow_with_the_conversation() -> None:
    chat = "/v1/chat/completions"
    one = prefix_key(chat, {"messages": _chat("be brief", 1)})
    two = prefix_key(chat, {"messages": _chat("be brief", 2)})
    assert one and two and two.startswith(one[: one.rindex("question 0")])
    assert prefix_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert prefix_key("/generate", {"input_ids": [5, 6]}) == "5,6,"
    assert prefix_key("/generate", {"text": "hi"}) == "hi"
    assert prefix_key("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch
    assert prefix_key(chat, {"messages": "no"}) is None


def test_later_turns_follow_their_prefix_and_new_ones_spread() -> None:
    policy = CacheAware()
    workers = [W("http://p0"), W("http://p1"), W("http://p2")]
    rng = random.Random(0)
    systems = ["".join(rng.choice("abcdef ") for _ in range(600)) for _ in range(9)]
    home: dict[int, str] = {}
    for turn in range(4):
        order = list(range(len(systems)))
        rng.shuffle(order)  # by load alone, another order would give other workers
        for c in order:
            key = prefix_key("/v1/chat/completions", {"messages": _chat(systems[c], turn)})
            w = policy.pick(workers, key)
            w.in_flight += 1  # requests in flight: loads stay within the balance thresholds
            if turn == 0:
                home[c] = w.url
            assert w.url == home[c], (turn, c)
        for w in workers:
            w.in_flight = 0
    assert len(set(home.values())) == 3  # new conversations spread over all prefills


def test_imbalanced_load_overrides_the_cache() -> None:
    policy = CacheAware(balance_abs=8, balance_rel=1.5)
    a, b = W("http://a"), W("http://b")
    key = "x" * (4 * BLOCK)
    first = policy.pick([a, b], key)
    other = b if first is a else a
    assert policy.pick([a, b], key) is first  # sticky while loads are even
    first.in_flight = 20
    assert policy.pick([a, b], key) is other  # 20 - 0 > 8 and 20 > 1.5 * 0
    first.in_flight, other.in_flight = 12, 6  # 6 apart: within balance_abs
    assert policy.pick([a, b], key) in (first, other)
    assert policy.pick([a, b], None) is other  # no key: least load


def test_the_routers_trie_is_bounded_and_keeps_what_is_used() -> None:
    trie = PrefixTrie(max_nodes=100)
    rng = random.Random(1)
    hot = "h" * (3 * BLOCK)
    for i in range(500):
        trie.insert("".join(rng.choice("xyz") for _ in range(4 * BLOCK)))
        if i % 10 == 0:
            trie.insert(hot)
        assert len(trie) <= 100
    assert trie.match(hot + "tail") == 3 * BLOCK
    assert trie.match("q" * BLOCK) == 0


def test_the_pool_routes_cache_aware_prefills_and_least_load_decodes() -> None:
    pool = WorkerPool.build(
        [("http://p0", 1), ("http://p1", 2)], ["http://d0", "http://d1"], "cache_aware"
    )
    body = {"input_ids": list(range(200))}
    p, d = pool.pick_pair("/generate", body)
    d.in_flight += 1
    p2, d2 = pool.pick_pair("/generate", {"input_ids": list(range(200)) + [7, 8]})
    assert p2 is p and d2 is not d
