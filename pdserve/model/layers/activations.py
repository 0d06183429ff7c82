"""MLP activations under the names transformers' ACT2FN gives them, computed the same way.

A `hidden_act` not listed here is refused at load (pdserve.model.arch.config)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:  # "gelu_new"
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:  # "gelu_pytorch_tanh"
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh_formula,
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}

# the activations the native kernels compute (kernels/native/decode_ops.c pd_<name>_mul)
NATIVE_ACTS: dict[Callable[[torch.Tensor], torch.Tensor], str] = {
    F.silu: "silu",
    _gelu_tanh: "gelu_tanh",
}
