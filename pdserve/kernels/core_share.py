"""Cores lent between engines on one host, by need.

`pdserve up` runs a prefill and a decode engine on one machine. Each owns a share of
the cores; an engine that is computing while its peers idle borrows their shares, and
gives them back as soon as a peer computes again. The engines agree through a small
file (the launcher names it, each engine opens or creates it), one record per engine:

    record i (24 bytes):  last_end  f64   time.monotonic() when its last forward ended
                          computing i32   1 while a forward runs
                          share     i32   cores it owns
                          backlog   i32   prompts queued or being prefilled (a prefill)
                          pad       i32

    threads(i) = share[i] + sum(share[j] for peers j idle: not computing and
                                 last_end older than IDLE_S)

Prefill first (DecodeEngine._yield_to_prefill): while a peer prefill holds prompts
(`always`, the default) or more prompts than the decode has streams running (`burst`),
the decode skips launching steps (still admitting requests and emitting their first
tokens), for at most a bounded time in a row, and marks itself idle meanwhile so the
prefill borrows its cores from its next layer on (threads). A new prompt then computes
on every core while the running streams wait; with `burst` only a burst does, and in a
steady state (more streams than queued prompts) nothing yields.

Each engine writes only its own record, at the start and end of each forward, and
reads the others' when a forward starts and between its layers (a few bytes of a
shared mapping: no system call), and again before each native kernel call
(kernel_threads): between two prompts
the decode's kernels run on the prefill's cores too, and give them back as soon as the
prefill's next forward starts. Reads may race with writes; the worst outcome is one
forward (or kernel) with one thread too many or too few. CLOCK_MONOTONIC is one clock
for every process on the host.

`torch.set_num_threads` is per thread for OpenMP (a thread keeps the count it first
saw), so the count is applied by the thread that runs the forward, when it changes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

RECORD = struct.Struct("<diiii")
IDLE_S = 0.1  # a peer whose last forward ended this long ago (and none runs) is idle


def parse(spec: str) -> tuple[str, int, int]:
    """'PATH:SLOT:ENGINES' -> (path, slot, engines)."""
    path, slot, engines = (spec.rsplit(":", 2) + ["", ""])[:3]
    if not path or not slot.isdigit() or not engines.isdigit() or int(slot) >= int(engines):
        raise ValueError(f"core share {spec!r}: expected PATH:SLOT:ENGINES, SLOT < ENGINES")
    return path, int(slot), int(engines)


class CoreShare:
    def __init__(self, path: str, slot: int, engines: int, share: int) -> None:
        """Engine `slot` of `engines` on this host, owning `share` cores."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = engines * RECORD.size
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # NOTE: zeros: a peer not started yet owns 0 cores
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slot, self.share = slot, max(1, share)
        self._peer_offsets = [i * RECORD.size for i in range(engines) if i != slot]
        self._backlog = 0
        self._applied = threading.local()
        self._view: ctypes.Array | None = None  # the mapping as native code reads it
        self._write(0.0, 0)

    def begin(self) -> int:
        """A forward starts: mark it, and return the threads this engine may use now."""
        self._write(0.0, 1, keep_time=True)
        return self.threads()

    def threads(self) -> int:
        """The threads this engine may use now: its share plus idle peers' (not computing,
        and their last forward ended IDLE_S ago, or they stepped aside: yield_now). Read
        again between a forward's layers (ModelRunner.forward), so a peer that steps aside
        mid-forward lends its cores from the next layer on, and gets them back as soon."""
        now, threads = time.monotonic(), self.share
        for last_end, computing, share, _, _ in self._peer_records():
            if not computing and now - last_end > IDLE_S:
                threads += share
        return threads

    def end(self) -> None:
        self._write(time.monotonic(), 0)

    def kernel_threads(self) -> int:
        """Threads for this engine's next native kernel call (Cores.kernel_threads):
        its own share plus the shares of peers not computing at this moment. No idle
        time is asked for, unlike begin(): the count is read again at every call, so a
        peer that starts a forward gets its cores back within one kernel (~0.1-1 ms),
        not one step later."""
        threads = self.share
        for _, computing, share, _, _ in self._peer_records():
            if not computing:
                threads += share
        return threads

    def records(self) -> tuple[int, int, int, int]:
        """(address of the records, engines, this engine's slot, its share): for native
        code that computes kernel_threads itself (kernels/native/decode_forward.c). The
        address stays valid until close()."""
        if self._view is None:
            self._view = (ctypes.c_char * len(self._map)).from_buffer(self._map)
        engines = len(self._map) // RECORD.size
        return ctypes.addressof(self._view), engines, self.slot, self.share

    def set_backlog(self, prompts: int) -> None:
        """A prefill engine: how many prompts are queued or being prefilled now."""
        if prompts != self._backlog:
            self._backlog = prompts
            self._write(0.0, 0, keep_time=True, keep_computing=True)

    def peer_backlog(self) -> int:
        """The largest backlog a peer reports (0: none)."""
        return max((backlog for _, _, _, backlog, _ in self._peer_records()), default=0)

    def yield_now(self) -> None:
        """This engine steps aside: peers may count its cores as idle at once."""
        self._write(0.0, 0)

    def _peer_records(self) -> list[tuple]:
        """Every peer's record (last_end, computing, share, backlog, pad), as it is now."""
        return [RECORD.unpack_from(self._map, off) for off in self._peer_offsets]

    def apply(self, threads: int) -> None:
        """torch.set_num_threads(threads) in the calling thread, if it differs."""
        if getattr(self._applied, "threads", 0) != threads:
            torch.set_num_threads(threads)
            self._applied.threads = threads

    def _write(
        self, last_end: float, computing: int, keep_time: bool = False, keep_computing: bool = False
    ) -> None:
        off = self.slot * RECORD.size
        old = RECORD.unpack_from(self._map, off)
        if keep_time:
            last_end = old[0]
        if keep_computing:
            computing = old[1]
        RECORD.pack_into(self._map, off, last_end, computing, self.share, self._backlog, 0)

    def close(self) -> None:
        self._view = None  # NOTE: an exported buffer would keep the mapping from closing
        self._map.close()


