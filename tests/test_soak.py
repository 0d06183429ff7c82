"""Short soak: concurrent streams, stop strings, cancellations and bursts through the router;
afterwards nothing is running and every row and page is free on both workers, no request
failed except the cancelled ones, and greedy samples taken under load equal transformers'."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.soak import Cluster, drive, greedy_mismatches, model_facts, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_soak_nothing_lost_nothing_leaked() -> None:
    cluster = Cluster(transfer={})
    try:
        p, d, r = cluster.start()
        path, name, vocab = model_facts(p.url)
        t = asyncio.run(drive(r.url, name, vocab, duration_s=20.0, concurrency=6, seed=1))
        held = wait_quiet([p.url, d.url], timeout_s=15.0)
        assert not held, (held, cluster.logs())
        assert t.requests == t.ok + t.cancelled + sum(t.errors.values())
        assert not t.errors, (t.errors, t.examples)
        assert t.ok >= 10 and t.cancelled >= 1 and len(t.samples) >= 3, t
        assert greedy_mismatches(path, t.samples) == 0
    finally:
        cluster.stop()
