"""Soak: many concurrent streams through the router, then check nothing was lost or leaked.

    python benchmarks/soak.py --duration 60 --concurrency 24        # table
    python benchmarks/soak.py --duration 60 --json                  # one JSON object

Starts its own router + prefill + decode (real processes, `python -m pdserve.cli`);
`Cluster` is also what tests/test_process_faults.py uses. Transfer timeouts go to the
workers as flags (`--kv-timeout` ...), see FAST_TRANSFER.

The load mixes native /generate greedy samples (kept and compared with transformers
afterwards), OpenAI completions with stop strings, streamed or not, client cancellations
(before the first byte and mid-stream) and bursts. Afterwards every worker must report
zero running/queued requests and every row and KV page free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.config import flag_of
from pdserve.server.launch_children import Child, free_port, start, stop_all, wait_healthy

# TransferConfig fields, each passed as its `pdserve prefill|decode` flag (config.flag_of)
FAST_TRANSFER = {
    "kv_ready_timeout_s": 4.0,
    "kv_timeout_s": 6.0,
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 2.0,
}
ENGINE_FLAGS = ["--max-running-requests", "16", "--max-total-tokens", "8192",
                "--max-context", "512", "--log-level", "warning"]  # fmt: skip


@dataclass
class Cluster:
    """One prefill, one decode and a router; `start()` blocks until all answer /health."""

    model: str = "tiny"  # the seeded random preset: small and quick on a shared CPU
    transfer: dict[str, float] = field(default_factory=lambda: dict(FAST_TRANSFER))
    engine_flags: list[str] = field(default_factory=lambda: list(ENGINE_FLAGS))
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pdserve-cluster-"))
    children: list[Child] = field(default_factory=list)
    _n: int = 0

    def worker(self, role: str, extra: list[str] | None = None) -> Child:
        """A new prefill or decode child (not started). Each gets fresh ports;
        `extra` flags come after the cluster's engine flags (and so win)."""
        self._n += 1
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            role,
            "--model",
            self.model,
            "--port",
            str(port),
        ]
        for key, value in self.transfer.items():
            argv += [flag_of(key), str(value)]
        boot = free_port() if role == "prefill" else None
        if boot is not None:
            argv += ["--bootstrap-port", str(boot)]
        argv += self.engine_flags + (extra or [])
        return Child(f"{role}{self._n}", argv, "127.0.0.1", port, boot)

    def router(self, prefills: list[Child], decodes: list[Child]) -> Child:
        port = free_port()
        argv = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port)]
        for p in prefills:
            argv += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decodes:
            argv += ["--decode", d.url]
        self._n += 1
        return Child(f"router{self._n}", argv, "127.0.0.1", port)

    def launch(self, children: list[Child], timeout_s: float = 180.0) -> None:
        env = dict(os.environ)
        for c in children:
            start(c, self.log_dir, env)
            self.children.append(c)
        wait_healthy(children, timeout_s, lambda: False)

    def start(self) -> tuple[Child, Child, Child]:
        """(prefill, decode, router), all healthy."""
        p, d = self.worker("prefill"), self.worker("decode")
        self.launch([p, d])
        r = self.router([p], [d])
        self.launch([r])
        return p, d, r

    def stop(self, children: list[Child] | None = None) -> None:
        stop_all(children if children is not None else self.children, grace_s=5.0)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}:\n{c.log_tail(15)}" for c in self.children)


