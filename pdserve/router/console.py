"""GET /console/state: one JSON document the web console polls (docs/console.md).

The router asks every worker for its GET /stats (engine gauges, the frontend's counters
and its last finished requests, server/activity.py) at once, and adds its own view
(health, requests in flight per worker, its counters) and rates it derives from
successive samples (KV bytes/s, tokens/s, requests/s). An answer is reused for
CACHE_S, and concurrent polls share one fan-out, so any number of open pages costs the
workers at most one /stats each per CACHE_S.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from pdserve.router.workers import Worker, WorkerPool

CACHE_S = 0.5
FETCH_TIMEOUT_S = 2.0  # a worker slower than this shows as unreachable for that poll
RATE_WINDOW_S = 5.0  # rates are averaged over the samples of the last few seconds
RECENT = 12  # finished requests in the answer, newest first


class Rates:
    """Per-second rates of counters from timestamped samples (a window per key)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def rate(self, key: str, now: float, value: float) -> float:
        """Add a sample; the rate over the window (0 until two samples are a moment apart;
        a counter that went down, a restarted worker, starts over)."""
        q = self._samples.setdefault(key, deque())
        if q and value < q[-1][1]:
            q.clear()
        q.append((now, value))
        while len(q) > 2 and now - q[1][0] >= self.window_s:
            q.popleft()
        (t0, v0), (t1, v1) = q[0], q[-1]
        return (v1 - v0) / (t1 - t0) if t1 - t0 > 0.05 else 0.0


def _used(stats: Mapping[str, float], free: str, total: str) -> list[int]:
    t = int(stats.get(total, 0))
    return [t - int(stats.get(free, 0)), t]


def worker_view(w: Worker, body: Mapping[str, Any] | None, rates: Rates, now: float,
                error: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One worker's card: the router's view, and its /stats when it answered."""
    view: dict[str, Any] = {"url": w.url, "role": w.role, "healthy": w.healthy,
                            "router_in_flight": w.in_flight, "reachable": body is not None}  # fmt: skip
    if body is None:
        return view | {"error": error}
    s = body.get("engine") or {}
    kv = float(s.get("kv_transfer_bytes", 0.0))
    out = float(body.get("output_tokens", 0))
    return view | {
        "engine_alive": bool(body.get("engine_alive")),
        "running": int(s.get("running", 0)),
        "queued": int(s.get("queued", 0)),
        "rows": _used(s, "free_rows", "total_rows"),
        "kv_pages": _used(s, "free_kv_pages", "total_kv_pages"),
        "busy": round(float(s.get("forward_busy_ratio", 0.0)), 3),
        "transfers": int(s.get("transfer_active_rooms", 0)),
        "kv_bytes": int(kv),
        "kv_bytes_per_s": round(rates.rate(w.url + " kv", now, kv)),
        "output_tokens": int(out),
        "tokens_per_s": round(rates.rate(w.url + " tokens", now, out), 1),
        "finished": int(body.get("finished", 0)),
    }


def recent_of(bodies: list[tuple[Worker, Mapping[str, Any] | None]]) -> list[dict[str, Any]]:
    """The decodes' last finished requests (theirs carry every stage), newest first."""
    rows = [{"worker": w.url, **r} for w, b in bodies if b and w.role == "decode"
            for r in b.get("recent") or []]  # fmt: skip
    rows.sort(key=lambda r: r.get("done_at", 0), reverse=True)
    return rows[:RECENT]


class ConsoleFeed:
    """Builds /console/state from the workers' /stats (cached CACHE_S, one fan-out at a time)."""

    def __init__(self, client: httpx.AsyncClient, pool: WorkerPool, stats: Mapping[str, int],
                 headers: Callable[[], dict[str, str]]) -> None:  # fmt: skip
        self.client, self.pool, self.stats, self.headers = client, pool, stats, headers
        self.rates = Rates()
        self._lock = asyncio.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None

    async def state(self) -> dict[str, Any]:
        async with self._lock:  # pollers arriving during a fan-out wait for its answer
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= CACHE_S:
                self._cached = (now, await self._build(now))
            return self._cached[1]

    async def _fetch(self, w: Worker) -> tuple[Mapping[str, Any] | None, str | None]:
        try:
            r = await self.client.get(w.url + "/stats", headers=self.headers(),
                                      timeout=FETCH_TIMEOUT_S)  # fmt: skip
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}"
            body = r.json()
            return (body, None) if isinstance(body, dict) else (None, "not a JSON object")
        except (httpx.HTTPError, ValueError) as e:
            return None, type(e).__name__

    async def _build(self, now: float) -> dict[str, Any]:
        workers = self.pool.all
        got = await asyncio.gather(*(self._fetch(w) for w in workers))
        views = [worker_view(w, b, self.rates, now, e) for w, (b, e) in zip(workers, got)]
        total = self.stats.get("requests_total", 0)
        router = {**self.stats, "requests_per_s": round(self.rates.rate("router", now, total), 2)}
        recent = recent_of([(w, b) for w, (b, _) in zip(workers, got)])
        return {"at": round(time.time(), 3), "router": router, "workers": views,
                "recent": recent}  # fmt: skip
