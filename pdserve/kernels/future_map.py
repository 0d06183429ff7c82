"""FutureMap kernels: gather (resolve) and scatter (publish / stash) of per-row tokens.

    src / dst : [R] int64   one token per request row (row 0 is padding)
    rows      : [B] int32 | int64, each in [0, R)
    out/values: [B] int64

    gather_tokens : out[i]       = src[rows[i]]
    scatter_tokens: dst[rows[i]] = values[i]

Each op has a torch reference ("torch", the CPU runtime path) and a Triton kernel
("triton"; on a machine without CUDA it runs under TRITON_INTERPRET, see
pdserve/kernels/__init__.py). The wrappers check dtypes, shapes, devices and
contiguity the same way for both backends.

Row bounds: on CPU an out-of-range row raises ValueError. On CUDA the wrapper does
not look (that would synchronize the host); the kernel masks such rows so memory is
never touched out of bounds (gather yields -1, scatter drops the value).
Duplicate rows in a scatter: which value lands is unspecified (padding entries all
point at row 0, whose value nobody reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BACKENDS = ("torch", "triton")
_ROW_DTYPES = (torch.int32, torch.int64)
_MAX_BLOCK = 1024


@triton.jit
def _gather_kernel(src_ptr, rows_ptr, out_ptr, batch, num_rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = offs < batch
    rows = tl.load(rows_ptr + offs, mask=in_batch, other=0)
    valid = in_batch & (rows >= 0) & (rows < num_rows)
    tokens = tl.load(src_ptr + rows, mask=valid, other=-1)
    tl.store(out_ptr + offs, tokens, mask=in_batch)


@triton.jit
def _scatter_kernel(dst_ptr, rows_ptr, values_ptr, batch, num_rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = offs < batch
    rows = tl.load(rows_ptr + offs, mask=in_batch, other=0)
    valid = in_batch & (rows >= 0) & (rows < num_rows)
    tokens = tl.load(values_ptr + offs, mask=in_batch, other=0)
    tl.store(dst_ptr + rows, tokens, mask=valid)


def gather_tokens_ref(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(src, 0, rows, out=out)


def scatter_tokens_ref(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    dst.index_copy_(0, rows.long(), values)


def gather_tokens(
    src: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor | None = None,
    backend: str = "torch",
    rows_checked: bool = False,
) -> torch.Tensor:
    """out[i] = src[rows[i]]. Issues work on the current stream; returns `out`
    (allocated on src's device when None). `rows_checked`: the caller validated the
    row values on the host already, so none are read here (a forward stream must not)."""
    _check_backend(backend)
    _check_vector("src", src, (torch.int64,), src.device)
    _check_vector("rows", rows, _ROW_DTYPES, src.device)
    if out is None:
        out = torch.empty(rows.shape[0], dtype=torch.int64, device=src.device)
    _check_vector("out", out, (torch.int64,), src.device, length=rows.shape[0])
    if not rows_checked:
        _check_bounds(rows, src.shape[0])
    if rows.shape[0] == 0:
        return out
    if backend == "torch":
        gather_tokens_ref(src, rows, out)
    else:
        batch, block = rows.shape[0], _block_for(rows.shape[0])
        grid = (triton.cdiv(batch, block),)
        _gather_kernel[grid](src, rows, out, batch, src.shape[0], BLOCK=block)
    return out


def scatter_tokens(
    dst: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    backend: str = "torch",
    rows_checked: bool = False,
) -> None:
    """dst[rows[i]] = values[i]. Issues work on the current stream; `rows_checked` as in
    gather_tokens."""
    _check_backend(backend)
    _check_vector("dst", dst, (torch.int64,), dst.device)
    _check_vector("rows", rows, _ROW_DTYPES, dst.device)
    _check_vector("values", values, (torch.int64,), dst.device, length=rows.shape[0])
    if not rows_checked:
        _check_bounds(rows, dst.shape[0])
    if rows.shape[0] == 0:
        return
    if backend == "torch":
        scatter_tokens_ref(dst, rows, values)
    else:
        batch, block = rows.shape[0], _block_for(rows.shape[0])
        grid = (triton.cdiv(batch, block),)
        _scatter_kernel[grid](dst, rows, values, batch, dst.shape[0], BLOCK=block)


def _block_for(batch: int) -> int:
    """A power of two >= 16 covering small batches in one program, capped at _MAX_BLOCK."""
    return max(16, min(_MAX_BLOCK, triton.next_power_of_2(batch)))


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")


def _check_vector(
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    length: int | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length} (len(rows)), got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_bounds(rows: torch.Tensor, num_rows: int) -> None:
    """CPU only: reading the values of a CUDA tensor would synchronize the host."""
    if rows.device.type != "cpu" or rows.shape[0] == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(rows))
    if lo < 0 or hi >= num_rows:
        raise ValueError(f"rows must lie in [0, {num_rows}), got values in [{lo}, {hi}]")
