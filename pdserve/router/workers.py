"""The router's view of its workers: addresses, in-flight counts, selection policy."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pdserve.config import ROUTER_POLICIES
from pdserve.router.policy import CacheAware, prefix_key

POLICIES = ROUTER_POLICIES


@dataclass(eq=False)  # identity: a worker is itself, whatever its counters
class Worker:
    url: str  # "http://host:port", no trailing slash
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None  # prefill only; None: the prefill's own default
    in_flight: int = 0  # requests through this router not yet finished on this worker
    healthy: bool = True  # last /health was 200: it gets new work
    # last /health answered in time, 200 or "draining" (a failed connect: False); the
    # requests on a decode that is not alive are given up on (proxy.watchdog), those on
    # a draining one finish there
    alive: bool = True

    @property
    def host(self) -> str:
        """The host the decode should dial for the KV bootstrap (the prefill URL's host)."""
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass
class Selector:
    """Picks one worker of a role. Invariant: `workers` is non-empty.

    round_robin cycles through the workers; least_load takes the fewest
    `in_flight`, ties broken by a rotating start so equal loads spread out.
    Only healthy workers with room (`in_flight` under `capacity`, 0: no limit) are
    candidates; those in `avoid` (the workers a migrated request failed on) only when
    no other is left.
    """

    workers: list[Worker]
    policy: str = "round_robin"
    _turn: Iterator[int] = field(default_factory=itertools.count)
    cache: CacheAware | None = None  # cache_aware prefills (router/policy.py)
    capacity: int = 0

    def pick(self, key: str | None = None, avoid: Collection[Worker] = ()) -> Worker:
        """`key`: the request's prefix key (policy.prefix_key), for cache_aware. Raises
        NoWorker when no worker is a candidate."""
        n = len(self.workers)
        start = next(self._turn) % n
        ordered = [self.workers[(start + i) % n] for i in range(n)]
        candidates = [w for w in ordered if w.healthy and self._room(w)]
        if not candidates:
            raise NoWorker(self.workers[0].role, any(w.healthy for w in self.workers))
        candidates = [w for w in candidates if w not in avoid] or candidates
        if self.cache is not None:
            return self.cache.pick(candidates, key)
        if self.policy in ("least_load", "cache_aware"):
            return min(candidates, key=lambda w: w.in_flight)  # min keeps the first of ties
        return candidates[0]

    def _room(self, w: Worker) -> bool:
        return self.capacity <= 0 or w.in_flight < self.capacity


class NoWorker(Exception):
    """Every worker of `role` is unhealthy or full (`saturated`: some are healthy)."""

    def __init__(self, role: str, saturated: bool) -> None:
        why = "at capacity" if saturated else "unhealthy"
        super().__init__(f"every {role} worker is {why}")
        self.role = role


@dataclass
class WorkerPool:
    prefill: Selector
    decode: Selector

    @classmethod
    def build(
        cls,
        prefills: list[tuple[str, int | None]],
        decodes: list[str],
        policy: str,
        capacity: int = 0,
    ) -> WorkerPool:
        """`capacity`: requests in flight per worker beyond which it gets no more (0: no
        limit)."""
        if not prefills or not decodes:
            raise ValueError("the router needs at least one --prefill and one --decode")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        p = [Worker(_norm(u), "prefill", b) for u, b in prefills]
        d = [Worker(_norm(u), "decode") for u in decodes]
        cache = CacheAware() if policy == "cache_aware" else None
        return cls(
            Selector(p, policy, cache=cache, capacity=capacity),
            Selector(d, policy, capacity=capacity),
        )

    @property
    def all(self) -> list[Worker]:
        return self.prefill.workers + self.decode.workers

    def pick_pair(
        self, path: str = "", body: dict[str, Any] | None = None, avoid: Collection[Worker] = ()
    ) -> tuple[Worker, Worker]:
        """Raises NoWorker (Selector.pick)."""
        key = prefix_key(path, body) if self.prefill.cache is not None and body else None
        decode = self.decode.pick(avoid=avoid)  # first: a full decode side draws no prefill
        return self.prefill.pick(key, avoid), decode

    @contextmanager
    def lease(self, *workers: Worker) -> Iterator[None]:
        """Counts one in-flight request on each worker for the duration of the block."""
        for w in workers:
            w.in_flight += 1
        try:
            yield
        finally:
            for w in workers:
                w.in_flight -= 1


def _norm(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


def worker_url(url: str, flag: str) -> str:
    """`url` as the router uses it (_norm: "host:port" means http), or ValueError naming
    `flag` where it cannot name an http(s) server: another scheme, no host, a port that
    is not a number or outside 0-65535."""
    norm = _norm(url)
    try:
        parts = urlsplit(norm)
        parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
    except ValueError as e:
        raise ValueError(f"{flag} {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r}: not an http(s) URL (for example http://127.0.0.1:30000)")
    return norm


def parse_prefill_args(groups: list[list[str]]) -> list[tuple[str, int | None]]:
    """`--prefill URL [BOOTSTRAP_PORT]` groups (argparse nargs="+", action="append").

    The port may be a number, `none`, or absent (None), as in sglang-router.
    """
    out: list[tuple[str, int | None]] = []
    for group in groups:
        if not 1 <= len(group) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {group}")
        port: int | None = None
        if len(group) == 2 and group[1].lower() != "none":
            try:
                port = int(group[1])
            except ValueError:
                raise ValueError(f"bad bootstrap port {group[1]!r} for {group[0]}") from None
            if not 0 < port < 65536:
                raise ValueError(f"bad bootstrap port {port} for {group[0]} (1-65535)")
        out.append((worker_url(group[0], "--prefill"), port))
    return out
