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
        self, e: int, x: torch.Tensor, act_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Expert e of x [n, H] float32 -> [n, H]."""
        x = x.contiguous()  # NOTE: the kernel reads rows H floats apart
        inter = self.gate.data.shape[1]
        h = torch.empty(x.shape[0], 2 * inter, dtype=torch.float32)
        self.kernel(x, self.gate.data[e], self.gate.type_id, None, h, 0)
        self.kernel(x, self.up.data[e], self.up.type_id, None, h, inter)
        a = act_mul(h).contiguous()
        y = torch.empty(x.shape[0], self.down.data.shape[1], dtype=torch.float32)
        self.kernel(a, self.down.data[e], self.down.type_id, None, y)
        return y

    def held(self) -> list[torch.Tensor]:
        return [self.gate.data, self.up.data, self.down.data]

    @property
    def num_experts(self) -> int:
        return self.gate.data.shape[0]
