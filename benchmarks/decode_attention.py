"""Decode attention alone on CPU: the native kernel against the portable gather, same run.

    python benchmarks/decode_attention.py [--batch 8 64] [--context 128 1024] [--json]

One layer of the `bench` layout (8 query heads, 2 KV heads, head_dim 64, float32, page
size 16), one query token per request, one thread. The pool holds exactly the batch's
pages, handed out in order ("in order") or shuffled ("shuffled"), as a long-running
server's allocator leaves them. ms per call (median), the bytes of K and V read over that
time (GB/s), and native / gather.

Two places the KV can be: "cache", the same pool every call (at 64 x 1024, 67 MB of K and
V, which a server CPU's L3 may hold), and "memory", each call the next of enough copies
to fill --rotate-mb (1 GiB by default, beyond any L3), as a decode step walks its layers'
pools (the native kernel only). Compare with the machine's sequential read speed over the
same two footprints, printed first (torch's sum).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.native import paged_decode  # noqa: E402
from pdserve.model.attention import gather as decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16
T = TypeVar("T")


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def make_case(batch: int, context: int, shuffled: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(batch * context)
    pages_each = -(-context // PAGE)
    pages = batch * pages_each
    kc = torch.randn(pages * PAGE, KV_HEADS, HEAD_DIM, generator=g)
    vc = torch.randn(pages * PAGE, KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    order = torch.randperm(pages, generator=g) if shuffled else torch.arange(pages)
    page_of = order.view(batch, pages_each)
    slots = (page_of[:, :, None] * PAGE + torch.arange(PAGE)).reshape(batch, -1)[:, :context]
    bounds = torch.tensor([[0, context]] * batch, dtype=torch.int64)
    hidden = torch.zeros(batch, context, dtype=torch.bool)
    return q, kc, vc, slots.contiguous(), bounds, hidden


class Rotation(Generic[T]):
    """Calls fn(copy) on the next of `n` copies each time: a footprint of n times one copy."""

    def __init__(self, copies: list[T], fn: Callable[[T], object]) -> None:
        self.copies, self.fn, self.i = copies, fn, 0

    def __call__(self) -> object:
        self.i = (self.i + 1) % len(self.copies)
        return self.fn(self.copies[self.i])


def measure(
    kernel: object, batch: int, context: int, shuffled: bool, reps: int, rotate_mb: int
) -> dict:
    q, kc, vc, slots, bounds, hidden = make_case(batch, context, shuffled)
    nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4
    gather = median_ms(lambda: decode_attention.gathered(q, kc, vc, slots, hidden, 0.125), reps)
    row = {"batch": batch, "context": context, "pages": "shuffled" if shuffled else "in order"}
    row.update(gather_ms=gather, mbytes=nbytes / 1e6)
    if isinstance(kernel, paged_decode.PagedDecode):
        native = median_ms(lambda: kernel(q, kc, vc, slots, bounds, 0.125), reps)
        row.update(native_ms=native, native_gbps=nbytes / native / 1e6)
        row.update(native_over_gather=native / gather)
        n = max(2, rotate_mb * 2**20 // nbytes)
        pools = [(kc.clone(), vc.clone()) for _ in range(n)]
        rotated = Rotation(pools, lambda kv: kernel(q, kv[0], kv[1], slots, bounds, 0.125))
        mem = median_ms(rotated, max(reps, 2 * n))
        row.update(memory_ms=mem, memory_gbps=nbytes / mem / 1e6)
    return row


def sequential_read(nbytes: int, reps: int, rotate_mb: int) -> tuple[float, float]:
    """GB/s of torch's sum over `nbytes`: the same tensor each time, then rotating."""
    xs = [torch.randn(nbytes // 4) for _ in range(max(2, rotate_mb * 2**20 // nbytes))]
    cached = median_ms(xs[0].sum, reps)
    memory = median_ms(Rotation(xs, torch.Tensor.sum), max(reps, 2 * len(xs)))
    return nbytes / cached / 1e6, nbytes / memory / 1e6


def run(batches: list[int], contexts: list[int], reps: int, rotate_mb: int) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        kernel = paged_decode.paged_decode(Path(cache))
        rows = [
            measure(kernel, batch, context, shuffled, reps, rotate_mb)
            for context in contexts
            for batch in batches
            for shuffled in (False, True)
        ]
    cached, memory = sequential_read(64 * 1024 * KV_HEADS * HEAD_DIM * 2 * 4, reps, rotate_mb)
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "native": kernel is not None,
        "sequential_read_gbps": cached,
        "sequential_read_memory_gbps": memory,
        "rotate_mb": rotate_mb,
        "rows": rows,
    }


def print_table(report: dict) -> None:
    print(f"torch {report['machine']['torch']}, one thread; sequential read (torch sum of "
          f"67 MB): {report['sequential_read_gbps']:.1f} GB/s cache, "
          f"{report['sequential_read_memory_gbps']:.1f} GB/s memory "
          f"(rotating over {report['rotate_mb']} MB)")  # fmt: skip
    if not report["native"]:
        print("no native kernel (no C compiler): gather only")
    print("| batch | context | pages | K+V MB | gather ms | native ms | native GB/s "
          "| native / gather | memory ms | memory GB/s |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["rows"]:
        nat = (f"{r['native_ms']:.2f} | {r['native_gbps']:.1f} | {r['native_over_gather']:.2f} | "
               f"{r['memory_ms']:.2f} | {r['memory_gbps']:.1f}"
               if "native_ms" in r else "- | - | - | - | -")  # fmt: skip
        print(f"| {r['batch']} | {r['context']} | {r['pages']} | {r['mbytes']:.1f} | "
              f"{r['gather_ms']:.2f} | {nat} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rotate-mb", type=int, default=1024,
                    help="footprint of the 'memory' columns: copies of the pool, one per call")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    report = run(args.batch, args.context, args.reps, args.rotate_mb)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
