"""The servers `multiturn.py` drives, and one streamed, timed request against each.

pdserve is asked through its native POST /generate (token ids in, `output_ids` out,
cumulative), vLLM through POST /v1/completions with `return_token_ids` (its token-id
route: the ids of each chunk are a delta). Both stream; a request's TTFT is the time to
the first chunk that carries an output token.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402  (its server and vLLM helpers)


@dataclass
class Reply:
    """One request: seconds since it was sent, and the greedy output ids."""

    ttft: float = -1.0
    latency: float = 0.0
    ids: list[int] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)  # pdserve's TTFT stages, s

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first."""
        return (self.latency - self.ttft) / max(len(self.ids) - 1, 1)


class Server:
    """A server in its own process group (compare.start_server), log in a temp dir."""

    kind = "pdserve"

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkdtemp(prefix=f"multiturn-{name}-")) / "server.log"
        self.proc = compare.start_server(argv, self.log, env)

    def wait(self, timeout: float) -> None:
        compare.wait_healthy(self.url, self.proc, timeout, self.log)

    def stop(self) -> None:
        compare.stop_server(self.proc)

    def body(self, ids: list[int], new: int) -> tuple[str, dict[str, Any]]:
        params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        return "/generate", {"input_ids": ids, "stream": True, "sampling_params": params}

    def new_ids(self, obj: dict[str, Any], sofar: list[int]) -> list[int]:
        """The output ids so far after chunk `obj`."""
        ids = obj.get("output_ids")
        return list(ids) if isinstance(ids, list) and len(ids) > len(sofar) else sofar

    async def ask(self, client: httpx.AsyncClient, ids: list[int], new: int) -> Reply:
        path, body = self.body(ids, new)
        rep = Reply()
        t0 = time.perf_counter()
        async with client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode("utf-8", "replace")[:200]
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {detail}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    raise RuntimeError(f"{self.name}: {str(obj['error'])[:200]}")
                got = self.new_ids(obj, rep.ids)
                stages = (obj.get("meta_info") or {}).get("ttft_breakdown")
                if isinstance(stages, dict):
                    rep.breakdown = {k: float(v) for k, v in stages.items()}
                if got and rep.ttft < 0:
                    rep.ttft = time.perf_counter() - t0
                rep.ids = got
        rep.latency = time.perf_counter() - t0
        if len(rep.ids) != new:
            raise RuntimeError(f"{self.name}: {len(rep.ids)} tokens, asked for {new}")
        return rep

    def metric(self, name: str) -> float:
        """The sum of a counter's samples on the engine that holds the prefix cache."""
        text = httpx.get(self.metrics_url(), timeout=5, trust_env=False).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
        )

    def metrics_url(self) -> str:
        info = httpx.get(self.url + "/server_info", timeout=5, trust_env=False).json()
        return str(info["router"]["prefill"][0][0]) + "/metrics"

    def hit_tokens(self) -> float:
        return self.metric("pdserve:prefix_cache_hit_tokens_total")


class VllmServer(Server):
    kind = "vllm"

    def __init__(self, argv: list[str], port: int, model: str, version: str) -> None:
        super().__init__("vllm", argv, port, compare.vllm_env())
        self.model, self.version = model, version

    def body(self, ids: list[int], new: int) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {
            "model": self.model, "prompt": ids, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
        }  # fmt: skip

    def new_ids(self, obj: dict[str, Any], sofar: list[int]) -> list[int]:
        for choice in obj.get("choices") or []:
            delta = choice.get("token_ids")
            if isinstance(delta, list) and delta:
                return sofar + list(delta)
        return sofar

    def metrics_url(self) -> str:
        return self.url + "/metrics"

    def hit_tokens(self) -> float:
        return self.metric("vllm:prefix_cache_hits_total")


def pdserve(name: str, model: str, extra: list[str], timeout: float) -> Server:
    port = compare.free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--port", str(port),
            "--startup-timeout", str(timeout), *extra]  # fmt: skip
    return Server(name, argv, port)


def vllm(venv: Path, model: str, max_seqs: int, max_len: int, extra: str) -> VllmServer | None:
    """vLLM's server from `venv`, prefix caching at its default (on); None if not installed."""
    found = compare.vllm_version(venv)
    if found is None:
        return None
    port = compare.free_port()
    argv = compare.vllm_argv(venv, found[0], model, port, max_seqs, max_len, extra)
    return VllmServer(argv, port, model, f"{found[1]} ({found[0]})")
