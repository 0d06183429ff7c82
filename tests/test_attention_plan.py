"""The attention plan's decode keys (model/attention/backends.py, padded_slots): on the CPU they
are built with numpy, not torch's kernels, and must be exactly what torch's
`table[rows, :Lmax]` masked past each request's length gives, as copies. The same for
the native forward's per-window bounds (host_bounds)."""

from __future__ import annotations

import torch

from pdserve.model.attention.plan import host_bounds, padded_slots


def _table() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 1 << 20, (32, 48), generator=g, dtype=torch.int32)


def _expected(table: torch.Tensor, rows: list[int], lens: list[int]) -> tuple:
    lmax = max(lens, default=0)
    pad = torch.arange(lmax)[None, :] >= torch.tensor(lens, dtype=torch.int64)[:, None]
    return table[torch.tensor(rows, dtype=torch.int64), :lmax].long().masked_fill(pad, 0), pad


def test_rows_in_any_order_with_repeats_match_torch() -> None:
    table = _table()
    rows, lens = [7, 0, 31, 7, 12, 3], [5, 48, 1, 17, 30, 48]
    slots, pad, keys = padded_slots(table, rows, lens)
    want_slots, want_pad = _expected(table, rows, lens)
    assert slots.dtype == keys.dtype == torch.int64 and pad.dtype == torch.bool
    assert keys.tolist() == lens
    assert torch.equal(slots, want_slots) and torch.equal(pad, want_pad)
    assert int(pad.sum()) == sum(48 - n for n in lens) and (slots[pad] == 0).all()


def test_no_decode_requests_give_empty_keys() -> None:
    slots, pad, keys = padded_slots(_table(), [], [])
    assert slots.shape == pad.shape == (0, 0) and keys.shape == (0,)


def test_the_keys_are_a_copy() -> None:
    table = _table()
    before = table.clone()
    slots, _, _ = padded_slots(table, [4, 5], [8, 3])
    slots.fill_(-1)  # writing to the plan must never write the table
    assert torch.equal(table, before)
    table[4, 0] = 123
    assert slots[0, 0] == -1


def test_host_bounds_match_torch_for_every_window() -> None:
    lens = torch.tensor([1, 5, 16, 17, 300], dtype=torch.int64)
    for window in (0, 1, 4, 16, 1000):
        first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
        want = torch.stack([first, lens], dim=1)
        got = torch.from_numpy(host_bounds(lens.numpy(), window))
        assert got.dtype == torch.int64 and got.is_contiguous() and torch.equal(got, want)
