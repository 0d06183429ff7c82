"""Reusable host staging buffers for outgoing KV frames.

A buffer is handed to ZeroMQ zero-copy; it is reused only after every message
that referenced it reports done through its MessageTracker. Reuse matters: a
fresh 10 MB allocation page-faults on first touch, which costs more than the copy.
"""

from __future__ import annotations

import numpy as np
import torch
import zmq


class StagingPool:
    def __init__(
        self, numel: int, dtype: torch.dtype, pin: bool = False, max_busy: int = 8
    ) -> None:
        self.numel = numel
        self.max_busy = max_busy
        self.dtype = dtype
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, list[zmq.MessageTracker]]] = []

    def gather(self, src: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """Copy src[:, idx] ([L, n, ...] with idx over dim 1) into a staging buffer.

        Returns (buffer, numpy view of the gathered bytes). Precondition: the result
        fits (L * n * row elements <= numel); call `hold` once the view is sent.
        """
        buf = self._take()
        shape = (src.shape[0], len(idx), *src.shape[2:])
        n = int(np.prod(shape))
        out = buf[:n].view(shape)
        if src.is_cuda:
            out.copy_(src.index_select(1, idx))
        else:
            torch.index_select(src, 1, idx, out=out)
        return buf, out.numpy()

    def hold(self, buf: torch.Tensor, trackers: list[zmq.MessageTracker]) -> None:
        """`buf` is in flight until every tracker is done."""
        self._busy.append((buf, trackers))

    def _take(self) -> torch.Tensor:
        self._reclaim()
        if not self._free and len(self._busy) >= self.max_busy:
            # backpressure: bounded wait for the oldest frame (a dead peer never finishes)
            for t in self._busy[0][1]:
                try:
                    t.wait(timeout=0.05)
                except zmq.NotDone:
                    break
            self._reclaim()
        if self._free:
            return self._free.pop()
        return torch.empty(self.numel, dtype=self.dtype, pin_memory=self.pin)

    def _reclaim(self) -> None:
        still = []
        for buf, trackers in self._busy:
            if all(t.done for t in trackers):
                self._free.append(buf)
            else:
                still.append((buf, trackers))
        self._busy = still
