"""The native kernels' thread pool (kernels/cpu/par.c): every index of [0, n) runs exactly
once whatever the part count, concurrent callers and a forked child still get every
part run, and parts do reach the workers (the point of the pool)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading

import pytest

from pdserve.kernels import cpu_native


@pytest.fixture(scope="module")
def par(tmp_path_factory) -> ctypes.CDLL:
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler")
    lib = cpu_native.load("par", tmp_path_factory.mktemp("native"))
    if lib is None:
        pytest.skip("par.c not built here")
    lib.pd_par_run.restype = ctypes.c_int
    lib.pd_par_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def _visits(par: ctypes.CDLL, n: int, parts: int) -> tuple[list[int], int]:
    """Runs the self-test function (out[i] += 1 over its range); (out, parts on workers)."""
    out = (ctypes.c_int64 * max(n, 1))()
    arg = ctypes.c_void_p(ctypes.addressof(out))
    fn = ctypes.cast(par.pd_par_selftest, ctypes.c_void_p)
    on_workers = par.pd_par_run(fn, ctypes.byref(arg), n, parts)
    return list(out)[:n], on_workers


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 100])
def test_every_index_runs_exactly_once(par, n, parts) -> None:
    for _ in range(20):  # back to back: workers spinning, taken back, asleep
        got, _ = _visits(par, n, parts)
        assert got == [1] * n


def test_concurrent_callers_each_get_all_their_parts(par) -> None:
    bad: list[object] = []

    def hammer() -> None:
        for i in range(300):
            got, _ = _visits(par, 50 + i % 7, 3)
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


def _child(q: mp.Queue) -> None:  # forked: the parent's workers do not exist here
    lib = cpu_native._loaded["par"]
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
