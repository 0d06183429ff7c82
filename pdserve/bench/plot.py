"""`--plot FILE.png`: latency CDFs and output tokens/s over time (matplotlib,
imported only here and only when asked for)."""

from __future__ import annotations

import math

from pdserve.bench.backends import RequestRecord
from pdserve.bench.runner import BenchResult


def token_rate(records: list[RequestRecord], bin_s: float) -> list[tuple[float, float]]:
    """Output tokens/s in bins of `bin_s` seconds since the run started, as
    (bin start, rate). A chunk's tokens land in the bin of its arrival; when a
    request's chunks carried several tokens, they are spread evenly over them."""
    bins: dict[int, float] = {}
    for r in records:
        if not r.success:
            continue
        t = r.start + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        per_chunk = r.output_tokens / len(times)
        for t in times:
            k = math.floor(t / bin_s)
            bins[k] = bins.get(k, 0.0) + per_chunk
    if not bins:
        return []
    return [(k * bin_s, bins.get(k, 0.0) / bin_s) for k in range(min(bins), max(bins) + 1)]


def require_matplotlib():  # -> the matplotlib.pyplot module
    """pyplot on a file-only backend; RuntimeError with the fix when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    return plt


def plot_result(result: BenchResult, path: str) -> None:
    """Write a 2x2 figure to `path`. Raises RuntimeError when matplotlib is missing."""
    plt = require_matplotlib()
    ok = [r for r in result.records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r.ttft * 1e3 for r in ok], "TTFT (ms)")
    _cdf(axes[0][1], [g * 1e3 for r in ok for g in r.itl], "ITL (ms)")
    _cdf(axes[1][0], [r.latency * 1e3 for r in ok], "E2E latency (ms)")
    bin_s = max(result.metrics.duration_s / 60.0, 0.05)
    series = token_rate(result.records, bin_s)
    ax = axes[1][1]
    ax.plot([t for t, _ in series], [v for _, v in series], drawstyle="steps-post")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    cfg = result.config
    fig.suptitle(f"{cfg.backend} {result.model or ''} @ {cfg.base_url}, rate {cfg.request_rate}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.plot(xs, ys, drawstyle="steps-post")
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
