"""Speculative decoding (n-gram lookup or a draft model) on and off, side by side,
taking turns.

    python benchmarks/speculative.py [--model qwen2.5-coder-0.5b] [--rounds R]
        [--max-tokens N] [--chat-streams 16] [--chat-tokens N] [--spec-k K]
        [--speculative ngram|draft [--draft-model MODEL]]
        [--llama-server PATH [--llama-spec-type T] [--llama-ngram-n N]]

One `pdserve up --speculative ngram` (or `--speculative draft --draft-model MODEL`)
serves both modes: "on" requests speculate, "off" requests opt out (`speculative:
false`), which takes exactly the ordinary decode step (the speculator declines such a
batch before it drafts anything). The modes alternate request by request (one stream)
or batch by batch (many streams), the first mode swapping each round, so a slow minute
of a shared machine hits both.

A draft model drafting for itself (`--speculative draft`, --draft-model the served
model, the default) is the trivial check of the draft path: its drafts are the model's
own tokens, so nearly all are accepted; it cannot be faster than off (each drafted
token costs the draft a forward as large as the one it saves the target).

With --llama-server, llama.cpp's `llama-server` serves the same GGUF twice, with its own
n-gram speculation and without (speculative_peer.py says which kind and why), and the
one-stream workloads take turns over all four: pdserve on and off, llama.cpp on and off,
the order reversed every other round. The chat workload stays pdserve's alone.

Workloads, greedy (temperature 0), chat completions:
  code-edit   the prompt holds a source file of this repository; the answer rewrites it
              with one small change (one stream; TPOT)
  summarize   the prompt holds a few paragraphs; the answer summarizes them (one stream)
  chat        ordinary short questions, --chat-streams at once (served tokens/s)

TPOT of a request: (last token's arrival - first token's) / (tokens - 1), streamed.
Acceptance: the decode's spec counters (/metrics) over the "on" turns; llama.cpp's from
the `timings` (draft_n, draft_n_accepted) on each answer's last chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import speculative_peer  # noqa: E402
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
SPEC_COUNTERS = ("spec_drafted_tokens_total", "spec_accepted_tokens_total", "spec_steps_total",
                 "spec_lookups_total", "spec_empty_lookups_total")  # fmt: skip
PD_ON, PD_OFF, LL_ON, LL_OFF = "pdserve on", "pdserve off", "llama.cpp on", "llama.cpp off"
RATIOS = ((PD_ON, PD_OFF), (LL_ON, LL_OFF), (PD_ON, LL_ON), (PD_OFF, LL_OFF))
SAME_TEXT = ((PD_ON, PD_OFF), (LL_ON, LL_OFF), (PD_ON, LL_ON))


@dataclass
class Answer:
    tokens: int
    tpot: float  # seconds
    wall: float  # seconds
    text: str
    drafts: tuple[int, int] | None  # llama.cpp's (drafted, accepted), from its timings


@dataclass
class Mode:
    """One side of a one-stream comparison: a server and what its requests add."""

    label: str
    url: str
    extra: dict = field(default_factory=dict)
    decode: str | None = None  # pdserve's decode, whose /metrics count its drafts
    tpot: list[float] = field(default_factory=list)
    spec: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPEC_COUNTERS, 0.0))
    text: str | None = None  # the first answer


async def one(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int,
              extra: dict) -> Answer:  # fmt: skip
    """One streamed greedy chat completion; `extra`: more body fields."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    first = last = 0.0
    tokens = 0
    parts: list[str] = []
    drafts = None
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            drafts = speculative_peer.draft_counts(ev) or drafts
            delta = [c.get("delta", {}).get("content") or "" for c in ev.get("choices", [])]
            if any(delta):
                parts += delta
                last = time.perf_counter()
                first = first or last
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return Answer(tokens, tpot, time.perf_counter() - t0, "".join(parts), drafts)


def counters(decode: str) -> dict[str, float]:
    text = httpx.get(decode + "/metrics", timeout=30).text
    out = {}
    for name in SPEC_COUNTERS:
        m = re.search(rf"^pdserve:{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def one_stream(modes: list[Mode], model: str, text: str, args: argparse.Namespace,
                     name: str) -> None:  # fmt: skip
    """TPOT of each mode, one request at a time, the modes taking turns (their order
    reversed every other round); p50s and ratios printed."""
    # a connection per request: llama-server closes one after a streamed answer, and a
    # pooled connection it closed fails the next request before any byte is sent
    fresh_conn = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=fresh_conn) as client:
        for r in range(args.rounds):
            for m in modes if r % 2 == 0 else modes[::-1]:
                before = counters(m.decode) if m.decode else None
                a = await one(client, m.url, model, text, args.max_tokens, m.extra)
                if before is not None and m.decode:
                    after = counters(m.decode)
                    for k in SPEC_COUNTERS:
                        m.spec[k] += after[k] - before[k]
                elif a.drafts:
                    m.spec["spec_drafted_tokens_total"] += a.drafts[0]
                    m.spec["spec_accepted_tokens_total"] += a.drafts[1]
                m.tpot.append(a.tpot)
                m.text = a.text if m.text is None else m.text
                print(f"{name} round {r} {m.label}: {a.tokens} tokens, TPOT "
                      f"{a.tpot * 1e3:.1f} ms, {a.wall:.1f} s", flush=True)  # fmt: skip
    report(modes, name)


