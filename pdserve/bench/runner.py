"""Drive a workload against a server: warm-up, timed arrivals, concurrency cap.

build_requests ──▶ warm-up (all at once, not measured)
               ──▶ measured: request i waits until t0 + offset[i], then for a
                   concurrency slot, then streams; TTFT counts from the send
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import httpx

from pdserve.bench.backends import RequestRecord, send_request
from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import BenchRequest, build_requests
from pdserve.bench.metrics import Metrics, compute_metrics


@dataclass
class BenchResult:
    config: BenchConfig
    model: str | None  # as sent to the server (None for the native backend without --model)
    metrics: Metrics
    records: list[RequestRecord]  # measured requests only, in dataset order
    started_at: float  # unix time at the first measured request


def arrival_offsets(n: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Send times in seconds after the start; the first request goes at 0.
    Poisson arrivals have exponential gaps of mean 1/rate; `rate == inf` is a burst."""
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return offsets


class Progress:
    """A one-line progress bar on a text stream (stderr), redrawn at most 10x/s."""

    def __init__(self, total: int, enabled: bool, out: TextIO | None = None, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.out = out or sys.stderr
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self._last_draw = 0.0

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.success
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now - self.t0)

    def _draw(self, elapsed: float) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = f"\rbench [{bar}] {self.done}/{self.total}  errors {self.failed}  "
        self.out.write(line + f"{elapsed:6.1f}s  {rate:6.2f} req/s")
        self.out.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.out.write("\n")
            self.out.flush()


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def fetch_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists at GET /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot read the model name from {url} ({e}); pass --model") from e


async def _run_phase(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str | None,
    requests: list[BenchRequest],
    offsets: list[float],
    progress: Progress | None,
) -> list[RequestRecord]:
    headers = _headers(cfg)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: BenchRequest, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        async with sem if sem is not None else contextlib.nullcontext():
            start = time.perf_counter() - t0
            rec = await send_request(
                client,
                cfg.backend,
                cfg.base_url,
                req,
                model=model,
                temperature=cfg.temperature,
                timeout=cfg.timeout,
                headers=headers,
            )
        rec.start = start
        if progress is not None:
            progress.update(rec)
        return rec

    return list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run the whole benchmark described by `cfg` and measure it.

    Raises ValueError on an invalid config or dataset, RuntimeError when the
    model name is needed and cannot be read from the server. Request failures
    do not raise: they are counted in `metrics.errors`.
    """
    cfg.validate()
    requests = build_requests(cfg)
    warmup, measured = requests[: cfg.num_warmup], requests[cfg.num_warmup :]
    offsets = arrival_offsets(
        len(measured), cfg.request_rate, cfg.arrival, random.Random(cfg.seed + 1_000_003)
    )
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = cfg.model
        if model is None and cfg.backend != "native":
            model = await fetch_model(client, cfg.base_url, _headers(cfg))
        if warmup:
            await _run_phase(client, cfg, model, warmup, [0.0] * len(warmup), None)
        progress = Progress(len(measured), not cfg.disable_progress)
        started_at, t0 = time.time(), time.perf_counter()
        records = await _run_phase(client, cfg, model, measured, offsets, progress)
        duration = time.perf_counter() - t0
        progress.close()
    metrics = compute_metrics(records, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
    return BenchResult(cfg, model, metrics, records, started_at)
