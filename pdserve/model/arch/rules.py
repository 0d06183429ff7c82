"""How each supported architecture reads its `config.json`, as transformers 5 does.

Every field that changes the computation is either read here (and ends up in
`ModelArch`) or refused with `UnsupportedConfig` naming the field. Fields that do
not change inference (dropout, initializer_range, use_cache, token ids, ...) are
not read. The per-architecture tables mirror the transformers config classes:
a field missing from config.json takes that class's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA, MISTRAL, QWEN2, QWEN3 = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# transformers' default when a field is absent from config.json
MAX_POSITIONS_DEFAULT = {LLAMA: 2048, MISTRAL: 131072, QWEN2: 32768, QWEN3: 32768}
KV_HEADS_DEFAULT: dict[str, int | None] = {LLAMA: None, MISTRAL: 8, QWEN2: 32, QWEN3: 32}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")  # others refused
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedConfig(ValueError):
    """config.json asks for a computation pdserve does not implement."""


def refuse(field: str, value: Any, why: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"config.json field `{field}` = {value!r}: {why}")


@dataclass(frozen=True)
class Biases:
    qkv: bool  # q_proj, k_proj, v_proj
    o: bool  # o_proj
    mlp: bool  # gate_proj, up_proj, down_proj


def biases(cfg: dict[str, Any], arch: str) -> Biases:
    """Llama: `attention_bias` adds q/k/v AND o biases, `mlp_bias` the MLP's.
    Qwen3: `attention_bias` as Llama, no mlp bias. Qwen2: q/k/v bias always, never o
    or mlp (its `attention_bias` is not read by transformers). Mistral: no biases."""
    attn = bool(cfg.get("attention_bias", False))
    mlp = bool(cfg.get("mlp_bias", False))
    if arch != LLAMA and mlp:
        raise refuse("mlp_bias", True, f"{arch} has no MLP bias in transformers")
    if arch == MISTRAL and attn:
        raise refuse("attention_bias", True, f"{arch} has no attention bias in transformers")
    if arch == QWEN2:
        return Biases(qkv=True, o=False, mlp=False)
    if arch == MISTRAL:
        return Biases(qkv=False, o=False, mlp=False)
    return Biases(qkv=attn, o=attn, mlp=mlp)


def head_dim(cfg: dict[str, Any], arch: str, hidden: int, heads: int) -> int:
    value = cfg.get("head_dim")
    if value is not None:
        return int(value)
    return 128 if arch == QWEN3 and "head_dim" not in cfg else hidden // heads


def kv_heads(cfg: dict[str, Any], arch: str, heads: int) -> int:
    value = cfg.get("num_key_value_heads", KV_HEADS_DEFAULT[arch])
    return int(value) if value is not None else heads


def rope(
    cfg: dict[str, Any],
    max_positions: int,
    where: str = "rope_parameters",
    partial_ok: bool = False,
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) where scaling is None for the default rope.

    transformers 5 reads `rope_scaling` (old layout) before `rope_parameters` (new
    layout); a `rope_theta` inside the dict wins over the top-level one, and 10000 is
    the default when neither has one. `where`: how refusals name the dict; `partial_ok`:
    the family rotates part of a head (partial_rotary_factor, read by `rotary_dim`)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise refuse(where, params, "expected a dict")
    if set(params) & {FULL, SLIDING}:
        raise refuse(where, params, "per-layer-type rope is not implemented")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise refuse(f"{where}.rope_type", kind, f"implemented: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if not partial_ok and partial is not None and float(partial) != 1.0:
        raise refuse(
            "partial_rotary_factor", partial, "partial rotary embeddings are not implemented"
        )
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise refuse(f"{where}.rope_theta", theta, "expected a positive number")
    if kind == "default":
        return float(theta), None
    skip = ("rope_theta", "type", "partial_rotary_factor")
    scaling = {k: v for k, v in params.items() if k not in skip}
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        # as transformers: a top-level value wins, else the dict's, else max_position_embeddings
        if "original_max_position_embeddings" in cfg:
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_positions)
    if kind in ("dynamic", "longrope"):  # dynamic's original context; longrope's default factor
        scaling["max_position_embeddings"] = max_positions
    for key in _NEED[kind]:
        if scaling.get(key) is None:
            raise refuse(f"{where}.{key}", None, f"required by rope_type {kind!r}")
    known = set(_NEED[kind]) | _OPTIONAL.get(kind, set()) | {"rope_type"}
    if kind in _OPTIONAL and (unknown := sorted(set(scaling) - known)):
        raise refuse(f"{where}.{unknown[0]}", scaling[unknown[0]], f"not read by {kind!r}")
    return float(theta), scaling


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The values of a head that rope turns: int(head_dim * partial_rotary_factor), even."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = 1.0 if partial is None else partial
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise refuse("partial_rotary_factor", partial, "expected a number in (0, 1]")
    dim = int(head_dim * factor)
    if dim % 2:
        raise refuse("partial_rotary_factor", partial, f"{dim} rotated values is not even")
    return dim


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_NEED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": LLAMA3_KEYS,
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# what else each type reads (rope_scaling.py); any other key is refused by name
_OPTIONAL: dict[str, set[str]] = {
    "yarn": {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"attention_factor", "factor", "max_position_embeddings"},
    "dynamic": set(),
}


def layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Per layer: 0 for full causal attention, W for a sliding window in which the
    query at position p sees keys p-W+1 .. p (transformers' `kv_idx > q_idx - W`)."""
    if arch in (QWEN2, QWEN3):
        return _qwen_windows(cfg, num_layers)
    window = cfg.get("sliding_window", 4096 if arch == MISTRAL else None)
    if arch == LLAMA:
        for field in ("sliding_window", "use_sliding_window"):
            if cfg.get(field):
                raise refuse(field, cfg[field], "LlamaForCausalLM has no sliding window")
        window = None
    types = cfg.get("layer_types")
    expected = SLIDING if window else FULL
    if types is not None and any(_norm_type(t) != expected for t in types):
        raise refuse("layer_types", types, f"{arch} uses {expected} on every layer")
    return tuple([_window_size(window)] * num_layers)