def server_info(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/server_info", timeout=5.0)
    r.raise_for_status()
    return dict(r.json())


def leaks(info: dict[str, Any]) -> list[str]:
    """What a quiet worker still holds (empty list: nothing)."""
    out = []
    if info.get("running", 0) or info.get("queued", 0):
        out.append(f"running={info.get('running')} queued={info.get('queued')}")
    if "free_rows" not in info:
        return [f"no engine stats (engine_error={info.get('engine_error')})"]
    if info["free_rows"] != info["total_rows"]:
        out.append(f"rows {info['free_rows']}/{info['total_rows']} free")
    if info["free_kv_pages"] != info["total_kv_pages"]:
        out.append(f"pages {info['free_kv_pages']}/{info['total_kv_pages']} free")
    return out


def wait_quiet(urls: list[str], timeout_s: float) -> dict[str, list[str]]:
    """Poll until no worker holds anything; returns what each still holds at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {u: leaks(server_info(u)) for u in urls}
        if not any(held.values()) or time.monotonic() > deadline:
            return {u: h for u, h in held.items() if h}
        time.sleep(0.2)


def engine_signal(url: str, sig: signal.Signals) -> int:
    """Send `sig` to the engine process of the worker at `url`; returns its pid."""
    pid = int(server_info(url)["engine_pid"])
    os.kill(pid, sig)
    return pid


# ---- load -----------------------------------------------------------------------------------

WORDS = "the a of sun river stone green quick light seven north open glass".split()
STOPS = ["e", "th", " a", "\n", "zz", "o "]


@dataclass
class Tally:
    """Outcomes of the load. Invariant: ok + cancelled + sum(errors) == requests."""

    requests: int = 0
    ok: int = 0
    cancelled: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    samples: list[tuple[list[int], int, list[int]]] = field(default_factory=list)  # greedy
    examples: dict[str, str] = field(default_factory=dict)  # first error body of each kind

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Load:
    def __init__(self, url: str, model: str, vocab: int, seed: int, max_samples: int) -> None:
        self.url, self.model, self.vocab, self.max_samples = url, model, vocab, max_samples
        self.rng = random.Random(seed)
        self.t = Tally()

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(["greedy", "text", "stream", "cancel"], [2, 3, 3, 2])[0]
        self.t.requests += 1
        t0 = time.monotonic()
        try:
            outcome = await getattr(self, "_" + kind)(client)
        except httpx.HTTPError as e:
            outcome = type(e).__name__
        if outcome == "ok":
            self.t.ok += 1
            self.t.latencies.append(time.monotonic() - t0)
        elif outcome == "cancelled":
            self.t.cancelled += 1
        else:
            self.t.error(outcome)

    async def _greedy(self, client: httpx.AsyncClient) -> str:
        ids = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(1, 40))]
        n = self.rng.randint(1, 24)
        sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        r = await client.post(
            self.url + "/generate", json={"input_ids": ids, "sampling_params": sp}
        )
        if r.status_code != 200:
            return self._bad(r.status_code, r.text)
        out = r.json()["output_ids"]
        self.t.tokens += len(out)
        if len(self.t.samples) < self.max_samples:
            self.t.samples.append((ids, n, out))
        return "ok"

    def _bad(self, status: int, text: str) -> str:
        self.t.examples.setdefault(f"http_{status}", text[:300])
        return f"http_{status}"

    def _body(self, stream: bool) -> dict[str, Any]:
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 60)))
        return {"model": self.model, "prompt": prompt, "max_tokens": self.rng.randint(1, 48),
                "temperature": self.rng.choice([0, 0.7, 1.0]), "stream": stream,
                "stop": self.rng.sample(STOPS, self.rng.randint(0, 2)) or None}  # fmt: skip

    async def _text(self, client: httpx.AsyncClient) -> str:
        r = await client.post(self.url + "/v1/completions", json=self._body(False))
        if r.status_code != 200:
            return self._bad(r.status_code, r.text)
        self.t.tokens += int(r.json()["usage"]["completion_tokens"])
        return "ok"

    async def _stream(self, client: httpx.AsyncClient, cut: int | None = None) -> str:
        async with client.stream("POST", self.url + "/v1/completions", json=self._body(True)) as r:
            if r.status_code != 200:
                return self._bad(r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "ok"
                if line.startswith("data: "):
                    if "error" in json.loads(line[6:]):
                        self.t.examples.setdefault("sse_error", line[:300])
                        return "sse_error"
                    self.t.tokens += 1
                    if cut is not None and (cut := cut - 1) <= 0:
                        return "cancelled"  # leaving the block closes the connection
        return "stream_ended_without_done"

    async def _cancel(self, client: httpx.AsyncClient) -> str:
        if self.rng.random() < 0.5:
            return await self._stream(client, cut=self.rng.randint(1, 4))
        try:  # gone before the first byte: often while the prefill still runs
            return await asyncio.wait_for(self._stream(client), self.rng.uniform(0.01, 0.3))
        except TimeoutError:
            return "cancelled"


async def drive(url: str, model: str, vocab: int, duration_s: float, concurrency: int, seed: int = 0,
                max_samples: int = 8) -> Tally:  # fmt: skip
    """`concurrency` clients loop until `duration_s`; every 3 s a burst of as many again."""
    load = Load(url, model, vocab, seed, max_samples)
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=4 * concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                await load.one(client)

        async def bursts() -> None:
            while time.monotonic() + 3 < deadline:
                await asyncio.sleep(3)
                await asyncio.gather(*(load.one(client) for _ in range(concurrency)))

        await asyncio.gather(bursts(), *(worker() for _ in range(concurrency)))
    return load.t


def model_facts(worker_url: str) -> tuple[str, str, int]:
    """(model folder, served model name, vocabulary size) of a worker."""
    info = server_info(worker_url)
    cfg = json.loads((Path(info["model_path"]) / "config.json").read_text())
    return info["model_path"], info["served_model_name"], int(cfg["vocab_size"])


def greedy_mismatches(model_path: str, samples: list[tuple[list[int], int, list[int]]]) -> int:
    """How many samples differ from transformers' greedy continuation."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.conftest import hf_greedy

    return sum(hf_greedy(model_path, ids, n) != out for ids, n, out in samples)


def figures(t: Tally, duration_s: float, held: dict[str, list[str]], bad: int) -> dict[str, Any]:
    lat = sorted(t.latencies) or [0.0]
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)  # noqa: E731
    return {"duration_s": duration_s, "requests": t.requests, "ok": t.ok,
            "cancelled": t.cancelled, "errors": t.errors, "tokens": t.tokens,
            "tokens_per_s": round(t.tokens / duration_s, 1), "p50_latency_s": pct(0.5),
            "p99_latency_s": pct(0.99), "greedy_checked": len(t.samples),
            "greedy_mismatches": bad, "leaks": held, "error_examples": t.examples}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cluster = Cluster(transfer={})  # default timeouts: a slow shared CPU is no fault
    try:
        p, d, r = cluster.start()
        path, name, vocab = model_facts(p.url)
        t = asyncio.run(drive(r.url, name, vocab, args.duration, args.concurrency, args.seed))
        held = wait_quiet([p.url, d.url], timeout_s=15.0)
        res = figures(t, args.duration, held, greedy_mismatches(path, t.samples))
    finally:
        cluster.stop()
    print(json.dumps(res) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in res.items()))
    return int(bool(res["errors"] or res["leaks"] or res["greedy_mismatches"]))


if __name__ == "__main__":
    sys.exit(main())
