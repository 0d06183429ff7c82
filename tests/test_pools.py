from __future__ import annotations

import pytest

from pdserve.kvcache.pools import PageAllocator, PoolError, ReqToTokenPool, slots_of


def test_rows_exact_accounting_and_generation() -> None:
    pool = ReqToTokenPool(rows=4, max_context=8)
    assert pool.total_rows == 3 and pool.free_rows == 3
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]  # row 0 is never handed out
    assert pool.alloc() is None
    pool.free(rows[0])
    again = pool.alloc()
    assert again == rows[0] and pool.handouts[again] == 2
    for r in [again, rows[1], rows[2]]:
        pool.free(r)
    assert pool.free_rows == pool.total_rows


def test_double_free_and_foreign_free_raise() -> None:
    pool = ReqToTokenPool(rows=3, max_context=4)
    r = pool.alloc()
    assert r is not None
    pool.free(r)
    with pytest.raises(PoolError):
        pool.free(r)
    with pytest.raises(PoolError):
        pool.free(0)
    pages = PageAllocator(num_pages=5, page_size=4)
    got = pages.alloc(2)
    assert got is not None
    with pytest.raises(PoolError):
        pages.free([4 if 4 not in got else 3])
    pages.free(got)
    with pytest.raises(PoolError):
        pages.free(got[:1])


def test_page_alloc_is_all_or_nothing() -> None:
    pages = PageAllocator(num_pages=5, page_size=4)
    assert pages.total_pages == 4
    assert pages.alloc(5) is None and pages.free_pages == 4
    a = pages.alloc(3)
    assert a is not None and 0 not in a and pages.free_pages == 1
    assert pages.pages_for(9) == 3


def test_slots_follow_pages_in_order() -> None:
    assert slots_of([3, 1], 6, 4).tolist() == [12, 13, 14, 15, 4, 5]


def test_context_length_defaults_to_the_model_capped_by_the_pool() -> None:
    from pdserve.config import CacheConfig

    pool = CacheConfig(page_size=16, max_total_tokens=65536)
    assert pool.context_length(8192) == 8192  # SmolLM2's own
    assert pool.context_length(32768) == 32768  # Qwen2.5's
    assert pool.context_length(131072) == 65536  # more than the pool holds
    assert pool.context_length(None) == 65536  # a model that names none: the pool
    assert CacheConfig(max_context=2048).context_length(8192) == 2048  # asked for less
    assert CacheConfig(max_context=16384).context_length(8192) == 8192  # never the model's beyond
    assert CacheConfig(max_context=4096, max_total_tokens=64).context_length(8192) == 4096  # as set
    small = CacheConfig(page_size=16, max_total_tokens=1000)  # 63 pages of 16
    assert small.context_length(8192) == 1008
    with pytest.raises(ValueError, match="max_context"):
        CacheConfig(max_context=-1)


def test_the_runner_serves_the_models_context_and_logs_it(caplog, tiny_model) -> None:
    import logging

    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.model.runner import ModelRunner

    cfg = EngineConfig(model_path=str(tiny_model), cache=CacheConfig(max_total_tokens=2048))
    with caplog.at_level(logging.INFO, logger="pdserve.model.runner"):
        runner = ModelRunner(cfg)
    assert runner.arch.max_position_embeddings == 4096
    assert runner.max_context == 2048  # the pool's, below the model's 4096
    assert runner.req_pool.max_context == 2048
    assert "context length 2048" in caplog.text
