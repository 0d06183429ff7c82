"""The native kernels' thread pool (kernels/native/par.c): every index of [0, n) runs exactly
once whatever the part count (fixed parts or chunks), concurrent callers and a forked
child still get every part run, parts do reach the workers (the point of the pool), and
with chunks a stalled worker's share of the rest goes to the thread that runs."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading

import pytest

from pdserve.kernels.native import library


@pytest.fixture(scope="module")
def par(tmp_path_factory) -> ctypes.CDLL:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    lib = library.load("par", tmp_path_factory.mktemp("native"))
    if lib is None:
        pytest.skip("par.c not built here")
    lib.pd_par_run.restype = ctypes.c_int
    lib.pd_par_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.pd_par_run_chunks.restype = ctypes.c_int
    lib.pd_par_run_chunks.argtypes = [*lib.pd_par_run.argtypes, ctypes.c_int64]
    lib.pd_par_run_chunks_spin.restype = ctypes.c_int
    lib.pd_par_run_chunks_spin.argtypes = [*lib.pd_par_run_chunks.argtypes, ctypes.c_int64]
    return lib


def _visits(par: ctypes.CDLL, n: int, parts: int, grain: int = 0) -> tuple[list[int], int]:
    """Runs the self-test function (out[i] += 1 over its range) in fixed parts, or in
    chunks of `grain`; (out, parts on workers)."""
    out = (ctypes.c_int64 * max(n, 1))()
    arg = ctypes.c_void_p(ctypes.addressof(out))
    fn = ctypes.cast(par.pd_par_selftest, ctypes.c_void_p)
    if grain < 0:  # chunks of -grain, the workers sleeping as soon as they are done
        on_workers = par.pd_par_run_chunks_spin(fn, ctypes.byref(arg), n, parts, -grain, 0)
    elif grain:
        on_workers = par.pd_par_run_chunks(fn, ctypes.byref(arg), n, parts, grain)
    else:
        on_workers = par.pd_par_run(fn, ctypes.byref(arg), n, parts)
    return list(out)[:n], on_workers


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 100])
def test_every_index_runs_exactly_once(par, n, parts) -> None:
    for _ in range(20):  # back to back: workers spinning, taken back, asleep
        got, _ = _visits(par, n, parts)
        assert got == [1] * n


@pytest.mark.parametrize("n", [0, 1, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 8])
@pytest.mark.parametrize("grain", [1, 3, 64, 5000, -1, -3])
def test_every_index_runs_exactly_once_in_chunks(par, n, parts, grain) -> None:
    """grain < 0: chunks of -grain with no spin after them (Split.alone: every call finds
    the workers asleep, each woken for its part or taken back)."""
    for _ in range(20):
        got, _ = _visits(par, n, parts, grain)
        assert got == [1] * n


@pytest.mark.parametrize("grain", [0, 4])
def test_concurrent_callers_each_get_all_their_parts(par, grain) -> None:
    bad: list[object] = []

    def hammer() -> None:
        for i in range(300):
            got, _ = _visits(par, 50 + i % 7, 3, grain)
            if got != [1] * (50 + i % 7):
                bad.append(got)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not bad


def test_parts_reach_the_workers(par) -> None:
    # 2 x 10M increments: the caller's half takes milliseconds, so the worker (spinning
    # or just woken) takes its part; five tries absorb a machine busy with other work
    assert any(_visits(par, 20_000_000, 2)[1] == 1 for _ in range(5))


_RANGE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@pytest.mark.parametrize("chunks", [False, True])
def test_chunks_go_to_the_thread_that_runs(par, chunks) -> None:
    """A worker stalled in its first range (a preempted thread, here a 0.3 s sleep): with
    fixed parts the caller still runs only its own half; with chunks it takes every
    chunk left meanwhile (all but the stalled one). Fails if chunks were cut up front."""
    caller = threading.get_ident()
    ran: list[tuple[int, int]] = []  # (lo, on the caller?)
    stalled = threading.Event()

    @_RANGE
    def fn(_args, lo, hi) -> None:
        on_caller = threading.get_ident() == caller
        if not on_caller and not stalled.is_set():
            stalled.set()
            threading.Event().wait(0.3)
        elif on_caller and not stalled.is_set():
            stalled.wait(2)  # the worker has started (and stalled) before the caller goes on
        ran.append((lo, on_caller))

    n = 64
    for _ in range(5):  # a worker asleep may be taken back before it starts: try again
        ran.clear()
        stalled.clear()
        args = ctypes.c_void_p(0)
        f = ctypes.cast(fn, ctypes.c_void_p)
        if chunks:
            workers = par.pd_par_run_chunks(f, ctypes.byref(args), n, 2, 4)
        else:
            workers = par.pd_par_run(f, ctypes.byref(args), n, 2)
        if workers:
            break
    assert workers == 1 and stalled.is_set()
    on_caller = sum(c for _, c in ran)
    if chunks:
        assert len(ran) == n // 4 and on_caller == n // 4 - 1
    else:
        assert len(ran) == 2 and on_caller == 1


def _child(q: mp.Queue) -> None:  # forked: the parent's workers do not exist here
    lib = library._loaded["par"]
    assert lib is not None
    got, _ = _visits(lib, 1000, 2)
    q.put(got == [1] * 1000)


def test_a_forked_child_runs_every_part(par) -> None:
    _visits(par, 1000, 2)  # the parent's workers exist
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(timeout=30)
    assert p.exitcode == 0
    assert q.get(timeout=5) is True
