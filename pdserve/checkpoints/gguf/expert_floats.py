"""A converted GGUF folder's experts in float32, written only for a reader that needs them.

A mixture-of-experts file's expert tensors ([E, rows, cols] of a block type) are most of
its bytes, and in float32 four to seven times more (a 1.5 GB Q4_K_M file: 10 GB). A CPU
engine serves them from the file's blocks (model/quant_experts.py), so convert.py leaves
them out of model.safetensors and lists them in `experts.json`. A reader that needs their
floats (--weights float32, a GPU, a type without a kernel, transformers on the folder)
calls `ensure` first: it writes model.safetensors again from `source.gguf` with every
tensor (the file the converter writes without leaving any out), replaces the old one and
removes the listing, once, under a lock.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve.checkpoints.build_once import file_lock
from pdserve.checkpoints.gguf.error import GGUFError
from pdserve.checkpoints.gguf.tensors import LISTING

WEIGHTS = "model.safetensors"
SOURCE = "source.gguf"  # resolve.py's link to the file (quant_weights.SOURCE_LINK)


def ensure(folder: str | Path) -> None:
    """The folder's model.safetensors with every tensor, the left-out experts included,
    made once. GGUFError where they are left out and the source file is not there."""
    folder = Path(folder)
    if not (folder / LISTING).exists():
        return
    with file_lock(folder / f".{LISTING}.lock"):
        if not (folder / LISTING).exists():  # another process wrote them while we waited
            return
        if not (folder / SOURCE).exists():
            raise GGUFError(f"{folder}: its experts' floats need {SOURCE}, which is missing")
        _write(folder)


def _write(folder: Path) -> None:
    import gguf

    from pdserve.checkpoints.gguf.convert import arch_of, read_metadata
    from pdserve.checkpoints.gguf.tensors import write_safetensors

    reader = gguf.GGUFReader(str(folder / SOURCE))
    name, arch = arch_of(read_metadata(reader))
    cfg = json.loads((folder / "config.json").read_text())
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tmp = folder / f".{WEIGHTS}.{os.getpid()}"
    write_safetensors(tmp, reader, name, arch, heads)
    os.replace(tmp, folder / WEIGHTS)  # NOTE: atomic: a reader has the old file or the new
    (folder / LISTING).unlink()
