"""CPU seconds a server's processes spend during a benchmark, read from /proc (Linux).

A server is the process compare.py started and every descendant of it (router,
frontends, engines; vLLM's API server and engine core), found through each process's
parent pid (pdserve's launcher starts its children in sessions of their own, so the
session id does not find them). `Usage` snapshots them before and after the run:

    usage = Usage(root=proc.pid)      # before
    ...                               # the run
    usage.done() -> {"wall_s", "server_cpu_s", "client_cpu_s", "machine_busy",
                     "processes": [{"label", "cpu_s"}, ...]}

A process that exits during the run is missed (a server does not), one that starts
during it counts from zero. `machine_busy` is the share of every core's time spent
outside idle and iowait over the same span (/proc/stat), other programs included.
Elsewhere than Linux `done()` returns None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system) of a live process, else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    # fields[0] is field 3 of proc(5): state; ppid is field 4, utime 14, stime 15
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def label(pid: str) -> str:
    """A short name: pdserve's role, vLLM's process title, else the command."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return pid
    args = [a.decode(errors="replace") for a in argv if a]
    if "pdserve.scheduler.engine_proc" in args:
        spec = next((a for a in args if a.startswith("{")), "")
        role = "prefill" if '"role":"prefill"' in spec.replace(" ", "") else "decode"
        return f"{role} engine"
    if "pdserve.cli" in args:
        sub = " ".join(args[args.index("pdserve.cli") + 1 :][:1]) or comm
        return f"{sub} frontend" if sub in ("prefill", "decode") else sub
    if comm not in ("python", "python3"):
        return comm  # a process title (vLLM: VLLM::Worker, VLLM::EngineCor)
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]  # the module it runs
    return " ".join(Path(a).name for a in args[:2])[:60]


def tree_cpu(root: int) -> dict[str, tuple[str, float]]:
    """pid -> (label, CPU seconds) of `root` and every live descendant of it."""
    stats = {pid: st for pid in os.listdir("/proc") if pid.isdigit() and (st := _stat(pid))}
    children: dict[int, list[str]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [str(root)] if str(root) in stats else []
    while todo:
        pid = todo.pop()
        out[pid] = (label(pid), stats[pid][1])
        todo += children.get(int(pid), [])
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


class Usage:
    def __init__(self, root: int) -> None:
        self.root = root
        self.ok = Path("/proc/stat").exists()
        self.before = tree_cpu(root) if self.ok else {}
        self.ticks = machine_ticks() if self.ok else (0, 0)
        self.t0 = time.monotonic()
        self.client0 = time.process_time()  # this process: the load generator

    def done(self) -> dict | None:
        if not self.ok:
            return None
        after = tree_cpu(self.root)
        busy, total = machine_ticks()
        procs = []
        for pid, (name, cpu) in after.items():
            spent = cpu - self.before.get(pid, (name, 0.0))[1]
            procs.append({"label": name, "cpu_s": round(spent, 2)})
        procs.sort(key=lambda p: -p["cpu_s"])
        span = max(total - self.ticks[1], 1)
        return {
            "wall_s": round(time.monotonic() - self.t0, 2),
            "server_cpu_s": round(sum(p["cpu_s"] for p in procs), 2),
            "client_cpu_s": round(time.process_time() - self.client0, 2),
            "machine_busy": round((busy - self.ticks[0]) / span, 3),
            "processes": procs,
        }


def thread_times(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """Each thread of process `pid`: thread id -> (its system name, CPU seconds so far),
    from /proc/<pid>/task/*/schedstat (time on a CPU); {} elsewhere than Linux."""
    out: dict[int, tuple[str, float]] = {}
    tasks = Path(f"/proc/{pid}/task")
    for task in tasks.glob("*") if tasks.is_dir() else []:
        try:
            comm = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(task.name)] = (comm, ns / 1e9)
    return out


def cpu_by_kind(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    names: dict[int, str],
) -> dict[str, float]:
    """CPU seconds between two thread_times() snapshots, summed by kind of thread:
    `names` (thread id -> kind) for threads known by id (Python's, whose system name is
    the process's), libzmq's by their system names, the rest (native workers such as
    par.c's, torch's) as "other"."""
    out: dict[str, float] = {}
    for tid, (comm, s) in after.items():
        kind = names.get(tid) or ("libzmq I/O" if comm.startswith("ZMQbg/IO") else "other")
        out[kind] = out.get(kind, 0.0) + s - before.get(tid, (comm, 0.0))[1]
    return out
