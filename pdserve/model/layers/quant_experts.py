"""One layer's experts computed from a GGUF's blocks (kernels/native/linear_quant.c).

Each projection of the experts is one tensor [E, rows, row bytes] as the GGUF stores it
(`ffn_{gate,up,down}_exps`): expert e's matrix is the contiguous slice [e], computed as
any projection in blocks. model/arch/moe.py groups a step's tokens by expert and calls
an expert once over its tokens, so an expert no token routes to is never read.

    x_e [n, H] -> gate_e | up_e -> [n, 2I] -> act(gate) * up -> [n, I] -> down_e -> [n, H]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.native.linear_quant import Group

if TYPE_CHECKING:
    from pdserve.kernels.native.linear_quant import LinearQuant, QuantTensor

# gate, up, down: the checkpoint names of expert {j}'s projections in one layer
ExpertNames = tuple[str, str, str]


@dataclass(frozen=True)
class QuantExperts:
    """One layer's experts in GGUF blocks: each QuantTensor's data is uint8
    [E, rows, row bytes] (gate and up: I rows of H; down: H rows of I)."""

    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor
    kernel: LinearQuant

    def __call__(
        self,
        x: torch.Tensor,
        counts: list[int],
        act_mul: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """x [P, H] float32, its rows grouped by expert (counts[e] rows of expert e, in
        expert order) -> each row through its expert, [P, H]. Two kernel calls: every
        routed expert's gate and up, then every one's down."""
        x = x.contiguous()  # NOTE: the kernel reads rows H floats apart
        inter, hidden = self.gate.data.shape[1], self.down.data.shape[1]
        h = torch.empty(x.shape[0], 2 * inter, dtype=torch.float32)
        spans = _spans(counts)
        g, u, d = self.gate, self.up, self.down
        xq = self.kernel.quantize(x)  # --quant-activations int8: each row once, not per expert
        self.kernel.groups(
            [Group(x[a:b], t.data[e], t.type_id, h[a:b], col, _rows(xq, a, b))
             for e, a, b in spans for t, col in ((g, 0), (u, inter))]
        )  # fmt: skip
        act = act_mul(h).contiguous()
        aq = self.kernel.quantize(act)
        y = torch.empty(x.shape[0], hidden, dtype=torch.float32)
        self.kernel.groups(
            [Group(act[a:b], d.data[e], d.type_id, y[a:b], 0, _rows(aq, a, b)) for e, a, b in spans]
        )
        return y

    def held(self) -> list[torch.Tensor]:
        return [self.gate.data, self.up.data, self.down.data]

    @property
    def num_experts(self) -> int:
        return self.gate.data.shape[0]


def _rows(xq: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if xq is None else xq[a:b]


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
            start += n
    return out
