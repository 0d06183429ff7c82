"""GGUF file -> Hugging Face model folder (config.json, model.safetensors, tokenizer files).

The rest of pdserve serves Hugging Face folders, so a GGUF is converted once into
one: its tensors de-quantized to float32 with the `gguf` package (llama.cpp's own
reader), renamed to Hugging Face names, and with the Q/K row order restored;
config and tokenizer rebuilt from the file's metadata. `gguf_cache.py` caches the
folder. Anything the converter does not implement exactly is refused by name:
an architecture, a tensor type, a tensor, a metadata key that changes the
computation (rope scaling, sliding window, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.model import gguf_tokenizer

if TYPE_CHECKING:
    import gguf
    import torch

# general.architecture -> Hugging Face architecture
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name -> Hugging Face name, per block and global
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_EXTRA = {  # tensors only some architectures have
    "qwen2": {
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "qwen3": {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Metadata that would change the computation and that this converter does not implement.
# Key suffix (after "<arch>.") -> what it is.
_REFUSED_KEYS = {
    "rope.scaling.type": "rope scaling",
    "rope.scaling.factor": "rope scaling",
    "attention.sliding_window": "sliding window attention",
    "expert_count": "mixture of experts",
    "attention.clamp_kqv": "QKV clamping",
    "logit_scale": "logit scaling",
    "attention.value_length": "a value head size other than the key head size",
}


class GGUFError(ValueError):
    """A GGUF file pdserve cannot serve exactly; the message names what and why."""


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata key of the file with its Python value (arrays as lists)."""
    return {k: f.contents() for k, f in reader.fields.items()}


def _arch(meta: dict[str, Any]) -> str:
    arch = str(meta.get("general.architecture"))
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF general.architecture = {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _check_keys(meta: dict[str, Any], arch: str) -> None:
    for suffix, what in _REFUSED_KEYS.items():
        value = meta.get(f"{arch}.{suffix}")
        if value is None or (suffix == "rope.scaling.type" and value == "none"):
            continue
        if suffix == "attention.value_length" and value == _head_dim(meta, arch):
            continue
        raise GGUFError(f"GGUF key {arch}.{suffix} = {value!r} ({what}) is not supported")


def _head_dim(meta: dict[str, Any], arch: str) -> int:
    """llama.cpp's head size: attention.key_length, else embedding_length / head_count."""
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length:
        return int(key_length)
    return int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the file: only standard fields, top-level `rope_theta`."""
    arch = _arch(meta)
    _check_keys(meta, arch)

    def key(name: str) -> Any:
        return meta[f"{arch}.{name}"]

    heads = int(key("attention.head_count"))
    head_dim = _head_dim(meta, arch)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(
            f"GGUF key {arch}.rope.dimension_count = {rope_dims} (partial rotary) is not "
            f"supported: head size is {head_dim}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        tid = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if tid is not None:
            cfg[f"{name}_token_id"] = int(tid)
    return cfg


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        tid = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if tid is not None:
            out[f"{name}_token_id"] = int(tid)
    return out


def tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS flags and the file's chat template."""
    tok = {
        name: gguf_tokenizer.special_token(meta, key)
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )
    }
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tok,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        out["chat_template"] = str(template)
    return out


def _hf_name(name: str, arch: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK_RE.fullmatch(name)
    table = {**_BLOCK, **_BLOCK_EXTRA.get(arch, {})}
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    raise GGUFError(f"GGUF tensor {name!r} is not supported for architecture {arch!r}")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from [first half | second half]
    (Hugging Face's rotate-half layout) to interleaved pairs (row 2i = HF row i,
    row 2i+1 = HF row i + head_dim/2). Here rows go back: per head (dim/2, 2) -> (2, dim/2).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_tensors(reader: gguf.GGUFReader, arch: str) -> None:
    """Refuse, before any de-quantizing, a tensor of unsupported type or unknown name."""
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                f"GGUF tensor {t.name!r} has type {qtype}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        _hf_name(t.name, arch)


def tensors(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """All tensors as float32, by Hugging Face name. Refuses unsupported types by name."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    arch = cfg["model_type"]
    permute = arch == "llama"  # llama.cpp permutes Q/K rows for Llama only (NEOX rope otherwise)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    check_tensors(reader, arch)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32))  # a copy
        kind = t.name.split(".")[-2]
        if permute and kind in heads:
            w = _unpermute(w, int(heads[kind]))
        out[name] = w.contiguous()
    return out


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the Hugging Face folder for `gguf_path` into `out_dir` (created) and return it."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors})
    tok = gguf_tokenizer.build_tokenizer(meta)
    check_tensors(reader, cfg["model_type"])  # refusals come before the slow part
    weights = tensors(reader, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(meta))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(meta, cfg["max_position_embeddings"])
    )
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
