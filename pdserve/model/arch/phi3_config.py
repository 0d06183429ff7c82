"""How `Phi3ForCausalLM` (Phi-3, Phi-3.5-mini, Phi-4-mini) reads its config.json, as
transformers 5's Phi3Config does (a field absent takes that class's default).

What differs from the Llama family (arch/rules.py):

    rope                 `default` or `longrope` (`su` and `yarn` are read as longrope, as
                         Phi3Config converts them); `original_max_position_embeddings` at
                         the top level (default 4096) is the one longrope switches at
    partial_rotary_factor  a head's first int(head_dim * factor) values turn (Phi-4-mini)
    sliding_window       on every layer where set (default none)
    checkpoint           qkv_proj and gate_up_proj fused (arch/phi3.py)
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.model.arch import rules
from pdserve.model.arch.config import ModelArch
from pdserve.model.arch.rules import FULL, SLIDING, refuse
from pdserve.model.layers.activations import ACTIVATIONS

log = logging.getLogger(__name__)

PHI3 = "Phi3ForCausalLM"
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 4096,
}
ORIGINAL_DEFAULT = 4096
_READ = frozenset({*_DEFAULTS, "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                   "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
                   "partial_rotary_factor", "original_max_position_embeddings",
                   "sliding_window", "layer_types"})  # fmt: skip
_INERT = frozenset({"resid_pdrop", "embd_pdrop"})  # dropout: training only


def read_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    """ModelArch of a Phi-3 config.json; raises UnsupportedConfig naming the field for
    what pdserve does not compute."""
    rules.refuse_foreign_fields(cfg, read=_READ)
    if unread := rules.unread_fields(cfg, known=_READ | _INERT):
        log.warning("config.json fields pdserve does not read: %s", ", ".join(unread))
    n = {k: _int(cfg, k) for k in _DEFAULTS}
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"implemented: {', '.join(sorted(ACTIVATIONS))}")
    heads, layers = n["num_attention_heads"], n["num_hidden_layers"]
    head_dim = int(cfg.get("head_dim") or n["hidden_size"] // heads)
    theta, scaling = rules.rope(_rope_view(cfg), n["max_position_embeddings"], partial_ok=True)
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind not in ("default", "longrope"):
        raise refuse("rope_parameters.rope_type", kind, "Phi3Config takes default or longrope")
    if scaling is not None and len(scaling["short_factor"]) != rules.rotary_dim(cfg, head_dim) // 2:
        raise refuse("rope_parameters.short_factor", "...", "needs one value per rotated pair")
    if scaling is not None and len(scaling["long_factor"]) != len(scaling["short_factor"]):
        raise refuse("rope_parameters.long_factor", "...", "needs one value per rotated pair")
    kv = cfg.get("num_key_value_heads")
    return ModelArch(
        architecture=PHI3,
        vocab_size=n["vocab_size"],
        hidden_size=n["hidden_size"],
        intermediate_size=n["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if kv is None else int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        hidden_act=act,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=n["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        layer_windows=_windows(cfg, layers),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        rotary_dim=rules.rotary_dim(cfg, head_dim),
        eos_token_ids=eos_token_ids,
    )


def _rope_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg as rules.rope reads it: `su`/`yarn` renamed longrope, the top-level original
    context (always set on a Phi3Config) in place."""
    view = dict(cfg)
    view.setdefault("original_max_position_embeddings", ORIGINAL_DEFAULT)
    for key in ("rope_scaling", "rope_parameters"):
        params = view.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in (
            "su",
            "yarn",
        ):
            view[key] = {**params, "rope_type": "longrope"}
            view[key].pop("type", None)
    return view


def _windows(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise refuse("sliding_window", window, "expected a positive integer or null")
    types = cfg.get("layer_types")
    if types is not None and set(types) != {SLIDING if window else FULL}:
        raise refuse("layer_types", types, "Phi-3 uses one attention on every layer")
    return tuple([window or 0] * layers)


def _int(cfg: dict[str, Any], field: str) -> int:
    value = cfg.get(field, _DEFAULTS[field])
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise refuse(field, value, "expected a positive integer")
    return value


def rekey_length(arch: ModelArch) -> int | None:
    """The position at which a decode rebuilds its request's keys (scheduler/rekey.py),
    or None: Phi3ForCausalLM.generate (transformers 5) drops its cache when the sequence
    first passes longrope's original context and runs it whole again, so every
    position is turned by the long factors from that step on."""
    s = arch.rope_scaling
    if arch.architecture != PHI3 or not s or s.get("rope_type") != "longrope":
        return None
    return int(s["original_max_position_embeddings"])
