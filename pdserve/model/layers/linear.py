"""Linear layers with their weight stored the way the fast GEMM on the device reads it.

A checkpoint stores a projection as W [out, in] and computes y = x @ W.T + b. On an
x86 CPU `F.linear(x, W)` over that layout runs up to 2x slower than a GEMM whose
weight is laid out for it (benchmarks/decode_step.py measures the floor), so at load:

    cpu, float32, oneDNN present   W is reordered once into oneDNN's blocked layout
                                   (torch.ops.mkldnn._reorder_linear_weight) and applied
                                   with oneDNN's linear; the layout is opaque
    otherwise                      W.T is kept contiguous [in, out] and applied with mm/addmm

A CPU engine then moves every Linear to the native kernel (`use_native`, from
ModelRunner.warm_up_decode / warm_up_prefill): W in 16-column panels,
kernels/native/linear_f32.c, which streams the weights 1.1-1.9x faster than oneDNN for a
decode's few rows (benchmarks/decode_step.py); at a prompt's rows it is 5-10% slower on
one thread, but its panels go to the threads in chunks, which a host shared with other
processes needs more (ModelRunner.warm_up_prefill).

Either way y equals x @ W.T + b up to float rounding; the original W is not kept.

A GGUF's projections on the CPU may instead stay in their block formats (`use_quant`,
model/quant_weights.py): each part of a fused projection (q|k|v, gate|up) is its own
tensor of blocks, computed by kernels/native/linear_quant.c into its columns of y.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.kernels.native.linear_f32 import LinearF32
    from pdserve.kernels.native.linear_quant import LinearQuant, QuantTensor

# oneDNN picks its blocked weight layout for a typical batch; any batch size works with it
_BATCH_HINT = 64


def _onednn_ok(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x @ W.T + b for x [T, in] -> [T, out]."""

    __slots__ = (
        "_apply", "bias", "in_features", "native", "onednn", "out_features", "quant", "weight"
    )  # fmt: skip

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`w`: [out, in] as in the checkpoint; `bias`: [out] or None."""
        self.out_features, self.in_features = w.shape
        self.bias = bias
        self.native: LinearF32 | None = None
        self.quant: tuple[LinearQuant, list[QuantTensor]] | None = None
        self.onednn = _onednn_ok(w)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _BATCH_HINT)
        else:
            self.weight = w.t().contiguous()  # [in, out]
        # how y is computed, chosen with the weight's layout (here, use_native or use_quant)
        self._apply: Callable[[torch.Tensor], torch.Tensor] = (
            self._by_onednn if self.onednn else self._by_mm
        )

    def use_native(self, kernel: LinearF32) -> None:
        """Repack W (and b) for `kernel`; a no-op when it is on already or W is not fp32."""
        if self.native is not None or self.quant is not None or self.weight.dtype != torch.float32:
            return
        w = self.weight.to_dense() if self.onednn else self.weight.t()  # [out, in]
        self.weight, self.bias = kernel.pack(w, self.bias)
        self.native, self.onednn, self._apply = kernel, False, self._by_kernel

    def use_quant(self, parts: list[QuantTensor], kernel: LinearQuant) -> None:
        """Compute from GGUF blocks: `parts` stacked by rows are W [out, in] (the float W,
        a `meta` tensor when the loader skipped it, is dropped)."""
        rows = sum(p.data.shape[0] for p in parts)
        if rows != self.out_features or any(p.cols != self.in_features for p in parts):
            raise ValueError(f"quantized parts {[p.name for p in parts]} are not W {self.shape}")
        self.quant, self.native, self.onednn = (kernel, parts), None, False
        self.weight, self._apply = torch.empty(0), self._by_blocks

    def _by_blocks(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quant is not None
        kernel, parts = self.quant
        x = x.contiguous()  # NOTE: the kernel reads rows K floats apart
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        # once for every part: x quantized (None: float activations) and, at a batch of
        # rows, laid out for the tiled GEMM
        xq, xt = kernel.prepare(x, [p.type_id for p in parts])
        col = 0
        for p in parts:
            n = p.data.shape[0]
            bias = None if self.bias is None else self.bias[col : col + n]
            kernel(x, p.data, p.type_id, bias, y, col, xq, xt)
            col += n
        return y

    def held(self) -> list[torch.Tensor]:
        """The tensors its weights are held in (blocks, or the float weight; the bias)."""
        held = [p.data for p in self.quant[1]] if self.quant else [self.weight]
        return held + ([] if self.bias is None else [self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x)

    def _by_kernel(self, x: torch.Tensor) -> torch.Tensor:
        assert self.native is not None  # use_native
        return self.native(x, self.weight, self.bias, self.out_features)

    def _by_onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _by_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in], the checkpoint's convention."""
        return (self.out_features, self.in_features)
