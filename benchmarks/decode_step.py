"""One decode step of a model, timed against the matmul floor measured in the same run.

For each batch size, context length and thread count it times a whole decode step as
the decode engine issues it (build the step + prepare, resolve ids from the FutureMap,
forward, sample, publish) and reports the share of each part:

    scheduler  build_batch + ModelRunner.prepare (host side, index tensors, attention plan)
    futuremap  resolve + publish
    attention  the attention backend's forward, summed over layers (KV write included);
               per-call path only (inside the one native call it is not timed apart)
    sampling   sample() on the logits
    floor      the step's GEMMs alone (qkv, o, gate_up, down per layer, lm_head), every
               weight streamed once, the fastest of three measured side by side: torch.mm
               on [in, out]-contiguous copies, oneDNN's prepacked linear, and the model's
               own projections (on CPU the native linear, kernels/native/linear_f32.c, after
               the decode's warm-up; model/layers/linear.py): what a step cannot beat without
               changing the arithmetic
    onednn/own the oneDNN floor over the model's own projections' floor (> 1: the native
               linear streams the weights faster)
    ratio      step / floor: medians over reps that alternate a step and each floor,
               so the machine's noisy stretches fall on both sides

Each case runs on both forward paths of a CPU decode engine (--paths):

    native     the whole forward as one native call (model/native_forward.py), what a
               decode engine runs where the model fits it
    per-call   the same kernels called one by one from Python (PDSERVE_PER_CALL_DECODE=1)

    python benchmarks/decode_step.py [--model DIR] [--batch 1 8 32 64] [--context 128 1024]
        [--threads 1 2] [--paths native per-call] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.checkpoints.presets import default_model_path
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model.layers.linear import Linear
from pdserve.model.runner import ModelRunner
from pdserve.model.sampling.pick import sample
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode_step import build_batch
from pdserve.scheduler.future_map import FutureMap
from pdserve.scheduler.request import Req

PAGE = 16


class TimedAttention:
    """Wraps an attention backend and sums the wall time of its per-layer forwards."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.seconds = 0.0

    def prepare(self, batch: object) -> None:
        self.inner.prepare(batch)  # type: ignore[attr-defined]

    def forward(self, *args: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.forward(*args)  # type: ignore[attr-defined]
        self.seconds += time.perf_counter() - t0
        return out


WEIGHTS = [EngineConfig.weights]  # --weights: a GGUF model's projections, blocks or float32


def make_runner(model: str, batch: int, context: int, compile_: bool) -> ModelRunner:
    tokens = batch * (context + 2 * PAGE)
    cfg = EngineConfig(
        model_path=model,
        weights=WEIGHTS[0],
        cache=CacheConfig(page_size=PAGE, max_total_tokens=tokens, max_context=context + PAGE),
        scheduler=SchedulerConfig(max_running_requests=batch),
    )
    return ModelRunner(replace(cfg, compile=compile_))


def make_reqs(runner: ModelRunner, batch: int, context: int) -> list[Req]:
    """`batch` requests with `context` tokens of random KV already in the pool."""
    pool, rows = runner.kv_pool, runner.req_pool
    pool.k.normal_()
    pool.v.normal_()
    reqs = []
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        row = rows.alloc()
        pages = pool.allocator.alloc(pool.allocator.pages_for(context + PAGE))
        assert row is not None and pages is not None
        slots = [p * PAGE + o for p in pages for o in range(PAGE)]
        rows.req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        reqs.append(Req(rid=str(i), prompt_ids=[1] * context, params=params, row=row, pages=pages))
    return reqs


def one_step(runner: ModelRunner, future: FutureMap, reqs: list[Req], t: dict[str, float]) -> None:
    """One decode step, inline; adds each part's seconds to `t`."""
    for r in reqs:
        r.launched_steps = 0  # same context every step
    t0 = time.perf_counter()
    batch, out_index = build_batch(reqs, PAGE, runner.device)
    runner.prepare(batch)
    t1 = time.perf_counter()
    batch.input_ids = future.resolve(batch.rows)
    t2 = time.perf_counter()
    logits = runner.forward(batch)
    t3 = time.perf_counter()
    params = [r.params for r in reqs]
    tokens, _ = sample(logits, params, [0] * len(reqs), out_index, argmax=runner.model.ops.argmax)
    t4 = time.perf_counter()
    future.publish(batch.rows, tokens)
    t5 = time.perf_counter()
    for k, v in (("scheduler", t1 - t0), ("futuremap", t2 - t1 + t5 - t4)):
        t[k] = t.get(k, 0.0) + v
    t["forward"] = t.get("forward", 0.0) + t3 - t2
    t["sampling"] = t.get("sampling", 0.0) + t4 - t3
    t["step"] = t.get("step", 0.0) + t5 - t0


FLOORS = ("mm", "onednn", "own")


def floor_fns(runner: ModelRunner, batch: int) -> list[Callable[[], None]]:
    """The step's GEMMs, three ways (FLOORS): torch.mm on [in, out]-contiguous weights,
    oneDNN's prepacked linear, and the model's own Linear objects (their served layout)."""
    linears = runner.model.linears()
    # weights as [in, out]; shapes are [out, in] in the checkpoint's convention
    weights = [torch.randn(w.shape[1], w.shape[0], dtype=runner.dtype) for w in linears]
    xs = [torch.randn(batch, w.shape[0], dtype=runner.dtype) for w in weights]
    onednn = [Linear(w.t()) for w in weights]  # oneDNN's layout where it applies

    def mm() -> None:
        for x, w in zip(xs, weights, strict=True):
            torch.mm(x, w)

    def prepacked() -> None:
        for x, lin in zip(xs, onednn, strict=True):
            lin(x)

    def served() -> None:
        for x, lin in zip(xs, linears, strict=True):
            lin(x)

    return [mm, prepacked, served]


def measure(
    model: str, batch: int, context: int, threads: int, reps: int, compile_: bool, path: str
) -> dict:
    torch.set_num_threads(threads)
    runner = make_runner(model, batch, context, compile_)
    runner.warm_up_decode()  # as the decode engine does at start-up (builds the native kernel)
    if path == "per-call":
        runner.native_forward = None
    elif runner.native_forward is None:
        path = "per-call (native n/a)"
    timed = TimedAttention(runner.attn)
    runner.attn = timed  # type: ignore[assignment]
    future = FutureMap(runner.cfg.max_rows)
    reqs = make_reqs(runner, batch, context)
    for _ in range(3):  # warm up (and compile, if on)
        one_step(runner, future, reqs, {})
    timed.seconds = 0.0
    t: dict[str, float] = {}
    floors = floor_fns(runner, batch)
    for fn in floors:
        fn()
    steps: list[float] = []
    floor_times: list[list[float]] = [[] for _ in floors]
    # interleaved: each rep times one step, then each floor once, so a noisy stretch of
    # the machine lands on both sides of the ratio; medians, not means, on both sides
    for _ in range(reps):
        before = t.get("step", 0.0)
        one_step(runner, future, reqs, t)
        steps.append(t["step"] - before)
        for fn, times in zip(floors, floor_times, strict=True):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    medians = dict(zip(FLOORS, (statistics.median(t) for t in floor_times), strict=True))
    floor = min(medians.values())
    step = statistics.median(steps)
    mean_step = t["step"] / reps
    row = {"batch": batch, "context": context, "threads": threads, "path": path}
    row.update({"step_ms": step * 1e3, "floor_ms": floor * 1e3, "ratio": step / floor})
    row.update({f"floor_{k}_ms": v * 1e3 for k, v in medians.items()})
    row["onednn_over_own"] = medians["onednn"] / medians["own"]
    parts = {
        "attention": timed.seconds / reps if timed.seconds else None,
        "sampling": t["sampling"] / reps,
        "futuremap": t["futuremap"] / reps,
        "scheduler": t["scheduler"] / reps,
    }
    row.update({f"{k}_share": None if v is None else v / mean_step for k, v in parts.items()})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model folder (default: the `bench` preset)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--disable-compile", action="store_true",
                    help="the portable torch decode attention, as the server's flag")  # fmt: skip
    ap.add_argument("--paths", nargs="+", default=["native", "per-call"],
                    choices=["native", "per-call"], help="forward paths to time")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="batch 8 and 64, context 128, 1 thread")
    ap.add_argument("--weights", default=EngineConfig.weights, choices=["quantized", "float32"],
                    help="a GGUF model (--model FILE.gguf's folder): its blocks or float32")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.context, args.threads, args.reps = [8, 64], [128], [1], 8
    WEIGHTS[0] = args.weights
    model = args.model or str(default_model_path("bench"))
    rows = [
        measure(model, b, c, n, args.reps, not args.disable_compile, path)
        for n in args.threads
        for c in args.context
        for b in args.batch
        for path in args.paths
    ]
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    if args.json:
        print(json.dumps({"model": model, "loadavg": load, "rows": rows}, indent=1))
        return
    attn = "torch (gather)" if args.disable_compile else "native"
    print(f"model {model}  loadavg {' '.join(load)}  torch {torch.__version__}  attention {attn}")
    head = f"{'path':>9} {'thr':>3} {'ctx':>5} {'batch':>5} {'step ms':>8} {'floor ms':>8}"
    head += f" {'ratio':>6}"
    print(head + f" {'attn':>6} {'sample':>6} {'future':>6} {'sched':>6} {'onednn/own':>10}")
    for r in rows:
        shares = [r[f"{k}_share"] for k in ("attention", "sampling", "futuremap", "scheduler")]
        print(
            f"{r['path']:>9} {r['threads']:>3} {r['context']:>5} {r['batch']:>5} {r['step_ms']:>8.2f} "
            f"{r['floor_ms']:>8.2f} {r['ratio']:>6.2f} "
            + " ".join(f"{'-':>6}" if s is None else f"{s:>6.1%}" for s in shares)
            + f" {r['onednn_over_own']:>10.2f}"
        )


if __name__ == "__main__":
    main()
