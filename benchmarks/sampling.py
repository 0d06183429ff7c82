"""A decode step's sampling (temperature > 0) of B rows over a vocabulary of V: pick.py's
batched inverse-CDF draw against a draw per row by an exponential race (argmax of p / E,
E ~ Exp(1) over the whole vocabulary, one generator a row), side by side.

    python benchmarks/sampling.py [--batch 1 16 64] [--vocab 32768 151936] [--reps 9]
        [--threads 2]

The two take turns every repetition; medians in ms. Both are seeded per (seed, index)
and draw from softmax(logits / T); only the method differs. The sampled tokens' cost is
paid on the forward stream once per step, beside the model's forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.model.sampling.pick import pick
from pdserve.sampling_params import SamplingParams


def race(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> torch.Tensor:
    """The per-row exponential race, for comparison."""
    out = []
    for i, p in enumerate(params):
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        gen = torch.Generator().manual_seed(seeds[i])
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out.append((probs / noise).argmax())
    return torch.stack(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"threads {a.threads}; ms a step (medians of {a.reps})")
    print(f"{'V':>7} {'B':>3} {'batched':>9} {'per row':>9}  per row / batched")
    for v in a.vocab:
        for b in a.batch:
            logits = torch.randn(b, v, generator=torch.Generator().manual_seed(b))
            params = [SamplingParams(temperature=0.8) for _ in range(b)]
            seeds, index = list(range(b)), [3] * b
            ours, theirs = [], []
            for rep in range(a.reps + 1):
                t0 = time.perf_counter()
                pick(logits, params, seeds, index)
                t1 = time.perf_counter()
                race(logits, params, seeds)
                t2 = time.perf_counter()
                if rep:  # the first: warm-up
                    ours.append(t1 - t0)
                    theirs.append(t2 - t1)
            x, y = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
            print(f"{v:7d} {b:3d} {x:9.2f} {y:9.2f}  {y / x:.1f}", flush=True)


if __name__ == "__main__":
    main()
