"""The CPU attention backends' per-forward plan: the index tensors every layer shares,
made once on the schedule side (`Plan.build`, from `prepare`), so the forward itself makes
none. Decode tokens read their keys as padded slots (`padded_slots`) with, per window, a
mask (`hidden`, the portable backend) or bounds (`bounds`, the native kernel); extend
requests as their slot range with, per window, each token's bounds (`extend_bounds`)."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.model.forward_batch import ForwardBatch, device_tensor


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


class Plan:
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
    def build(cls, batch: ForwardBatch, req_to_token: torch.Tensor) -> Plan:
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
