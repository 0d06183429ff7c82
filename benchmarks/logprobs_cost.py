"""What logprobs cost: served tokens/s with and without them, side by side.

    python benchmarks/logprobs_cost.py [--requests N] [--concurrency C] [--rounds R] [--top K]

Starts `pdserve up` (SmolLM2 by default) and sends the same completion requests in
three modes per round, C at a time: `plain` (no logprobs), `top` (`logprobs: K`, each
output token's logprob and the top K), and `mixed` (half the requests ask, half do not:
the batches the sampler computes the top K for hold requests that did not ask). Every
request makes exactly `--max-tokens` tokens (ignore_eos, temperature 0.8, a seed each),
so tok/s compares equal work. The modes take turns (a rotated order each round) so a
slow minute of a shared VM hits each. The sampler computes logprobs only for a batch where
some request asked, so `plain` runs the code it ran before logprobs existed; the plain
requests of `mixed` report their TPOT apart, which is what asking costs the others.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from up_stack import pdserve_up, stream_timed, timed_gather  # noqa: E402

PROMPTS = ["Once upon a time", "The history of Rome", "A recipe for bread", "Dear diary,"]
MODES = ("plain", "top", "mixed")


async def run_batch(
    url: str, mode: str, n: int, concurrency: int, top: int, max_tokens: int
) -> tuple[int, float, dict[bool, list[float]]]:
    """(completion tokens, wall seconds, TPOT of each request by whether it asked)."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    tpots: dict[bool, list[float]] = {False: [], True: []}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        asks = mode == "top" or (mode == "mixed" and i % 2 == 0)
        body = {"model": "smollm2", "prompt": PROMPTS[i % len(PROMPTS)], "seed": i,
                "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if asks:
            body["logprobs"] = top

        def check(c: dict) -> None:
            assert not asks or c["logprobs"] is not None

        async with sem:
            got = await stream_timed(client, url + "/v1/completions", body, check)
        tokens += got.tokens
        if got.tpot is not None:
            tpots[asks].append(got.tpot)

    secs = await timed_gather(n, one)
    return tokens, secs, tpots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    with pdserve_up("bench-logprobs", args.model) as url:
        asyncio.run(run_batch(url, "mixed", 2, 2, args.top, 8))  # warm-up
        rate: dict[str, list[float]] = {m: [] for m in MODES}
        tpot: dict[str, list[float]] = {m: [] for m in (*MODES, "mixed-plain")}
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:
                toks, secs, t = asyncio.run(run_batch(url, mode, args.requests, args.concurrency,
                                                      args.top, args.max_tokens))  # fmt: skip
                rate[mode].append(toks / secs)
                tpot[mode] += t[True] + t[False]
                if mode == "mixed":
                    tpot["mixed-plain"] += t[False]
                print(f"round {r} {mode:6}: {toks} tokens in {secs:.1f} s = {toks / secs:.1f} "
                      f"tok/s, TPOT p50 {statistics.median(t[True] + t[False]) * 1e3:.1f} ms",
                      flush=True)  # fmt: skip
        means = {m: sum(v) / len(v) for m, v in rate.items()}
        p50 = {m: statistics.median(v) * 1e3 for m, v in tpot.items()}
        print(f"mean tok/s: plain {means['plain']:.1f}, logprobs {args.top} {means['top']:.1f} "
              f"(ratio {means['top'] / means['plain']:.2f}), mixed {means['mixed']:.1f} (ratio "
              f"{means['mixed'] / means['plain']:.2f}); TPOT p50 ms: plain {p50['plain']:.1f}, "
              f"logprobs {p50['top']:.1f}, mixed {p50['mixed']:.1f} (its plain requests "
              f"{p50['mixed-plain']:.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
