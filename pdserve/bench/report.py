"""A run's summary table (stdout) and its JSON line (appended to --output)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Any

from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import Dist, Metrics
from pdserve.bench.runner import BenchResult

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def summary_table(result: BenchResult) -> str:
    cfg, m = result.config, result.metrics
    rows = [
        ("Backend / model", f"{cfg.backend} / {result.model or '-'}"),
        ("Base URL", cfg.base_url),
        ("Successful requests", str(m.completed)),
        ("Failed requests", _failures(m)),
        ("Duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", str(m.total_input_tokens)),
        ("Total output tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Input throughput (tok/s)", f"{m.input_throughput:.2f}"),
        ("Output throughput (tok/s)", f"{m.output_throughput:.2f}"),
    ]
    if m.goodput is not None and m.slo_attainment is not None:
        rows.append(("Goodput (req/s)", f"{m.goodput:.2f}"))
        rows.append(("SLO attainment (%)", f"{100 * m.slo_attainment:.1f}"))
    lines = ["=" * 20 + " pdserve bench " + "=" * 20]
    lines += [f"{k + ':':<34}{v}" for k, v in rows]
    lines += _dist_table("latency (ms)", [(n, getattr(m, a)) for n, a in _LATENCIES])
    if m.ttft_breakdown_ms:
        lines += _dist_table("TTFT breakdown (ms)", list(m.ttft_breakdown_ms.items()))
    lines.append("=" * 55)
    return "\n".join(lines)


def _failures(m: Metrics) -> str:
    if not m.errors:
        return str(m.failed)
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(m.errors.items()))
    return f"{m.failed}  ({reasons})"


def _dist_table(title: str, rows: list[tuple[str, Dist]]) -> list[str]:
    out = [f"{'-' * 4} {title} {'-' * (49 - len(title))}"]
    out.append(f"{'':<18}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}")
    for name, d in rows:
        out.append(f"{name:<18}{d.mean:>9.2f}{d.median:>9.2f}{d.p90:>9.2f}{d.p99:>9.2f}")
    return out


def json_record(result: BenchResult, details: bool) -> dict[str, Any]:
    """The run as one JSON-ready object: config, model, metrics [, per-request records]."""
    record: dict[str, Any] = {
        "date": datetime.datetime.fromtimestamp(result.started_at).isoformat(timespec="seconds"),
        "started_at": result.started_at,
        "model": result.model,
        "config": _json_safe(dataclasses.asdict(_redacted(result.config))),
        "metrics": _json_safe(dataclasses.asdict(result.metrics)),
    }
    if details:
        record["details"] = [
            {**dataclasses.asdict(r), "tpot": r.tpot, "success": r.success} for r in result.records
        ]
    return record


def _redacted(cfg: BenchConfig) -> BenchConfig:
    # the API key is a secret: it never goes into a results file
    return dataclasses.replace(cfg, api_key="<redacted>") if cfg.api_key else cfg


def append_json_line(path: str, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def _json_safe(obj: Any) -> Any:
    # Strict JSON has no Infinity: a burst rate is written as the string "inf".
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
