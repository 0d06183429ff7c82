"""One decode step of a mixture-of-experts GGUF: where the per-call path's time goes, and
the one-call native forward (kernels/native/decode_moe.h) against it, same run.

    python benchmarks/moe_decode_step.py FILE.gguf [--batch 1 16] [--context 64]
        [--activations float int8] [--threads 2] [--reps 20]

For each batch size and activation mode, the two paths take turns step by step (medians
over --reps, after a warm-up), and the per-call step is split by wall-clock timers:

    router     the router's projection (x @ Wrouter^T)
    experts    the grouped expert calls (gate|up, activation, down: QuantExperts)
    glue       the rest of the sparse MLPs: routing (softmax, top-k), sorting the pairs
               by expert, gathering their rows, the weighted sum (Python and torch ops)
    attention  the attention sublayers (qkv, norms, rope, KV write, attention, o)
    other      embedding, norms, head and the Python between them

Build a file with `benchmarks/moe_llamacpp.py make` (24 layers, 64 experts, top-8,
hidden 1024, expert hidden 512 by default; `--layers 4` profiles the same shapes faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from pdserve.envs import engine_env

os.environ.update(engine_env(os.environ))  # before torch loads OpenMP, as in an engine
import torch  # noqa: E402

from pdserve.checkpoints.resolve import resolve_model  # noqa: E402
from pdserve.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.model.arch.moe import MoeModel  # noqa: E402
from pdserve.model.forward_batch import ForwardBatch  # noqa: E402
from pdserve.model.runner import ModelRunner  # noqa: E402


class Timed:
    """A callable wrapped so that its wall time adds up under `name` in `totals`."""

    def __init__(self, fn: Callable[..., Any], name: str, totals: dict[str, float]) -> None:
        self.fn, self.name, self.totals = fn, name, totals

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:  # QuantExperts' fields, for the native plan
        return getattr(self.fn, name)


def runner_of(path: str, acts: str, batch: int, context: int) -> ModelRunner:
    folder = resolve_model(path).path
    tokens = batch * (context + 16) + 64
    cfg = EngineConfig(model_path=str(folder), cache=CacheConfig(max_total_tokens=tokens),
                       quant_activations=acts)  # fmt: skip
    runner = ModelRunner(cfg)
    runner.warm_up_decode()
    if not isinstance(runner.model, MoeModel) or runner.native_forward is None:
        raise SystemExit("not a mixture of experts on the native decode forward")
    return runner


def step_of(runner: ModelRunner, b: int, context: int) -> ForwardBatch:
    """b requests of `context` tokens of random K/V; the step writes each one's next."""
    g = torch.Generator().manual_seed(b)
    pool, table = runner.kv_pool, runner.req_pool.req_to_token
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    slots = torch.randperm(pool.k.shape[1] - 1, generator=g)[: b * (context + 1)] + 1
    for row in range(b):
        table[row, : context + 1] = slots[row * (context + 1) : (row + 1) * (context + 1)]
    return ForwardBatch(
        input_ids=torch.randint(0, runner.arch.vocab_size, (b,), generator=g),
        positions=torch.full((b,), context),
        out_cache_loc=table[:b, context].to(torch.int64).clone(),
        rows=torch.arange(b),
        seq_lens=[context + 1] * b,
        extend_lens=[1] * b,
        host_rows=list(range(b)),
    )


def instrument(model: MoeModel, totals: dict[str, float]) -> None:
    """Timers on the per-call path's parts (after the native plan was built)."""
    for layer in model.layers:
        e = layer.experts
        if e is not None:
            e.router = Timed(e.router, "router", totals)  # type: ignore[assignment]
            e.quant = Timed(e.quant, "experts", totals)  # type: ignore[assignment]
    model._mlp = Timed(model._mlp, "mlp", totals)  # type: ignore[method-assign]
    model._attention = Timed(model._attention, "attention", totals)  # type: ignore[method-assign]


def measure(runner: ModelRunner, batch: ForwardBatch, reps: int) -> dict[str, float]:
    native = runner.native_forward
    assert native is not None
    runner.prepare(batch)
    totals: dict[str, float] = {}
    instrument(runner.model, totals)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {"per-call": [], "native": []}
    parts: dict[str, list[float]] = {}
    for rep in range(reps + 2):
        totals.clear()
        t0 = time.perf_counter()
        runner.model.forward(batch, runner.attn)
        t1 = time.perf_counter()
        native(batch)
        t2 = time.perf_counter()
        if rep < 2:
            continue  # warm-up
        times["per-call"].append(t1 - t0)
        times["native"].append(t2 - t1)
        glue = totals["mlp"] - totals["router"] - totals["experts"]
        step = {"router": totals["router"], "experts": totals["experts"], "glue": glue,
                "attention": totals["attention"]}  # fmt: skip
        step["other"] = (t1 - t0) - sum(step.values())
        for k, v in step.items():
            parts.setdefault(k, []).append(v)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.update({k: statistics.median(v) * 1e3 for k, v in parts.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--activations", nargs="+", default=["float", "int8"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{a.file}: threads {a.threads}, context {a.context}; ms per step (medians)")
    cols = ("per-call", "native", "router", "experts", "glue", "attention", "other")
    print(f"{'acts':6} {'B':>3} " + " ".join(f"{c:>9}" for c in cols) + "  per-call/native")
    for acts in a.activations:
        for b in a.batch:
            runner = runner_of(a.file, acts, b, a.context)
            r = measure(runner, step_of(runner, b, a.context), a.reps)
            row = " ".join(f"{r[c]:9.2f}" for c in cols)
            print(f"{acts:6} {b:3d} {row}  {r['per-call'] / r['native']:.2f}", flush=True)


if __name__ == "__main__":
    main()