def _qwen_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    # Qwen2/Qwen3: the window exists only with use_sliding_window; explicit
    # layer_types win over max_window_layers (layers >= it slide)
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
    if len(types) != num_layers:
        raise refuse("layer_types", types, f"need one entry per layer ({num_layers})")
    out = []
    for t in types:
        kind = _norm_type(t)
        if kind not in (FULL, SLIDING):
            raise refuse("layer_types", types, f"layer type {t!r} is not implemented")
        if kind == SLIDING and window is None:
            raise refuse("layer_types", types, "sliding layers without use_sliding_window")
        out.append(_window_size(window) if kind == SLIDING else 0)
    return tuple(out)


def _norm_type(t: object) -> object:
    return FULL if t == "attention" else t  # transformers' legacy name


def _window_size(window: object) -> int:
    if window is None:
        return 0
    if not isinstance(window, int) or window < 1:
        raise refuse("sliding_window", window, "expected a positive integer or null")
    return window


# Fields of other architectures that change the computation when set; a config of
# a supported architecture that carries one of them with a non-neutral value is
# refused rather than served as if the field were absent.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "quantization_config": (None,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "rope_interleaved": (None, False),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "embedding_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),
    "no_rope_layers": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "attention_chunk_size": (None,),
}


def refuse_foreign_fields(cfg: dict[str, Any], read: frozenset[str] = frozenset()) -> None:
    """`read`: fields the architecture reads itself (not foreign to it)."""
    for field, neutral in _NEUTRAL.items():
        if field in cfg and field not in read and cfg[field] not in neutral:
            raise refuse(field, cfg[field], "not implemented for this architecture")


# Fields read above, and fields that do not change inference.
_READ = {
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "max_position_embeddings", "original_max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "eos_token_id", "torch_dtype", "dtype",
}  # fmt: skip
_INERT = {
    "model_type", "transformers_version", "_name_or_path", "bos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "attention_dropout", "pretraining_tp", "is_llama_config",
    "transformers.js_config", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
}  # fmt: skip


def unread_fields(cfg: dict[str, Any], known: frozenset[str] = frozenset()) -> list[str]:
    """Fields pdserve neither reads, refuses, nor knows to be inert (logged at load).
    `known`: the architecture's own read and inert fields."""
    skip = _READ | _INERT | _NEUTRAL.keys() | known
    return sorted(k for k in cfg if k not in skip)
