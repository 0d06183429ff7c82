"""Cores lent between engines on one host (pdserve/kernels/core_share.py): an engine
borrows the shares of peers that are idle, and gives them back when a peer computes."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import threading

import pytest
import torch

from pdserve.kernels import core_share
from pdserve.kernels.core_share import IDLE_S, Cores, CoreShare
from pdserve.kernels.native import library, par


def test_borrows_only_from_idle_peers(tmp_path, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: clock[0])
    path = str(tmp_path / "cores")
    prefill, decode = CoreShare(path, 0, 2, 1), CoreShare(path, 1, 2, 1)
    assert decode.begin() == 2  # the prefill has never computed
    prefill_threads = prefill.begin()
    assert prefill_threads == 1  # the decode is computing
    assert decode.begin() == 1  # ... and so is the prefill now
    decode.end()
    prefill.end()
    clock[0] += IDLE_S / 2
    assert decode.begin() == 1  # the prefill just finished: it may have more work
    decode.end()
    clock[0] += IDLE_S
    assert decode.begin() == 2  # idle long enough: its core is lent
    assert prefill.begin() == 1  # a prompt arrives while the decode computes
    assert decode.begin() == 1  # the decode's next step gives the core back


def test_a_peer_not_started_yet_lends_nothing(tmp_path) -> None:
    a = CoreShare(str(tmp_path / "cores"), 0, 3, 2)
    assert a.begin() == 2  # the other two records are zeros: they own no cores yet
    CoreShare(str(tmp_path / "cores"), 2, 3, 1)
    assert a.begin() == 3


def test_apply_sets_threads_of_the_calling_thread(tmp_path) -> None:
    share = CoreShare(str(tmp_path / "cores"), 0, 1, 1)
    seen = []

    before = torch.get_num_threads()

    def forward_thread() -> None:
        share.apply(before + 1)
        seen.append(torch.get_num_threads())

    try:
        t = threading.Thread(target=forward_thread)
        t.start()
        t.join()
        assert seen == [before + 1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("spec", ["x", "f:1", "f:2:2", "f:a:2", ":0:1"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="PATH:SLOT:ENGINES"):
        core_share.parse(spec)


def test_launcher_gives_each_engine_its_slot(tmp_path) -> None:
    from pdserve.server import launch

    args = argparse.Namespace(engine_args=[], num_prefill=1, num_decode=1)
    per_engine = launch._thread_plan(args.engine_args, 2, str(tmp_path))
    share = str(max(1, (os.cpu_count() or 1) // 2))
    path = str(tmp_path / "core-share")
    assert per_engine == [
        ["--num-threads", share, "--core-share", f"{path}:0:2"],
        ["--num-threads", share, "--core-share", f"{path}:1:2"],
    ]
    assert (
        launch._thread_plan(["--num-threads", "3"], 2, str(tmp_path))
        == [["--num-threads", "3"]] * 2
    )  # the user's choice stands: no sharing


def test_a_decode_sharing_the_host_with_a_prefill_runs_nicer() -> None:
    from pdserve.server import launch

    shared = ["--num-threads", "1", "--core-share", "f:1:2"]
    nicer = launch._decode_nice(shared, prefills=1)
    assert nicer == [*shared, "--nice", str(launch.DECODE_NICE)]
    assert launch._decode_nice(shared, prefills=0) == shared  # no prefill beside it
    assert launch._decode_nice(["--num-threads", "3"], prefills=1) == ["--num-threads", "3"]
    own = [*shared, "--nice", "0"]
    assert launch._decode_nice(own, prefills=1) == own  # the user's choice stands


def test_the_engine_process_takes_its_niceness(monkeypatch, tmp_path) -> None:
    from pdserve import protocol as P
    from pdserve.config import EngineConfig, TransferConfig
    from pdserve.scheduler import engine_proc

    calls: list[int] = []
    monkeypatch.setattr(engine_proc.os, "nice", calls.append)

    def no_engine(*_: object) -> object:
        raise RuntimeError("stop here")  # serve reports it and returns 1

    monkeypatch.setattr(engine_proc, "_report_error", lambda *_: None)
    spec = P.EngineSpec(role="decode", engine=EngineConfig(model_path="m", nice=7),
                        transfer=TransferConfig())  # fmt: skip
    assert engine_proc.serve(spec, str(tmp_path), build=no_engine) == 1
    assert calls == [7]


def test_children_get_the_api_key_and_the_users_environment() -> None:
    """`pdserve up`'s children: the caller's environment and the API key. The OpenMP
    policy is the engine's business (the next test), not the launcher's."""
    from pdserve.server import launch

    assert launch.child_env({"PATH": "/bin"}, api_key="k") == {
        "PATH": "/bin",
        "PDSERVE_API_KEY": "k",
    }
    assert launch.child_env({"OMP_WAIT_POLICY": "ACTIVE"}, None) == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_an_engine_process_starts_with_sleeping_openmp_threads(monkeypatch) -> None:
    """Whatever started its server (`pdserve up`, a container, by hand), the engine
    process gets OMP_WAIT_POLICY=PASSIVE unless the environment sets a policy: the decode's
    schedule thread computes beside its forward and needs a core no OpenMP thread spins on."""
    import asyncio

    from pdserve import protocol as P
    from pdserve.config import EngineConfig, TransferConfig
    from pdserve.server import engine_client

    seen: list[dict[str, str]] = []

    def popen(argv, env=None, **kw):
        seen.append(env)
        raise OSError("not started in this test")

    monkeypatch.setattr(engine_client.subprocess, "Popen", popen)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = P.EngineSpec(role="decode", engine=EngineConfig(model_path="m"),
                        transfer=TransferConfig())  # fmt: skip
    for policy in (None, "ACTIVE"):
        if policy:
            monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        client = engine_client.EngineClient(spec)
        with pytest.raises(OSError):
            asyncio.run(client.start())
        asyncio.run(client.close())
    assert [env["OMP_WAIT_POLICY"] for env in seen] == ["PASSIVE", "ACTIVE"]
    assert seen[0]["PATH"] == os.environ["PATH"]


def test_a_decode_steps_aside_for_a_prefill_backlog(tmp_path, monkeypatch) -> None:
    """Prefill first: while the prefill has more prompts queued than the decode runs
    streams, the decode skips steps, for at most max_yield_s in a row, and reads as idle
    meanwhile (the prefill borrows its core)."""
    from types import SimpleNamespace

    from pdserve.scheduler import decode as decode_mod
    from pdserve.scheduler.decode import DecodeEngine

    clock = [100.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(decode_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(decode_mod.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    path = str(tmp_path / "cores")
    prefill, share = CoreShare(path, 0, 2, 1), CoreShare(path, 1, 2, 1)
    dec = SimpleNamespace(runner=SimpleNamespace(cores=Cores(share)), max_yield_s=0.05)
    dec._yield_since, dec.running, dec.yield_always = None, ["a", "b"], False
    dec._blocked = contextlib.nullcontext  # no claimed core to give back (HostCore)
    step_aside = lambda: DecodeEngine._yield_to_prefill(dec)  # noqa: E731

    share.begin()
    share.end()  # the decode just stepped: not idle to its peer
    assert not step_aside()  # no backlog: the decode steps
    prefill.set_backlog(2)
    assert not step_aside()  # as many streams running as prompts queued: no yielding
    prefill.set_backlog(3)
    assert prefill.begin() == 1
    prefill.end()
    assert step_aside()  # more prompts queued than streams: skip this step ...
    assert prefill.begin() == 2  # ... and the prefill has both cores at once
    prefill.end()
    skipped = 1
    while step_aside():
        skipped += 1
    assert 25 <= skipped <= 26  # 50 ms in 2 ms polls (float clock); then one step runs
    assert step_aside()  # and it steps aside again
    prefill.set_backlog(0)
    assert not step_aside()
    dec.yield_always = True
    prefill.set_backlog(1)
    assert step_aside()  # "always": one prompt held is enough, with streams running
    prefill.set_backlog(0)
    assert not step_aside()
    dec.max_yield_s = 0.0
    prefill.set_backlog(3)
    assert not step_aside()  # off: the decode never waits


def test_prefill_first_mode_is_checked() -> None:
    from pdserve.cli import build_parser
    from pdserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="prefill_first must be one of"):
        SchedulerConfig(prefill_first="sometimes")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--prefill-first", "sometimes"])


def test_kernel_threads_follow_the_peer_at_once(tmp_path, monkeypatch) -> None:
    """Unlike begin(), the per-kernel count asks for no idle time: the decode's kernels
    use the prefill's core between two of its forwards and give it back at the next."""
    clock = [100.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: clock[0])
    path = str(tmp_path / "cores")
    prefill, decode = CoreShare(path, 0, 2, 1), CoreShare(path, 1, 2, 1)
    decode.begin()
    assert prefill.begin() == 1 and decode.kernel_threads() == 1  # the prefill computes
    prefill.end()
    assert decode.kernel_threads() == 2  # at once: begin() would wait IDLE_S
    assert decode.begin() == 1
    prefill.begin()
    assert decode.kernel_threads() == 1  # given back within the decode's step


