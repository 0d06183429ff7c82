"""llama-bench's two figures for pdserve's engines and llama.cpp's `llama-bench`, one GGUF.

    python benchmarks/llama_bench.py [--model gemma3-270m] [--llama-bench PATH]
        [-p 512] [-n 128] [--rounds 3] [--threads 2] [--quant-activations float int8] [--json]

pp (prompt processing): tokens/s of one prompt of `-p` random token ids through the
prefill engine (the time to its first token). tg (text generation): tokens/s of `-n`
tokens generated one at a time at batch 1 after a one-token prompt, the time of the
first token taken off. pdserve runs both engines in one process (pdserve.LLM: the
engines the servers run, the KV handed over in memory, no HTTP), its weights read from
the GGUF's blocks (`--weights quantized`), once per `--quant-activations` mode asked for
(float: de-quantize in registers; int8: x quantized to 8 bits, integer dots, as
llama.cpp computes), each mode its own engines. llama-bench runs the same file with the same
number of threads (`-t`), `-r 1` per round. The two take turns, `--rounds` times, and
the ratios are per round (pdserve / llama.cpp: over 1 means pdserve is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import llamacpp_peer

from pdserve import LLM, SamplingParams
from pdserve.model.quant_weights import source_gguf


def pdserve_round(llm: LLM, vocab: int, p: int, n: int, rng: random.Random) -> dict[str, float]:
    prompt = [rng.randrange(100, vocab) for _ in range(p)]
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    pp = p / (time.perf_counter() - t0)
    one = [rng.randrange(100, vocab)]
    t0 = time.perf_counter()
    llm.generate([one], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate([one], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    total = time.perf_counter() - t0
    assert len(out[0].token_ids) == n + 1, out[0]
    return {"pp": pp, "tg": n / max(total - first, 1e-9)}


def llamacpp_round(binary: Path, gguf: Path, p: int, n: int, threads: int) -> dict[str, float]:
    argv = [str(binary), "-m", str(gguf), "-p", str(p), "-n", str(n), "-t", str(threads),
            "-r", "1", "-o", "json"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
    rows = json.loads(out.stdout)
    got = {}
    for row in rows:
        kind = "pp" if row["n_prompt"] and not row["n_gen"] else "tg"
        got[kind] = float(row["avg_ts"])
    return got


def find_llama_bench(args: argparse.Namespace) -> Path:
    """--llama-bench, else the one built beside llama-server under --setup-llamacpp's DIR,
    else `llama-bench` on PATH."""
    if args.llama_bench:
        return Path(args.llama_bench)
    server = llamacpp_peer.built_binary(Path(args.setup_llamacpp)) if args.setup_llamacpp else None
    found = server.parent / "llama-bench" if server else shutil.which("llama-bench")
    if not found:
        raise SystemExit("llama-bench not found: pass --llama-bench PATH or --setup-llamacpp DIR "
                         "(make bench-llamacpp builds it)")  # fmt: skip
    return Path(found)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gemma3-270m", help="a GGUF file or a built-in GGUF name")
    ap.add_argument("--llama-bench", default=None, metavar="PATH")
    ap.add_argument(
        "--setup-llamacpp",
        default=None,
        metavar="DIR",
        help="where `make bench-llamacpp` built llama.cpp (llama-bench beside llama-server)",
    )
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (default: %(default)s)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quant-activations",
        nargs="+",
        default=["float"],
        choices=["float", "int8"],
        help="pdserve's modes, each its own engines",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()  # fmt: skip

    binary = find_llama_bench(args)
    llms = {f"pdserve {mode}": LLM(args.model, weights="quantized", quant_activations=mode,
                                   max_prefill_tokens=max(args.p, 512))
            for mode in args.quant_activations}  # fmt: skip
    first = next(iter(llms.values()))
    gguf = source_gguf(first.cfg.model_path)
    if gguf is None:
        raise SystemExit(f"{args.model} did not come from a GGUF: llama-bench needs one")
    vocab = first.tokenizer.get_vocab_size() if first.tokenizer else 1000
    rng = random.Random(args.seed)
    for llm in llms.values():
        pdserve_round(llm, vocab, min(args.p, 64), 4, rng)  # warm-up: kernels, pages
    rounds = []
    for r in range(args.rounds):
        who_all = [*llms, "llama.cpp"]
        order = who_all if r % 2 == 0 else who_all[::-1]
        row: dict[str, dict[str, float]] = {}
        for who in order:
            if who in llms:
                row[who] = pdserve_round(llms[who], vocab, args.p, args.n, rng)
            else:
                row[who] = llamacpp_round(binary, gguf, args.p, args.n, args.threads)
        rounds.append(row)
        for who in llms:
            print(f"round {r + 1}: " + "  ".join(
                f"{k}{args.p if k == 'pp' else args.n} {who} {row[who][k]:.1f} / llama.cpp "
                f"{row['llama.cpp'][k]:.1f} tok/s ({row[who][k] / row['llama.cpp'][k]:.2f}x)"
                for k in ("pp", "tg")), flush=True)  # fmt: skip
    for llm in llms.values():
        llm.close()
    summary = {who: {k: statistics.median(r[who][k] / r["llama.cpp"][k] for r in rounds)
                     for k in ("pp", "tg")} for who in llms}  # fmt: skip
    for who, ratio in summary.items():
        print(
            f"median {who} / llama.cpp: pp{args.p} {ratio['pp']:.2f}x, tg{args.n} "
            f"{ratio['tg']:.2f}x  ({gguf.name}, {args.threads} threads, "
            f"{platform.processor() or platform.machine()})"
        )
    if args.json:
        print(json.dumps({"gguf": str(gguf), "threads": args.threads, "rounds": rounds,
                          "median_ratio": summary}))  # fmt: skip


if __name__ == "__main__":
    main()
