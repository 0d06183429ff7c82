"""What pdserve does not implement is refused at load, and the error names the field
or tensor; nothing in a config or a checkpoint is silently ignored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM
from pdserve.model.arch.registry import arch_from_config, load_arch
from tests.test_config_conformance import BASE, make_checkpoint


def _set(**fields: Any):
    def edit(cfg: dict[str, Any]) -> None:
        cfg.update(fields)

    return edit


def _rope(params: dict[str, Any]):
    return _set(rope_parameters={"rope_theta": 10000.0, **params})


# name -> (family, config.json edit, text the error must contain)
REFUSED_CONFIGS: dict[str, tuple[str, Any, str]] = {
    "rope-type": ("Llama", _rope({"rope_type": "proportional", "factor": 4.0}), "rope_type"),
    # a key the rope type does not read, one it needs and lacks
    "yarn-foreign-key": (
        "Llama",
        _rope({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}),
        "rope_parameters.low_freq_factor",
    ),
    "dynamic-no-factor": ("Llama", _rope({"rope_type": "dynamic"}), "rope_parameters.factor"),
    "longrope-no-factors": ("Qwen2", _rope({"rope_type": "longrope"}), "short_factor"),
    "partial-rotary": ("Llama", _set(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "activation": ("Llama", _set(hidden_act="mish"), "hidden_act"),
    "quantized": (
        "Llama",
        _set(quantization_config={"quant_method": "gptq", "bits": 4}),
        "quantization_config",
    ),
    "softcap": ("Llama", _set(final_logit_softcapping=30.0), "final_logit_softcapping"),
    "llama-window": ("Llama", _set(sliding_window=8), "sliding_window"),
    "mistral-mlp-bias": ("Mistral", _set(mlp_bias=True), "mlp_bias"),
    "qwen3-unknown-layer": (
        "Qwen3",
        _set(layer_types=["chunked_attention", "full_attention"]),
        "layer_types",
    ),
    "qwen2-sliding-without-window": (
        "Qwen2",
        _set(use_sliding_window=False, layer_types=["sliding_attention"] * 2),
        "layer_types",
    ),
    "interleaved-rope": ("Llama", _set(rope_interleaved=True), "rope_interleaved"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refusals")


_BASES: dict[tuple[Path, str], Path] = {}


def _variant(root: Path, name: str, family: str, edit) -> Path:
    """A copy of one transformers-made checkpoint per family, config.json edited."""
    key = (root, family)
    if key not in _BASES:
        _BASES[key] = make_checkpoint(root, f"base-{family}", family)
    path = root / name
    shutil.copytree(_BASES[key], path)
    data = json.loads((path / "config.json").read_text())
    edit(data)
    (path / "config.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_config_field_refused_by_name(root: Path, case: str) -> None:
    family, edit, needle = REFUSED_CONFIGS[case]
    path = _variant(root, case, family, edit)
    with pytest.raises(ValueError, match=needle) as err:
        LLM(path, max_total_tokens=256, max_context=64)
    assert "config.json" in str(err.value)


def _rewrite_tensors(path: Path, edit) -> Path:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def test_untied_head_missing_is_named(root: Path) -> None:
    path = make_checkpoint(root, "untied", "Llama", tie_word_embeddings=False)
    _rewrite_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"'lm_head\.weight'.*tie_word_embeddings"):
        LLM(path, max_total_tokens=256, max_context=64)


def test_missing_tensor_is_named(root: Path) -> None:
    path = make_checkpoint(root, "missing", "Qwen2")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        LLM(path, max_total_tokens=256, max_context=64)


def test_unused_tensors_are_named(root: Path) -> None:
    """An o_proj bias the config does not announce would be dropped: refused instead."""
    path = make_checkpoint(root, "unused", "Llama")

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(BASE["hidden_size"])
        t["model.layers.2.mlp.down_proj.weight"] = torch.ones(2, 2)

    _rewrite_tensors(path, add)
    with pytest.raises(ValueError, match=r"o_proj\.bias.*layers\.2\.mlp") as err:
        LLM(path, max_total_tokens=256, max_context=64)
    assert "2 tensor(s)" in str(err.value)


def test_tensor_shape_that_contradicts_the_config_is_named(root: Path) -> None:
    """head_dim in config.json says 16 per head; the checkpoint was made with 24."""
    path = make_checkpoint(root, "head-dim", "Llama", head_dim=24)
    data = json.loads((path / "config.json").read_text())
    data["head_dim"] = 16
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight'.*\(64, 64\)"
    ):
        LLM(path, max_total_tokens=256, max_context=64)


def test_tied_head_copy_that_differs_is_refused(root: Path) -> None:
    path = make_checkpoint(root, "tied-copy", "Llama", tie_word_embeddings=True)
    _rewrite_tensors(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1})
    )
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        LLM(path, max_total_tokens=256, max_context=64)


def _cfg(**fields: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], **BASE, **fields}


def test_rope_theta_in_both_layouts() -> None:
    """The transformers-5 layout keeps rope_theta inside rope_parameters (the SmolLM2 bug)."""
    new = _cfg(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert arch_from_config(new).rope_theta == 100000.0
    assert arch_from_config(new).rope_scaling is None
    old = _cfg(rope_theta=500000.0, rope_scaling=None)
    assert arch_from_config(old).rope_theta == 500000.0
    assert arch_from_config(_cfg()).rope_theta == 10000.0
    llama3 = _cfg(rope_theta=5.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0})  # fmt: skip
    arch = arch_from_config(llama3)
    assert arch.rope_theta == 5.0
    assert arch.rope_scaling is not None
    assert arch.rope_scaling["original_max_position_embeddings"] == BASE["max_position_embeddings"]


def test_transformers_defaults_for_absent_fields() -> None:
    """A field absent from config.json takes the transformers config class default."""
    bare = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads",)}
    mistral = arch_from_config({"architectures": ["MistralForCausalLM"], **bare})
    assert mistral.num_kv_heads == 8 and mistral.layer_windows == (4096, 4096)
    qwen3 = arch_from_config({"architectures": ["Qwen3ForCausalLM"], **bare})
    assert qwen3.head_dim == 128 and qwen3.layer_windows == (0, 0)
    llama = arch_from_config({"architectures": ["LlamaForCausalLM"], **bare})
    assert llama.num_kv_heads == BASE["num_attention_heads"] and llama.head_dim == 16


def test_arch_matches_transformers_config_object(root: Path) -> None:
    """pdserve's reading of a saved config agrees with transformers' own config object."""
    import transformers

    path = make_checkpoint(
        root, "q2", "Qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=1
    )
    hf = transformers.AutoConfig.from_pretrained(path)
    arch = load_arch(path)
    want = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert arch.layer_windows == want == (0, 9)
    assert arch.rope_theta == hf.rope_parameters["rope_theta"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_unknown_fields_are_logged_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pdserve.model.arch.config"):
        arch_from_config(_cfg(some_new_knob=3, use_cache=True))
    assert "some_new_knob" in caplog.text and "use_cache" not in caplog.text


def test_a_model_that_is_not_there_is_refused_by_name(tmp_path):
    """--model names a folder, a GGUF file or a built-in name; anything else is refused
    up front (not passed on for a library to fail on with 'No such file')."""
    import subprocess
    import sys

    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.server.tokenizer import Tokenizer

    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no such folder or GGUF file, and not a built-in"):
        resolve_model(str(missing))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(tmp_path)  # a folder, but not a model's
    for model, why in ((missing, "no such folder or GGUF file"), (tmp_path, "no tokenizer.json")):
        cmd = [sys.executable, "-m", "pdserve.server.serve_cli", "decode", "--model", str(model),
               "--port", "0"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert (
            out.stderr.startswith(f"pdserve decode: {model}")
            or "pdserve decode: model" in out.stderr
        )
        assert why in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("flags", "why"),
    [(["--page-size", "0"], "page_size (--page-size) must be >= 1, got 0"),
     (["--max-total-tokens", "-5"], "max_total_tokens (--max-total-tokens) must be >= 1, got -5"),
     (["--max-running-requests", "0"], "max_running_requests (--max-running-requests) must be >= 1"),
     (["--num-threads", "-1"], "num_threads (--num-threads) must be >= 0, got -1"),
     (["--device", "tpu"], "device must be cpu, cuda or cuda:N, got 'tpu'"),
     (["--dtype", "int8"], "dtype must be one of float32, bfloat16, float16, got 'int8'")],
)  # fmt: skip
def test_engine_flags_that_cannot_work_are_refused_at_start(tmp_path, flags, why):
    """A page size of 0 divided by zero in the engine; 0 rows or 0 KV pages started a
    server that could serve nothing. Each is refused before anything starts."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pdserve.server.serve_cli", "decode", "--model", str(tmp_path),
           "--port", "0", *flags]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.startswith("pdserve decode: ") and why in out.stderr
