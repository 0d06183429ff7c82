"""A deterministic fake engine and a tiny model folder, for the server tests.

A frontend runs this file as its engine process when `PDSERVE_ENGINE_ENTRY`
names it (`ServerProc` does that); the product never imports it. The fake echoes the prompt: output token i is
`input_ids[i % len(input_ids)]` with logprob `-(i + 1) / 10`, so a test knows
the exact expected output. It keeps row/page accounting like a real engine and
counts what it saw (`added`, `aborted`, `finished`) in `stats()`.

`stats()` also reports the numeric sampling parameters of the last request added
(`last_temperature`, ..., `last_logit_bias.<token id>`, `last_grammar` 1 or 0), so a test sees what reached the engine.

Knobs (environment of the engine process):
    PDSERVE_FAKE_STEP_S   seconds one step() takes while requests run (default 0.002)
A request with `seed == FAIL_SEED` ends with an engine error event.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.config import EngineConfig, TransferConfig
from pdserve.protocol import QUEUE_FULL, EngineRequest, PromptLogprobs, TokenEvent, TopLogprobs

FAIL_SEED = 4242
# numeric sampling parameters the fake reports in stats() as last_<name> (what it was sent)
LAST_PARAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
               "frequency_penalty", "presence_penalty", "repetition_penalty")  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello world! hello there, general kenobi. STOP here and there.",
    "def main(): return 0  # python code with indentation\n    pass\n",
]


@dataclass
class _Running:
    req: EngineRequest
    pages: int
    produced: int = 0
    stages: dict[str, float] = field(default_factory=dict)


def _top(ids: list[int], i: int, k: int, first: float) -> TopLogprobs:
    """The fake's top k at output (or prompt) position i: ids[i], ids[i + 1], ..."""
    return TopLogprobs([ids[(i + j) % len(ids)] for j in range(k)], [first - j for j in range(k)])


class FakeEngine:
    def __init__(self, role: str, cfg: EngineConfig) -> None:
        self.role = role
        self.total_rows = cfg.scheduler.max_running_requests
        self.total_pages = cfg.cache.num_pages - 1
        self.page_size = cfg.cache.page_size
        self.free_pages = self.total_pages
        self.step_s = float(os.environ.get("PDSERVE_FAKE_STEP_S", "0.002"))
        self.queue: deque[EngineRequest] = deque()
        self.max_queued = cfg.scheduler.max_queued_requests
        self.running: dict[str, _Running] = {}
        self.out: list[TokenEvent] = []
        self.counts = {"added": 0, "aborted": 0, "finished": 0}
        self.last_params: dict[str, float] = {}  # numeric SamplingParams of the last request

    def add_request(self, req: EngineRequest) -> None:
        self.counts["added"] += 1
        p = req.params
        self.last_params = {f"last_{k}": float(getattr(p, k)) for k in LAST_PARAMS
                            if getattr(p, k) is not None}  # fmt: skip
        self.last_params |= {f"last_logit_bias.{t}": b for t, b in p.logit_bias.items()}
        self.last_params["last_grammar"] = float(p.grammar is not None)
        if req.params.seed == FAIL_SEED:
            self.out.append(TokenEvent(rid=req.rid, finished=True, error="fake engine failure"))
            return
        if len(self.queue) >= self.max_queued:  # as the engines' admission refuses
            self.out.append(TokenEvent(rid=req.rid, finished=True, error=QUEUE_FULL))
            return
        self.queue.append(req)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        r = self.running.pop(rid, None)
        if r is not None:
            self.free_pages += r.pages
        elif any(q.rid == rid for q in self.queue):
            self.queue = deque(q for q in self.queue if q.rid != rid)
        else:
            return
        self.counts["aborted"] += 1
        self.out.append(TokenEvent(rid=rid, finished=True, finish_reason="abort"))

    def _admit(self) -> None:
        while self.queue and len(self.running) < self.total_rows:
            req = self.queue[0]
            need = -(-(len(req.input_ids) + req.params.max_tokens) // self.page_size)
            if need > self.free_pages:
                return
            self.queue.popleft()
            self.free_pages -= need
            self.running[req.rid] = _Running(req, need, stages={"admit": time.time()})

    def _advance(self, r: _Running) -> TokenEvent:
        ids, p = r.req.input_ids, r.req.params
        tok = ids[r.produced % len(ids)]
        r.produced += 1
        ev = TokenEvent(rid=r.req.rid, token_ids=[tok], logprobs=[-r.produced / 10])
        if p.top_logprobs:  # the token itself, then the next prompt tokens
            ev.top_logprobs = [_top(ids, r.produced - 1, p.top_logprobs, -r.produced / 10)]
        if p.prompt_logprobs is not None and r.produced == 1:
            tops = [_top(ids, i, p.prompt_logprobs, -0.5) for i in range(1, len(ids))]
            ev.prompt_logprobs = PromptLogprobs.pack(
                [-0.5] * (len(ids) - 1), tops, p.prompt_logprobs
            )
        if tok in p.stop_token_ids:
            ev.finish_reason, ev.matched_stop = "stop", tok
        elif r.produced >= p.max_tokens or self.role == "prefill":
            ev.finish_reason = "length"
        if ev.finish_reason is not None:
            ev.finished, ev.stages = True, r.stages
            self.running.pop(r.req.rid)
            self.free_pages += r.pages
            self.counts["finished"] += 1
        return ev

    def step(self) -> list[TokenEvent]:
        self._admit()
        if self.running:
            time.sleep(self.step_s)
        events, self.out = self.out, []
        events += [self._advance(r) for r in list(self.running.values())]
        return events

    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.out)

    def has_unfinished(self) -> bool:
        return self.has_work()

    def stats(self) -> dict[str, float]:
        return {
            "free_rows": float(self.total_rows - len(self.running)),
            "total_rows": float(self.total_rows),
            "free_kv_pages": float(self.free_pages),
            "total_kv_pages": float(self.total_pages),
            "running": float(len(self.running)),
            "queued": float(len(self.queue)),
            **{k: float(v) for k, v in self.counts.items()},
            **self.last_params,
        }

    def close(self) -> None:
        pass


def build_engine(role: str, cfg: EngineConfig, transfer: TransferConfig) -> FakeEngine:
    return FakeEngine(role, cfg)


def make_model_dir(path: Path, max_positions: int = 256) -> Path:
    """A model folder with a small byte-level BPE tokenizer and no weights."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": 0,
              "vocab_size": tok.get_vocab_size(), "max_position_embeddings": max_positions}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tcfg = {"eos_token": SPECIALS[0], "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`pdserve <role>` with the fake engine, as a real process on a free loopback port."""

    def __init__(self, model: Path, role: str = "decode", *args: str, **env: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve.server.serve_cli", role, "--model", str(model),
               "--port", str(self.port), "--log-level", "warning", *args]  # fmt: skip
        if role == "prefill" and "--bootstrap-port" not in args:
            cmd += ["--bootstrap-port", str(free_port())]
        full_env = {**os.environ, "PDSERVE_ENGINE_ENTRY": str(Path(__file__).resolve()), **env}
        self.proc = subprocess.Popen(cmd, env=full_env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 30.0) -> ServerProc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":  # the engine process of a frontend under test
    from pdserve.scheduler.engine_proc import main

    sys.exit(main(build=build_engine))
