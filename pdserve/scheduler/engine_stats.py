"""Counters both engines report through `stats()` (served at /server_info and /metrics)."""

from __future__ import annotations

import time
from typing import Any

from pdserve.model.runner import ModelRunner
from pdserve.scheduler.request import Req


def pool_stats(runner: ModelRunner) -> dict[str, float]:
    rows, pages = runner.req_pool, runner.kv_pool.allocator
    return {
        "free_rows": rows.free_rows,
        "total_rows": rows.total_rows,
        "free_kv_pages": pages.free_pages,
        "total_kv_pages": pages.total_pages,
        "token_usage": (pages.total_pages - pages.free_pages) / max(pages.total_pages, 1),
    }


def busy_ratio(busy_s: float, started: float) -> float:
    return busy_s / max(time.perf_counter() - started, 1e-9)


def channel_stats(channel: object) -> dict[str, float]:
    """The KV sink's or source's own counters (refused, dropped, ...), prefixed."""
    stats = getattr(channel, "stats", None)
    return {f"transfer_{k}": float(v) for k, v in (stats() if stats else {}).items()}


class TransferTotals:
    """Decode side: completed transfers' time and bytes, and failures."""

    def __init__(self) -> None:
        self.seconds_sum = 0.0
        self.count = 0
        self.bytes = 0
        self.failed = 0

    def completed(self, req: Req, token_bytes_all_layers: int) -> None:
        self.seconds_sum += req.stages["kv_done"] - req.stages["reserved"]
        self.count += 1
        self.bytes += 2 * token_bytes_all_layers * req.prompt_len  # K and V

    def as_stats(self) -> dict[str, float]:
        return {
            "kv_transfer_seconds_sum": self.seconds_sum,
            "kv_transfer_seconds_count": self.count,
            "kv_transfer_bytes": self.bytes,
            "transfer_failed": self.failed,
        }


def decode_stats(eng: Any) -> dict[str, float]:
    """A DecodeEngine's counters: pools, its queues, busy ratio, transfers."""
    return {
        **pool_stats(eng.runner),
        "running": len([r for r in eng.running if not r.finished]),
        "running_peak": eng.running_peak,
        "queued": len(eng.prealloc) + len(eng.transfer) + len(eng.prebuilt) + len(eng.preempted),
        "prealloc": len(eng.prealloc),
        "preempted": len(eng.preempted),
        "preemptions": eng.preemptions,
        "recomputed_tokens": eng.recomputed_tokens,
        "transfer": len(eng.transfer),
        "prebuilt": len(eng.prebuilt),
        "forward_busy_ratio": busy_ratio(eng.busy_s, eng.started),
        "decode_steps": eng.steps,
        **(eng.spec.stats() if eng.spec is not None else {}),
        **eng.transfer_totals.as_stats(),
        **channel_stats(eng.source),
    }
