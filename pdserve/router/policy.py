"""Cache-aware choice of a prefill worker (`--policy cache_aware`), after sglang-router's.

Each prefill worker keeps the KV of prompts it computed (its prefix cache), so a
request whose prompt begins like one the router sent to worker W before is
cheapest on W. The router cannot see the workers' caches; it keeps its own
approximate picture: per worker, a trie of the prompts it routed there, in blocks
of BLOCK characters of the request's prefix key (`prefix_key`), bounded in size,
least recently used leaves dropped first.

    loads imbalanced .......... least in-flight worker (the cache cannot pay for a queue)
    best match >= threshold ... the worker with the longest matched prefix
    otherwise ................. least in-flight worker, then the smallest trie (the
                                most cache room), so new prefixes spread out

Loads are imbalanced when max - min in-flight > `balance_abs` and max > `balance_rel`
x min. The chosen worker's trie learns the key either way. The decode side has no
prefix to follow: cache_aware picks its decodes by least load.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

BLOCK = 64  # characters of a prefix key per trie node


class Loaded(Protocol):
    url: str
    in_flight: int


W = TypeVar("W", bound=Loaded)


def prefix_key(path: str, body: dict[str, Any]) -> str | None:
    """A string whose prefixes follow the prompt's: a chat's messages in order, a
    completion's prompt, /generate's text or input_ids. None for what has no single
    prompt (batches) or no recognizable one."""
    if path == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        return "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) + "\n" for m in msgs)
    prompt = body.get("prompt") if path == "/v1/completions" else None
    if path == "/generate":
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return None


@dataclass(eq=False)
class _Node:
    id: int
    key: tuple[int, str]
    stamp: int
    children: int = 0


class PrefixTrie:
    """Prefix keys in blocks of BLOCK characters; at most `max_nodes` nodes."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self._nodes: dict[tuple[int, str], _Node] = {}
        self._by_id: dict[int, _Node] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, key: str) -> int:
        """Characters of `key`'s longest prefix in the trie (whole blocks)."""
        parent, n = 0, 0
        for i in range(0, len(key) - BLOCK + 1, BLOCK):
            node = self._nodes.get((parent, key[i : i + BLOCK]))
            if node is None:
                break
            parent, n = node.id, n + BLOCK
        return n

    def insert(self, key: str) -> None:
        parent, chain = 0, []
        for i in range(0, len(key) - BLOCK + 1, BLOCK):
            k = (parent, key[i : i + BLOCK])
            node = self._nodes.get(k)
            if node is None:
                node = _Node(next(self._ids), k, 0)
                self._nodes[k], self._by_id[node.id] = node, node
                if parent:
                    self._by_id[parent].children += 1
            chain.append(node)
            parent = node.id
        for node in reversed(chain):  # leaf first: a path's root is never older than its leaf
            node.stamp = next(self._clock)
        if len(self._nodes) > self.max_nodes:
            self._evict(len(self._nodes) - self.max_nodes * 9 // 10)

    def _evict(self, count: int) -> None:
        """Drop `count` nodes, least recently used leaves first (amortized: called once
        per tenth of max_nodes inserted)."""
        while count > 0 and self._nodes:
            leaves = sorted(
                (n for n in self._nodes.values() if not n.children), key=lambda n: n.stamp
            )
            for node in leaves[:count]:
                del self._nodes[node.key]
                del self._by_id[node.id]
                if node.key[0]:
                    self._by_id[node.key[0]].children -= 1
                count -= 1


class CacheAware:
    def __init__(
        self,
        threshold: float = 0.5,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
        max_nodes: int = 1 << 16,
    ) -> None:
        self.threshold = threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_nodes = max_nodes
        self.tries: dict[str, PrefixTrie] = {}

    def _trie(self, w: W) -> PrefixTrie:
        return self.tries.setdefault(w.url, PrefixTrie(self.max_nodes))

    def imbalanced(self, workers: list[W]) -> bool:
        loads = [w.in_flight for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def pick(self, workers: list[W], key: str | None) -> W:
        """The worker for a request with `key` (None: by load alone). Precondition:
        `workers` is non-empty (the healthy ones, in the selector's rotating order)."""
        spare = min(workers, key=lambda w: (w.in_flight, len(self._trie(w))))
        if key is None:
            return spare
        chosen = spare
        if not self.imbalanced(workers):
            best = max(workers, key=lambda w: self._trie(w).match(key))  # first of ties
            if self._trie(best).match(key) >= self.threshold * len(key) > 0:
                chosen = best
        self._trie(chosen).insert(key)
        return chosen
