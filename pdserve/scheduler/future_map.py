"""FutureMap: the last sampled token of every request row, kept on the device.

    output_tokens[rows]  int64
    row 0 ............ padding: padded batch entries resolve from / publish into it
    rows 1..R-1 ...... output_tokens[row] = last token of the request in `row`

A decode step resolves its input ids from here and publishes its sampled tokens
back, both on the forward stream, so tokens never round-trip through the host
between steps and the scheduler can build step N+1 before step N's tokens arrive.
"""

from __future__ import annotations

import torch

from pdserve.kernels.future_map import BACKENDS, gather_tokens, scatter_tokens


class FutureMap:
    """Per-row device state: output_tokens[row] is the last sampled token of the request in `row`."""

    def __init__(self, rows: int, device: str = "cpu", backend: str = "torch") -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1 (row 0 is padding), got {rows}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
        self.device = torch.device(device)
        self.backend = backend
        self.output_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        # CPU: the same memory as a numpy array, for resolve (made here, not on the stream)
        cpu = self.device.type == "cpu" and backend == "torch"
        self._host_tokens = self.output_tokens.numpy() if cpu else None

    @property
    def rows(self) -> int:
        return self.output_tokens.shape[0]

    def check_rows(self, rows: list[int]) -> None:
        """Host-side validation of a step's rows, done on the schedule side so that
        resolve/publish on the forward stream never read device values."""
        if rows and not (0 <= min(rows) and max(rows) < self.rows):
            raise ValueError(f"rows must lie in [0, {self.rows}), got {rows}")

    def resolve(self, rows: torch.Tensor, host_rows: list[int] | None = None) -> torch.Tensor:
        """Input ids of a decode step: a new [B] int64 tensor, output_tokens[rows].

        Call on the forward stream, after the publish of the previous step was
        issued there (stream order makes the read see it). `rows`: [B] int32/int64
        on this map's device, each in [0, self.rows), checked with `check_rows`;
        `host_rows`, the same rows as a list, where the caller has them.
        """
        if self._host_tokens is not None and host_rows is not None:
            # NOTE: numpy on the CPU, not torch. This runs on the forward stream's thread
            # as a step starts, just as the schedule thread wakes for the previous step's
            # tokens and runs its Python. A torch CPU op lets go of the GIL and must take
            # it back, which waits for that Python (about 0.1 ms a step, the forward's cores
            # idle meanwhile); numpy's indexing keeps the GIL, so the forward reaches its
            # native call (which runs without the GIL) first.
            return torch.from_numpy(self._host_tokens[host_rows])
        return gather_tokens(self.output_tokens, rows, backend=self.backend, rows_checked=True)

    def publish(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """output_tokens[rows] = tokens: the sampled tokens of a step. Call on the forward
        stream. `tokens`: [B] int64 on this map's device; rows as in resolve."""
        scatter_tokens(self.output_tokens, rows, tokens, backend=self.backend, rows_checked=True)

    def stash(self, row: int, token: int) -> None:
        """output_tokens[row] = token: the first token of a prebuilt request.

        Call on the schedule stream, and only after the forward stream holds no
        in-flight step that may still publish into `row` (the caller fences with
        schedule_stream.wait_stream(forward_stream), docs/architecture.md §3 row-reuse race).
        """
        if not 0 < row < self.rows:
            raise ValueError(f"row must lie in [1, {self.rows}) (row 0 is padding), got {row}")
        rows = torch.tensor([row], dtype=torch.int64, device=self.device)
        tokens = torch.tensor([token], dtype=torch.int64, device=self.device)
        scatter_tokens(self.output_tokens, rows, tokens, backend=self.backend)
