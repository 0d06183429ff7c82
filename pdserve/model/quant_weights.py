"""A GGUF's quantized tensors served as they are stored (`--weights quantized`, CPU).

resolve.py converts a GGUF once into a Hugging Face folder of float32 weights and links
the file beside them (`source.gguf`). Here, for a CPU engine, the projections whose
tensors are in a type kernels/native/linear_quant.c computes take their blocks straight
from the memory-mapped file instead: the float32 copies are never read (the loader gives
them as shapeless `meta` tensors), and a prefill and a decode on one host share the
file's pages. What is left on float32, and why, is logged by tensor name:

    norms, biases, F32/F16/BF16 tensors     float32, as the folder has them
    a type without a kernel (IQ2_*, TQ*...) float32, de-quantized at conversion
    a fused projection (q|k|v, gate|up)     quantized only when every part is
    the embedding                           quantized row look-ups where the model's
                                            forward asks `embed_rows` (LlamaModel)

Values: a block de-quantizes to what `gguf` gives; only llama.cpp's Q/K row permutation
(Llama files) is undone, on whole rows of blocks, as the converter undoes it on floats.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.checkpoints.gguf.arch import GGUFArch, arch_entry
from pdserve.checkpoints.gguf.index import read_index
from pdserve.checkpoints.gguf.tensors import hf_name, hf_shape, unpermute
from pdserve.kernels.native.linear_quant import TYPES, LinearQuant, QuantTensor
from pdserve.model.arch.moe import linear_groups as moe_linear_groups

if TYPE_CHECKING:
    import gguf

    from pdserve.model.arch.config import ModelArch
    from pdserve.model.arch.llama import LlamaModel

log = logging.getLogger(__name__)

SOURCE_LINK = "source.gguf"  # in a converted folder: the GGUF it was converted from
EMBED = "model.embed_tokens.weight"


class QuantEmbedding:
    """An embedding look-up over quantized rows: ids [T] -> [T, hidden] float32."""

    def __init__(self, t: QuantTensor, kernel: LinearQuant) -> None:
        self.tensor, self.kernel = t, kernel

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.tensor.data.shape[0]
        # NOTE: the C trusts the ids; F.embedding's IndexError for the same input
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise IndexError(f"token id out of range [0, {rows})")
        return self.kernel.rows(self.tensor.data, self.tensor.type_id, ids, self.tensor.cols)


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF a converted folder came from (resolve.py links it), or None."""
    link = Path(model_dir) / SOURCE_LINK
    return link.resolve() if link.exists() else None


class QuantSource:
    """The tensors of one GGUF that linear_quant.c computes, by Hugging Face name."""

    def __init__(self, path: Path, heads: dict[str, int]) -> None:
        """`heads`: query and key heads ({"attn_q": H, "attn_k": KH}), for Llama's rows."""
        # the tensors only (index.py steps over the metadata: a vocabulary's strings cost
        # gguf's reader seconds per engine), views of a copy-on-write mapping: writable (no
        # torch warning), pages shared with every other process mapping the file
        index = read_index(path)
        self.path = path
        arch_name = index.architecture
        experts = any("_exps." in t.name for t in index.tensors)
        self.arch: GGUFArch = arch_entry(arch_name, experts)
        self.heads = heads
        self.tensors: dict[str, gguf.ReaderTensor] = {
            hf_name(t.name, arch_name, self.arch): t for t in index.tensors
        }
        self.fallback: dict[str, str] = {}  # HF name -> why it stays float32

    def servable(self, name: str) -> bool:
        """True if tensor `name` can be served from its blocks (else why is noted)."""
        t = self.tensors.get(name)
        if t is None:
            return False
        type_id = int(t.tensor_type)
        if type_id not in TYPES:
            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                self.fallback[name] = f"{t.tensor_type.name} has no kernel"
            return False
        if len(hf_shape(t)) != 2 or not self._values_kept(t):
            self.fallback[name] = "the architecture changes its values"
            return False
        return True

    def _values_kept(self, t: gguf.ReaderTensor) -> bool:
        """No value fix changes this tensor (checked on its first row)."""
        fix = self.arch.value_fix
        if fix is None:
            return True
        from gguf.quants import dequantize

        row = np.asarray(dequantize(t.data[:1], t.tensor_type), np.float32)
        return bool(np.array_equal(np.asarray(fix(t.name, row), np.float32), row))

    def take(self, name: str) -> QuantTensor:
        """Blocks of a servable tensor; rows un-permuted where llama.cpp permuted them."""
        t = self.tensors[name]
        data = t.data  # [rows, row bytes], a view of the mapping
        kind = t.name.split(".")[-2]
        if self.arch.permute_qk and kind in self.heads:
            data = np.ascontiguousarray(unpermute(data, self.heads[kind]))
        return QuantTensor(name, torch.from_numpy(data), int(t.tensor_type), hf_shape(t)[1])


def linear_groups(arch: ModelArch) -> list[list[str]]:
    """The weight names of each projection the model fuses, in linears() order."""
    tied = arch.tie_word_embeddings
    if arch.moe is not None:
        return [*moe_linear_groups(arch), [EMBED if tied else "lm_head.weight"]]
    groups = []
    for i in range(arch.num_layers):
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        groups += [
            [att + f"{x}_proj.weight" for x in "qkv"],
            [att + "o_proj.weight"],
            [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
            [mlp + "down_proj.weight"],
        ]
    return [*groups, [EMBED if tied else "lm_head.weight"]]


def plan(source: QuantSource, arch: ModelArch) -> list[list[str] | None]:
    """Per projection (linears() order): its names when every part is servable, else None."""
    return [g if all([source.servable(n) for n in g]) else None for g in linear_groups(arch)]


def meta_names(groups: list[list[str] | None]) -> set[str]:
    """Names the loader need not read: served from blocks (the tied embedding is read)."""
    return {n for g in groups if g is not None for n in g if n != EMBED}


def apply(
    model: LlamaModel, source: QuantSource, groups: list[list[str] | None], kernel: LinearQuant
) -> None:
    """Move the planned projections (and the embedding, where the forward allows) onto
    their blocks; log what stays float32."""
    linears = model.linears()
    assert len(linears) == len(groups), "linears() and linear_groups() disagree"
    counts: Counter[str] = Counter()
    for lin, names in zip(linears, groups, strict=True):
        if names is not None:
            parts = [source.take(n) for n in names]
            lin.use_quant(parts, kernel)
            counts.update(p.type_name for p in parts)
    if model.quant_embed_ok() and source.servable(EMBED):
        embed = source.take(EMBED)
        model.use_quant_embed(QuantEmbedding(embed, kernel))
        counts[embed.type_name + " (embedding)"] += 1
    shown = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    log.info("weights from %s in GGUF blocks: %s", source.path.name, shown or "none")
    for name, why in sorted(source.fallback.items()):
        log.info("tensor %s stays float32: %s", name, why)
