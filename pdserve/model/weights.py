"""Load a model's weights: the folder's tensors, or a GGUF's blocks where they serve.

    --weights quantized (default)  a converted GGUF folder, CPU, float32, native kernels
                                   built: projections (and the embedding) from the GGUF's
                                   blocks (model/quant_weights.py); the rest from the folder
    otherwise                      every tensor from the folder, in --dtype
    --quant-activations int8       the blocks meet x quantized to 8 bits per block
                                   (kernels/native/quant_int8.h); refused by name where
                                   no blocks serve (a folder, --weights float32, CUDA)

Either way the engine logs the bytes its weights hold (`resident_bytes`), so the memory
a process needs is known before it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.checkpoints.gguf import expert_floats
from pdserve.checkpoints.tensor_files import load_state
from pdserve.config import EngineConfig
from pdserve.kernels.native.linear_quant import LinearQuant
from pdserve.model import quant_experts, quant_weights
from pdserve.model.arch import moe
from pdserve.model.arch.config import ModelArch
from pdserve.model.arch.llama import LlamaModel
from pdserve.model.layers.linear import Linear
from pdserve.model.layers.quant_experts import ExpertNames

if TYPE_CHECKING:
    from pdserve.model.native_kernels import NativeKernels

log = logging.getLogger(__name__)

Build = Callable[[dict[str, torch.Tensor]], LlamaModel]


def _quant_source(
    cfg: EngineConfig, arch: ModelArch, dtype: torch.dtype, native: NativeKernels | None
) -> tuple[quant_weights.QuantSource, LinearQuant] | None:
    """The GGUF and the kernel to serve its blocks with, or None (said why when it was
    asked for and cannot be). ValueError: --quant-activations int8 where no blocks serve."""
    path = quant_weights.source_gguf(cfg.model_path)
    int8 = cfg.quant_activations == "int8"
    if int8 and (cfg.weights != "quantized" or path is None):
        raise ValueError(
            "--quant-activations int8 applies to a GGUF model's blocks (--weights quantized); "
            f"this engine serves {'a folder' if path is None else '--weights ' + cfg.weights}"
        )
    if cfg.weights != "quantized" or path is None:
        return None
    why = ""
    if not cfg.device.startswith("cpu") or dtype != torch.float32:
        why = "quantized weights run on the CPU with --dtype float32"
    elif native is None:
        why = "native kernels are off (--disable-compile or PDSERVE_DISABLE_COMPILE)"
    kernel = None if why or native is None else native.linear_quant(int8)
    if kernel is None and int8:
        raise ValueError(
            f"--quant-activations int8 cannot apply: {why or 'linear_quant not built'}"
        )
    if kernel is None:
        log.info("weights from the folder in %s: %s", dtype, why or "linear_quant not built")
        return None
    heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}
    return quant_weights.QuantSource(path, heads), kernel


def load_model(
    cfg: EngineConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    native: NativeKernels | None,
    build: Build,
) -> LlamaModel:
    """The model `build` makes from the folder's tensors, its projections then moved onto
    the GGUF's blocks where --weights quantized applies; logs its resident weight bytes."""
    quant = _quant_source(cfg, arch, dtype, native)
    groups = [] if quant is None else quant_weights.plan(quant[0], arch)
    experts: list[ExpertNames | None] = []
    if quant is not None and arch.moe is not None:
        experts = quant_experts.plan(quant[0], moe.expert_names(arch))
    skip = quant_weights.meta_names(groups) | quant_experts.meta_names(experts, arch)
    if arch.moe is not None and (quant is None or _some_experts_float(arch, experts)):
        expert_floats.ensure(cfg.model_path)  # a converted folder left them out
    # NOTE: copies where blocks serve: a view would keep the whole float32 file mapped,
    # the dropped float embedding's pages resident with it
    state = load_state(cfg.model_path, dtype, cfg.device, skip, copy=quant is not None)
    if arch.moe is not None:  # experts served from blocks that the folder left out
        shapes = moe.tensor_shapes(arch)
        for name in skip - state.keys():
            state[name] = torch.empty(shapes[name], dtype=dtype, device="meta")
    model = build(state)
    if quant is not None:
        quant_weights.apply(model, quant[0], groups, quant[1])
        if quant[1].int8:
            _say_float_types(model, quant[1])
        _use_quant_experts(model, quant[0], experts, quant[1])
    log.info("weights: %.1f MB resident", resident_bytes(model) / 1e6)
    return model


def _some_experts_float(arch: ModelArch, plans: list[ExpertNames | None]) -> bool:
    """Whether a sparse layer's experts are not served from blocks (plans: quant_experts.plan)."""
    assert arch.moe is not None
    return any(s and not p for s, p in zip(arch.moe.sparse, plans or [None] * len(arch.moe.sparse)))


def _say_float_types(model: LlamaModel, kernel: LinearQuant) -> None:
    """--quant-activations int8: logs once per GGUF type that has no integer kernel on
    this build (its projections keep float activations)."""
    types = {p.type_id: p.type_name for lin in model.linears() if lin.quant for p in lin.quant[1]}
    for type_id, name in sorted(types.items()):
        if not kernel.int8_supported(type_id):
            log.info("--quant-activations int8: %s has no integer kernel here: float x", name)
    log.info("--quant-activations int8: integer dots for %s",
             ", ".join(n for t, n in sorted(types.items()) if kernel.int8_supported(t)) or "none")  # fmt: skip


def _use_quant_experts(
    model: LlamaModel,
    source: quant_weights.QuantSource,
    plans: list[ExpertNames | None],
    kernel: LinearQuant,
) -> None:
    """Move each planned layer's experts onto their blocks (their float copies unread)."""
    if not isinstance(model, moe.MoeModel) or not any(plans):
        return
    assert model.arch.moe is not None
    types: set[str] = set()
    for layer, names in zip(model.layers, plans, strict=True):
        e = layer.experts
        if names is None or e is None:
            continue
        e.quant = quant_experts.experts_of(source, names, kernel, model.arch.moe.num_experts)
        e.gate_up = e.down = torch.empty(0)
        types.update(t.type_name for t in (e.quant.gate, e.quant.up, e.quant.down))
    n = sum(1 for p in plans if p)
    log.info("experts of %d layers in GGUF blocks (%s)", n, ", ".join(sorted(types)))


def resident_bytes(model: LlamaModel) -> int:
    """Bytes the model's weights hold: tensors, blocks (mapped from the file: resident
    once read), each storage once."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():
            key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque layout has no pointer
            seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())

    for lin in model.linears():
        for t in lin.held():
            add(t)
    for obj in [model, *model.layers]:
        for value in vars(obj).values():
            if isinstance(value, moe.Experts):
                for t in value.held():
                    add(t)
            elif not isinstance(value, Linear):
                add(value)
    if isinstance(model.embed_quant, quant_weights.QuantEmbedding):
        add(model.embed_quant.tensor.data)
    return sum(seen.values())
