"""Multi-turn TTFT with the prefill's prefix cache on and off.

Conversations share one system prompt (--system tokens) and grow turn by turn: a
turn's prompt is the turn before's prompt + its answer + a new user message. Two
`pdserve up` stacks serve the same conversations, one with the prefix cache (the
default) and one with --disable-prefix-cache, taking turns request by request (the
one that goes first alternates), so the machine's state falls on both alike. One
request at a time: TTFT is the prefill's work, not queueing.

    python benchmarks/multiturn.py [--model bench] [--conversations 4] [--turns 4] [--json]

Reports TTFT p50 of first turns and of later turns for each stack, the ratio of later
turns (cache on / off), and the prefill's hit tokens from its /metrics. Greedy answers
of the two stacks are compared token for token as a side check.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="what `pdserve up --model` takes")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=1024, help="system prompt tokens (shared)")
    p.add_argument("--user", type=int, default=48, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """One `pdserve up` (router, prefill, decode) in its own process group."""

    def __init__(self, name: str, model: str, extra: list[str]) -> None:
        self.name = name
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.gettempdir()) / f"multiturn-{name}-{port}.log"
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", model,
                "--port", str(port), *extra]  # fmt: skip
        out = open(self.log, "w")  # the child writes it until it stops
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not healthy after {timeout} s; see {self.log}")

    def generate(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        """(TTFT in seconds, the greedy output ids) of one streamed request."""
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        t0 = time.perf_counter()
        ttft, out = -1.0, []
        with httpx.stream("POST", self.url + "/generate", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("output_ids") and ttft < 0:
                    ttft = time.perf_counter() - t0
                out = obj.get("output_ids") or out
        return ttft, out

    def hit_tokens(self) -> float:
        """The prefill's prefix-cache hit tokens (its /metrics), 0 without a cache."""
        info = httpx.get(self.url + "/server_info", timeout=5).json()["router"]
        text = httpx.get(info["prefill"][0][0] + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("pdserve:prefix_cache_hit_tokens_total"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]  # ids every model here has

    system = words(args.system)
    stacks = [Stack("cache-on", args.model, []),
              Stack("cache-off", args.model, ["--disable-prefix-cache"])]  # fmt: skip
    ttft: dict[str, dict[str, list[float]]] = {s.name: {"first": [], "later": []} for s in stacks}
    same = True
    try:
        for s in stacks:
            s.wait(args.startup_timeout)
        for s in stacks:  # warm-up: a request each, outside the figures
            s.generate(words(16), 2)
        history = [system + words(args.user) for _ in range(args.conversations)]
        order = list(stacks)
        for turn in range(args.turns):
            for c in range(args.conversations):
                answers = []
                for s in order:
                    t, out = s.generate(history[c], args.answer)
                    ttft[s.name]["first" if turn == 0 else "later"].append(t)
                    answers.append(out)
                order.reverse()  # the other goes first next time
                same = same and answers[0] == answers[1]
                history[c] = history[c] + answers[0] + words(args.user)
        hits = {s.name: s.hit_tokens() for s in stacks}
    finally:
        for s in stacks:
            s.stop()
    p50 = {n: {k: statistics.median(v) for k, v in d.items() if v} for n, d in ttft.items()}
    return {
        "model": args.model,
        "conversations": args.conversations,
        "turns": args.turns,
        "system_tokens": args.system,
        "ttft_p50_s": p50,
        "later_ratio_on_off": p50["cache-on"]["later"] / p50["cache-off"]["later"],
        "prefix_cache_hit_tokens": hits,
        "answers_identical": same,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return
    print(f"model {res['model']}: {res['conversations']} conversations x {res['turns']} turns, "
          f"{res['system_tokens']}-token system prompt")  # fmt: skip
    for name, d in res["ttft_p50_s"].items():
        print(f"  {name:9s} TTFT p50 first turn {d['first'] * 1e3:7.1f} ms, "
              f"later turns {d['later'] * 1e3:7.1f} ms, "
              f"hit tokens {res['prefix_cache_hit_tokens'][name]:.0f}")  # fmt: skip
    print(f"  later turns, cache on / off: {res['later_ratio_on_off']:.3f}")
    print(f"  answers identical: {res['answers_identical']}")


if __name__ == "__main__":
    main()
