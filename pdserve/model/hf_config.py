"""The part of a Hugging Face `config.json` that the Llama-family models need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

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
    """Parse `config.json`; raises ValueError for a family pdserve does not serve."""
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    if not cfg:
        raise ValueError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    rope_theta = cfg.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
    return ModelArch(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=_eos_ids(cfg, model_dir),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )
