"""Capacity on the default pool: 64 concurrent chats without max_tokens (the frontend
then asks for the rest of the context, as chat clients do) on the `bench` model all
run at once. Reserving prompt + max_tokens up front, the default pool (65,536 tokens)
held 8 of them (8,192-token context); with pages on demand all 64 run in one batch,
and each yields transformers' greedy tokens, as it would alone."""

from __future__ import annotations

import random
import time

import torch

from pdserve.config import EngineConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff
from tests.conftest import model_path

CHATS = 64
PROMPT = 40
TOKENS = 12  # checked per chat; then the chats are aborted (they would run to the context)


def test_64_chats_without_max_tokens_run_at_once_on_the_default_pool() -> None:
    path = model_path("bench")
    cfg = EngineConfig(model_path=str(path))  # the default pool, context and rows
    handoff = InProcessHandoff()
    pr = ModelRunner(cfg)
    prefill = PrefillEngine(cfg, pr, handoff.sink)
    decode = DecodeEngine(cfg, ModelRunner(cfg, model=pr.model), handoff.source)
    assert decode.runner.max_context == 8192  # the model's own
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(PROMPT)] for _ in range(CHATS)]
    for i, prompt in enumerate(prompts):
        rest = decode.runner.max_context - len(prompt)  # the frontend's default max_tokens
        params = SamplingParams(max_tokens=rest, temperature=0.0, ignore_eos=True)
        er = EngineRequest(rid=str(i), input_ids=prompt, params=params, room=i + 1)
        prefill.add_request(er)
        decode.add_request(er)
    out: dict[str, list[int]] = {str(i): [] for i in range(CHATS)}
    deadline = time.monotonic() + 240
    running = 0  # the most requests the /metrics gauge num_running_reqs showed
    while min(len(t) for t in out.values()) < TOKENS:
        assert time.monotonic() < deadline, "stuck"
        prefill.step()
        for ev in decode.step():
            assert ev.error is None and not ev.finished, ev
            out[ev.rid].extend(ev.token_ids)
        running = max(running, int(decode.stats()["running"]))
    assert running >= 48, running
    peak = decode.stats()["running_peak"]  # the largest batch launched
    for rid in out:
        decode.abort(rid)
        prefill.abort(rid)
    decode.drain()
    while prefill.has_unfinished():
        prefill.step()
    assert peak >= 48, peak
    s = decode.stats()
    assert s["preemptions"] == 0
    assert s["free_rows"] == s["total_rows"] and s["free_kv_pages"] == s["total_kv_pages"], s

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    toks = [out[str(i)][:TOKENS] for i in range(CHATS)]
    with torch.no_grad():  # teacher-forced: transformers' greedy pick after each prefix
        ids = torch.tensor([p + t[:-1] for p, t in zip(prompts, toks)])
        best = hf(ids).logits[:, PROMPT - 1 :].argmax(-1).tolist()
    bad = [i for i in range(CHATS) if best[i] != toks[i]]
    assert not bad, f"chats {bad} differ from transformers' greedy tokens"
    decode.close()
