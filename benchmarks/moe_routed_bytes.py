"""A mixture-of-experts decode: tokens per second and the expert bytes each step reads.

Makes a random Qwen3-MoE folder with transformers (its shape from the flags; the default
is a small model with a realistic router: 64 experts, top 8), serves it with the offline
engine pair (`pdserve.LLM`) at each stream count, and counts, per decode step and
sparse layer, the distinct experts the batch routes to (model/arch/moe.py runs each of
them once and reads no other). Reported per stream count:

    tok/s         generated tokens / wall time of the generate call (prefill included)
    experts/layer the distinct experts a decode step's batch routes to, mean over steps
    read / step   their weights' bytes over every sparse layer, against all experts'

    python benchmarks/moe_routed_bytes.py [--streams 1 16] [--layers 4] [--experts 64]
        [--top-k 8] [--hidden 512] [--expert-size 256] [--tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.model.arch import moe as moe_module


def make_folder(out: Path, a: argparse.Namespace) -> Path:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=a.hidden, intermediate_size=a.expert_size * 4,
        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_size,
        norm_topk_prob=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # a router with spread logits, weights of usual scale
            p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out)
    return out


def routed_experts(
    path: Path | str, streams: int, tokens: int, prompt: int, vocab: int
) -> tuple[list[int], float]:
    """(the distinct experts of each decode layer call, the generate's wall seconds) of
    `streams` greedy requests of `tokens` tokens, served by `pdserve.LLM`; the prompts of
    `prompt` token ids below `vocab`, longer than any decode batch, so a layer call of at
    most `streams` tokens is a decode step."""
    counts: list[tuple[int, int]] = []  # (tokens routed, distinct experts) per layer call
    route = moe_module.route

    def counting(logits: torch.Tensor, spec: object) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = route(logits, spec)  # type: ignore[arg-type]
        counts.append((logits.shape[0], int(chosen.unique().numel())))
        return weights, chosen

    moe_module.route = counting  # type: ignore[assignment]
    llm = LLM(str(path), max_running_requests=streams, max_total_tokens=8192, max_context=512)
    try:
        prompts = [[(7 * i + 3 * j) % (vocab - 10) + 10 for j in range(prompt)]
                   for i in range(streams)]  # fmt: skip
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        counts.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        llm.close()
        moe_module.route = route  # type: ignore[assignment]
    return [d for n, d in counts if n <= streams], wall


def run(path: Path, streams: int, tokens: int, a: argparse.Namespace) -> dict[str, float]:
    decode, wall = routed_experts(path, streams, tokens, max(a.streams) + 8, 4010)
    per_expert = 3 * a.hidden * a.expert_size * 4  # gate, up, down in float32
    mean = sum(decode) / max(1, len(decode))
    return {
        "streams": streams,
        "tok_per_s": streams * tokens / wall,
        "experts_per_layer": mean,
        "read_mb_per_step": mean * per_expert * a.layers / 1e6,
        "experts_mb": a.experts * per_expert * a.layers / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_folder(Path(tmp) / "moe", a)
        rows = [run(path, s, a.tokens, a) for s in a.streams]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'streams':>7} {'tok/s':>8} {'experts/layer':>14} {'read/step':>22}")
    for r in rows:
        read = f"{r['read_mb_per_step']:.1f} of {r['experts_mb']:.1f} MB"
        print(
            f"{r['streams']:>7} {r['tok_per_s']:>8.1f} {r['experts_per_layer']:>14.1f} {read:>22}"
        )


if __name__ == "__main__":
    main()
