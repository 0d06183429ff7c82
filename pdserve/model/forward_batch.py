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


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64; for decode steps filled on the forward stream (resolve)
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot written for each token
    rows: torch.Tensor  # [B] int64: request rows in req_to_token
    seq_lens: list[int]  # [B] KV length of each request after this step (host)
    extend_lens: list[int]  # [B] new tokens of each request (host)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def last_token_index(self) -> torch.Tensor:
        """[B] index into the T tokens of each request's last token (where logits are read)."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.positions.device)
