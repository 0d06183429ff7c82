"""How `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and
`Qwen3ForCausalLM` read their config.json, as transformers 5 does (the per-family
tables are in rules.py); one LlamaModel computes all four."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.model.arch import rules
from pdserve.model.arch.config import ModelArch, required
from pdserve.model.layers.activations import ACTIVATIONS

log = logging.getLogger(__name__)


def read_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    arch = (cfg.get("architectures") or [rules.LLAMA])[0]
    rules.refuse_foreign_fields(cfg)
    if unread := rules.unread_fields(cfg):
        log.warning("config.json fields pdserve does not read: %s", ", ".join(unread))
    heads, hidden = int(required(cfg, "num_attention_heads")), int(required(cfg, "hidden_size"))
    layers = int(required(cfg, "num_hidden_layers"))
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise rules.refuse("hidden_act", act, f"implemented: {', '.join(sorted(ACTIVATIONS))}")
    max_pos = int(cfg.get("max_position_embeddings") or rules.MAX_POSITIONS_DEFAULT[arch])
    rope_theta, rope_scaling = rules.rope(cfg, max_pos)
    bias = rules.biases(cfg, arch)
    return ModelArch(
        architecture=arch,
        vocab_size=int(required(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required(cfg, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=rules.kv_heads(cfg, arch, heads),
        head_dim=rules.head_dim(cfg, arch, hidden, heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias.qkv,
        o_bias=bias.o,
        mlp_bias=bias.mlp,
        qk_norm=arch == rules.QWEN3,
        layer_windows=rules.layer_windows(cfg, arch, layers),
        eos_token_ids=eos_token_ids,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )
