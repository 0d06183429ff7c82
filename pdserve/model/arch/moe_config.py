"""How the mixture-of-experts architectures read their config.json, as transformers 5's
config classes do (a field absent takes that class's default).

    Qwen2MoeForCausalLM   Qwen2's attention (q/k/v bias: `qkv_bias`, default true); every
                          sparse layer has a shared expert scaled by sigmoid(its gate)
    Qwen3MoeForCausalLM   Qwen3's attention (per-head q/k RMSNorm, `attention_bias`)
    MixtralForCausalLM    Mistral's attention; the top-k weights always renormalised
    OlmoeForCausalLM      q/k RMSNorm over the whole projection, `clip_qkv`

A layer is sparse when the config has experts, `(layer + 1) % decoder_sparse_step == 0`
and the layer is not in `mlp_only_layers` (Qwen); the others run a dense MLP of
`intermediate_size`. Routing (model/moe.py): softmax over the experts in float32, top
`num_experts_per_tok`, divided by their sum where `norm_topk_prob` (Mixtral: always).

Refused by name: a sliding window (`use_sliding_window`) on the Qwen MoE families,
anything else the model classes would compute that is not implemented here.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.model.arch import rules
from pdserve.model.arch.config import ModelArch, MoeSpec
from pdserve.model.arch.rules import FULL, refuse
from pdserve.model.layers.activations import ACTIVATIONS

log = logging.getLogger(__name__)

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
MIXTRAL, OLMOE = "MixtralForCausalLM", "OlmoeForCausalLM"
MOE_ARCHS = (QWEN2_MOE, QWEN3_MOE, MIXTRAL, OLMOE)
MODEL_TYPES = {"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "olmoe": OLMOE}


# each family's defaults (transformers 5's config classes)
_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_MOE: dict(intermediate_size=5632, num_key_value_heads=16, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, num_experts=60, num_experts_per_tok=4,
                    moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
    QWEN3_MOE: dict(intermediate_size=6144, num_key_value_heads=4, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
                    moe_intermediate_size=768),
    MIXTRAL: dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2),
    OLMOE: dict(intermediate_size=2048, num_key_value_heads=None, max_position_embeddings=4096,
                rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=8),
}  # fmt: skip

_READ = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers", "qkv_bias", "clip_qkv", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types",
})  # fmt: skip
# training-only: the router's auxiliary loss, its jitter (off in eval), its logits output
_INERT = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})


def read_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    """ModelArch of a mixture-of-experts config.json; raises UnsupportedConfig naming the
    field for what pdserve does not compute."""
    arch = str((cfg.get("architectures") or [MODEL_TYPES[cfg["model_type"]]])[0])
    d = _DEFAULTS[arch]
    rules.refuse_foreign_fields(cfg, read=_READ)
    if unread := rules.unread_fields(cfg, known=_READ | _INERT):
        log.warning("config.json fields pdserve does not read: %s", ", ".join(unread))
    heads, hidden = _int(cfg, "num_attention_heads", None), _int(cfg, "hidden_size", None)
    layers = _int(cfg, "num_hidden_layers", None)
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"implemented: {', '.join(sorted(ACTIVATIONS))}")
    max_pos = _int(cfg, "max_position_embeddings", d["max_position_embeddings"])
    theta, scaling = rules.rope(cfg, max_pos)
    kv = cfg.get("num_key_value_heads", d["num_key_value_heads"])
    attn_bias = bool(cfg.get("attention_bias", False))
    if arch == QWEN2_MOE:
        qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
    elif arch == MIXTRAL:
        if attn_bias:
            raise refuse("attention_bias", True, f"{arch} has no attention bias in transformers")
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = attn_bias
    return ModelArch(
        architecture=arch,
        vocab_size=_int(cfg, "vocab_size", None),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if kv is None else int(kv),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", d["rms_norm_eps"])),
        hidden_act=act,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=False,
        qk_norm=arch in (QWEN3_MOE, OLMOE),
        layer_windows=_windows(arch, cfg, layers),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        clip_qkv=_clip(arch, cfg),
        moe=moe_spec(arch, cfg, layers),
        eos_token_ids=eos_token_ids,
    )


def moe_spec(arch: str, cfg: dict[str, Any], layers: int) -> MoeSpec:
    d = _DEFAULTS[arch]
    names = [n for n in ("num_experts", "num_local_experts") if cfg.get(n) is not None]
    experts = _int(cfg, names[0], None) if names else d["num_experts"]
    if len(names) == 2 and cfg[names[0]] != cfg[names[1]]:
        raise refuse(names[1], cfg[names[1]], f"differs from {names[0]} = {cfg[names[0]]}")
    top_k = _int(cfg, "num_experts_per_tok", d["num_experts_per_tok"])
    if top_k > experts:
        raise refuse("num_experts_per_tok", top_k, f"more than the {experts} experts")
    sparse = [True] * layers
    if arch in (QWEN2_MOE, QWEN3_MOE):
        step = _int(cfg, "decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise refuse("mlp_only_layers", only, "expected a list of layer indices")
        sparse = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    elif cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        field = (
            "decoder_sparse_step" if cfg.get("decoder_sparse_step", 1) != 1 else "mlp_only_layers"
        )
        raise refuse(field, cfg[field], f"{arch} has experts in every layer in transformers")
    if arch in (MIXTRAL, OLMOE):  # their experts are intermediate_size wide
        expert_size = _int(cfg, "intermediate_size", d["intermediate_size"])
    else:
        expert_size = _int(cfg, "moe_intermediate_size", d["moe_intermediate_size"])
    shared = 0
    if arch == QWEN2_MOE:
        shared = _int(cfg, "shared_expert_intermediate_size", d["shared_expert_intermediate_size"])
    elif cfg.get("shared_expert_intermediate_size"):
        field = "shared_expert_intermediate_size"
        raise refuse(field, cfg[field], f"{arch} has no shared expert in transformers")
    norm = arch == MIXTRAL or bool(cfg.get("norm_topk_prob", False))
    if arch == MIXTRAL and cfg.get("norm_topk_prob") is False:
        raise refuse("norm_topk_prob", False, "Mixtral always renormalises the top-k weights")
    return MoeSpec(experts, top_k, norm, expert_size, shared, tuple(sparse))


def _windows(arch: str, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Mixtral: `sliding_window` (default none) on every layer; the others: none."""
    if arch == MIXTRAL:
        window = cfg.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise refuse("sliding_window", window, "expected a positive integer or null")
        types = cfg.get("layer_types")
        if types is not None and set(types) != {rules.SLIDING if window else FULL}:
            raise refuse("layer_types", types, f"{arch} uses one attention on every layer")
        return tuple([window or 0] * layers)
    if cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window", True, f"sliding windows of {arch} are not implemented")
    if arch == OLMOE and cfg.get("sliding_window"):
        raise refuse("sliding_window", cfg["sliding_window"], f"{arch} has no sliding window")
    types = cfg.get("layer_types")
    if types is not None and any(t != FULL for t in types):
        raise refuse("layer_types", types, f"only {FULL} is implemented for {arch}")
    return tuple([0] * layers)


def _clip(arch: str, cfg: dict[str, Any]) -> float | None:
    clip = cfg.get("clip_qkv")
    if clip is None:
        return None
    if arch != OLMOE:
        raise refuse("clip_qkv", clip, f"{arch} does not clip q/k/v in transformers")
    if not isinstance(clip, int | float) or isinstance(clip, bool) or clip <= 0:
        raise refuse("clip_qkv", clip, "expected a positive number or null")
    return float(clip)


def _int(cfg: dict[str, Any], field: str, default: int | None) -> int:
    value = cfg.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise refuse(field, value, "expected a positive integer")
    return value
