"""The KV page allocator hands pages out in as few runs as it can (kvcache/page_runs.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.kvcache.pools import PageAllocator, PoolError
from pdserve.transfer.sending.pieces import slot_runs


def runs_of(pages: list[int]) -> list[tuple[int, int]]:
    return slot_runs(np.array(pages), max_runs=len(pages)) or []


def holed(n: int, keep: list[tuple[int, int]]) -> PageAllocator:
    """An allocator of n pages with only the runs `keep` (start, length) free."""
    alloc = PageAllocator(n, 4)
    every = alloc.alloc(n - 1)
    assert every == list(range(1, n))
    alloc.free([p for s, c in keep for p in range(s, s + c)])
    return alloc


def test_a_fresh_pool_hands_out_ascending_runs() -> None:
    alloc = PageAllocator(64, 4)
    assert alloc.alloc(5) == [1, 2, 3, 4, 5] and alloc.alloc(3) == [6, 7, 8]
    assert alloc.free_pages == 63 - 8 and alloc.alloc(0) == []


def test_the_shortest_run_that_fits_is_used() -> None:
    alloc = holed(64, [(3, 3), (10, 5), (20, 8)])
    assert alloc.alloc(5) == list(range(10, 15))  # exactly fits
    assert alloc.alloc(4) == list(range(20, 24))  # 3 is too short; 8 is the only fit
    assert alloc.alloc(3) == [3, 4, 5]
    assert alloc.alloc(4) == [24, 25, 26, 27] and alloc.free_pages == 0
    assert alloc.alloc(1) is None


def test_without_a_fit_the_longest_runs_are_joined() -> None:
    alloc = holed(64, [(3, 2), (10, 5), (20, 4), (40, 1)])
    got = alloc.alloc(7)
    assert got == [10, 11, 12, 13, 14, 20, 21]  # 5 whole, then the head of 4
    assert alloc.free_pages == 12 - 7
    assert sorted(alloc.alloc(5) or []) == [3, 4, 22, 23, 40]


def test_bad_frees_are_refused_and_change_nothing() -> None:
    alloc = PageAllocator(16, 4)
    got = alloc.alloc(4)
    assert got == [1, 2, 3, 4]
    for bad in ([1, 1], [5], [0], [16], [-1], [2, 9]):
        with pytest.raises(PoolError):
            alloc.free(bad)
        assert alloc.free_pages == 11
    alloc.free(got)
    with pytest.raises(PoolError):
        alloc.free([3])
    assert alloc.free_pages == 15


def test_churn_keeps_accounts_exact_and_uses_a_fitting_run() -> None:
    """Mixed sizes, random ends: every alloc gives distinct free pages, one run whenever
    a free run was long enough, and everything comes back."""
    n, rng = 512, random.Random(7)
    alloc = PageAllocator(n, 4)
    free = set(range(1, n))
    live: list[list[int]] = []
    for _ in range(3000):
        if live and (rng.random() < 0.5 or alloc.free_pages < 70):
            pages = live.pop(rng.randrange(len(live)))
            alloc.free(pages)
            free |= set(pages)
            continue
        k = rng.choice([1, 2, 3, 8, 20, 64])
        longest = max((c for _, c in runs_of(sorted(free))), default=0)
        got = alloc.alloc(k)
        assert got is not None and len(set(got)) == k and set(got) <= free
        assert len(runs_of(got)) == 1 or longest < k
        free -= set(got)
        live.append(got)
        assert alloc.free_pages == len(free)
    for pages in live:
        alloc.free(pages)
    assert alloc.free_pages == n - 1
