"""Decode throughput and forward-stream busy fraction, overlap on vs off, side by side.

All requests are prefilled first (in-process handoff), then only the decode loop
is timed, so the numbers are the overlap scheduler's alone.

    python benchmarks/decode_overlap.py [--concurrency 16 64] [--prompt-len 128] [--output-len 64]
        [--rounds 7] [--json]

Each round runs overlap off and on back to back (the order alternates between rounds);
on/off is the median of the rounds' ratios (this VM's runs spread ±6%, some rounds
far more), and the tok/s columns show each side's best round.

What overlap can win: with it off, the forward stream idles while the host processes
step N and builds step N+1 ("host ms/step" = wall minus forward, per step, off). With it
on, that host work runs beside the forward; where the forward leaves a core free (one
forward thread on two cores) on/off can reach 1 + host/wall, where the forward uses
every core the host work takes cycles from it and the bound is about half that. The
"forward ms/step" columns show how much the forward slowed beside the host work. One untimed run of each side goes first: a
process's first decode loop pays one-off costs (first-touch pages of the pools and the
caching allocator), which made the first round's "off" side 20-25% slower (its on/off
read 1.27-1.29 at 16 requests while the other rounds read 0.97-1.03).

The script runs in an engine process's environment (envs.engine_env: OpenMP threads
sleep after a parallel region, OMP_WAIT_POLICY=PASSIVE, unless the caller set a policy),
re-running itself with it where needed: libgomp reads the policy once, as torch loads it.
With spinning OpenMP threads (the default outside an engine) the sampler's torch ops left
a thread spinning on the core the schedule thread needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from pdserve.checkpoints.presets import default_model_path
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.envs import engine_env
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff


def run_once(
    model: str,
    conc: int,
    prompt_len: int,
    output_len: int,
    overlap: bool,
    device: str = "cpu",
    threads: int = 0,
    cuda_graph: bool = True,
    dtype: str = "float32",
) -> dict:
    cfg = EngineConfig(
        model_path=model,
        dtype=dtype,
        device=device,
        num_threads=threads,
        cuda_graph=cuda_graph,
        kernel_backend="triton" if device == "cuda" else "torch",
        cache=CacheConfig(page_size=16, max_total_tokens=conc * (prompt_len + output_len + 16)),
        scheduler=SchedulerConfig(max_running_requests=conc, disable_overlap=not overlap),
    )
    handoff = InProcessHandoff()
    prefill_runner = ModelRunner(cfg)
    prefill = PrefillEngine(cfg, prefill_runner, handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=prefill_runner.model), handoff.source)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(conc):
        ids = [rng.randrange(3, prefill_runner.arch.vocab_size) for _ in range(prompt_len)]
        er = EngineRequest(rid=str(i), input_ids=ids, params=params, room=i + 1)
        prefill.add_request(er)
        decode.add_request(er)
    while prefill.has_unfinished() or len(decode.prebuilt) < conc:
        prefill.step()
        decode.receive()  # the in-process handoff completes when the decode expects the KV
    decode.step()  # admit + merge the prebuilt batch outside the timed loop
    tokens, steps0 = 0, decode.steps
    decode.busy_s, t0 = 0.0, time.perf_counter()
    decode.started = t0
    while decode.has_unfinished():
        tokens += sum(len(ev.token_ids) for ev in decode.step())
    decode.drain()
    wall = time.perf_counter() - t0
    busy = decode.busy_s / wall
    steps = max(decode.steps - steps0, 1)
    decode.close()
    return {
        "tokens_per_s": tokens / wall,
        "forward_busy": busy,
        "wall_s": wall,
        "tokens": tokens,
        "steps": steps,
        "forward_ms_per_step": decode.busy_s / steps * 1e3,
        "wall_ms_per_step": wall / steps * 1e3,
    }


def as_an_engine_process() -> None:
    """Re-run this script in an engine process's environment, if it is not in one."""
    env = engine_env(os.environ)
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    as_an_engine_process()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="model folder (default: the cached `bench` model)"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of the forward (0: torch's default; `pdserve up` "
                         "gives a decode one core of two)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=7,
                    help="(off, on) pairs per concurrency, taking turns; on/off is their median")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype (weights, activations, KV cache)")  # fmt: skip
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="cuda: launch the forward's kernels one by one (no graph replay)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    model = args.model or str(default_model_path("bench"))
    rows = []
    for overlap in (False, True):  # warm-up, untimed (see the module docstring)
        run_once(
            model, 8, 32, 8, overlap, args.device, args.threads,
            not args.disable_cuda_graph, args.dtype,
        )  # fmt: skip
    for conc in args.concurrency:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(args.rounds):  # the order alternates, so neither side always goes first
            for overlap in (False, True) if r % 2 == 0 else (True, False):
                runs[overlap].append(
                    run_once(
                        model,
                        conc,
                        args.prompt_len,
                        args.output_len,
                        overlap=overlap,
                        device=args.device,
                        threads=args.threads,
                        cuda_graph=not args.disable_cuda_graph,
                        dtype=args.dtype,
                    )  # fmt: skip
                )
        ratios = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(runs[True], runs[False], strict=True)
        ]
        best = {k: max(v, key=lambda x: x["tokens_per_s"]) for k, v in runs.items()}
        rows.append(
            {
                "concurrency": conc,
                "overlap_on": best[True],
                "overlap_off": best[False],
                "speedup": statistics.median(ratios),
                "round_speedups": [round(x, 3) for x in ratios],
            }
        )
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": args.device,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": rows}))
        return
    print(f"decode overlap benchmark ({meta})")
    print(
        "| concurrency | off tok/s | on tok/s | on/off (median) | rounds | busy off | busy on "
        "| host ms/step (off) | forward ms/step off / on |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        on, off = r["overlap_on"], r["overlap_off"]
        host = off["wall_ms_per_step"] - off["forward_ms_per_step"]
        print(
            f"| {r['concurrency']} | {off['tokens_per_s']:.1f} | {on['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f} | {' '.join(f'{x:.2f}' for x in r['round_speedups'])} | "
            f"{off['forward_busy']:.0%} | {on['forward_busy']:.0%} | {host:.2f} | "
            f"{off['forward_ms_per_step']:.2f} / {on['forward_ms_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
