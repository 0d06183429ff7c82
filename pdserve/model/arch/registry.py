"""The one registry of architectures: Hugging Face architecture name -> its record
(config reader with its rules, model class, the GGUF architecture converted into it).

Adding an architecture is a module that defines its `Architecture` and one line below
that registers it. A folder's config.json is read here, once, and handed to the
architecture's reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.model.arch import gemma3, llama, moe, phi3
from pdserve.model.arch.config import Architecture, ModelArch, read_config_files
from pdserve.model.arch.rules import LLAMA, UnsupportedConfig

ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Adds `arch`; a name registered twice is a programming error."""
    if arch.name in ARCHITECTURES:
        raise ValueError(f"architecture {arch.name} is registered twice")
    ARCHITECTURES[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Removes a registered architecture (tests that register a toy one)."""
    ARCHITECTURES.pop(name, None)


for _arch in (*llama.ARCHITECTURES, gemma3.ARCHITECTURE, phi3.ARCHITECTURE, *moe.ARCHITECTURES):
    register(_arch)


def lookup(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {name} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def name_of(cfg: dict[str, Any]) -> str:
    """config.json's architecture: "architectures"[0], else the one its model_type names,
    else Llama (transformers' AutoConfig does the same for a bare Llama config)."""
    listed = cfg.get("architectures")
    if listed:
        return str(listed[0])
    by_type = [a.name for a in ARCHITECTURES.values() if cfg.get("model_type") in a.model_types]
    return by_type[0] if by_type else LLAMA


def arch_from_config(cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    """ModelArch of a config.json dict; ValueError for an architecture not registered,
    UnsupportedConfig naming the field for a computation not implemented."""
    return lookup(name_of(cfg)).read_config(cfg, eos_token_ids)


def load_arch(model_dir: str | Path) -> ModelArch:
    """ModelArch of a model folder (`config.json`, `generation_config.json`)."""
    cfg, eos = read_config_files(model_dir)
    try:
        return arch_from_config(cfg, eos)
    except UnsupportedConfig as e:
        raise UnsupportedConfig(f"{model_dir}: {e}") from None
