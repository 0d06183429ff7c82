"""A `gemma3` GGUF file read as transformers' GGUF loader reads it (an arch.ARCHES entry).

transformers maps the metadata onto Gemma3TextConfig (integrations/ggml.py): head_dim
from attention.key_length, sliding_window from attention.sliding_window, the full
layers' rope_theta from rope.freq_base; everything else keeps the config class's
default (layer_types every 6th layer full, rope_local_base_freq 1e4,
query_pre_attn_scalar 256, gelu_pytorch_tanh). llama.cpp stores every RMSNorm weight as
1 + weight; transformers subtracts the 1 again (Gemma2TensorProcessor) and Gemma3RMSNorm
adds it back in float32, so the converted folder holds weight - 1 as well.

Where llama.cpp would compute something else than those defaults, the file is refused
by name rather than served one way or the other: a local rope base other than 1e4, a
layer pattern key, or a head size other than 256 (llama.cpp then scales attention by
1/sqrt(head size), or by the 27B's own rule; transformers by 1/sqrt(256)).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdserve.checkpoints.gguf.error import GGUFError

if TYPE_CHECKING:
    import numpy as np

HF_ARCHITECTURE, MODEL_TYPE = "Gemma3ForCausalLM", "gemma3_text"
QUERY_PRE_ATTN_SCALAR = 256  # Gemma3TextConfig's default, which the loader keeps
BLOCK_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # Llama's post-attention norm
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
IMPLEMENTED_KEYS = frozenset({"attention.sliding_window"})


def value_fix(name: str, w: np.ndarray) -> np.ndarray:
    """The Hugging Face value of GGUF tensor `name` (float32)."""
    return w - 1 if name.endswith("norm.weight") else w


def config_fix(meta: Mapping[str, Any], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json fields beyond the dense-decoder ones, as Gemma3TextConfig reads them."""
    swa_base = meta.get(f"{arch}.rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != 10_000.0:
        raise GGUFError(
            f"key {arch}.rope.freq_base_swa = {swa_base!r} (the sliding layers' rope base) "
            "is not supported: transformers' loader keeps 10000"
        )
    if f"{arch}.attention.sliding_window_pattern" in meta:
        value = meta[f"{arch}.attention.sliding_window_pattern"]
        raise GGUFError(
            f"key {arch}.attention.sliding_window_pattern = {value!r} is not supported: "
            "transformers' loader keeps every 6th layer full"
        )
    if cfg["head_dim"] != QUERY_PRE_ATTN_SCALAR:
        raise GGUFError(
            f"key {arch}.attention.key_length = {cfg['head_dim']} is not supported: the "
            "file does not say query_pre_attn_scalar, and llama.cpp's rule and "
            f"transformers' default ({QUERY_PRE_ATTN_SCALAR}) differ for it"
        )
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 1_000_000.0),
    }
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None:
        out["sliding_window"] = int(window)
    return out
