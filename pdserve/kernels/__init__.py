"""The bottom of the compute stack: what runs on a device, below the model.

    native/          C kernels for the CPU, each beside its ctypes wrapper, built once
                     per machine; their structs declared once (native/abi.py) and
                     checked against the library at load
    page_io.py       KV pages in and out of a CPU pool with block hashes: native or
                     portable, chosen once
    core_share.py    the cores an engine may use, lent between engines on one host
                     (Cores: one policy object per engine process)
    attention_triton.py, future_map.py, kv_copy.py: Triton kernels, each with a torch
                     reference; stream.py: the device stream abstraction

Without CUDA, Triton kernels run under its interpreter. `TRITON_INTERPRET` is read
when a kernel is decorated with `@triton.jit`, so it is set here, before any module
of this package defines a kernel. A value the user set explicitly wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
