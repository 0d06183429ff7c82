"""Attention backends over the paged KV pool, behind one small interface.

Each backend writes the step's K/V into the pool (at `batch.out_cache_loc`) and
attends every query token to its request's KV, read through
`req_to_token[row, :seq_len]`. Queries of an extend request at position p see
positions <= p (causal); a decode token sees the whole sequence. A layer with a
sliding window W (`windows[layer]` > 0) narrows that to positions p-W+1 .. p, as
transformers' sliding-window mask does; older positions stay in the pool.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.kernels.native import decode_ops, paged_decode
from pdserve.kernels.native.decode_ops import DecodeOps
from pdserve.kernels.native.paged_decode import PagedDecode
from pdserve.kernels.native.par import Threads
from pdserve.kvcache.pools import KVPool
from pdserve.model import decode_attention
from pdserve.model.forward_batch import ForwardBatch, device_tensor

log = logging.getLogger(__name__)


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


class TorchAttention:
    """The CPU backend: decode tokens batched with padding, extend requests one by one.
    Once `warm_up` has built the native kernel (fp32, `native_dir` given) every query
    token reads the pool in place through it, an extend's tokens each as one query over
    its causal keys (`_extend_native`); else decode tokens go through an eager gather
    (pdserve.model.decode_attention) and extends through torch's fused attention."""

    def __init__(
        self,
        pool: KVPool,
        req_to_token: torch.Tensor,
        scale: float,
        windows: tuple[int, ...] = (),
        native_dir: str | None = None,
        kernel_threads: Threads | None = None,
    ) -> None:
        """`windows[layer]`: 0 (or absent) for full causal attention, W for a sliding window.
        `native_dir`: where the native decode kernel is built and cached (None: eager);
        `kernel_threads`: the threads its calls may use (kernels/native/par.Split)."""
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.windows = windows
        self.native_dir = native_dir
        self._threads = kernel_threads
        self._native: PagedDecode | None = None
        self._kv_write: DecodeOps | None = None  # the pool write in one call, with _native

    def warm_up(self, num_heads: int | None = None) -> None:
        """Build (or load) the native kernel now: engines call it at start-up, so no
        step builds anything. With `num_heads` (the model's query heads) a shape the
        kernel does not take (kernels/native/paged_decode.c's limits) keeps the eager path
        instead of failing every step."""
        if self.native_dir is None or self.pool.k.dtype != torch.float32:
            return
        cache_dir, self.native_dir = Path(self.native_dir), None
        if self.pool.k.device.type != "cpu":
            return
        native = paged_decode.paged_decode(cache_dir, self._threads)
        if native is None:
            log.warning("attention stays eager (the native kernel was not built)")
            return
        _, kh, d = self.pool.k.shape[1:]
        if num_heads is not None and not native.takes(num_heads, kh, d):
            log.warning(
                "attention stays eager: the native kernel does not take %d query heads "
                "over %d KV heads of %d",
                num_heads,
                kh,
                d,
            )
            return
        self._native = native
        self._kv_write = decode_ops.decode_ops(cache_dir)

    @property
    def native(self) -> bool:
        return self._native is not None

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_plan = plan = _Plan.build(batch, self.req_to_token)
        for window in set(self.windows) | {0}:  # made here: the forward makes no index tensors
            if self._native is not None:
                plan.bounds(window)
                plan.extend_bounds(window)
            else:
                plan.hidden(window)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        plan = batch.attn_plan
        assert isinstance(plan, _Plan), "prepare() must run before forward()"
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        if self._kv_write is not None:
            self._kv_write.kv_write(kc, vc, batch.out_cache_loc, k, v)
        else:
            self.pool.write(layer, batch.out_cache_loc, k, v)
        window = self.window(layer)
        if not plan.extends:  # a decode step: token i is request i's one token
            return self._decode(q, kc, vc, plan, window).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if plan.decode_tok.numel():
            out[plan.decode_tok] = self._decode(q[plan.decode_tok], kc, vc, plan, window)
        if self._native is not None:
            for (tok, slots), bounds in zip(plan.extends, plan.extend_bounds(window)):
                self._extend_native(q[tok], kc, vc, slots, bounds, out[tok])
            return out.reshape(q.shape[0], -1)
        for tok, slots in plan.extends:
            out[tok] = self._extend(q[tok], kc[slots], vc[slots], window)
        return out.reshape(q.shape[0], -1)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: full attention)."""
        return self.windows[layer] if layer < len(self.windows) else 0

    def decode_keys(
        self, batch: ForwardBatch, windows: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A prepared pure decode step's keys, as the native kernel reads them: slots
        [B, Lmax] int64 and, per window, bounds [B, 2] (model/native_forward.py)."""
        plan = batch.attn_plan
        assert isinstance(plan, _Plan) and not plan.extends, "a prepared decode step"
        return plan.decode_slots, [plan.bounds(w) for w in windows]

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: _Plan, window: int
    ) -> torch.Tensor:
        if self._native is not None:
            return self._native(q, kc, vc, p.decode_slots, p.bounds(window), self.scale)
        return decode_attention.gathered(q, kc, vc, p.decode_slots, p.hidden(window), self.scale)

    def _extend_native(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slots: torch.Tensor,
        bounds: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """An extend's n query tokens [n, H, D] into `out` [n, H, D]: each one query of
        the decode kernel over its own keys (bounds [n, 2]), all reading one row of
        slots (a stride-0 view). Why not torch's fused attention: this reads the pool in
        place (no gather of the request's K/V per layer), and its token ranges go to
        par.c's threads in chunks (the causal work grows along the prompt, and a thread
        another process preempts holds up only its chunk); one thread, 8 heads of 64
        over 2 kv heads, 128-512 tokens: 0.63-0.66x the fused kernel's time."""
        assert self._native is not None
        n = q.shape[0]
        rows = slots[None].expand(n, slots.shape[0])
        self._native(q, kc, vc, rows, bounds, self.scale, out=out, grain=max(1, n // 16))

    def _extend(
        self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, window: int
    ) -> torch.Tensor:
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
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def padded_slots(
    table: torch.Tensor, rows: list[int], lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, pad, lens) of decode requests, on the table's device: slots [B, Lmax]
    int64 is table[rows[i], :lens[i]] padded with slot 0, pad [B, Lmax] bool is True at
    the padding, lens [B] int64; Lmax = max(lens).

    On the CPU through numpy, not torch. The overlap scheduler builds this on its
    schedule thread while the previous step's forward holds the cores, and torch's CPU
    kernels hand work to their OpenMP threads, which then wait for a core: a small
    gather's mean time a step grows many times over its median, while numpy's stays
    flat (it runs on the calling thread)."""
    lmax = max(lens, default=0)
    if table.device.type != "cpu":
        keys = device_tensor(lens, torch.int64, table.device)
        pad = torch.arange(lmax, device=table.device)[None, :] >= keys[:, None]
        index = device_tensor(rows, torch.int64, table.device)
        return table[index, :lmax].long().masked_fill(pad, 0), pad, keys
    keys_np = np.asarray(lens, dtype=np.int64)
    pad_np = np.arange(lmax)[None, :] >= keys_np[:, None]
    slots = table.numpy()[rows, :lmax].astype(np.int64)
    slots[pad_np] = 0
    return torch.from_numpy(slots), torch.from_numpy(pad_np), torch.from_numpy(keys_np)


class _Plan:
    """Per-forward gather indices, shared by all layers."""

    decode_tok: torch.Tensor  # [Bd] token indices of decode requests
    decode_slots: torch.Tensor  # [Bd, Lmax] KV slots (padding -> slot 0)
    decode_pad: torch.Tensor  # [Bd, Lmax] True where padded
    decode_lens: torch.Tensor  # [Bd] seq_lens of decode requests
    decode_lens_host: np.ndarray | None  # the same on the host (CPU plans only)
    _hidden: dict[int, torch.Tensor]  # window -> [Bd, Lmax] True where not attended
    _bounds: dict[int, torch.Tensor]  # window -> [Bd, 2] (first attended position, seq_len)
    extends: list[tuple[slice, torch.Tensor]]  # (token range, KV slots) per extend request
    _extend_bounds: dict[int, list[torch.Tensor]]  # window -> per extend [n, 2], as _bounds

    @classmethod
    def build(cls, batch: ForwardBatch, req_to_token: torch.Tensor) -> _Plan:
        plan = cls()
        rows = batch.rows_on_host()
        starts = [0]
        for n in batch.extend_lens:
            starts.append(starts[-1] + n)
        dec = [i for i, n in enumerate(batch.extend_lens) if n == 1]
        plan.extends = [
            (slice(starts[i], starts[i + 1]), req_to_token[rows[i], : batch.seq_lens[i]].long())
            for i, n in enumerate(batch.extend_lens)
            if n != 1
        ]
        device = req_to_token.device
        plan.decode_tok = device_tensor([starts[i] for i in dec], torch.int64, device)
        lens = [batch.seq_lens[i] for i in dec]
        plan.decode_slots, plan.decode_pad, plan.decode_lens = padded_slots(
            req_to_token, [rows[i] for i in dec], lens
        )
        plan.decode_lens_host = plan.decode_lens.numpy() if device.type == "cpu" else None
        plan._hidden = {0: plan.decode_pad}
        plan._bounds = {}
        plan._extend_bounds = {}
        return plan

    def hidden(self, window: int) -> torch.Tensor:
        """[Bd, Lmax]: True at the keys a decode token does not attend to (padding, and
        with a window the positions below seq_len - window)."""
        if window not in self._hidden:
            ar = torch.arange(self.decode_pad.shape[1], device=self.decode_pad.device)
            below = ar[None, :] < (self.decode_lens - window)[:, None]
            self._hidden[window] = self.decode_pad | below
        return self._hidden[window]

    def extend_bounds(self, window: int) -> list[torch.Tensor]:
        """Per extend request, [n, 2] int64 on the host: (first position, keys) of each of
        its tokens: the token at position p sees [0, p + 1), with a window W
        [max(0, p + 1 - W), p + 1), as `_extend`'s mask says."""
        if window not in self._extend_bounds:
            out = []
            for tok, slots in self.extends:  # slots: the request's whole sequence
                total = slots.shape[0]
                keys = torch.arange(total - (tok.stop - tok.start), total) + 1
                first = (keys - window).clamp(min=0) if window else torch.zeros_like(keys)
                out.append(torch.stack([first, keys], dim=1).contiguous())
            self._extend_bounds[window] = out
        return self._extend_bounds[window]

    def bounds(self, window: int) -> torch.Tensor:
        """[Bd, 2] int64: (first position a decode token attends to, seq_len); the keys
        are positions [first, seq_len), as `hidden(window)` says with a mask."""
        if window not in self._bounds:
            if self.decode_lens_host is not None:  # numpy: see host_bounds
                self._bounds[window] = torch.from_numpy(host_bounds(self.decode_lens_host, window))
            else:
                lens = self.decode_lens
                first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
                self._bounds[window] = torch.stack([first, lens], dim=1).contiguous()
        return self._bounds[window]


def host_bounds(lens: np.ndarray, window: int) -> np.ndarray:
    """[B, 2] int64 (first attended position, seq_len) of decode lengths `lens`.

    numpy, not torch: the native forward asks for these on the forward stream's thread
    just before its one native call, and torch's CPU ops let go of the GIL and must take
    it back, while the schedule thread (woken by the previous step's end) holds it for
    its Python: each op waited for that (scheduler/future_map.py, resolve)."""
    out = np.empty((lens.shape[0], 2), dtype=np.int64)
    out[:, 0] = np.maximum(lens - window, 0) if window else 0
    out[:, 1] = lens
    return out
