"""One forward over a batch mixing extend (prefill chunks) and decode requests
gives the same logits as running each request on its own."""

from __future__ import annotations

import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.kvcache.pools import slots_of
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.runner import ModelRunner


def _runner(model) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model_path=str(model),
            cache=CacheConfig(page_size=4, max_total_tokens=256, max_context=64),
        )
    )


def _place(r: ModelRunner, n: int) -> tuple[int, torch.Tensor]:
    row = r.req_pool.alloc()
    pages = r.kv_pool.allocator.alloc(r.kv_pool.allocator.pages_for(n))
    assert row is not None and pages is not None
    slots = slots_of(pages, n, 4)
    r.req_pool.req_to_token[row, :n] = slots.int()
    return row, slots


def _batch(parts: list[tuple[int, torch.Tensor, list[int], int]]) -> ForwardBatch:
    """parts: (row, slots, new token ids, start position)."""
    ids, pos, locs = [], [], []
    for _, slots, toks, start in parts:
        ids += toks
        pos += list(range(start, start + len(toks)))
        locs.append(slots[start : start + len(toks)])
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        out_cache_loc=torch.cat(locs),
        rows=torch.tensor([p[0] for p in parts]),
        seq_lens=[start + len(toks) for _, _, toks, start in parts],
        extend_lens=[len(toks) for _, _, toks, _ in parts],
    )


def test_mixed_extend_and_decode_batch(tiny_model) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 4096, (20,), generator=g).tolist()  # decodes its 20th token
    b = torch.randint(3, 4096, (30,), generator=g).tolist()  # second chunk: positions 12..29
    c = torch.randint(3, 4096, (9,), generator=g).tolist()  # whole prompt at once

    solo = _runner(tiny_model)
    expected = []
    for toks in (a, b, c):
        row, slots = _place(solo, len(toks))
        expected.append(solo.forward(_batch([(row, slots, toks, 0)]))[0])

    mixed = _runner(tiny_model)
    ra, sa = _place(mixed, 20)
    rb, sb = _place(mixed, 30)
    rc, sc = _place(mixed, 9)
    # history: a's first 19 tokens and b's first 12 are already in the pool
    mixed.forward(_batch([(ra, sa, a[:19], 0), (rb, sb, b[:12], 0)]))
    logits = mixed.forward(_batch([(ra, sa, a[19:], 19), (rb, sb, b[12:], 12), (rc, sc, c, 0)]))
    for got, want in zip(logits, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert int(got.argmax()) == int(want.argmax())
