"""What every architecture's config reader produces (`ModelArch`), the record that
registers an architecture (`Architecture`), and reading a folder's config files once.

A family's module (llama_config.py, gemma3_config.py) turns a `config.json` dict into a
ModelArch or refuses a field by name; registry.py maps an architecture name to its record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.model.arch.rules import refuse


@dataclass(frozen=True)
class MoeSpec:
    """The expert layers of a mixture-of-experts model (arch/moe_config.py)."""

    num_experts: int
    top_k: int  # experts each token is routed to
    norm_topk_prob: bool  # the top-k weights divided by their sum
    expert_size: int  # each expert's intermediate size
    shared_size: int  # the shared expert's intermediate size (Qwen2-MoE); 0: none
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP


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
    hidden_act: str  # a name in pdserve.model.layers.activations.ACTIVATIONS
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
    # Gemma 3 (pdserve.model.arch.gemma3_config); the defaults are every other family's
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    # rope of the sliding-window layers where it differs from rope_theta / rope_scaling
    # (which then hold the full-attention layers'); None: every layer has the same rope
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    rotary_dim: int | None = None  # the values of a head rope turns (Phi-3); None: head_dim
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] (OLMoE)
    moe: MoeSpec | None = None  # the expert layers (arch/moe.py); None: dense

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


def read_config_files(model_dir: str | Path) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(config.json as a dict, the end-of-sequence ids of config and generation_config),
    the one place a model folder's config files are read."""
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    if not cfg:
        raise ValueError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    return cfg, _eos_ids(cfg, model_dir)


def required(cfg: dict[str, Any], field: str) -> Any:
    if cfg.get(field) is None:
        raise refuse(field, None, "required")
    return cfg[field]


# (config.json, eos ids) -> ModelArch, or UnsupportedConfig naming the field
ConfigReader = Callable[[dict[str, Any], tuple[int, ...]], ModelArch]
# (arch, state dict, max context) -> the model that computes it: a LlamaModel or a
# subclass (typed Any here: the model classes import this module)
ModelFactory = Callable[[ModelArch, dict[str, Any], int], Any]


@dataclass(frozen=True)
class Architecture:
    """Everything pdserve knows of one Hugging Face architecture name: registering one
    of these (registry.register) is all it takes to serve it."""

    name: str  # config.json "architectures"[0], e.g. "LlamaForCausalLM"
    model_types: tuple[str, ...]  # config.json "model_type"s that mean this name when
    # "architectures" is absent
    read_config: ConfigReader
    model: ModelFactory
    gguf: str | None = None  # the GGUF architecture converted into it (checkpoints/gguf/arch.py)