def test_split_asks_the_budget_at_every_call(tmp_path, monkeypatch) -> None:
    budget = iter([2, 1, 3])
    split = par.Split(tmp_path, lambda: next(budget))
    calls: list[int] = []
    split._run = lambda fn, args, n, parts: calls.append(parts)
    ran: list[tuple[int, int]] = []
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
        lambda args, lo, hi: ran.append((lo, hi))
    )
    args = ctypes.c_int(0)
    for _ in range(3):
        split(fn, args, 10)
    assert calls == [2, 3] and ran == [(0, 10)]  # the 1-thread call runs here, unsplit


def test_threads_follow_a_peer_that_steps_aside_mid_forward(tmp_path, monkeypatch) -> None:
    """threads() (read between a forward's layers) counts a peer that yielded at once,
    and stops counting it as soon as it computes again."""
    monkeypatch.setattr(core_share.time, "monotonic", lambda: 100.0)  # no IDLE_S passes
    path = str(tmp_path / "cores")
    prefill, decode = CoreShare(path, 0, 2, 1), CoreShare(path, 1, 2, 1)
    decode.begin()  # the decode is computing
    assert prefill.begin() == 1
    decode.end()
    assert prefill.threads() == 1  # just finished a step: not idle yet (IDLE_S)
    decode.yield_now()
    assert prefill.threads() == 2  # stepped aside: its core is lent from the next layer
    decode.begin()
    assert prefill.threads() == 1  # computing again: given back


