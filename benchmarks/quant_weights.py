"""GGUF weights served quantized against float32: memory per process and decode speed.

Each round starts one fresh process per mode (--weights quantized, then float32, taking
turns, so a busy machine's noisy stretches fall on both) and reports, per mode:

    weights MB   the engine's weight bytes (model/weights.py resident_bytes: blocks mapped
                 from the GGUF, float32 tensors), and that over the GGUF file's size
    rss MB       the process's resident set grown by loading the model (VmRSS after the
                 engine is built minus before; KV pool excluded by a tiny pool)
    TPOT ms      one stream's time per output token: offline LLM, greedy, ignore_eos;
                 (time for 1 + N tokens - time for 1 token) / N, the prompt's prefill
                 cancelling out; the median over --reps generations
    proj ms      one decode step's projections alone at batch 1 (every Linear once, as
                 the engine holds them: native float32 panels or GGUF blocks), the
                 fastest of 20: the part of a step the weights' format changes

    python benchmarks/quant_weights.py [--model smollm2|FILE.gguf] [--rounds 3]
        [--tokens 64] [--reps 3] [--threads 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("quantized", "float32")
PROMPT = list(range(100, 228))  # 128 prompt tokens


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e3
    return 0.0


def worker(model: str, mode: str, tokens: int, reps: int, threads: int) -> dict[str, object]:
    import torch

    from pdserve.llm import LLM
    from pdserve.model.weights import resident_bytes
    from pdserve.sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    before = _rss_mb()
    llm = LLM(model, weights=mode, max_total_tokens=1024, max_context=512)
    rss = _rss_mb() - before
    weights = resident_bytes(llm.prefill.runner.model)

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params)
        return time.perf_counter() - start

    proj = _projections_ms(llm.decode.runner.model)
    timed(4)  # warm
    tpot = []
    for _ in range(reps):
        one, many = timed(1), timed(1 + tokens)
        tpot.append((many - one) / tokens * 1e3)
    llm.close()
    return {"mode": mode, "weights_mb": weights / 1e6, "rss_mb": rss,
            "tpot_ms": statistics.median(tpot), "tpot_all": tpot, "proj_ms": proj}  # fmt: skip


def _projections_ms(model: object) -> float:
    import torch

    lins = model.linears()  # type: ignore[attr-defined]
    xs = {n: torch.randn(1, n) for n in {lin.in_features for lin in lins}}
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        for lin in lins:
            lin(xs[lin.in_features])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def gguf_size(model: str) -> int:
    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.model.quant_weights import source_gguf

    src = source_gguf(resolve_model(model).path)
    return src.stat().st_size if src else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.worker, a.tokens, a.reps, a.threads)))
        return 0
    size = gguf_size(a.model)
    rows = []
    for r in range(a.rounds):
        for mode in MODES:
            argv = [sys.executable, __file__, "--worker", mode, "--model", a.model,
                    "--tokens", str(a.tokens), "--reps", str(a.reps), "--threads", str(a.threads)]  # fmt: skip
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1]) | {"round": r}
            rows.append(row)
            if not a.json:
                ratio = row["weights_mb"] * 1e6 / size if size else float("nan")
                print(f"round {r} {mode:9s} weights {row['weights_mb']:7.1f} MB "
                      f"({ratio:.2f}x the GGUF's {size / 1e6:.1f} MB)  rss +{row['rss_mb']:7.1f} MB  "
                      f"TPOT {row['tpot_ms']:6.2f} ms  proj {row['proj_ms']:6.2f} ms", flush=True)  # fmt: skip
    if a.json:
        print(json.dumps({"gguf_bytes": size, "rows": rows}))
        return 0
    for mode in MODES:
        tp = [x["tpot_ms"] for x in rows if x["mode"] == mode]
        pj = [x["proj_ms"] for x in rows if x["mode"] == mode]
        print(
            f"{mode:9s} TPOT median {statistics.median(tp):.2f} ms, projections "
            f"{statistics.median(pj):.2f} ms, over {len(tp)} rounds"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
