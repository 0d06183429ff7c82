"""A forward's elementwise passes behind one small interface, with two implementations:

    TorchOps    torch ops, any device and dtype: the reference (what transformers computes,
                in the same order); every engine starts with it
    NativeOps   kernels/native/decode_ops.c, one call per pass; CPU engines turn it on at
                start-up (ModelRunner.warm_up_decode / warm_up_prefill) for fp32 models:
                at a decode's few rows each torch op costs more in dispatch than in
                arithmetic, and a prefill's passes read each value once instead of 2-4
                times

Both compute the same values up to float rounding (the native sum of squares, exp and
GELU-tanh, computed as g * sigmoid(2u) instead of 0.5 g (1 + tanh u), round differently
in the last bits). NativeOps mutates `h` in place in `add_norm`; the model owns `h` (its
embedding output), so no caller sees that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.native.decode_ops import MAX_EXPERTS, DecodeOps
from pdserve.model.layers.activations import NATIVE_ACTS
from pdserve.model.layers.rope import rotate

Tables = tuple[torch.Tensor, torch.Tensor]
Act = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in float32 and cast back, as the reference implementation does
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TorchOps:
    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * w); delta None: nothing added."""
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, w, eps)

    def head_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, heads, D]: each head's D values rms-normed and scaled by w (q/k norms)."""
        return rms_norm(x, w, eps)

    def rotate(self, x: torch.Tensor, tables: Tables) -> torch.Tensor:
        """x [T, heads, D] rotated by the rope tables of its tokens (model/layers/rope.py)."""
        return rotate(x, tables)

    def act_mul(self, act: Act, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> act(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, experts [T, k]): softmax in
        float32, the top k, divided by their sum where `norm`."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def moe_combine(
        self, y: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, t: int
    ) -> torch.Tensor:
        """[t, n]: the pairs' rows y [P, n] (grouped by expert, k per token) times w [P],
        each token's k added in the pairs' order."""
        y = y * w[:, None]
        back = torch.argsort(tokens, stable=True)
        # a running sum over a token's rows: one small op where index_add_ costs more
        # than a decode token's experts' glue together
        return y[back].view(t, y.shape[0] // t, -1).cumsum(1)[:, -1]

    def moe_gated_add(
        self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
    ) -> torch.Tensor:
        """out + sigmoid(gate [T, 1]) * shared (Qwen2-MoE's shared expert)."""
        return out + torch.sigmoid(gate) * shared


class NativeOps(TorchOps):
    """The passes the native kernels cover; the rest (other activations, non-fp32 input)
    falls through to torch."""

    def __init__(self, kernels: DecodeOps) -> None:
        self.kernels = kernels

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if h.dtype != torch.float32:
            return super().add_norm(h, delta, w, eps)
        return h, self.kernels.add_rms_norm(h, delta, w, eps)  # h += delta in place

    def head_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().head_norm(x, w, eps)
        self.kernels.rms_norm_heads_(x, w, eps)  # in place: x is a view of the fresh qkv output
        return x

    def rotate(self, x: torch.Tensor, tables: Tables) -> torch.Tensor:
        if x.dtype != torch.float32 or tables[0].shape[-1] != x.shape[-1]:  # partial: torch
            return super().rotate(x, tables)
        self.kernels.rope_(x, tables)  # in place: x is a view of the fresh qkv output
        return x

    def act_mul(self, act: Act, gate_up: torch.Tensor) -> torch.Tensor:
        name = NATIVE_ACTS.get(act)
        if name is None or gate_up.dtype != torch.float32:
            return super().act_mul(act, gate_up)
        if name == "silu":
            return self.kernels.silu_mul(gate_up)
        return self.kernels.gelu_tanh_mul(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.device.type != "cpu":
            return super().argmax(logits)
        return self.kernels.argmax(logits)

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype != torch.float32 or logits.shape[-1] > MAX_EXPERTS:
            return super().moe_route(logits, top_k, norm)
        return self.kernels.moe_route(logits, top_k, norm)

    def moe_combine(
        self, y: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, t: int
    ) -> torch.Tensor:
        if y.dtype != torch.float32:
            return super().moe_combine(y, w, tokens, t)
        return self.kernels.moe_combine(y.contiguous(), w.float().contiguous(), tokens, t)

    def moe_gated_add(
        self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
    ) -> torch.Tensor:
        if out.dtype != torch.float32:
            return super().moe_gated_add(out, gate, shared)
        out = out.contiguous()
        self.kernels.moe_gated_add_(out, gate, shared)  # in place: out is the layer's own
        return out