def test_each_runner_hands_its_own_cores_to_every_kernel(tiny_model, monkeypatch, tmp_path) -> None:
    """The core policy is an object the composition root hands to the runner, not state
    of the process: two runners in one process keep their own thread counts, and every
    native kernel of each (linear, attention, norms) asks its runner's policy."""
    from pdserve.config import EngineConfig
    from pdserve.model.runner import ModelRunner

    if library.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    cfg = EngineConfig(model_path=str(tiny_model))
    shared = ModelRunner(cfg, cores=Cores(CoreShare(str(tmp_path / "cores"), 0, 1, 7)))
    alone = ModelRunner(cfg, cores=Cores())  # NOTE: its own weights (a model's ops are its own)
    for runner in (shared, alone):
        runner.warm_up_decode()
    lin = shared.model.linears()[0].native
    attn = shared.attn.kernel  # type: ignore[attr-defined]
    ops = shared.model.ops.kernels  # type: ignore[attr-defined]
    assert lin is not None and attn is not None
    assert [k._split.threads() for k in (lin, attn, ops)] == [7, 7, 7]
    assert alone.attn.kernel._split.threads() == torch.get_num_threads()  # type: ignore[attr-defined]


def test_a_runner_asked_to_share_cores_needs_the_policy_made_for_it(tiny_model) -> None:
    from pdserve.config import EngineConfig
    from pdserve.model.runner import ModelRunner

    cfg = EngineConfig(model_path=str(tiny_model), core_share="/nowhere:0:2")
    with pytest.raises(ValueError, match="core_share"):
        ModelRunner(cfg)


def test_cores_alone_on_the_host_do_nothing_and_use_torch_threads(tmp_path) -> None:
    cores = Cores.for_engine("", "cpu", 0)
    assert cores.share is None and cores.kernel_threads() == torch.get_num_threads()
    with cores.computing() as between_layers:
        assert between_layers is None
    cores.set_backlog(3)
    cores.yield_now()
    assert cores.peer_backlog() == 0
    assert Cores.for_engine(f"{tmp_path}/f:0:2", "cuda", 1).share is None  # CPU only
    shared = Cores.for_engine(f"{tmp_path}/f:0:2", "cpu", 3)
    assert shared.share is not None and shared.share.share == 3
    shared.share.close()
