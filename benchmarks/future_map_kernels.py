"""Bandwidth of the FutureMap kernels: torch reference vs Triton, side by side.

    python benchmarks/future_map_kernels.py [--device cpu|cuda] [--json]

Bytes moved per call (rows int64): gather reads rows + src[rows], writes out;
scatter reads rows + values, writes dst[rows]: 3 * 8 * B bytes each.
On a machine without CUDA the Triton column runs under TRITON_INTERPRET (a
correctness tool, not a fast path): it is labelled "triton-interp".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.future_map import gather_tokens, scatter_tokens  # noqa: E402

BATCHES = (16, 64, 256, 1024, 4096)
TABLE_ROWS = 8192  # rows of the token table (> the largest batch)


def _time_per_call(fn: Callable[[], object], device: str, budget_s: float) -> float:
    """Mean seconds per call: one warm-up, then repeat until `budget_s` has passed."""
    fn()
    _sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 8 == 0 or calls < 8:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s and calls >= 3:
                return elapsed / calls


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure(batch: int, backend: str, device: str, budget_s: float) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    table = torch.randint(0, 1 << 30, (TABLE_ROWS,), generator=g).to(device)
    rows = torch.randperm(TABLE_ROWS, generator=g)[:batch].to(device)
    values = torch.randint(0, 1 << 30, (batch,), generator=g).to(device)
    out = torch.empty(batch, dtype=torch.int64, device=device)
    nbytes = 3 * 8 * batch
    gather_s = _time_per_call(
        lambda: gather_tokens(table, rows, out, backend=backend), device, budget_s
    )
    scatter_s = _time_per_call(
        lambda: scatter_tokens(table, rows, values, backend=backend), device, budget_s
    )
    return {
        "gather_us": gather_s * 1e6,
        "gather_gbps": nbytes / gather_s / 1e9,
        "scatter_us": scatter_s * 1e6,
        "scatter_gbps": nbytes / scatter_s / 1e9,
    }


def _columns(device: str) -> list[tuple[str, str]]:
    """(backend, label) pairs that can run on `device` in this process."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.startswith("cuda") and not interpreted:
        return [("torch", "torch"), ("triton", "triton")]
    if device == "cpu" and interpreted:
        return [("torch", "torch"), ("triton", "triton-interp")]
    return [("torch", "torch")]  # e.g. --device cpu on a CUDA machine: no Triton CPU path


def run(device: str, budget_s: float) -> dict[str, object]:
    columns = _columns(device)
    results = []
    for batch in BATCHES:
        row: dict[str, object] = {"batch": batch}
        for backend, label in columns:
            row[label] = _measure(batch, backend, device, budget_s)
        results.append(row)
    return {
        "benchmark": "futuremap_kernels",
        "device": torch.cuda.get_device_name()
        if device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "columns": [label for _, label in columns],
        "bytes_per_call": "24 * batch",
        "results": results,
    }


def print_table(report: dict[str, object]) -> None:
    cols = report["columns"]
    assert isinstance(cols, list)
    print(f"FutureMap kernels on {report['device']} (torch {report['torch']}); GB/s (us/call)")
    head = "".join(f"{c + ' ' + op:>28}" for c in cols for op in ("gather", "scatter"))
    print(f"{'batch':>6}{head}")
    for row in report["results"]:  # type: ignore[attr-defined]
        cells = ""
        for c in cols:
            m = row[c]
            for op in ("gather", "scatter"):
                cells += f"{m[op + '_gbps']:>17.3g} ({m[op + '_us']:>8.1f})"
        print(f"{row['batch']:>6}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default)
    parser.add_argument("--budget", type=float, default=0.02, help="seconds timed per cell")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    report = run(args.device, args.budget)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
