"""The Triton attention backend: paged decode and extend kernels over the KV pool.

Registered as "triton" in `attention/registry.py`, where "auto" picks it on CUDA. Without CUDA the kernels run under
the Triton interpreter (pdserve.kernels sets TRITON_INTERPRET): correct, but slow,
which is why "auto" keeps the torch backend on CPU.

Per forward, `prepare` splits the batch once into decode requests (extend_len 1) and
extend requests and moves their index vectors to the device; every layer then
writes its K/V into the pool and launches at most one kernel of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pdserve.kernels  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from pdserve.kernels.attention_triton import decode_attention, extend_attention
from pdserve.kvcache.pools import KVPool
from pdserve.model.forward_batch import ForwardBatch, device_tensor


@dataclass(slots=True)
class _TritonPlan:
    """Index vectors on the device, shared by all layers of one forward."""

    dec_rows: torch.Tensor  # [Bd] request rows of decode requests
    dec_lens: torch.Tensor  # [Bd] int32 seq_lens
    dec_tok: torch.Tensor  # [Bd] token index in the batch's T tokens
    ext_rows: torch.Tensor  # [Be]
    ext_lens: torch.Tensor  # [Be] int32 seq_lens
    ext_new: torch.Tensor  # [Be] int32 extend_lens
    ext_starts: torch.Tensor  # [Be] first token index
    max_extend: int  # host copy of max(ext_new), sizes the grid

    @classmethod
    def build(cls, batch: ForwardBatch) -> _TritonPlan:
        starts, pos = [], 0
        for n in batch.extend_lens:
            starts.append(pos)
            pos += n
        dec = [i for i, n in enumerate(batch.extend_lens) if n == 1]
        ext = [i for i, n in enumerate(batch.extend_lens) if n != 1]
        device = batch.rows.device

        def vec(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return device_tensor(values, dtype, device)

        # rows are gathered on the device: batch.rows may still be in flight there
        return cls(
            dec_rows=batch.rows[vec(dec, torch.int64)],
            dec_lens=vec([batch.seq_lens[i] for i in dec]),
            dec_tok=vec([starts[i] for i in dec]),
            ext_rows=batch.rows[vec(ext, torch.int64)],
            ext_lens=vec([batch.seq_lens[i] for i in ext]),
            ext_new=vec([batch.extend_lens[i] for i in ext]),
            ext_starts=vec([starts[i] for i in ext]),
            max_extend=max((batch.extend_lens[i] for i in ext), default=0),
        )


class TritonAttention:
    """Same contract as TorchAttention (see pdserve.model.attention.backends.AttentionBackend)."""

    def __init__(
        self,
        pool: KVPool,
        req_to_token: torch.Tensor,
        scale: float,
        windows: tuple[int, ...] = (),
    ) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.windows = windows  # per layer: 0 = full causal, W = sliding window

    def prepare(self, batch: ForwardBatch) -> None:
        """Precondition: batch.seq_lens[i] >= batch.extend_lens[i] >= 1 and every
        position below seq_lens[i] - extend_lens[i] already has its K/V in the pool."""
        batch.attn_plan = _TritonPlan.build(batch)

    def static_decode_plan(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, tok: torch.Tensor
    ) -> _TritonPlan:
        """The plan of a decode batch over caller-owned buffers (a CUDA graph's inputs:
        the plan's tensors stay the same, their contents change). rows int64, seq_lens
        and tok int32, all [B] on the pool's device."""
        none = rows[:0].to(torch.int32)
        return _TritonPlan(rows, seq_lens, tok, rows[:0], none, none, none, max_extend=0)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D] of this step -> [T, H * D]."""
        plan = batch.attn_plan
        assert isinstance(plan, _TritonPlan), "prepare() must run before forward()"
        self.pool.write(layer, batch.out_cache_loc, k, v)
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        r2t, scale = self.req_to_token, self.scale
        window = self.windows[layer] if layer < len(self.windows) else 0
        if plan.dec_rows.numel():
            decode_attention(
                q, kc, vc, out, r2t, plan.dec_rows, plan.dec_lens, plan.dec_tok, scale, window
            )  # fmt: skip
        if plan.ext_rows.numel():
            extend_attention(
                q, kc, vc, out, r2t, plan.ext_rows, plan.ext_lens, plan.ext_new,
                plan.ext_starts, plan.max_extend, scale, window,
            )  # fmt: skip
        return out.reshape(q.shape[0], -1)
