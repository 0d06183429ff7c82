"""Attention backends over the paged KV pool, behind one small interface.

Each backend writes the step's K/V into the pool (at `batch.out_cache_loc`) and
attends every query token to its request's KV, read through
`req_to_token[row, :seq_len]`. Queries of an extend request at position p see
positions <= p (causal); a decode token sees the whole sequence. A layer with a
sliding window W (`windows[layer]` > 0) narrows that to positions p-W+1 .. p, as
transformers' sliding-window mask does; older positions stay in the pool.

On the CPU two backends share one forward (`CpuAttention`: decode tokens batched with
padding, extend requests one by one) and differ in how they compute it:

    TorchAttention   portable: decode tokens through an eager gather
                     (model/attention/gather.py), extends through torch's fused attention
    NativeAttention  kernels/native/paged_decode.c reads the pool in place, every query
                     token (an extend's too, head sizes 64 and 128; others take torch's
                     fused attention) one query of it; the KV write in one call

A runner starts on TorchAttention; a CPU engine's warm-up swaps in NativeAttention
where the kernel builds and takes the model's shape (model/native_kernels.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.kernels.native.decode_ops import DecodeOps
from pdserve.kernels.native.paged_decode import PagedDecode
from pdserve.kvcache.pools import KVPool
from pdserve.model.attention import gather as decode_attention
from pdserve.model.attention.plan import Plan
from pdserve.model.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> None:
        """Called once per forward, on the schedule side, before the forward is issued:
        stores the forward's index vectors in `batch.attn_plan` (never on the backend,
        since step N+1 is prepared while step N still runs)."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D] of this step -> [T, H * D]."""
        ...


class CpuAttention:
    """The CPU backends' forward: the KV write, then decode tokens batched with padding
    and extend requests one by one. Subclasses say how each part is computed."""

    def __init__(
        self, pool: KVPool, req_to_token: torch.Tensor, scale: float, windows: tuple[int, ...] = ()
    ) -> None:
        """`windows[layer]`: 0 (or absent) for full causal attention, W for a sliding window."""
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.windows = windows

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_plan = plan = Plan.build(batch, self.req_to_token)
        for window in set(self.windows) | {0}:  # made here: the forward makes no index tensors
            self._plan_window(plan, window)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        plan = batch.attn_plan
        assert isinstance(plan, Plan), "prepare() must run before forward()"
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        self._write(layer, kc, vc, batch.out_cache_loc, k, v)
        window = self.window(layer)
        if not plan.extends:  # a decode step: token i is request i's one token
            return self._decode(q, kc, vc, plan, window).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if plan.decode_tok.numel():
            out[plan.decode_tok] = self._decode(q[plan.decode_tok], kc, vc, plan, window)
        self._extends(q, kc, vc, plan, window, out)
        return out.reshape(q.shape[0], -1)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: full attention)."""
        return self.windows[layer] if layer < len(self.windows) else 0

    def _plan_window(self, plan: Plan, window: int) -> None:
        """Make the plan's index tensors of `window` that `_decode` and `_extends` read."""
        raise NotImplementedError

    def _write(
        self,
        layer: int,
        kc: torch.Tensor,
        vc: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """This step's K and V [T, KH, D] into layer `layer`'s pool (kc, vc) at slots `loc`."""
        self.pool.write(layer, loc, k, v)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: Plan, window: int
    ) -> torch.Tensor:
        """The plan's decode tokens' queries q [Bd, H, D] -> [Bd, H, D]."""
        raise NotImplementedError

    def _extends(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        p: Plan,
        window: int,
        out: torch.Tensor,
    ) -> None:
        """Every extend request's tokens of q [T, H, D] into their rows of `out`."""
        raise NotImplementedError


def fused_extend(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, window: int, scale: float
) -> torch.Tensor:
    """One extend's queries q [n, H, D] over its keys and values [total, KH, D] (the
    last n the queries' own) by torch's fused attention."""
    n, total = q.shape[0], keys.shape[0]
    # query i sits at position total - n + i and sees keys 0 .. total - n + i,
    # with a window only keys total - n + i - window + 1 .. total - n + i
    # a whole prompt that no window narrows is plain causal: is_causal skips the blocks
    # above the diagonal (same bits as the mask, 7-9% faster at 128-384 tokens here)
    mask = None
    if total != n or (window and window < n):
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        if window:
            mask = mask.triu(total - n - window + 1)
    # 4-D [1, H, n, D]: on CPU that takes torch's fused (flash) kernel, which
    # handles the mask and the grouped heads itself; 3-D inputs take the unfused
    # path (bmm, softmax, mask checks), 1.5-2.5x slower at prompt lengths of 256
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        vals.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


