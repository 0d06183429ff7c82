"""KV copy kernels for the transfer: gather a request's slots into a contiguous staging
buffer (prefill side) and scatter received frames into slots (decode side).

    pool   [L, S, KH, D]   pool.k or pool.v, or a layer range of it (pool.k[l0:l1])
    slots  [n] int32|int64 the request's slots in position order (req_to_token / slots_of)
    stage  [L, n, KH, D]   contiguous: exactly the bytes of one KV frame

    gather_kv : stage[l, i] = pool[l, slots[i]]
    scatter_kv: pool[l, slots[i]] = stage[l, i]

Each op has a torch reference ("torch") and a Triton kernel ("triton"; interpreted
without CUDA, see pdserve/kernels/__init__.py). pool and stage must share a device.
Slot bounds are checked on CPU only (reading a CUDA tensor would sync the host); on
CUDA the kernel masks out-of-range slots: gather writes zeros, scatter drops the row.

Status: tested kernels (tests/test_kv_copy.py, interpreted on CPU) that the transfer
does not call yet. pdserve/transfer gathers and scatters KV with torch indexing on
host memory; a CUDA pool would need these kernels on a copy stream, with the staging
buffers kept alive until both the copy event and ZeroMQ's tracker say done. That
pipeline is not built (nothing here has run on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BACKENDS = ("torch", "triton")
_SLOT_DTYPES = (torch.int32, torch.int64)
_MAX_BLOCK = 1024


@triton.jit
def _gather_kernel(
    src_ptr, slots_ptr, out_ptr, num_slots, row_len, s_layer, s_slot, n,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # program (layer, i, block): one block of the KH*D-element row of slot slots[i]
    layer = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i).to(tl.int64) + tl.zeros([BLOCK], tl.int64)  # as a block
    in_row = offs < row_len
    valid = (slot >= 0) & (slot < num_slots)
    x = tl.load(src_ptr + layer * s_layer + slot * s_slot + offs, mask=in_row & valid, other=0)
    tl.store(out_ptr + (layer * n + i) * row_len + offs, x, mask=in_row)


@triton.jit
def _scatter_kernel(
    dst_ptr, slots_ptr, src_ptr, num_slots, row_len, s_layer, s_slot, n,
    BLOCK: tl.constexpr,
):  # fmt: skip
    layer = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i).to(tl.int64) + tl.zeros([BLOCK], tl.int64)  # as a block
    in_row = offs < row_len
    valid = (slot >= 0) & (slot < num_slots)
    x = tl.load(src_ptr + (layer * n + i) * row_len + offs, mask=in_row, other=0)
    tl.store(dst_ptr + layer * s_layer + slot * s_slot + offs, x, mask=in_row & valid)


def gather_kv_ref(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(pool, 1, slots, out=out)


def scatter_kv_ref(pool: torch.Tensor, slots: torch.Tensor, stage: torch.Tensor) -> None:
    pool.index_copy_(1, slots.long(), stage)


def gather_kv(
    pool: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """out[l, i] = pool[l, slots[i]]; issues work on the current stream; returns `out`
    (allocated contiguous on pool's device when None)."""
    shape = _check(pool, slots, backend)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    _check_stage("out", out, pool, shape)
    if slots.shape[0] == 0 or pool.shape[0] == 0:
        return out
    if backend == "torch":
        gather_kv_ref(pool, slots, out)
    else:
        _launch(_gather_kernel, pool, slots, out)
    return out


def scatter_kv(
    pool: torch.Tensor, slots: torch.Tensor, stage: torch.Tensor, backend: str = "torch"
) -> None:
    """pool[l, slots[i]] = stage[l, i]; issues work on the current stream.
    Duplicate slots: which row lands is unspecified."""
    shape = _check(pool, slots, backend)
    _check_stage("stage", stage, pool, shape)
    if slots.shape[0] == 0 or pool.shape[0] == 0:
        return
    if backend == "torch":
        scatter_kv_ref(pool, slots, stage)
    else:
        _launch(_scatter_kernel, pool, slots, stage)


def stage_to_host(stage: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Copy a device staging buffer into host memory: asynchronous when `host` is pinned
    (record an event on the current stream and wait on it before reading `host`).
    NOTE: `stage` must stay alive and untouched until that event: the DMA reads it."""
    if host.shape != stage.shape or host.dtype != stage.dtype or host.device.type != "cpu":
        raise ValueError(f"host must be a CPU tensor of {tuple(stage.shape)} {stage.dtype}")
    if not host.is_contiguous():
        raise ValueError("host must be contiguous (it is sent as one frame)")
    host.copy_(stage, non_blocking=host.is_pinned())
    return host


def _launch(kernel, pool: torch.Tensor, slots: torch.Tensor, stage: torch.Tensor) -> None:
    layers, n = pool.shape[0], slots.shape[0]
    row_len = pool.shape[2] * pool.shape[3]
    block = max(16, min(_MAX_BLOCK, triton.next_power_of_2(row_len)))
    grid = (layers, n, triton.cdiv(row_len, block))
    kernel[grid](
        pool, slots, stage, pool.shape[1], row_len, pool.stride(0), pool.stride(1), n,
        BLOCK=block,
    )  # fmt: skip


def _check(pool: torch.Tensor, slots: torch.Tensor, backend: str) -> tuple[int, ...]:
    """Validates pool and slots; returns the staging shape [L, n, KH, D]."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if pool.dim() != 4:
        raise ValueError(f"pool must be [L, S, KH, D], got shape {tuple(pool.shape)}")
    kh, d = pool.shape[2], pool.shape[3]
    if pool.stride(3) != 1 or pool.stride(2) != d:
        raise ValueError("each slot's [KH, D] row of pool must be contiguous")
    if slots.dim() != 1 or slots.dtype not in _SLOT_DTYPES or not slots.is_contiguous():
        raise ValueError("slots must be a contiguous 1-D int32/int64 tensor")
    if slots.device != pool.device:
        raise ValueError(f"slots are on {slots.device}, pool on {pool.device}")
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = (int(x) for x in torch.aminmax(slots))
        if lo < 0 or hi >= pool.shape[1]:
            raise ValueError(f"slots must lie in [0, {pool.shape[1]}), got [{lo}, {hi}]")
    return (pool.shape[0], slots.shape[0], kh, d)


def _check_stage(name: str, t: torch.Tensor, pool: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype != pool.dtype:
        raise ValueError(f"{name} must be {shape} {pool.dtype}, got {tuple(t.shape)} {t.dtype}")
    if t.device != pool.device:
        raise ValueError(f"{name} is on {t.device}, pool on {pool.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
