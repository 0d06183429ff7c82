"""What one forward pass needs: tokens, positions, where their KV goes, per-request lengths.

A batch holds B requests and T tokens laid out request after request:

    tokens  |-- req 0: extend_lens[0] --|-- req 1 --| ... |-- req B-1 --|
    req i's tokens sit at positions seq_lens[i]-extend_lens[i] .. seq_lens[i]-1

A decode request has extend_len 1; an extend (prefill) request has extend_len >= 1
and may be one chunk of a longer prompt (its earlier chunks are already in the KV pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def device_tensor(
    values: list[int], dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """Host values as a tensor on `device`, for the inputs of a step built on the schedule
    side. On CUDA they are staged in pinned memory and copied with non_blocking (torch's
    pinned allocator keeps the staging buffer until the copy is done), so the host never
    waits; a stream that reads the result must be ordered after the issuing stream."""
    if torch.device(device).type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype)


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64; for decode steps filled on the forward stream (resolve)
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot written for each token
    rows: torch.Tensor  # [B] int64: request rows in req_to_token
    seq_lens: list[int]  # [B] KV length of each request after this step (host)
    extend_lens: list[int]  # [B] new tokens of each request (host)
    host_rows: list[int] | None = None  # [B] `rows` on the host, when the builder has them
    # [B] the sequence length longrope / dynamic take their frequencies of, where it is
    # not seq_lens (scheduler/rekey.py: transformers' forward holds one more token)
    rope_lens: list[int] | None = None
    # Filled by ModelRunner.prepare on the schedule side, so that the forward itself only
    # issues device work and never reads a device value on the host:
    last_index: torch.Tensor | None = None  # [B] see last_token_index()
    attn_plan: object | None = None  # the attention backend's per-forward index vectors

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def last_token_index(self) -> torch.Tensor:
        """[B] index into the T tokens of each request's last token (where logits are read)."""
        ends, total = [], 0
        for n in self.extend_lens:
            total += n
            ends.append(total - 1)
        return device_tensor(ends, torch.int64, self.positions.device)

    def rows_on_host(self) -> list[int]:
        """`rows` as host ints (a device read only when the builder gave no host copy)."""
        return self.host_rows if self.host_rows is not None else self.rows.tolist()