class TorchAttention(CpuAttention):
    """The portable CPU backend (any dtype, no compiler): decode tokens through an eager
    gather, extends through torch's fused attention."""

    def _plan_window(self, plan: Plan, window: int) -> None:
        plan.hidden(window)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: Plan, window: int
    ) -> torch.Tensor:
        return decode_attention.gathered(q, kc, vc, p.decode_slots, p.hidden(window), self.scale)

    def _extends(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        p: Plan,
        window: int,
        out: torch.Tensor,
    ) -> None:
        for tok, slots in p.extends:
            out[tok] = fused_extend(q[tok], kc[slots], vc[slots], window, self.scale)


# head sizes paged_decode.c has a fixed-size copy of (its extends are faster there)
NATIVE_EXTEND_D = (64, 128)


class NativeAttention(CpuAttention):
    """The CPU backend on kernels/native/paged_decode.c (fp32): every query token reads
    the pool in place, an extend's tokens each as one query over its causal keys; the
    step's K and V go into the pool in one call (kernels/native/decode_ops.c)."""

    def __init__(
        self,
        pool: KVPool,
        req_to_token: torch.Tensor,
        scale: float,
        windows: tuple[int, ...],
        kernel: PagedDecode,
        kv_write: DecodeOps,
    ) -> None:
        """Precondition: `kernel.takes` the model's heads and the pool is fp32 on the CPU
        (model/native_kernels.py checks both)."""
        super().__init__(pool, req_to_token, scale, windows)
        self.kernel = kernel
        self._kv_write = kv_write

    def decode_keys(
        self, batch: ForwardBatch, windows: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A prepared pure decode step's keys, as the native kernel reads them: slots
        [B, Lmax] int64 and, per window, bounds [B, 2] (model/native_forward.py)."""
        plan = batch.attn_plan
        assert isinstance(plan, Plan) and not plan.extends, "a prepared decode step"
        return plan.decode_slots, [plan.bounds(w) for w in windows]

    def _plan_window(self, plan: Plan, window: int) -> None:
        plan.bounds(window)
        plan.extend_bounds(window)

    def _write(
        self,
        layer: int,
        kc: torch.Tensor,
        vc: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        self._kv_write.kv_write(kc, vc, loc, k, v)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: Plan, window: int
    ) -> torch.Tensor:
        return self.kernel(q, kc, vc, p.decode_slots, p.bounds(window), self.scale)

    def _extends(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        p: Plan,
        window: int,
        out: torch.Tensor,
    ) -> None:
        """Each extend's n query tokens [n, H, D] into `out`: each one query of the
        decode kernel over its own keys (bounds [n, 2]), all reading one row of slots
        (a stride-0 view). Why not torch's fused attention: this reads the pool in place
        (no gather of the request's K/V per layer), and its token ranges go to par.c's
        threads in chunks (the causal work grows along the prompt, and a thread another
        process preempts holds up only its chunk); one thread, 8 heads of 64 over 2 kv
        heads, 128-512 tokens: 0.63-0.66x the fused kernel's time. A head size without
        the kernel's fixed-size copies (NATIVE_EXTEND_D) takes the fused kernel: Gemma 3's
        256, one thread's generic loop, ran 4x its time at 512 tokens."""
        if q.shape[-1] not in NATIVE_EXTEND_D:
            for tok, slots in p.extends:
                out[tok] = fused_extend(q[tok], kc[slots], vc[slots], window, self.scale)
            return
        for (tok, slots), bounds in zip(p.extends, p.extend_bounds(window)):
            n = tok.stop - tok.start
            rows = slots[None].expand(n, slots.shape[0])
            self.kernel(
                q[tok], kc, vc, rows, bounds, self.scale, out=out[tok], grain=max(1, n // 16)
            )
