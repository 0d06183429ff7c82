"""Latency distributions, throughput and goodput from request records.

Definitions (per successful request unless said otherwise):
  TTFT  send -> first content chunk
  ITL   gap between successive content chunks (pooled over all requests)
  TPOT  (E2E - TTFT) / (output_tokens - 1), requests with >= 2 tokens
  E2E   send -> end of stream
  throughput = completed requests (or their tokens) / run duration
  goodput    = requests that succeeded *and* met every SLO given / run duration
  SLO attainment = those requests / all measured requests (failures count as misses)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.bench.backends import BREAKDOWN_KEYS, RequestRecord


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest
    ranks (numpy's default). Precondition: `values` is not empty."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Dist:
    """Summary of a latency sample in milliseconds (all 0.0 when empty)."""

    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    count: int = 0

    @staticmethod
    def of_seconds(values: list[float]) -> Dist:
        if not values:
            return Dist()
        ms = [v * 1000.0 for v in values]
        return Dist(
            mean=sum(ms) / len(ms),
            median=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
            count=len(ms),
        )


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float  # tok/s
    ttft_ms: Dist
    itl_ms: Dist
    tpot_ms: Dist
    e2e_ms: Dist
    errors: dict[str, int]  # reason -> count
    goodput: float | None = None  # req/s; None when no SLO was given
    slo_attainment: float | None = None  # 0..1; None when no SLO was given
    ttft_breakdown_ms: dict[str, Dist] | None = None  # stage -> Dist; None when not reported


def meets_slo(rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within every SLO given (a 1-token request has no TPOT)."""
    if not rec.success:
        return False
    if slo_ttft_ms is not None and rec.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = rec.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> Metrics:
    """Metrics of the measured (non-warm-up) records. Precondition: duration_s > 0."""
    ok = [r for r in records if r.success]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    goodput = attainment = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
        goodput = good / duration_s
        attainment = good / len(records) if records else 0.0
    return Metrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=in_tok,
        total_output_tokens=out_tok,
        request_throughput=len(ok) / duration_s,
        input_throughput=in_tok / duration_s,
        output_throughput=out_tok / duration_s,
        ttft_ms=Dist.of_seconds([r.ttft for r in ok]),
        itl_ms=Dist.of_seconds([gap for r in ok for gap in r.itl]),
        tpot_ms=Dist.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        e2e_ms=Dist.of_seconds([r.latency for r in ok]),
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        goodput=goodput,
        slo_attainment=attainment,
        ttft_breakdown_ms=breakdown(ok),
    )


def breakdown(records: list[RequestRecord]) -> dict[str, Dist] | None:
    """Per-stage TTFT breakdown over the records that reported one; known
    stages first, in pipeline order, then any others the server sent."""
    reported = [r.ttft_breakdown for r in records if r.ttft_breakdown]
    if not reported:
        return None
    seen = {k for b in reported for k in b}
    keys = [k for k in BREAKDOWN_KEYS if k in seen] + sorted(seen - set(BREAKDOWN_KEYS))
    return {k: Dist.of_seconds([b[k] for b in reported if k in b]) for k in keys}
