"""A mixture-of-experts model's experts taken from a GGUF's blocks (`--weights quantized`):
which layers' `ffn_{gate,up,down}_exps` have a kernel, and their blocks as
model/layers/quant_experts.py computes them (each expert a contiguous slice).

Values: a block de-quantizes to what `gguf` gives, so an expert computes what its
float32 copy in the converted folder computes, up to summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.checkpoints.gguf.tensors import hf_shape
from pdserve.kernels.native.linear_quant import TYPES, LinearQuant, QuantTensor
from pdserve.model.layers.quant_experts import ExpertNames, QuantExperts

if TYPE_CHECKING:
    from pdserve.model.arch.config import ModelArch
    from pdserve.model.quant_weights import QuantSource


def servable(source: QuantSource, name: str) -> bool:
    """True if the [E, rows, cols] tensor `name` (with `{j}`) has a kernel (else why is
    noted in source.fallback)."""
    t = source.tensors.get(name)
    if t is None:
        return False
    if int(t.tensor_type) not in TYPES:
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            source.fallback[name] = f"{t.tensor_type.name} has no kernel"
        return False
    if len(hf_shape(t)) != 3 or source.arch.value_fix is not None:
        source.fallback[name] = "the architecture changes its values"
        return False
    return True


def take(source: QuantSource, name: str) -> QuantTensor:
    """The blocks of a servable tensor of experts, [E, rows, row bytes] (a view of the
    mapping: each expert's slice is contiguous)."""
    t = source.tensors[name]
    data = torch.from_numpy(t.data)
    rows, cols = hf_shape(t)[1:]
    data = data.reshape(data.shape[0], rows, -1)
    return QuantTensor(name, data, int(t.tensor_type), cols)


def plan(source: QuantSource, layers: list[ExpertNames | None]) -> list[ExpertNames | None]:
    """Per layer: its experts' names where all three projections are servable, else None."""
    return [
        names if names is not None and all([servable(source, n) for n in names]) else None
        for names in layers
    ]


def meta_names(plans: list[ExpertNames | None], arch: ModelArch) -> set[str]:
    """The per-expert checkpoint names the loader need not read (served from blocks)."""
    if arch.moe is None:
        return set()
    return {
        n.format(j=j)
        for names in plans
        if names
        for n in names
        for j in range(arch.moe.num_experts)
    }


def experts_of(
    source: QuantSource, names: ExpertNames, kernel: LinearQuant, experts: int
) -> QuantExperts:
    gate, up, down = (take(source, n) for n in names)
    if not gate.data.shape[0] == up.data.shape[0] == down.data.shape[0] == experts:
        raise ValueError(f"{names[0]}: {gate.data.shape[0]} experts, the config says {experts}")
    return QuantExperts(gate, up, down, kernel)
