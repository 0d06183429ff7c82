"""Prefix cache: full KV pages of finished prompts, shared by later prompts that begin
with the same tokens (the prefill's; docs/architecture.md §9).

    node key = (parent node id, the page's page_size token ids)   root parent id: 0

A chain of nodes spells a prompt's prefix page by page, so a key matches only under
the same whole prefix: the KV of a page depends on every token before it. Exact:
keys hold the tokens themselves, no hash stands for them.

Ownership. A page in the cache belongs to the cache, not to the page allocator's
users: it is handed out by `acquire` (its reference count goes up; the caller only
reads it) and handed back by `release`. Only unreferenced leaves are evicted (a
leaf: no cached page extends it), least recently used first, straight back to the
allocator. Using a chain stamps its pages leaf first, root last, so a chain's root
is never older than its leaves. A page is never written once it is cached: a prompt
that matches k pages computes from position k * page_size on, into its own pages.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from pdserve.kvcache.pools import PageAllocator


@dataclass(eq=False)
class _Node:
    id: int
    key: tuple[int, tuple[int, ...]]
    page: int
    refs: int = 0
    children: int = 0
    stamp: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.alloc = allocator
        self.page_size = allocator.page_size
        self._nodes: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._by_id: dict[int, _Node] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.query_tokens = 0  # prompt tokens looked up
        self.evictions = 0  # pages evicted
        self._unreferenced = 0  # nodes with refs == 0 (evictable), kept as refs change

    def _chain(self, tokens: list[int]) -> list[_Node]:
        ps, parent, out = self.page_size, 0, []
        for i in range(len(tokens) // ps):
            node = self._nodes.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if node is None:
                break
            out.append(node)
            parent = node.id
        return out

    def acquire(self, tokens: list[int], limit: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens`, at most `limit` tokens long,
        each referenced once more (the caller reads them until `release`)."""
        nodes = self._chain(tokens[:limit])
        self._touch(nodes)
        for n in nodes:
            self._unreferenced -= n.refs == 0
            n.refs += 1
        return [n.page for n in nodes]

    def count(self, query_tokens: int, hit_pages: int) -> None:
        """Stats of one admitted prompt: its length and the pages it found cached."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_pages * self.page_size

    def release(self, tokens: list[int], pages: list[int]) -> None:
        """Give back pages from `acquire` (the first len(pages) pages of `tokens`)."""
        nodes = self._chain(tokens[: len(pages) * self.page_size])
        if [n.page for n in nodes] != pages:
            raise ValueError("released pages are not the cached prefix of these tokens")
        for n in nodes:
            if n.refs <= 0:
                raise ValueError(f"page {n.page} released more often than acquired")
            self._unref(n)

    def insert(self, tokens: list[int], pages: list[int], held: int) -> list[int]:
        """A request ends owning `pages` (KV of `tokens` in order); its first `held`
        pages came from `acquire`. Full pages not cached yet join the cache; the pages
        acquired are released. Returns the pages the caller still owns (to free):
        the partial last page and pages whose prefix another request cached first."""
        ps, parent = self.page_size, 0
        rest: list[int] = []
        chain: list[_Node] = []
        for i, page in enumerate(pages):
            block = tuple(tokens[i * ps : (i + 1) * ps])
            node = self._nodes.get((parent, block)) if len(block) == ps else None
            if i < held:
                if node is None or node.page != page or node.refs <= 0:
                    raise ValueError(f"page {page} was not acquired from the cache")
                self._unref(node)
            elif node is None and len(block) == ps and parent >= 0:
                node = self._add(parent, block, page)
            else:
                rest.append(page)  # partial, or another page holds this prefix already
            if node is not None:
                chain.append(node)
            parent = node.id if node is not None else -1  # -1: nothing cached below
        self._touch(chain)
        return rest

    def publish(self, tokens: list[int], pages: list[int], held: int) -> int:
        """A request whose prompt KV is computed shares its full pages now, before it
        ends (prompts arriving together, such as the n samples of one request, then
        find them): its first `held` pages are cached already; the full pages after
        them join the cache referenced once, for the request, until the first page
        whose prefix another page holds. Returns the request's new `held`: its pages
        up to there are the cache's, the rest stay its own."""
        ps = self.page_size
        chain = self._chain(tokens[: held * ps])
        if [n.page for n in chain] != pages[:held]:
            raise ValueError("the held pages are not the cached prefix of these tokens")
        parent = chain[-1].id if chain else 0
        while held < len(pages) and len(block := tuple(tokens[held * ps : (held + 1) * ps])) == ps:
            if (parent, block) in self._nodes:
                break
            node = self._add(parent, block, pages[held])
            self._ref(node)  # the request's, until it ends
            chain.append(node)
            parent, held = node.id, held + 1
        self._touch(chain)
        return held

    def _ref(self, node: _Node) -> None:
        self._unreferenced -= node.refs == 0
        node.refs += 1

    def _unref(self, node: _Node) -> None:
        node.refs -= 1
        self._unreferenced += node.refs == 0

    def _add(self, parent: int, block: tuple[int, ...], page: int) -> _Node:
        self._unreferenced += 1
        node = _Node(id=next(self._ids), key=(parent, block), page=page)
        self._nodes[node.key] = node
        self._by_id[node.id] = node
        if parent:
            self._by_id[parent].children += 1
        return node

    def _touch(self, chain: list[_Node]) -> None:
        for n in reversed(chain):  # leaf first: the root ends the most recent
            n.stamp = next(self._clock)

    def evict(self, pages: int) -> int:
        """Return up to `pages` unreferenced leaf pages to the allocator, least
        recently used first; how many went back."""
        heap = [(n.stamp, n.id) for n in self._nodes.values() if n.refs == 0 and n.children == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            node = self._by_id[heapq.heappop(heap)[1]]
            parent = self._by_id.get(node.key[0])
            self._drop(node)
            freed += 1
            if parent is not None and parent.refs == 0 and parent.children == 0:
                heapq.heappush(heap, (parent.stamp, parent.id))  # a leaf now
        return freed

    def _drop(self, node: _Node) -> None:
        del self._nodes[node.key]
        del self._by_id[node.id]
        self._unreferenced -= 1  # only unreferenced nodes are dropped
        parent = node.key[0]
        if parent:
            self._by_id[parent].children -= 1
        self.alloc.free([node.page])
        self.evictions += 1

    @property
    def pages(self) -> int:
        return len(self._nodes)

    @property
    def evictable(self) -> int:
        """Pages eviction could give back now: the unreferenced ones. (An unreferenced
        page's descendants are unreferenced too: a request acquires whole chains.)"""
        return self._unreferenced

    def referenced(self) -> set[int]:
        return {n.page for n in self._nodes.values() if n.refs > 0}

    def stats(self) -> dict[str, float]:
        return {
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_query_tokens": self.query_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / max(self.query_tokens, 1),
            "prefix_cache_evictions": self.evictions,
            "prefix_cache_pages": self.pages,
        }
