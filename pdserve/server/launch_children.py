"""Child processes of `pdserve up`: start, wait healthy, watch and restart, stop.

Each child is the leader of its own process group (its engine process joins
that group), so one `killpg` reaches the whole server.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.envs import ENV

POLL_S = 0.2


@dataclass
class Child:
    name: str
    argv: list[str]
    host: str
    port: int
    bootstrap_port: int | None = None  # prefill only
    proc: subprocess.Popen | None = None  # set by start()
    log_path: str = ""  # set by start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if `up` itself is killed hard, so nothing is orphaned.
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start(child: Child, log_dir: str, env: dict[str, str]) -> None:
    child.log_path = os.path.join(log_dir, f"{child.name}.log")
    with open(child.log_path, "ab") as log:
        child.proc = subprocess.Popen(
            child.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group, and Ctrl-C reaches only `up`
            preexec_fn=_die_with_parent,
        )


def _exited(child: Child) -> int | None:
    assert child.proc is not None
    return child.proc.poll()


def _healthy(child: Child, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(child.url + "/health", headers=headers, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(children: list[Child], timeout_s: float, stop: Callable[[], bool]) -> None:
    """Returns when every child answers /health with 200, or `stop()` became true.

    Raises RuntimeError, with the log tail, if a child exits or the timeout passes.
    """
    key = ENV.API_KEY.get()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    pending = list(children)
    deadline = time.monotonic() + timeout_s
    while pending and not stop():
        for c in children:
            if (rc := _exited(c)) is not None:
                raise RuntimeError(f"{c.name} exited with {rc} during startup:\n{c.log_tail()}")
        for c in list(pending):
            if _healthy(c, headers):
                pending.remove(c)
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail()}" for c in pending)
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"not healthy after {timeout_s:.0f}s: {names}\n{tails}")
        time.sleep(POLL_S)


@dataclass(frozen=True)
class RestartPolicy:
    """How `supervise` restarts a child that exits after start-up: after `first_s`, then
    twice as long after each exit in a row, at most `max_s`; a child that stayed up
    `stable_s` starts over at `first_s`."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0


@dataclass
class _Watch:
    """A child's restart state: when it last started, its current delay, and (while it is
    down) when it starts again."""

    started: float
    delay: float
    due: float | None = None


def supervise(
    children: list[Child],
    stop: Callable[[], bool],
    restart: Callable[[Child], None],
    policy: RestartPolicy = RestartPolicy(),
) -> None:
    """Blocks until `stop()`. A child that exits is reported with its log tail, what is
    left of its process group (its engine) is killed, and `restart(child)` runs after the
    policy's backoff; the other children serve on meanwhile."""
    now = time.monotonic()
    watches = {c.name: _Watch(now, policy.first_s) for c in children}
    while not stop():
        now = time.monotonic()
        for c in children:
            w = watches[c.name]
            if w.due is None and (rc := _exited(c)) is not None:
                w.delay = policy.first_s if now - w.started >= policy.stable_s else w.delay
                w.due = now + w.delay
                print(f"pdserve up: {c.name} exited with {rc}; restarting it in "
                      f"{w.delay:.1f}s:\n{c.log_tail()}", file=sys.stderr, flush=True)  # fmt: skip
                _signal_group(c, signal.SIGKILL)  # an engine left behind holds its ports
            elif w.due is not None and now >= w.due and not _group_alive(c):
                restart(c)
                print(f"pdserve up: {c.name} restarted (pid {_pid(c)})", file=sys.stderr,
                      flush=True)  # fmt: skip
                w.started, w.due, w.delay = now, None, min(w.delay * 2, policy.max_s)
        time.sleep(POLL_S)


def _pid(child: Child) -> int | None:
    return child.proc.pid if child.proc is not None else None


def _signal_group(child: Child, sig: int) -> None:
    if child.proc is None:
        return
    try:
        os.killpg(child.proc.pid, sig)  # pgid == leader pid (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_leader(child: Child, sig: int) -> None:
    if child.proc is not None and child.proc.poll() is None:
        child.proc.send_signal(sig)


def _group_alive(child: Child) -> bool:
    if child.proc is None:
        return False
    child.proc.poll()  # reap the leader so a zombie does not count
    try:
        os.killpg(child.proc.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_all(children: list[Child], grace_s: float) -> None:
    """SIGINT each server's leader (last started first): a frontend shuts down
    gracefully (streams in flight end) and then stops its own engine, so no engine dies
    under a live frontend (which would log it as a crash). Once a leader is gone, SIGTERM
    what is left of its group; SIGKILL every group still alive after `grace_s`."""
    for c in reversed(children):
        _signal_leader(c, signal.SIGINT)  # SIGTERM would drain (server/drain.py)
    swept: set[int] = set()
    deadline = time.monotonic() + grace_s
    while any(_group_alive(c) for c in children) and time.monotonic() < deadline:
        for i, c in enumerate(children):
            if i not in swept and c.proc is not None and c.proc.poll() is not None:
                _signal_group(c, signal.SIGTERM)
                swept.add(i)
        time.sleep(0.05)
    for c in children:
        if _group_alive(c):
            _signal_group(c, signal.SIGKILL)
        if c.proc is not None:
            c.proc.wait()
