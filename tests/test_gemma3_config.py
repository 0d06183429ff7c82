"""A Gemma 3 config.json read as transformers' Gemma3TextConfig reads it, field by field,
or refused naming the field; Gemma's norm and embedding scale in bfloat16 bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM
from pdserve.model.arch.gemma3 import gemma_rms_norm
from pdserve.model.arch.registry import arch_from_config, load_arch
from pdserve.model.arch.rules import UnsupportedConfig
from tests.test_config_conformance import BASE

S, F = "sliding_attention", "full_attention"
SMALL = {**BASE, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 6}


def _saved(root: Path, name: str, edit: dict[str, Any] | None = None, **kw: Any) -> Path:
    """config.json as transformers writes it, then keys set (None deletes)."""
    import transformers

    path = root / name
    transformers.Gemma3TextConfig(**{**SMALL, **kw}).save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data["architectures"] = ["Gemma3ForCausalLM"]
    for key, value in (edit or {}).items():
        data.pop(key) if value is None else data.__setitem__(key, value)
    (path / "config.json").write_text(json.dumps(data))
    return path


OLD_ROPE = {"rope_parameters": None, "rope_theta": 3e5, "rope_local_base_freq": 77.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
# name -> (Gemma3TextConfig kwargs, config.json edit)
READ_LIKE_TRANSFORMERS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "defaults": ({}, None),
    "layer-types": (dict(layer_types=[F, S, S, F], query_pre_attn_scalar=40), None),
    "pattern": ({}, {"layer_types": None, "sliding_window_pattern": 3}),
    "pattern-default": ({"num_hidden_layers": 7}, {"layer_types": None}),
    "old-rope-layout": ({}, OLD_ROPE),
    "rope-per-type": (
        dict(
            rope_parameters={
                F: {
                    "rope_type": "llama3",
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 2.0,
                    "rope_theta": 1e4,
                },
                S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 99.0},
            }
        ),
        None,
    ),  # fmt: skip
    "softcap-bias-act": (
        dict(final_logit_softcapping=30.0, attention_bias=True, hidden_activation="silu"),
        {"hidden_act": "relu"},  # not read by Gemma 3 (hidden_activation is)
    ),
}


@pytest.mark.parametrize("case", list(READ_LIKE_TRANSFORMERS))
def test_fields_read_like_transformers(tmp_path: Path, case: str) -> None:
    import transformers

    kw, edit = READ_LIKE_TRANSFORMERS[case]
    path = _saved(tmp_path, case, edit, **kw)
    hf = transformers.AutoConfig.from_pretrained(path)
    arch = load_arch(path)
    windows = tuple(hf.sliding_window if t == S else 0 for t in hf.layer_types)
    assert arch.layer_windows == windows
    for i, t in enumerate(hf.layer_types):
        params = dict(hf.rope_parameters[t])
        theta, scaling = arch.layer_rope(i)
        assert theta == params.pop("rope_theta"), (i, t)
        if params["rope_type"] == "default":
            assert scaling is None
        else:
            assert scaling == params, (i, t)
    assert arch.attention_scale == hf.query_pre_attn_scalar**-0.5
    assert arch.head_dim == hf.head_dim and arch.hidden_act == hf.hidden_activation
    assert arch.final_logit_softcapping == hf.final_logit_softcapping
    assert arch.qkv_bias == arch.o_bias == hf.attention_bias
    assert arch.tie_word_embeddings == hf.tie_word_embeddings
    assert arch.max_position_embeddings == hf.max_position_embeddings


def test_absent_fields_take_gemma3_defaults() -> None:
    arch = arch_from_config({"model_type": "gemma3_text"})  # no architectures: the model type
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.hidden_size, arch.num_layers, arch.head_dim) == (2304, 26, 256)
    assert arch.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 4096 for i in range(26))
    assert arch.rope_theta == 1e6 and arch.sliding_rope == (1e4, None)
    assert arch.attention_scale == 256**-0.5 and arch.tie_word_embeddings


def _cfg(**fields: Any) -> dict[str, Any]:
    return {"architectures": ["Gemma3ForCausalLM"], **SMALL, **fields}


# name -> (config.json fields, the field the error must name)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "attn-softcap": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "chunked-layer": ({"layer_types": [S, "chunked_attention", S, F]}, "layer_types"),
    "layer-count": ({"layer_types": [S, F]}, "layer_types"),
    "no-window": ({"sliding_window": None, "layer_types": [S, F, S, F]}, "sliding_window"),
    "sliding-yarn-foreign-key": (
        {"rope_parameters": {S: {"rope_type": "yarn", "factor": 2.0, "low_freq_factor": 1}, F: {}}},
        "rope_parameters.sliding_attention.low_freq_factor",
    ),
    "flat-rope": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
        "rope_parameters",
    ),
    "activation": ({"hidden_activation": "mish"}, "hidden_activation"),
    "partial-rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "pattern-zero": ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    "quantized": ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    "softcap-zero": ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_naming_the_field(case: str) -> None:
    fields, needle = REFUSED[case]
    cfg = {k: v for k, v in _cfg(**fields).items() if v is not None or k == "sliding_window"}
    with pytest.raises(UnsupportedConfig, match=f"`{needle}`"):
        arch_from_config(cfg)


def test_refusal_reaches_the_user_naming_config_json(tmp_path: Path) -> None:
    path = _saved(tmp_path, "refused", {"attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="attn_logit_softcapping") as err:
        LLM(path, max_total_tokens=256, max_context=64)
    assert "config.json" in str(err.value)


def test_norm_and_embedding_scale_bit_for_bit_in_bfloat16() -> None:
    """Gemma scales by (1 + weight) in float32 before the cast (Llama casts first), and
    sqrt(hidden) is rounded to the weights' dtype: both exactly transformers' modules."""
    import transformers.models.gemma3.modeling_gemma3 as g3

    g = torch.Generator().manual_seed(0)
    norm = g3.Gemma3RMSNorm(640, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(640, generator=g) * 0.5)
    x = (torch.randn(5, 640, generator=g) * 3).to(torch.bfloat16)
    ours = gemma_rms_norm(x, 1.0 + norm.weight.float(), 1e-6)
    assert torch.equal(ours, norm(x))
    emb = g3.Gemma3TextScaledWordEmbedding(32, 640, 0, embed_scale=640**0.5).to(torch.bfloat16)
    ids = torch.arange(32)
    scale = torch.tensor(640**0.5).to(torch.bfloat16)  # what Gemma3Model multiplies by
    assert torch.equal(torch.nn.functional.embedding(ids, emb.weight) * scale, emb(ids))
    assert float(scale) == 25.25  # not sqrt(640) = 25.30: the rounding matters


def test_fingerprint_names_what_differs_per_layer() -> None:
    """A prefill and a decode whose layers differ only in one window or in the sliding
    layers' rope refuse each other, and the message says so in words."""
    import dataclasses

    from pdserve.kvcache.pools import KVLayout
    from pdserve.transfer.identity import describe_mismatch, model_fingerprint

    arch = arch_from_config(_cfg(layer_types=[S, S, S, F]))
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, "float32", 16)
    base = model_fingerprint(arch, layout)
    assert "layers=3x(w6,r10000)+1x(full,r1e+06)" in base
    one = dataclasses.replace(arch, layer_windows=(6, 6, 7, 0))
    rope = dataclasses.replace(arch, sliding_rope=(20.0, None))
    for other, part in ((one, "2x(w6,r10000)+1x(w7,r10000)"), (rope, "3x(w6,r20)")):
        msg = describe_mismatch(model_fingerprint(other, layout), base)
        assert msg.startswith("layers: decode ") and part in msg, msg


def test_unknown_fields_are_logged_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pdserve.model.arch.gemma3_config"):
        arch_from_config(_cfg(some_new_knob=3, use_cache=True, hidden_act="silu"))
    assert "some_new_knob" in caplog.text
    assert "use_cache" not in caplog.text and "hidden_act" not in caplog.text
