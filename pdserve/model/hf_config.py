"""The part of a Hugging Face `config.json` that the Llama-family models need."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.model import arch_rules as rules
from pdserve.model import gemma3_config, moe_config, phi3_config
from pdserve.model.activations import ACTIVATIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelArch:
    """Every config value that changes the computation (fingerprinted as a whole)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str  # a name in pdserve.model.activations.ACTIVATIONS
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: default rope; else rope_type + its parameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections (Qwen2; Llama/Qwen3 with attention_bias)
    o_bias: bool  # o_proj (Llama/Qwen3 with attention_bias)
    mlp_bias: bool  # gate/up/down projections (Llama with mlp_bias)
    qk_norm: bool  # Qwen3
    # per layer: 0 = full causal attention; W = the query at p sees keys p-W+1 .. p
    layer_windows: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Gemma 3 (pdserve.model.gemma3_config); the defaults are every other family's
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    # rope of the sliding-window layers where it differs from rope_theta / rope_scaling
    # (which then hold the full-attention layers'); None: every layer has the same rope
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    rotary_dim: int | None = None  # the values of a head rope turns (Phi-3); None: head_dim
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] (OLMoE)
    moe: moe_config.MoeSpec | None = None  # the expert layers (model/moe.py); None: dense

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of layer `layer`'s rotary embedding."""
        if self.sliding_rope is not None and self.layer_windows[layer]:
            return self.sliding_rope
        return self.rope_theta, self.rope_scaling

    @property
    def context_positions(self) -> int:
        """The longest context the model computes: max_position_embeddings, times `factor`
        under dynamic rope (which rescales past it)."""
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "dynamic":
            return int(self.max_position_embeddings * float(s["factor"]))
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_ids(cfg: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg, _read_json(model_dir / "generation_config.json")):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(e) for e in eos)
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def load_arch(model_dir: str | Path) -> ModelArch:
    """Parse `config.json` as transformers 5 does; raises ValueError for a family pdserve
    does not serve and UnsupportedConfig (naming the field) for a computation it does not
    implement."""
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    if not cfg:
        raise ValueError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    try:
        return arch_from_config(cfg, _eos_ids(cfg, model_dir))
    except rules.UnsupportedConfig as e:
        raise rules.UnsupportedConfig(f"{model_dir}: {e}") from None


def arch_from_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    default = _DEFAULT_ARCH.get(str(cfg.get("model_type")), rules.LLAMA)
    arch = (cfg.get("architectures") or [default])[0]
    if arch == gemma3_config.GEMMA3:
        return ModelArch(**gemma3_config.arch_fields(cfg), eos_token_ids=eos_token_ids)
    if arch in moe_config.MOE_ARCHS:
        return ModelArch(**moe_config.arch_fields(arch, cfg), eos_token_ids=eos_token_ids)
    if arch == phi3_config.PHI3:
        return ModelArch(**phi3_config.arch_fields(cfg), eos_token_ids=eos_token_ids)
    if arch not in rules.SUPPORTED:
        supported = (
            *rules.SUPPORTED,
            gemma3_config.GEMMA3,
            phi3_config.PHI3,
            *moe_config.MOE_ARCHS,
        )
        raise ValueError(f"architecture {arch} is not supported; supported: {supported}")
    rules.refuse_foreign_fields(cfg)
    if unread := rules.unread_fields(cfg):
        log.warning("config.json fields pdserve does not read: %s", ", ".join(unread))
    heads, hidden = int(_required(cfg, "num_attention_heads")), int(_required(cfg, "hidden_size"))
    layers = int(_required(cfg, "num_hidden_layers"))
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise rules.refuse("hidden_act", act, f"implemented: {', '.join(sorted(ACTIVATIONS))}")
    max_pos = int(cfg.get("max_position_embeddings") or rules.MAX_POSITIONS_DEFAULT[arch])
    rope_theta, rope_scaling = rules.rope(cfg, max_pos)
    bias = rules.biases(cfg, arch)
    return ModelArch(
        architecture=arch,
        vocab_size=int(_required(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_required(cfg, "intermediate_size")),
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


_DEFAULT_ARCH = {
    "gemma3_text": gemma3_config.GEMMA3,
    "phi3": phi3_config.PHI3,
    **moe_config.MODEL_TYPES,
}


def _required(cfg: dict[str, Any], field: str) -> Any:
    if cfg.get(field) is None:
        raise rules.refuse(field, None, "required")
    return cfg[field]