def report(modes: list[Mode], name: str) -> None:
    p50 = {m.label: statistics.median(m.tpot) for m in modes}
    for m in modes:
        drafted = m.spec["spec_drafted_tokens_total"]
        accepted = m.spec["spec_accepted_tokens_total"]
        steps = m.spec["spec_steps_total"]
        acc = (
            f"; drafted {drafted:.0f}, accepted {accepted:.0f} ({accepted / drafted:.0%})"
            if drafted
            else ""
        )
        acc += f" in {steps:.0f} verifying steps" if steps else ""
        print(f"{name} {m.label}: one stream TPOT p50 {p50[m.label] * 1e3:.1f} ms{acc}",
              flush=True)  # fmt: skip
    for a, b in RATIOS:
        if a in p50 and b in p50:
            print(f"{name}: TPOT p50 {a} / {b} = {p50[a] / p50[b]:.2f}", flush=True)
    texts = {m.label: m.text or "" for m in modes}
    for a, b in SAME_TEXT:
        if a in texts and b in texts:
            n = common_prefix(texts[a], texts[b])
            same = "the same" if texts[a] == texts[b] else f"differ after {n} characters"
            print(f"{name}: answers of {a} and {b} {same}", flush=True)


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def many_streams(
    url: str, decode: str, model: str, streams: int, args: argparse.Namespace
) -> float:
    """Served tokens/s of `streams` chat requests at once per mode, batches alternating;
    the decode's spec counters over the "on" batches."""
    rate: dict[bool, list[float]] = {True: [], False: []}
    spec = dict.fromkeys(SPEC_COUNTERS, 0.0)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4)) as client:
        for r in range(args.rounds):
            for mode in (True, False) if r % 2 == 0 else (False, True):
                before = counters(decode)
                t0 = time.perf_counter()
                extra = {"speculative": mode}
                jobs = [one(client, url, model, CHAT[i % len(CHAT)], args.chat_tokens, extra)
                        for i in range(streams)]  # fmt: skip
                done = await asyncio.gather(*jobs)
                secs = time.perf_counter() - t0
                after = counters(decode)
                for k in SPEC_COUNTERS:
                    spec[k] += after[k] - before[k]
                toks = sum(d.tokens for d in done)
                rate[mode].append(toks / secs)
                label = "on " if mode else "off"
                print(f"chat x{streams} round {r} {label}: {toks} tokens in {secs:.1f} s = "
                      f"{toks / secs:.1f} tok/s", flush=True)  # fmt: skip
    on, off = statistics.mean(rate[True]), statistics.mean(rate[False])
    # each round's two turns ran back to back: their ratio drops what a slow minute of a
    # shared machine does to both, which the ratio of means keeps
    paired = statistics.median(a / b for a, b in zip(rate[True], rate[False]))
    print(f"chat x{streams}: served tok/s on {on:.1f}, off {off:.1f}, on/off {on / off:.2f} "
          f"(median of the rounds' on/off {paired:.2f}); "
          f"drafted {spec['spec_drafted_tokens_total']:.0f}, accepted "
          f"{spec['spec_accepted_tokens_total']:.0f} in {spec['spec_steps_total']:.0f} "
          f"verifying steps; {spec['spec_lookups_total']:.0f} steps looked for drafts, "
          f"{spec['spec_empty_lookups_total']:.0f} found none", flush=True)  # fmt: skip
    return on / off


async def run(url: str, llama: dict[bool, str], args: argparse.Namespace) -> None:
    info = httpx.get(url + "/server_info", timeout=30).json()["router"]
    decode = info["decode"][0]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    modes = [Mode(PD_ON, url, {"speculative": True}, decode),
             Mode(PD_OFF, url, {"speculative": False})]  # fmt: skip
    modes += [Mode(LL_ON if on else LL_OFF, u) for on, u in llama.items()]
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for m in modes:  # warm-up
            await one(client, m.url, model, CHAT[0], 4, m.extra)
    if "code-edit" in args.workloads:
        src = CODE_FILE.read_text()
        await one_stream(fresh(modes), model, CODE_ASK.format(src=src), args, "code-edit")
    if "summarize" in args.workloads:
        text = SUMMARY_ASK.format(text=ARTICLE)
        await one_stream(fresh(modes), model, text, args, "summarize")
    if "chat" in args.workloads:
        for streams in args.chat_streams:
            await many_streams(url, decode, model, streams, args)


def fresh(modes: list[Mode]) -> list[Mode]:
    return [Mode(m.label, m.url, m.extra, m.decode) for m in modes]


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
    ap.add_argument("--speculative", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-model", default=None,
                    help="--speculative draft: the drafting model (default: --model itself)")  # fmt: skip
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags, space-separated")
    speculative_peer.add_args(ap)
    args = ap.parse_args()
    flags = ["--speculative", args.speculative, "--spec-k", str(args.spec_k),
             *args.up_args.split()]  # fmt: skip
    if args.speculative == "draft":
        flags += ["--draft-model", args.draft_model or args.model]
        if speculative_peer.wanted(args):
            ap.error("--llama-server compares n-gram speculation only (--speculative ngram)")
    elif args.draft_model:
        ap.error("--draft-model is only for --speculative draft")
    if args.spec_max_batch is not None:
        flags += ["--spec-max-batch", str(args.spec_max_batch)]
    print(f"model {args.model}, pdserve up {' '.join(flags)}", flush=True)
    with ExitStack() as stack:
        url = stack.enter_context(pdserve_up("bench-speculative", args.model, tuple(flags)))
        llama: dict[bool, str] = {}
        if speculative_peer.wanted(args):
            gguf = speculative_peer.gguf_for(args)
            print(f"llama.cpp {speculative_peer.describe(args)} on {gguf}", flush=True)
            llama = stack.enter_context(speculative_peer.llama_servers(args, gguf))
        asyncio.run(run(url, llama, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
