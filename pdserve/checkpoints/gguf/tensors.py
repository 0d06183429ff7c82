"""A GGUF's tensors, de-quantized to float32 and streamed into model.safetensors.

De-quantizing is the `gguf` package's own (llama.cpp's reference, and what transformers'
GGUF loader calls), so every type it reads converts to the very floats transformers
computes. Memory stays flat: the safetensors header is written first from the shapes,
then each tensor is de-quantized a slab of rows at a time (blocks never span rows, so a
slab gives the same floats as the whole) and written out; only Q/K matrices whose rows
llama.cpp permuted are held whole, one at a time.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.checkpoints.gguf.arch import GLOBAL_TENSORS, GGUFArch
from pdserve.checkpoints.gguf.error import GGUFError
from pdserve.checkpoints.gguf.moe import ROW_VECTORS

if TYPE_CHECKING:
    import gguf
    import numpy as np

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
SLAB_FLOATS = 1 << 20  # rows de-quantized at once: about 4 MB of float32


@cache
def dequantizable_types() -> tuple[str, ...]:
    """Names of the tensor types the installed `gguf` package de-quantizes."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    names = []
    for qtype in GGMLQuantizationType:
        type_size = GGML_QUANT_SIZES[qtype][1]
        try:
            dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


def hf_name(name: str, arch_name: str, arch: GGUFArch) -> str:
    """The Hugging Face name of GGUF tensor `name` (an expert tensor's: with `{j}`)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = _BLOCK_RE.fullmatch(name)
    table = arch.tensor_table()
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    raise GGUFError(f"tensor {name!r} is not supported for architecture {arch_name!r}")


def hf_entries(
    t: gguf.ReaderTensor, arch_name: str, arch: GGUFArch
) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of each checkpoint tensor `t` holds, in the order its
    values lie: one per expert for an [E, rows, cols] tensor of experts."""
    name, shape = hf_name(t.name, arch_name, arch), hf_shape(t)
    if "{j}" in name:
        if len(shape) != 3:
            raise GGUFError(f"tensor {t.name!r} has shape {shape}, expected [experts, rows, cols]")
        return [(name.format(j=j), shape[1:]) for j in range(shape[0])]
    if name.endswith(ROW_VECTORS) and len(shape) == 1:
        return [(name, (1, *shape))]
    return [(name, shape)]


LISTING = "experts.json"  # in a converted folder: the GGUF tensors left out (expert_floats.py)


def left_out(reader: gguf.GGUFReader, arch_name: str, arch: GGUFArch) -> list[str]:
    """The GGUF names of the tensors the converter leaves out of model.safetensors:
    tensors of experts in a block type (served from the file's blocks)."""
    return [t.name for t in reader.tensors
            if "{j}" in hf_name(t.name, arch_name, arch)
            and t.tensor_type.name not in ("F32", "F16", "BF16")]  # fmt: skip


def check_tensors(reader: gguf.GGUFReader, arch_name: str, arch: GGUFArch) -> None:
    """Refuse, before any de-quantizing, a tensor of unsupported type or unknown name."""
    supported = dequantizable_types()
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise GGUFError(
                f"tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package "
                f"cannot de-quantize (supported: {', '.join(supported)})"
            )
        hf_entries(t, arch_name, arch)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from [first half | second half]
    (Hugging Face's rotate-half layout) to interleaved pairs (row 2i = HF row i,
    row 2i+1 = HF row i + head_dim/2). Here rows go back: per head (dim/2, 2) -> (2, dim/2).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; numpy and torch outermost first."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _slabs(t: gguf.ReaderTensor) -> Iterator[np.ndarray]:
    import numpy as np
    from gguf.quants import dequantize

    data = t.data
    shape = hf_shape(t)
    rows = data.shape[0] if data.ndim > 1 else 1
    step = max(1, SLAB_FLOATS // max(1, int(np.prod(shape[1:], dtype=np.int64))))
    if data.ndim == 1:
        yield np.asarray(dequantize(data, t.tensor_type), np.float32).reshape(shape)
        return
    for i in range(0, rows, step):
        slab = np.asarray(dequantize(data[i : i + step], t.tensor_type), np.float32)
        yield slab.reshape(-1, *shape[1:])


def tensor_values(
    t: gguf.ReaderTensor, arch: GGUFArch, heads: dict[str, int]
) -> Iterator[np.ndarray]:
    """The Hugging Face float32 values of `t`, in row slabs."""
    import numpy as np

    kind = t.name.split(".")[-2]
    slabs = _slabs(t)
    if arch.permute_qk and kind in heads:  # rows move across slabs: permute the whole
        whole = np.concatenate(list(slabs)) if len(hf_shape(t)) > 1 else next(slabs)
        slabs = iter([unpermute(whole, heads[kind])])
    for slab in slabs:
        if arch.value_fix is not None:
            slab = np.asarray(arch.value_fix(t.name, slab), np.float32)
        yield slab


def write_safetensors(
    path: Path,
    reader: gguf.GGUFReader,
    arch_name: str,
    arch: GGUFArch,
    heads: dict[str, int],
    on_tensor: Callable[[int, str], None] = lambda i, name: None,
    keep: Callable[[gguf.ReaderTensor], bool] = lambda t: True,
) -> None:
    """A safetensors file of every tensor `keep` keeps as float32, written one slab at a
    time."""
    import numpy as np

    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    kept = [t for t in reader.tensors if keep(t)]
    for t in kept:
        for name, shape in hf_entries(t, arch_name, arch):
            size = 4
            for n in shape:
                size *= n
            entries[name] = {
                "dtype": "F32",
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes with spaces
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for i, t in enumerate(kept):
            for slab in tensor_values(t, arch, heads):
                f.write(np.ascontiguousarray(slab, dtype="<f4").data)  # no copy
            on_tensor(i + 1, t.name)
        if f.tell() != 8 + len(header) + offset:
            raise GGUFError(f"{path}: wrote {f.tell()} bytes, expected {8 + len(header) + offset}")
