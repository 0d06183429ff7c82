"""Speculative decoding (n-gram lookup) on and off, side by side, taking turns.

    python benchmarks/speculative.py [--model qwen2.5-coder-0.5b] [--rounds R]
        [--max-tokens N] [--chat-streams 16] [--chat-tokens N] [--spec-k K]

One `pdserve up --speculative ngram` serves both modes: "on" requests speculate, "off"
requests opt out (`speculative: false`), which takes exactly the ordinary decode step
(the speculator declines such a batch before it looks anything up). The modes alternate
request by request (one stream) or batch by batch (many streams), the first mode
swapping each round, so a slow minute of a shared machine hits both.

Workloads, greedy (temperature 0), chat completions:
  code-edit   the prompt holds a source file of this repository; the answer rewrites it
              with one small change (one stream; TPOT)
  summarize   the prompt holds a few paragraphs; the answer summarizes them (one stream)
  chat        ordinary short questions, --chat-streams at once (served tokens/s)

TPOT of a request: (last token's arrival - first token's) / (tokens - 1), streamed.
Acceptance: the decode's spec counters (/metrics) over the "on" turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from up_stack import pdserve_up  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODE_FILE = ROOT / "pdserve" / "scheduler" / "stop.py"
CODE_ASK = (
    "Rename the parameter `eos_ids` to `eos_token_ids` everywhere in this file. Reply with "
    "the whole updated file in one code block and nothing else.\n\n```python\n{src}```"
)
ARTICLE = (
    "The town council met on Tuesday to discuss the future of the old railway station. "
    "The station, built in 1887, has been closed since the line was cut in 1964, and its "
    "roof partly collapsed during the storms of last winter. Three proposals were put "
    "forward. The first would turn the building into a museum of local history, paid for "
    "by a grant from the regional heritage fund. The second would sell the site to a "
    "developer who plans forty flats and a small shop. The third, backed by the cycling "
    "club, would restore the platform as a cafe at the start of a new cycle path along the "
    "old track bed. After two hours of debate the council voted to commission a survey of "
    "the roof before choosing, and to hold a public meeting in the spring so that residents "
    "can say which of the three proposals they prefer."
)
SUMMARY_ASK = "Summarize this article in three sentences, keeping its key facts:\n\n{text}"
CHAT = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Why is the sky blue?", "Write a haiku about autumn.", "How do vaccines work?",
    "What is a prime number?", "Suggest a name for a cat.", "How far away is the Moon?",
]  # fmt: skip
SPEC_COUNTERS = ("spec_drafted_tokens_total", "spec_accepted_tokens_total", "spec_steps_total")


async def one(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int,
              spec: bool) -> tuple[int, float, float]:  # fmt: skip
    """(completion tokens, TPOT seconds, wall seconds) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "temperature": 0, "max_tokens": max_tokens, "speculative": spec, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = 0.0
    tokens = 0
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return tokens, tpot, time.perf_counter() - t0


def counters(decode: str) -> dict[str, float]:
    text = httpx.get(decode + "/metrics", timeout=30).text
    out = {}
    for name in SPEC_COUNTERS:
        m = re.search(rf"^pdserve:{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def one_stream(url: str, decode: str, model: str, text: str, args: argparse.Namespace,
                     name: str) -> float:  # fmt: skip
    """TPOT p50 of each mode, one request at a time, the modes alternating; the ratio."""
    tpot: dict[bool, list[float]] = {True: [], False: []}
    spec = {k: 0.0 for k in SPEC_COUNTERS}
    async with httpx.AsyncClient() as client:
        for r in range(args.rounds):
            for mode in (True, False) if r % 2 == 0 else (False, True):
                before = counters(decode)
                toks, t, wall = await one(client, url, model, text, args.max_tokens, mode)
                if mode:
                    after = counters(decode)
                    for k in SPEC_COUNTERS:
                        spec[k] += after[k] - before[k]
                tpot[mode].append(t)
                label = "on " if mode else "off"
                print(f"{name} round {r} {label}: {toks} tokens, TPOT {t * 1e3:.1f} ms, "
                      f"{wall:.1f} s", flush=True)  # fmt: skip
    on, off = statistics.median(tpot[True]), statistics.median(tpot[False])
    drafted, accepted = spec["spec_drafted_tokens_total"], spec["spec_accepted_tokens_total"]
    rate = accepted / drafted if drafted else 0.0
    print(f"{name}: one stream TPOT p50 on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, "
          f"on/off {on / off:.2f}; drafted {drafted:.0f}, accepted {accepted:.0f} "
          f"({rate:.0%}) in {spec['spec_steps_total']:.0f} verifying steps", flush=True)  # fmt: skip
    return on / off


async def many_streams(url: str, model: str, streams: int, args: argparse.Namespace) -> float:
    """Served tokens/s of `streams` chat requests at once per mode, batches alternating."""
    rate: dict[bool, list[float]] = {True: [], False: []}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4)) as client:
        for r in range(args.rounds):
            for mode in (True, False) if r % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                jobs = [one(client, url, model, CHAT[i % len(CHAT)], args.chat_tokens, mode)
                        for i in range(streams)]  # fmt: skip
                done = await asyncio.gather(*jobs)
                secs = time.perf_counter() - t0
                toks = sum(d[0] for d in done)
                rate[mode].append(toks / secs)
                label = "on " if mode else "off"
                print(f"chat x{streams} round {r} {label}: {toks} tokens in {secs:.1f} s = "
                      f"{toks / secs:.1f} tok/s", flush=True)  # fmt: skip
    on, off = statistics.mean(rate[True]), statistics.mean(rate[False])
    print(f"chat x{streams}: served tok/s on {on:.1f}, off {off:.1f}, on/off {on / off:.2f}",
          flush=True)  # fmt: skip
    return on / off


async def run(url: str, args: argparse.Namespace) -> None:
    info = httpx.get(url + "/server_info", timeout=30).json()["router"]
    decode = info["decode"][0]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    async with httpx.AsyncClient() as client:  # warm-up
        await one(client, url, model, CHAT[0], 4, True)
    if "code-edit" in args.workloads:
        src = CODE_FILE.read_text()
        await one_stream(url, decode, model, CODE_ASK.format(src=src), args, "code-edit")
    if "summarize" in args.workloads:
        await one_stream(url, decode, model, SUMMARY_ASK.format(text=ARTICLE), args, "summarize")
    if "chat" in args.workloads:
        for streams in args.chat_streams:
            await many_streams(url, model, streams, args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160, help="one-stream answers")
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--chat-streams", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16], help="comma-separated stream counts")  # fmt: skip
    ap.add_argument("--workloads", default="code-edit,summarize,chat")
    ap.add_argument("--spec-k", type=int, default=8)
    ap.add_argument("--spec-max-batch", type=int, default=None)
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags, space-separated")
    args = ap.parse_args()
    flags = ["--speculative", "ngram", "--spec-k", str(args.spec_k), *args.up_args.split()]
    if args.spec_max_batch is not None:
        flags += ["--spec-max-batch", str(args.spec_max_batch)]
    print(f"model {args.model}, pdserve up {' '.join(flags)}", flush=True)
    with pdserve_up("bench-speculative", args.model, tuple(flags)) as url:
        asyncio.run(run(url, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
