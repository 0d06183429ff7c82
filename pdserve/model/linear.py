"""Linear layers with their weight stored the way the fast GEMM on the device reads it.

A checkpoint stores a projection as W [out, in] and computes y = x @ W.T + b. On an
x86 CPU `F.linear(x, W)` over that layout runs up to 2x slower than a GEMM whose
weight is laid out for it (benchmarks/decode_step.py measures the floor), so at load:

    cpu, float32, oneDNN present   W is reordered once into oneDNN's blocked layout
                                   (torch.ops.mkldnn._reorder_linear_weight) and applied
                                   with oneDNN's linear; the layout is opaque
    otherwise                      W.T is kept contiguous [in, out] and applied with mm/addmm

Either way y equals x @ W.T + b up to float rounding; the original W is not kept.
"""

from __future__ import annotations

import torch

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

    __slots__ = ("bias", "in_features", "onednn", "out_features", "weight")

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`w`: [out, in] as in the checkpoint; `bias`: [out] or None."""
        self.out_features, self.in_features = w.shape
        self.bias = bias
        self.onednn = _onednn_ok(w)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _BATCH_HINT)
        else:
            self.weight = w.t().contiguous()  # [in, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in], the checkpoint's convention."""
        return (self.out_features, self.in_features)
