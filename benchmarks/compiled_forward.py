"""The decode forward compiled by inductor against the eager forward, same run.

    python benchmarks/compiled_forward.py [--batch 8 64] [--context 128] [--threads 1] [--json]

A compiled decode step (torch.compile, batch-size buckets, as vLLM's CPU backend
does) is one way to a faster step. This measures whether it would pay before anything is built
into the server: the `bench` model's whole decode forward (8 layers, lm_head) captured
as ONE inductor graph, static shapes, one compile per batch size. Two calls stay opaque
custom ops so nothing breaks the graph: the oneDNN linear (inductor's own lowering of
`mkldnn._linear_pointwise` rejects the prepacked weight) and the attention backend
(KV write + the native C kernel through ctypes). Everything between them (RMSNorm,
RoPE, residual adds, SiLU * up, the embedding, the last-token pick) is inductor's.

Reported per batch size: compile seconds, eager and compiled forward ms (median), their
ratio (the two alternate within every rep), the largest logit difference and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_step import PAGE, make_reqs, make_runner  # noqa: E402

from pdserve.checkpoints.presets import default_model_path  # noqa: E402
from pdserve.model.forward_batch import ForwardBatch  # noqa: E402
from pdserve.model.layers import linear  # noqa: E402
from pdserve.model.runner import ModelRunner  # noqa: E402
from pdserve.scheduler.decode_step import build_batch  # noqa: E402
from pdserve.scheduler.future_map import FutureMap  # noqa: E402

# the attention backend and batch of the forward being traced or run (one at a time)
_CURRENT: dict[str, object] = {}


@torch.library.custom_op("pdserve_bench::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


# Declared pure although it writes the step's K/V into the pool: nothing in the graph
# reads the pool, and declaring the mutation would make inductor copy the whole pool.
@torch.library.custom_op("pdserve_bench::attention", mutates_args=())
def _attention_op(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    backend, batch = _CURRENT["attn"], _CURRENT["batch"]
    return backend.forward(layer, q, k, v, batch)  # type: ignore[attr-defined]


@_attention_op.register_fake
def _(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class OpaqueAttention:
    """The runner's backend behind the custom op."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def prepare(self, batch: ForwardBatch) -> None:
        self.inner.prepare(batch)  # type: ignore[attr-defined]
        _CURRENT.update(attn=self.inner, batch=batch)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return torch.ops.pdserve_bench.attention(layer, q, k, v)


def opaque_linear(self: linear.Linear, x: torch.Tensor) -> torch.Tensor:
    assert self.onednn and self.bias is None, "the bench model: oneDNN, no bias"
    return torch.ops.pdserve_bench.linear(x, self.weight, self.out_features)


def alternate_ms(
    runner: ModelRunner, fns: list[object], next_batch: object, reps: int
) -> list[float]:
    """Median ms of each forward function, the functions taking turns within every rep
    (so the machine's noisy stretches fall on all of them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            runner.model.forward = fn  # type: ignore[method-assign]
            batch = next_batch()  # type: ignore[operator]
            t0 = time.perf_counter()
            runner.forward(batch)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def measure(model: str, batch_size: int, context: int, reps: int) -> dict:
    runner = make_runner(model, batch_size, context, True)
    runner.warm_up_decode()
    runner.attn = OpaqueAttention(runner.attn)  # type: ignore[assignment]
    future = FutureMap(runner.cfg.max_rows)
    reqs = make_reqs(runner, batch_size, context)

    def next_batch() -> ForwardBatch:
        for r in reqs:
            r.launched_steps = 0  # same context every step
        batch, _ = build_batch(reqs, PAGE, runner.device)
        runner.prepare(batch)
        batch.input_ids = future.resolve(batch.rows)
        return batch

    eager_fn = runner.model.forward
    first = next_batch()
    ref = runner.forward(first)
    compiled_fn = torch.compile(eager_fn, dynamic=False)
    runner.model.forward = compiled_fn  # type: ignore[method-assign]
    t0 = time.perf_counter()
    out = runner.forward(first)
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        runner.forward(next_batch())
    eager, compiled = alternate_ms(runner, [eager_fn, compiled_fn], next_batch, reps)
    return {
        "batch": batch_size,
        "context": context,
        "threads": torch.get_num_threads(),
        "compile_s": compile_s,
        "eager_ms": eager,
        "compiled_ms": compiled,
        "compiled_over_eager": compiled / eager,
        "max_logit_diff": (out - ref).abs().max().item(),
        "greedy_equal": bool(torch.equal(out.argmax(-1), ref.argmax(-1))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model folder (default: the `bench` preset)")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        sys.exit("this torch has no oneDNN linear: nothing to compare")
    linear.Linear.__call__ = opaque_linear  # type: ignore[method-assign]
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path("bench"))
    rows = [measure(model, b, args.context, args.reps) for b in args.batch]
    load = open("/proc/loadavg").read().split()[:3]
    if args.json:
        print(json.dumps({"model": model, "loadavg": load, "rows": rows}, indent=1))
        return
    print(f"model {model}  loadavg {' '.join(load)}  torch {torch.__version__}")
    print("| batch | context | threads | compile s | eager ms | compiled ms | compiled / eager "
          "| max logit diff | greedy equal |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r['threads']} | {r['compile_s']:.1f} "
            f"| {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['compiled_over_eager']:.2f} "
            f"| {r['max_logit_diff']:.1e} | {r['greedy_equal']} |"
        )


if __name__ == "__main__":
    main()