class Cores:
    """One engine's policy for its cores: made once per engine process by the composition
    root (scheduler/build.py) and handed to the model runner, which gives it to what
    computes (its forwards, the native kernels' thread counts, the native decode
    forward) and to the engines (prefill first); the KV transfer's kernels get
    `kernel_threads`. Alone on its host (no CoreShare) every call is a no-op and the
    threads are the calling thread's torch threads (--num-threads)."""

    def __init__(self, share: CoreShare | None = None) -> None:
        self.share = share
        self.host_core = HostCore()  # the decode's schedule thread's claim (overlap, CPU)

    @classmethod
    def for_engine(cls, spec: str, device: str, threads: int) -> Cores:
        """From EngineConfig.core_share ("PATH:SLOT:ENGINES", or "" for none), owning
        `threads` cores (--num-threads, else torch's count); no sharing off the CPU."""
        if not spec or not device.startswith("cpu"):
            return cls()
        path, slot, engines = parse(spec)
        return cls(CoreShare(path, slot, engines, threads or torch.get_num_threads()))

    def kernel_threads(self) -> int:
        """Threads for the next native kernel call (kernels/native/par.Split)."""
        return torch.get_num_threads() if self.share is None else self.share.kernel_threads()

    @contextmanager
    def computing(self) -> Iterator[Callable[[], None] | None]:
        """Around a forward: marked as computing on the host, on the cores this engine
        owns and idle peers' (CoreShare.begin); yields what to call between layers to
        follow peers that start or stop meanwhile (None alone on the host)."""
        share = self.share
        if share is None:
            yield None
            return
        share.apply(share.begin())
        try:
            yield lambda: share.apply(share.threads())
        finally:
            share.end()

    def set_backlog(self, prompts: int) -> None:
        """A prefill engine: prompts queued or being prefilled now (CoreShare)."""
        if self.share is not None:
            self.share.set_backlog(prompts)

    def peer_backlog(self) -> int:
        """The largest backlog a peer on this host reports (0: none, or alone)."""
        return 0 if self.share is None else self.share.peer_backlog()

    def yield_now(self) -> None:
        """This engine steps aside: peers may count its cores as idle at once."""
        if self.share is not None:
            self.share.yield_now()


class HostCore:
    """A core of the engine's own threads, claimed by its schedule thread while that
    thread computes beside an in-flight forward (the overlap scheduler on CPU).

    The native decode forward reads the claim before every kernel (threads_now in
    kernels/native/decode_forward.c) and, while it is set, splits the kernel over one part
    fewer (never fewer than one), so the schedule thread's host work has a core to
    itself instead of preempting one of the forward's threads; when the schedule thread
    blocks on the forward stream (or sleeps) it gives the core back, from the next
    kernel on. Unclaimed, the forward runs exactly as without it.

    Why: with the forward on both cores of a 2-core machine, the schedule thread's
    ~1 ms of Python per step took the forward several times its own length (a forward
    thread preempted mid-kernel stalls its peers), and overlap lost more than it hid
    (benchmarks/decode_overlap.py). One writer (the schedule thread); the
    forward's reads may see a claim one kernel late, which costs a part, never a result.
    """

    def __init__(self) -> None:
        self._flag = ctypes.c_int32(0)

    @property
    def claimed(self) -> bool:
        return bool(self._flag.value)

    def claim(self) -> None:
        self._flag.value = 1

    def release(self) -> None:
        self._flag.value = 0

    def address(self) -> int:
        """Where native code reads the claim (an int32, 0 or 1), valid while self lives."""
        return ctypes.addressof(self._flag)
