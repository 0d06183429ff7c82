"""Every refusal and abort reaches the other side at once (docs/architecture.md §5),
over real ZeroMQ.

Each case: one refusal/abort cause, on one side, while the request is in one state on
the other side. Afterwards both engines must hold no row, page, request or room within
2 s, and each side's client sees exactly one terminal event: an error naming the cause
(or finish_reason "abort" on the side that aborted it).

    prefill pool: 64 tokens (4 pages), 8-token prefill chunks     decode pool: 512 tokens
    PREFILL_TOO_LONG  80-token prompt: only the prefill refuses it
    DECODE_TOO_LONG   20-token prompt + 600 tokens: only the decode refuses it
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from engine_pair import Pair, engine_cfg

from pdserve.model.runner import ModelRunner
from tests.conftest import model_path

BOUND_S = 2.0


@pytest.fixture(scope="module")
def weights() -> object:
    return ModelRunner(engine_cfg(model_path("tiny"), 64)).model


@pytest.fixture
def pair(weights: object) -> Iterator[Pair]:
    model = model_path("tiny")
    p = Pair(engine_cfg(model, 64, max_prefill=8), engine_cfg(model, 512), weights=weights)
    yield p
    p.close()


def _steps(pair: Pair, n: int) -> None:
    for _ in range(n):
        pair.step_prefill()


def _prefill_holding(pair: Pair, rid: str) -> None:
    assert pair.pump_until(lambda: rid in pair.prefill.holding, 10), "prefill never finished"


# ---- the cases: run(pair, rid, room) -> the side that aborted ("" for a refusal)
Case = Callable[[Pair, str, int], str]


def prefill_refuses_decode_queued(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 80))  # decode: prealloc, no Ready yet
    p.prefill.add_request(p.request(rid, room, 80))
    return ""


def prefill_refuses_decode_admitted(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 80))
    p.step_decode()  # reserved + Ready sent
    p.prefill.add_request(p.request(rid, room, 80))
    return ""


def prefill_aborts_queued(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 40))
    p.step_decode()
    p.prefill.add_request(p.request(rid, room, 40))  # not admitted until it steps
    p.prefill.abort(rid, "client gone")
    return "prefill"


def prefill_aborts_kv_in_flight(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 40))
    p.step_decode()
    p.prefill.add_request(p.request(rid, room, 40))
    _steps(p, 2)  # 2 of 5 chunks computed and pushed
    assert rid in p.decode.transfer
    p.prefill.abort(rid, "client gone")
    return "prefill"


def prefill_aborts_holding_decode_not_there(p: Pair, rid: str, room: int) -> str:
    p.prefill.add_request(p.request(rid, room, 40))
    _prefill_holding(p, rid)
    p.prefill.abort(rid, "client gone")
    p.decode.add_request(p.request(rid, room, 40))  # its Ready is answered with Abort
    return "prefill"


def decode_refuses_prefill_queued(p: Pair, rid: str, room: int) -> str:
    p.prefill.add_request(p.request(rid, room, 20, max_tokens=600))
    p.decode.add_request(p.request(rid, room, 20, max_tokens=600))
    return ""


def decode_refuses_prefill_in_flight(p: Pair, rid: str, room: int) -> str:
    p.prefill.add_request(p.request(rid, room, 20, max_tokens=600))
    _steps(p, 1)
    p.decode.add_request(p.request(rid, room, 20, max_tokens=600))
    return ""


def decode_refuses_prefill_holding(p: Pair, rid: str, room: int) -> str:
    p.prefill.add_request(p.request(rid, room, 20, max_tokens=600))
    _prefill_holding(p, rid)
    p.decode.add_request(p.request(rid, room, 20, max_tokens=600))
    return ""


def decode_refuses_prefill_not_there(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 20, max_tokens=600))
    p.step_decode()
    p.prefill.add_request(p.request(rid, room, 20, max_tokens=600))
    return ""


def decode_aborts_queued(p: Pair, rid: str, room: int) -> str:
    p.prefill.add_request(p.request(rid, room, 40))
    _steps(p, 1)
    p.decode.add_request(p.request(rid, room, 40))  # prealloc: no Ready yet
    p.decode.abort(rid, "client gone")
    return "decode"


def decode_aborts_kv_in_flight(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 40))
    p.step_decode()
    p.prefill.add_request(p.request(rid, room, 40))
    _steps(p, 2)
    assert rid in p.decode.transfer
    p.decode.abort(rid, "client gone")
    return "decode"


def decode_aborts_prebuilt(p: Pair, rid: str, room: int) -> str:
    p.decode.add_request(p.request(rid, room, 40))
    p.step_decode()
    p.prefill.add_request(p.request(rid, room, 40))

    def prebuilt() -> bool:
        p.decode.receive()  # stage 1 of a step only: the request stays prebuilt
        return any(r.rid == rid for r in p.decode.prebuilt)

    end = time.monotonic() + 30
    while not prebuilt():
        assert time.monotonic() < end, "KV never arrived"
        p.step_prefill()
        time.sleep(0.002)
    p.decode.abort(rid, "client gone")
    return "decode after transfer"  # the prefill's part ended fine (Ack) before the abort


CASES: list[Case] = [
    prefill_refuses_decode_queued, prefill_refuses_decode_admitted, prefill_aborts_queued,
    prefill_aborts_kv_in_flight, prefill_aborts_holding_decode_not_there,
    decode_refuses_prefill_queued, decode_refuses_prefill_in_flight,
    decode_refuses_prefill_holding, decode_refuses_prefill_not_there, decode_aborts_queued,
    decode_aborts_kv_in_flight, decode_aborts_prebuilt,
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_refusal_reaches_the_other_side(pair: Pair, case: Case) -> None:
    rid, room = case.__name__, 1000 + CASES.index(case)
    aborted_by = case(pair, rid, room)

    def settled() -> bool:
        ended = all(pair.finished(side, rid) for side in ("prefill", "decode"))
        return ended and not pair.holdings()

    assert pair.pump_until(settled, BOUND_S), (pair.holdings(), dict(pair.events))
    for side in ("prefill", "decode"):
        [end] = pair.finished(side, rid)  # exactly one terminal event
        if aborted_by.startswith(side):
            assert end.finish_reason == "abort" or end.error, end
        elif aborted_by == "decode after transfer":
            assert end.error is None and len(end.token_ids) == 1, end
        else:
            assert end.error and not end.token_ids, (side, end)
            cause = "client gone" if aborted_by else "KV pages"
            assert cause in end.error, (side, end.error)


def test_dead_decode_found_by_heartbeat_and_prefill_frees_its_rooms(pair: Pair) -> None:
    """The decode dies once its Readies are out (its I/O thread stops without a word), so
    the prefill computes and pushes KV to a dead peer: it notices the missing heartbeats
    after peer_timeout_s (2 s here; its own timeouts are 60 s) and frees every row and page
    it held for it. (Killed after two prefill steps instead, a room could already be
    done: a 40-token transfer takes a few ms.)"""
    rids = ["dead-0", "dead-1"]
    for i, rid in enumerate(rids):
        pair.decode.add_request(pair.request(rid, 3000 + i, 40))
    pair.step_decode()
    assert _wait(lambda: pair.sender.active_rooms() == {3000, 3001}, 2.0)  # Readies in
    pair.receiver._io.stop(kill=True)  # kill -9 of the decode, as far as the prefill can tell
    t0 = time.monotonic()
    for i, rid in enumerate(rids):
        pair.prefill.add_request(pair.request(rid, 3000 + i, 40))
    _steps(pair, 2)
    assert pair.sender.active_rooms() == {3000, 3001}

    def prefill_free() -> bool:
        pair.step_prefill()
        return all(pair.finished("prefill", r) for r in rids) and not pair.sender.active_rooms()

    assert _wait(prefill_free, 2.0 + 3.0), pair.sender.room_phases()
    took = time.monotonic() - t0
    pool, alloc = pair.prefill.runner.req_pool, pair.prefill.runner.kv_pool.allocator
    assert (pool.free_rows, alloc.free_pages) == (pool.total_rows, alloc.total_pages)
    for rid in rids:
        [end] = pair.finished("prefill", rid)
        assert end.error and "silent" in end.error, end
    print(f"prefill freed a dead decode's rooms after {took:.2f}s")


def _wait(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True
