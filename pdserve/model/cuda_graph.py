"""The decode forward replayed from CUDA graphs, one per batch-size bucket.

A decode step launches a few hundred small kernels (several per layer, the Triton
attention among them). On a GPU, issuing them from Python takes longer than running
them, and on CUDA that issuing happens on the scheduler thread, so the overlap loop has
nothing to hide behind. Each bucket's forward is captured once at start-up over static
input buffers; a step copies its inputs into the buffers of the smallest bucket that
holds it, pads the rest, replays the graph and reads the first B rows of its logits.

Static buffers (M = the largest bucket); bucket b captures over [:b]:

    entry        0 .. B-1              B .. b-1 (padding)
    input_ids    the step's tokens     0
    positions    the step's            0
    out_loc      the step's KV slots   0   (page 0 is padding: absorbs padded writes)
    rows         the step's rows       0   (row 0 is padding: req_to_token[0] -> slot 0)
    seq_lens     the step's            1   (a padded entry attends to slot 0 alone)
    tok          0 .. b-1, fixed (one token a request)

Only decode batches (every extend_len 1) of at most M requests replay; anything else
runs the forward eagerly. Resolve, sampling and publish stay outside the graph: they
depend on each request's sampling parameters, and are few kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from pdserve.model.attention.triton_backend import TritonAttention
from pdserve.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch], torch.Tensor]  # a prepared batch -> logits [B, vocab]


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: powers of two to 8, then steps of 8 to 64, of 16 to 128,
    of 32 beyond; always max_batch itself (a step pads to the next bucket)."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 129, 16))
    sizes += list(range(160, max_batch + 1, 32))
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


class _Static:
    """The graphs' input buffers, sized for the largest bucket."""

    def __init__(self, size: int, device: torch.device) -> None:
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(torch.int64), zeros(torch.int64)
        self.out_loc, self.rows = zeros(torch.int64), zeros(torch.int64)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.tok = torch.arange(size, dtype=torch.int32, device=device)
        self.last = torch.arange(size, dtype=torch.int64, device=device)
        self.loaded = 0  # INVARIANT: entries from here on hold padding

    def batch(self, b: int, attn: TritonAttention) -> ForwardBatch:
        """A decode batch of b entries over the buffers (the graph's inputs)."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            out_cache_loc=self.out_loc[:b],
            rows=self.rows[:b],
            seq_lens=[1] * b,
            extend_lens=[1] * b,
        )
        batch.last_index = self.last[:b]
        batch.attn_plan = attn.static_decode_plan(self.rows[:b], self.seq_lens[:b], self.tok[:b])
        return batch

    def load(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        """Copy a prepared decode batch of n entries in; every entry past n is padding."""
        n = batch.batch_size
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_loc[:n].copy_(batch.out_cache_loc)
        self.rows[:n].copy_(batch.rows)
        self.seq_lens[:n].copy_(seq_lens)
        if n < self.loaded:  # a larger step left its entries here: pad them again, once
            for buf in (self.input_ids, self.positions, self.out_loc, self.rows):
                buf[n : self.loaded].zero_()
            self.seq_lens[n : self.loaded].fill_(1)
        self.loaded = n


@dataclass
class _Bucket:
    size: int
    replay: Callable[[], None]
    logits: torch.Tensor  # [size, vocab]: written by each replay


class GraphedDecode:
    """Decode forwards replayed from per-bucket graphs. Build with `capture`."""

    def __init__(self, static: _Static, graphs: list[_Bucket]) -> None:
        self.static = static
        self.graphs = graphs  # ascending sizes
        self.max_batch = graphs[-1].size

    @classmethod
    def capture(
        cls, forward: Forward, attn: TritonAttention, max_batch: int, device: torch.device
    ) -> GraphedDecode:
        """Capture `forward` for every bucket up to max_batch (largest first, so the
        smaller ones reuse its memory pool). Precondition: no request is running (the
        warm-up and capture forwards write padding KV and read the pools).

        Off CUDA there is nothing to capture: each bucket's "replay" runs `forward` over
        the static buffers and copies its logits into the bucket's output. The runner
        never does that; tests do, to check the buckets, buffers and padding on a CPU."""
        sizes = buckets(max_batch)
        static = _Static(sizes[-1], device)
        if device.type == "cuda":
            record = partial(_capture_one, forward, pool=torch.cuda.graph_pool_handle())
        else:
            record = partial(_run_eagerly, forward)
        graphs = [record(static.batch(b, attn)) for b in reversed(sizes)]
        log.info("captured the decode forward for batch sizes %s", sizes)
        return cls(static, graphs[::-1])

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and 0 < batch.batch_size <= self.max_batch

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of a prepared decode batch (`fits`), a view of the bucket's
        output that the next replay of that bucket overwrites: read it on this stream,
        before the next step (the overlap loop's forward stream runs steps in order)."""
        n = batch.batch_size
        graph = next(g for g in self.graphs if g.size >= n)
        seq_lens = batch.attn_plan.dec_lens  # type: ignore[attr-defined]  # a Triton plan
        # NOTE: the buffers are shared by every step: loaded and replayed on the current
        # (forward) stream only, so a step's load cannot overtake the previous replay
        self.static.load(batch, seq_lens)
        graph.replay()
        return graph.logits[:n]


def _capture_one(forward: Forward, batch: ForwardBatch, pool: Any) -> _Bucket:
    # Warm up on a side stream first (Triton's compilation, cuBLAS's workspaces): work
    # the capture must not see for the first time.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the transfer's I/O thread may touch CUDA while this thread captures
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        logits = forward(batch)
    return _Bucket(batch.batch_size, graph.replay, logits)


def _run_eagerly(forward: Forward, batch: ForwardBatch) -> _Bucket:
    logits = forward(batch).clone()

    def replay() -> None:
        logits.copy_(forward(batch))

    return _Bucket(batch.batch_size, replay, logits)
