"""The quantized matmul (kernels/native/linear_quant.c) per GGUF type, against the
float32 matmul (linear_f32.c's panels, what --weights float32 runs) and a plain read.

Per type, random blocks of N x K weights, several copies taken in turn so that together
they exceed the last-level cache (every call reads its weights from memory, as a decode
step of a model larger than the cache does). Reported, per type:

    read GB/s    a plain read of the same bytes (numpy's OR-reduce over them as uint64,
                 one part per thread): the machine's bandwidth on these threads
    b1 GB/s      the weights' bytes over the time of a batch-1 call
    b1 %read     that against the plain read (the roofline: 100% reads as fast as memory)
    bM ms / f32  time of a batch-M call (M = each --batch), and the float32 matmul's time
                 for the same shapes over that (>1: quantized is faster)
    i8 ...       the same for --quant-activations int8 (x quantized to 8 bits, integer
                 dots: quant_int8.h per row, quant_gemm8.h's tiled GEMM from 8 or 16
                 rows), the quantizing (and laying out) of x included; bM q/i8 the float-
                 activation call's time over the int8 one's (>1: int8 is faster); bM
                 f32/i8 the float32 matmul's time over the int8 one's

Taking turns: each repetition times the read, every quantized batch (float and int8
activations) and every float32 batch once, so a busy machine's noisy stretches fall on all; the medians are reported.
Clock: with one thread (the default) each call's CPU time on the calling thread
(time.thread_time), so time the thread spends preempted by other work on a shared machine
is not counted; with --threads N > 1 (the kernels' workers) the wall clock.

    python benchmarks/quant_kernels.py [--types Q4_K Q6_K ...] [--n 8192] [--k 2048]
        [--batch 1 8 64] [--reps 3] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.native.linear_f32 import linear_f32  # noqa: E402
from pdserve.kernels.native.linear_quant import TYPES, linear_quant, row_bytes  # noqa: E402

CACHE_BYTES = 96 << 20  # the copies of a type's weights together exceed this (L3: 32 MB here)


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, row bytes] random bits; every half-precision field a finite small scale."""
    w = rng.integers(0, 256, (n, row_bytes(type_id, k)), dtype=np.uint8)
    blocks = w.reshape(-1, TYPES[type_id][2])
    for off in _halves(type_id):
        scale = rng.uniform(0.01, 0.1, blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(w)


def _halves(type_id: int) -> list[int]:
    name = TYPES[type_id][0]
    if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K"):
        return [0, 2] if name != "Q2_K" else [80, 82]
    return {"Q6_K": [208], "Q3_K": [108]}.get(name, [0])


def timed(fn: Any, *args: Any) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn(*args)
    return clock() - start


def bench_type(
    type_id: int, args: argparse.Namespace, cache: Path, pool: ThreadPoolExecutor
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    kernel, f32 = linear_quant(cache), linear_f32(cache)
    kernel8 = linear_quant(cache, int8=True)
    assert kernel is not None and f32 is not None and kernel8 is not None, "no C compiler"
    n, k = args.n, args.k
    rng = np.random.default_rng(type_id)
    first = random_blocks(type_id, n, k, rng)
    copies = [first] + [
        random_blocks(type_id, n, k, rng) for _ in range(CACHE_BYTES // first.numel())
    ]
    parts = [
        p for c in copies for p in np.array_split(c.numpy().reshape(-1).view(np.uint64), threads)
    ]
    packed, _ = f32.pack(torch.randn(n, k), None)  # one float32 W: 4 bytes a weight > cache
    xs = {m: torch.randn(m, k) for m in args.batch}
    ys = {m: torch.empty(m, n) for m in args.batch}
    turn = [0]

    def quant(m: int) -> None:
        w = copies[turn[0] % len(copies)]
        turn[0] += 1
        kernel(xs[m], w, type_id, None, ys[m])

    def int8(m: int) -> None:
        w = copies[turn[0] % len(copies)]
        turn[0] += 1
        xq, xt = kernel8.prepare(xs[m], [type_id])  # as model/layers/linear.py: codes, tiles
        kernel8(xs[m], w, type_id, None, ys[m], xq=xq, xt=xt)

    def read_all(parts: list[np.ndarray]) -> None:  # on this thread where it is the only one
        list(
            map(np.bitwise_or.reduce, parts)
            if threads == 1
            else pool.map(np.bitwise_or.reduce, parts)
        )

    read_s: list[float] = []
    q_s: dict[int, list[float]] = {m: [] for m in args.batch}
    f_s: dict[int, list[float]] = {m: [] for m in args.batch}
    i_s: dict[int, list[float]] = {m: [] for m in args.batch}
    for m in args.batch:  # warm: pages touched, workers started
        quant(m)
        int8(m)
        f32(xs[m], packed, None, n)
    for _ in range(args.reps * len(copies)):
        read_s.append(timed(read_all, parts) / len(copies))
        for m in args.batch:
            q_s[m].append(timed(quant, m))
            i_s[m].append(timed(int8, m))
            f_s[m].append(timed(f32, xs[m], packed, None, n))
    nbytes = first.numel()
    read = statistics.median(read_s)
    row: dict[str, Any] = {"type": TYPES[type_id][0], "MB": round(nbytes / 1e6, 1)}
    row["read GB/s"] = round(nbytes / read / 1e9, 1)
    b1 = statistics.median(q_s[args.batch[0]])
    row[f"b{args.batch[0]} GB/s"] = round(nbytes / b1 / 1e9, 1)
    row[f"b{args.batch[0]} %read"] = round(100 * read / b1)
    i1 = statistics.median(i_s[args.batch[0]])
    row[f"b{args.batch[0]} i8 GB/s"] = round(nbytes / i1 / 1e9, 1)
    for m in args.batch:
        q, f, i = statistics.median(q_s[m]), statistics.median(f_s[m]), statistics.median(i_s[m])
        row[f"b{m} ms"] = round(q * 1e3, 2)
        row[f"b{m} f32/q"] = round(f / q, 2)
        row[f"b{m} i8 ms"] = round(i * 1e3, 2)
        row[f"b{m} q/i8"] = round(q / i, 2)
        row[f"b{m} f32/i8"] = round(f / i, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    names = {v[0]: t for t, v in TYPES.items()}
    ap.add_argument("--types", nargs="+", default=list(names), choices=list(names))
    ap.add_argument("--n", type=int, default=8192, help="output rows of W")
    ap.add_argument("--k", type=int, default=2048, help="inputs (a multiple of 256)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=3, help="passes over the copies")
    ap.add_argument("--threads", type=int, default=1, help="1: CPU time; more: wall clock")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(torch.get_num_threads()) as pool:
        for name in args.types:
            rows.append(bench_type(names[name], args, Path(tmp), pool))
            if not args.json:
                print("  ".join(f"{key} {val}" for key, val in rows[-1].items()), flush=True)
    clock = "thread CPU time" if args.threads == 1 else "wall"
    info = {"threads": args.threads, "clock": clock, "n": args.n, "k": args.k, "rows": rows}
    if args.json:
        print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
