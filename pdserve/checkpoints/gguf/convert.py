"""GGUF file -> Hugging Face model folder (config.json, model.safetensors, tokenizer files).

The rest of pdserve serves Hugging Face folders, so a GGUF is converted once into
one: its tensors de-quantized to float32 with the `gguf` package (llama.cpp's own
reader) and streamed to disk (gguf_tensors.py), renamed and fixed per architecture
(arch.py), config and tokenizer rebuilt from the file's metadata
(gguf_tokenizer.py). resolve.py caches the folder. Anything the converter does not
implement exactly is refused by name: an architecture, a tensor type, a tensor, a
metadata key that changes the computation (rope scaling, sliding window, ...).
Every refusal is a GGUFError whose message starts with the file's path. A
mixture-of-experts file's experts in block types are left out (served from the file's
blocks; expert_floats.py writes their floats for a reader that needs them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pdserve.checkpoints.gguf import tokenizer as gguf_tokenizer
from pdserve.checkpoints.gguf.arch import ARCHES, REFUSED_KEYS, GGUFArch, arch_entry
from pdserve.checkpoints.gguf.tensors import (
    LISTING,
    GGUFError,
    check_tensors,
    left_out,
    write_safetensors,
)

if TYPE_CHECKING:
    import gguf

__all__ = ["GGUFError", "convert", "hf_config", "read_metadata"]


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata key of the file with its Python value (arrays as lists)."""
    return {k: f.contents() for k, f in reader.fields.items()}


def arch_of(meta: dict[str, Any]) -> tuple[str, GGUFArch]:
    name = str(meta.get("general.architecture"))
    if name not in ARCHES:
        raise GGUFError(
            f"key general.architecture = {name!r} is not supported (supported: {', '.join(ARCHES)})"
        )
    return name, arch_entry(name, meta.get(f"{name}.expert_count") is not None)


def _check_keys(meta: dict[str, Any], name: str, arch: GGUFArch) -> None:
    for suffix, what in REFUSED_KEYS.items():
        value = meta.get(f"{name}.{suffix}")
        if value is None or suffix in arch.implemented_keys:
            continue
        if suffix == "rope.scaling.type" and value == "none":
            continue
        if suffix == "attention.value_length" and value == _head_dim(meta, name):
            continue
        raise GGUFError(f"key {name}.{suffix} = {value!r} ({what}) is not supported")


def _head_dim(meta: dict[str, Any], name: str) -> int:
    """llama.cpp's head size: attention.key_length, else embedding_length / head_count."""
    key_length = meta.get(f"{name}.attention.key_length")
    if key_length:
        return int(key_length)
    return int(meta[f"{name}.embedding_length"]) // int(meta[f"{name}.attention.head_count"])


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    out = {}
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        tid = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if tid is not None:
            out[f"{name}_token_id"] = int(tid)
    return out


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the file: only standard fields, top-level `rope_theta`."""
    name, arch = arch_of(meta)
    _check_keys(meta, name, arch)

    def key(suffix: str) -> Any:
        full = f"{name}.{suffix}"
        if full not in meta:
            raise GGUFError(f"key {full} is missing")
        return meta[full]

    heads = int(key("attention.head_count"))
    head_dim = _head_dim(meta, name)
    rope_dims = meta.get(f"{name}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(
            f"key {name}.rope.dimension_count = {rope_dims} (partial rotary) is not "
            f"supported: head size is {head_dim}"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": int(meta.get(f"{name}.vocab_size") or len(tokens)),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{name}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": arch.hidden_act,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{name}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        **_special_ids(meta),
    }
    if arch.config_fix is not None:
        cfg.update(arch.config_fix(meta, name, cfg))
    return cfg


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    return _special_ids(meta)


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
        "add_bos_token": gguf_tokenizer.adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        out["chat_template"] = str(template)
    return out


class Progress:
    """`<file>: 12/236 tensors, 3.4 s` on one stderr line, redrawn; off when not a TTY."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.on = self.stream.isatty()
        self.label, self.total = label, total
        self.start = self._last = time.monotonic()

    def __call__(self, done: int, name: str) -> None:
        now = time.monotonic()
        if self.on and (now - self._last >= 0.1 or done == self.total):
            self._last = now
            line = f"converting {self.label}: {done}/{self.total} tensors, {now - self.start:.1f} s"
            self.stream.write(f"\r{line}\x1b[K")
            self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()


def convert(gguf_path: str | Path, out_dir: str | Path, progress: IO[str] | None = None) -> Path:
    """Write the Hugging Face folder for `gguf_path` into `out_dir` (created) and return it.

    Raises GGUFError (or GGUFTokenizerError) whose message starts with the file's path.
    """
    try:
        return _convert(Path(gguf_path), Path(out_dir), progress)
    except (GGUFError, gguf_tokenizer.GGUFTokenizerError) as e:
        raise type(e)(f"{gguf_path}: {e}") from None


def _convert(src: Path, out: Path, progress: IO[str] | None) -> Path:
    import gguf

    try:
        reader = gguf.GGUFReader(str(src))
    except (ValueError, OSError) as e:  # not a GGUF, truncated, or an unknown version
        raise GGUFError(f"not a readable GGUF file ({e})") from None
    meta = read_metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors})
    name, arch = arch_of(meta)
    check_tensors(reader, name, arch)  # refusals come before the slow part
    tok = gguf_tokenizer.build_tokenizer(meta)
    out.mkdir(parents=True, exist_ok=True)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    left = set(left_out(reader, name, arch))  # served from the blocks
    bar = Progress(src.name, len(reader.tensors) - len(left), progress)
    try:
        write_safetensors(out / "model.safetensors", reader, name, arch, heads, bar,
                          keep=lambda t: t.name not in left)  # fmt: skip
    finally:
        bar.close()
    if left:
        _write_json(out / LISTING, sorted(left))
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(meta))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(meta, cfg["max_position_embeddings"])
    )
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
