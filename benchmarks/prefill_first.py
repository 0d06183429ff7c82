"""pdserve's two prefill-first modes side by side: `--prefill-first burst` and `always`.

Runs compare.py's workload against `pdserve up` once per mode per round, the modes taking
turns (this VM's speed drifts within minutes), and prints each round's output tok/s,
TTFT p50 / mean and TPOT p50, then the medians over rounds and always / burst ratios.
Flags are compare.py's (workload, --pdserve-args appended to the mode's flags), plus:

    python benchmarks/prefill_first.py --num-prompts 48 --concurrency 24
        --input-len 128:384 --output-len 64:192 [--rounds 3] [--prefill-first-ms 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402

MODES = ("burst", "always")
FIELDS = {  # column -> (metrics key, its statistic)
    "tok/s": ("output_throughput", None),
    "TTFT p50 ms": ("ttft_ms", "median"),
    "TTFT mean ms": ("ttft_ms", "mean"),
    "TPOT p50 ms": ("tpot_ms", "median"),
}


def figures(metrics: dict) -> dict[str, float]:
    return {col: metrics[k] if s is None else metrics[k][s] for col, (k, s) in FIELDS.items()}


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--rounds", type=int, default=3)
    own.add_argument("--prefill-first-ms", type=int, default=None,
                     help="for both modes (default: the server's)")  # fmt: skip
    mine, rest = own.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        print(
            __doc__ + "\n    --rounds N (default 3), --prefill-first-ms MS; compare.py's flags:\n"
        )
    args = compare.parse_args(rest)
    model = compare.model_path(args)
    cfg = compare.workload(args, model)
    extra = args.pdserve_args
    if mine.prefill_first_ms is not None:
        extra += f" --prefill-first-ms {mine.prefill_first_ms}"
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(mine.rounds):
        for mode in MODES:
            print(f"prefill_first: round {r + 1}, {mode} ...", file=sys.stderr, flush=True)
            args.pdserve_args = f"--prefill-first {mode} {extra}"
            row = compare.run_pdserve(args, model, cfg)
            if row["status"] != "ok":
                print(f"{mode}: {row['status']}", file=sys.stderr)
                return 1
            runs[mode].append(figures(row["metrics"]))
    args.pdserve_args = extra  # what both modes had besides --prefill-first
    medians = {m: {c: statistics.median(f[c] for f in runs[m]) for c in FIELDS} for m in MODES}
    result = {"settings": compare.settings(args, model), "machine": compare.machine(),
              "prefill_first_ms": mine.prefill_first_ms, "runs": runs, "medians": medians}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['machine']}  settings: {result['settings']}")
    print("| mode | " + " | ".join(f"{c} (each round)" for c in FIELDS) + " |")
    print("|---|" + "---|" * len(FIELDS))
    for m in MODES:
        cells = [" / ".join(f"{f[c]:.1f}" for f in runs[m]) for c in FIELDS]
        print(f"| {m} | " + " | ".join(cells) + " |")
    ratios = [medians["always"][c] / medians["burst"][c] for c in FIELDS]
    print("| always / burst (medians) | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
