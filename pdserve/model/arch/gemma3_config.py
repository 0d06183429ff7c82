"""How `Gemma3ForCausalLM` (model_type `gemma3_text`) reads its config.json, as
transformers 5's Gemma3TextConfig does.

A field absent from config.json takes that class's default. What differs from the
Llama family (pdserve.model.arch.rules):

    layer_types      per layer "sliding_attention" or "full_attention"; absent: every
                     `sliding_window_pattern`-th layer (default 6th) is full, the rest slide
    rope             one rope per layer type: `rope_parameters` = {"full_attention": {...},
                     "sliding_attention": {...}}, or the older top-level `rope_theta`
                     (full layers, default 1e6), `rope_local_base_freq` (sliding layers,
                     default 1e4) and `rope_scaling` (full layers only)
    attention scale  query_pre_attn_scalar ** -0.5 (default 256), not head_dim ** -0.5
    activation       `hidden_activation` (transformers' Gemma 3 never reads `hidden_act`)

Refused by name: `attn_logit_softcapping` when set (transformers' Gemma 3 attention does
not pass it to any attention function, so what the checkpoint meant is not known),
`use_bidirectional_attention`, and any layer type or rope the backends do not compute.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.model.arch import rules
from pdserve.model.arch.config import ModelArch
from pdserve.model.arch.rules import FULL, SLIDING, refuse
from pdserve.model.layers.activations import ACTIVATIONS

log = logging.getLogger(__name__)

GEMMA3 = "Gemma3ForCausalLM"

# Gemma3TextConfig's defaults
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
}
_THETA = {FULL: ("rope_theta", 1_000_000.0), SLIDING: ("rope_local_base_freq", 10_000.0)}
PATTERN_DEFAULT = 6

_READ = frozenset({
    *_DEFAULTS, "query_pre_attn_scalar", "hidden_activation", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_scaling", "rope_theta", "rope_local_base_freq", "partial_rotary_factor",
    "attention_bias", "sliding_window", "sliding_window_pattern", "layer_types",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
})  # fmt: skip
# not read by transformers' Gemma 3 either: `hidden_act` (it reads hidden_activation),
# `_sliding_window_pattern` (what save_pretrained writes; loading reads the name without
# the underscore, and layer_types is saved beside it)
_INERT = frozenset(
    {"hidden_act", "_sliding_window_pattern", "attention_dropout", "is_encoder_decoder"}
)


def read_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    return ModelArch(**arch_fields(cfg), eos_token_ids=eos_token_ids)


def arch_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's fields (all but eos_token_ids) of a Gemma 3 config.json; raises
    UnsupportedConfig naming the field for what pdserve does not compute."""
    rules.refuse_foreign_fields(cfg, read=_READ)
    if unread := rules.unread_fields(cfg, known=_READ | _INERT):
        log.warning("config.json fields pdserve does not read: %s", ", ".join(unread))
    if cfg.get("attn_logit_softcapping") is not None:
        raise refuse(
            "attn_logit_softcapping",
            cfg["attn_logit_softcapping"],
            "transformers' Gemma 3 attention does not apply it, so its meaning is ambiguous",
        )
    if cfg.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", True, "only causal attention is implemented")
    n = {k: _int(cfg, k) for k in _DEFAULTS}
    act = str(cfg.get("hidden_activation", "gelu_pytorch_tanh"))
    if act not in ACTIVATIONS:
        raise refuse("hidden_activation", act, f"implemented: {', '.join(sorted(ACTIVATIONS))}")
    windows = layer_windows(cfg, n["num_hidden_layers"])
    full, sliding = ropes(cfg, n["max_position_embeddings"])
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        architecture=GEMMA3,
        vocab_size=n["vocab_size"],
        hidden_size=n["hidden_size"],
        intermediate_size=n["intermediate_size"],
        num_layers=n["num_hidden_layers"],
        num_heads=n["num_attention_heads"],
        num_kv_heads=n["num_key_value_heads"],
        head_dim=n["head_dim"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        rope_theta=full[0],
        rope_scaling=full[1],
        max_position_embeddings=n["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        layer_windows=windows,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar", 256),
        sliding_rope=sliding if sliding != full else None,
        final_logit_softcapping=_positive(cfg, "final_logit_softcapping", None),
    )


def _int(cfg: dict[str, Any], field: str) -> int:
    value = cfg.get(field, _DEFAULTS[field])
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise refuse(field, value, "expected a positive integer")
    return value


def _positive(cfg: dict[str, Any], field: str, default: float | None) -> float | None:
    value = cfg.get(field, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise refuse(field, value, "expected a positive number")
    return float(value)


def layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Per layer: 0 (full causal attention) or the sliding window W (the query at p sees
    keys p-W+1 .. p, transformers' `kv_idx > q_idx - sliding_window`)."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", PATTERN_DEFAULT)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise refuse("sliding_window_pattern", pattern, "expected a positive integer")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise refuse("layer_types", types, f"need a list of one entry per layer ({num_layers})")
    window = cfg.get("sliding_window", 4096)
    out = []
    for t in types:
        if t not in (FULL, SLIDING):
            raise refuse("layer_types", types, f"layer type {t!r} is not implemented")
        if t == SLIDING and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise refuse("sliding_window", window, "sliding layers need a positive integer")
        out.append(window if t == SLIDING else 0)
    return tuple(out)


Rope = tuple[float, dict[str, Any] | None]


def ropes(cfg: dict[str, Any], max_positions: int) -> tuple[Rope, Rope]:
    """(full-attention rope, sliding-attention rope), each (theta, scaling or None), as
    Gemma3TextConfig.convert_rope_params_to_dict and standardize_rope_params build them."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = {SLIDING: {"rope_type": "default"}, FULL: {"rope_type": "default"}}
    if not isinstance(params, dict) or not set(params) <= {FULL, SLIDING}:
        raise refuse("rope_parameters", params, f"expected a dict keyed by {FULL}, {SLIDING}")
    per_type = {t: dict(params.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
    legacy = cfg.get("rope_scaling")
    if legacy is not None:  # the older layout's scaling is the full-attention layers'
        if not isinstance(legacy, dict):
            raise refuse("rope_scaling", legacy, "expected a dict")
        per_type[FULL].update(legacy)
    out = []
    for t in (FULL, SLIDING):
        field, default = _THETA[t]
        per_type[t].setdefault("rope_theta", cfg.get(field, default))
        flat = {"rope_parameters": per_type[t], "partial_rotary_factor": None}
        flat["partial_rotary_factor"] = cfg.get("partial_rotary_factor")
        out.append(rules.rope(flat, max_positions, where=f"rope_parameters.{t}"))
    return out[0], out[1]
