"""What a JSON schema costs: served tokens/s with and without one, side by side.

    python benchmarks/structured_output.py [--requests N] [--concurrency C] [--rounds R]

Starts `pdserve up` (SmolLM2 by default) and sends the same chat requests twice per
round, once unconstrained and once with a `json_schema` response_format, C at a time,
temperature 0.8 with a seed per request, ignore_eos off. Output tokens/s counts the
answers' completion tokens over the wall time of each batch. The rounds take turns
(plain first, then schema first) so a slow minute of a shared VM hits both. A schema
answer is shorter than a free one (more prefill per output token), so the script also
prints the median TPOT (time per output token after the first), which compares the
decode steps with and without the grammar's mask.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from up_stack import pdserve_up, stream_timed, timed_gather  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 4},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "population", "landmarks", "coastal"],
    "additionalProperties": False,
}  # fmt: skip
CITIES = ["Paris", "Lisbon", "Oslo", "Cairo", "Lima", "Tokyo", "Quito", "Perth"]


async def run_batch(
    url: str, n: int, concurrency: int, schema: bool
) -> tuple[int, float, list[float]]:
    """(completion tokens, wall seconds, each request's TPOT: seconds per token after
    its first one). A schema answer is shorter than a free one, so tok/s also counts
    more prefill per token; TPOT compares the decode steps themselves."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    tpots: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {"model": "smollm2", "max_tokens": 96, "temperature": 0.8, "seed": i,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]}."}]}  # fmt: skip
        if schema:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "city", "schema": SCHEMA}}  # fmt: skip
        parts: list[str] = []
        async with sem:
            got = await stream_timed(client, url + "/v1/chat/completions", body,
                                     lambda c: parts.append(c["delta"].get("content") or ""))  # fmt: skip
        tokens += got.tokens
        if got.tpot is not None:
            tpots.append(got.tpot)
        text = "".join(parts)
        if schema:
            json.loads(text)  # the grammar held

    secs = await timed_gather(n, one)
    return tokens, secs, tpots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    with pdserve_up("bench-structured", args.model) as url:
        asyncio.run(run_batch(url, 2, 2, True))  # warm-up: the engines' grammar tokenizer
        rows: dict[bool, list[float]] = {False: [], True: []}
        tpot: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for schema in (False, True) if r % 2 == 0 else (True, False):
                toks, secs, t = asyncio.run(run_batch(url, args.requests, args.concurrency, schema))
                rows[schema].append(toks / secs)
                tpot[schema] += t
                print(f"round {r} {'schema' if schema else 'plain '}: {toks} tokens in "
                      f"{secs:.1f} s = {toks / secs:.1f} tok/s, TPOT p50 "
                      f"{statistics.median(t) * 1e3:.1f} ms", flush=True)  # fmt: skip
        plain, with_schema = (sum(v) / len(v) for v in (rows[False], rows[True]))
        tp, ts = (statistics.median(tpot[k]) * 1e3 for k in (False, True))
        print(f"mean: plain {plain:.1f} tok/s, json_schema {with_schema:.1f} tok/s "
              f"(ratio {with_schema / plain:.2f}); TPOT p50 plain {tp:.1f} ms, "
              f"json_schema {ts:.1f} ms (ratio {ts / tp:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
