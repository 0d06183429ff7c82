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
