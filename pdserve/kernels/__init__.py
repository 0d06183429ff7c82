"""Triton kernels with a torch reference each, and the device stream abstraction.

Without CUDA, Triton kernels run under its interpreter. `TRITON_INTERPRET` is read
when a kernel is decorated with `@triton.jit`, so it is set here, before any module
of this package defines a kernel. A value the user set explicitly wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
