"""KV frames sent through libzmq's own C API: no pyzmq Frame, no collector thread.

pyzmq's zero-copy send wraps each frame in a zmq.Frame (about 12 us each here) and
learns that libzmq let a frame go through its garbage-collector thread: libzmq's I/O
thread messages it once per frame, and it takes the GIL to drop the frame and set its
tracker. On the prefill of an 8k-token transfer (128 frames) that thread used 2.5 ms of
CPU, beside 1.2 ms for the sender's own I/O thread (benchmarks/kv_transfer.py, CPU by
thread), and it takes the GIL from the engine's threads each time.

Here one C call (transfer/native/zmq_send.c) sends a KVChunk's header and frames on the
socket pyzmq made, through the functions of the libzmq pyzmq loaded; libzmq's I/O thread
counts a frame off in a `Pending` slot when it lets the frame go. A `Pending` is the
tracker of the whole message (`done`, `wait`, as zmq.MessageTracker).

So no thread wakes, and takes the GIL, once per frame: the prefill spends less CPU per
byte sent (benchmarks/kv_transfer.py, against pyzmq's send).

Where libzmq cannot be found as a library of its own (a pyzmq built with it inside the
extension), or no C compiler is, `NativeSend.load` returns None and MsgSocket sends
through pyzmq as before. Fault injection (a send hook) always goes through pyzmq.

Invariants:
- A frame's memory stays valid until its message's Pending is done: the Pending keeps
  a reference to the frames, and one dropped before it is done is kept (`_orphans`)
  until it is. (Untouched is the caller's part: a room is reported, and its pages
  freed, only once its Pendings are done: sending/sender.py.)
- Slots are never freed, only reused once their count is 0: libzmq may count a frame off
  after its socket is closed (linger 0 discards queued messages from libzmq's reaper).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from pdserve.kernels.native.library import load

log = logging.getLogger(__name__)

SRC_DIR = Path(__file__).parent / "native"  # zmq_send.c
_SLAB = 4096  # Pending slots per slab (8 bytes each); slabs are made as needed, kept


class _Slots:
    """int64 counters that libzmq's I/O thread decrements (zmq_send.c's `pending`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # NOTE: a Pending's __del__ may run while held
        self._slabs: list[np.ndarray] = []  # NOTE: never freed (module docstring)
        self._free: list[tuple[np.ndarray, int]] = []
        self._orphans: list[Pending] = []  # dropped before done: kept alive until done

    def take(self) -> tuple[np.ndarray, int]:
        with self._lock:
            if self._orphans:
                self._sweep()
            if not self._free:
                slab = np.zeros(_SLAB, np.int64)
                self._slabs.append(slab)
                self._free = [(slab, i) for i in range(_SLAB - 1, -1, -1)]
            return self._free.pop()

    def give(self, slab: np.ndarray, i: int) -> None:
        with self._lock:
            self._free.append((slab, i))

    def orphan(self, p: Pending) -> None:
        with self._lock:
            self._orphans.append(p)

    def _sweep(self) -> None:
        """Caller holds the lock: orphans whose frames libzmq let go give their slots back
        (and are dropped: their __del__ ran once already, so it does not run again)."""
        done = [p for p in self._orphans if p.done]
        self._orphans = [p for p in self._orphans if not p.done]
        self._free += [(p._slab, p._i) for p in done]


_slots = _Slots()


class Pending:
    """The tracker of one message sent by NativeSend: done once libzmq let every frame go."""

    __slots__ = ("_slab", "_i", "_keep", "__weakref__")

    def __init__(self, keep: object) -> None:
        self._slab, self._i = _slots.take()
        self._keep: object = keep  # the frames' owners: alive while libzmq reads them

    @property
    def address(self) -> int:
        return int(self._slab.ctypes.data) + 8 * self._i

    @property
    def done(self) -> bool:
        return int(self._slab[self._i]) == 0

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; zmq.NotDone after `timeout` seconds (as MessageTracker)."""
        end = None if timeout is None else time.monotonic() + timeout
        nap = 0.00005  # libzmq lets a frame go within microseconds of writing it
        while not self.done:
            if end is not None and time.monotonic() >= end:
                raise zmq.NotDone
            time.sleep(nap)
            nap = min(2 * nap, 0.001)

    def __del__(self) -> None:
        try:
            if self.done:
                _slots.give(self._slab, self._i)
            else:  # NOTE: libzmq still reads the frames: this object (and them) lives on
                _slots.orphan(self)  # (PEP 442: __del__ runs once; the sweep drops it)
        except Exception:  # interpreter shutdown: modules may be gone
            pass


class ZmqApi(ctypes.Structure):  # checked against zmq_send.c's at load (kernels/native/abi.py)
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "msg_init_size",
            "msg_init_data",
            "msg_data",
            "msg_send",
            "msg_close",
            "errno_",
        )
    ]


def _libzmq() -> ctypes.CDLL | None:
    """The libzmq that pyzmq loaded (its sockets belong to it), found among this process's
    mapped libraries: the one in pyzmq's own package folder where there are several."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libzmq" in ln.rsplit("/", 1)[-1]}
    except OSError:
        return None
    pyzmq_dir = str(Path(zmq.__file__).parent.parent)
    mine = [p for p in paths if p.startswith(pyzmq_dir)] if len(paths) > 1 else sorted(paths)
    if len(mine) != 1:
        return None
    try:
        lib = ctypes.CDLL(mine[0])
        version = [ctypes.c_int() for _ in range(3)]
        lib.zmq_version(*map(ctypes.byref, version))
    except (OSError, AttributeError):
        return None
    if tuple(v.value for v in version) != zmq.zmq_version_info():
        return None
    return lib


class NativeSend:
    """Sends a header and in-place frames as one message (module docstring)."""

    def __init__(self, lib: ctypes.CDLL, libzmq: ctypes.CDLL) -> None:
        names: tuple[str, ...] = ("zmq_msg_init_size", "zmq_msg_init_data", "zmq_msg_data")
        names += ("zmq_msg_send", "zmq_msg_close", "zmq_errno")
        fns = [ctypes.cast(getattr(libzmq, n), ctypes.c_void_p).value for n in names]
        self._api = ZmqApi(*fns)
        self._libzmq = libzmq  # NOTE: keeps the functions' library loaded
        self._send = lib.pd_zmq_send
        self._send.restype = ctypes.c_int
        self._send.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
        self._send.argtypes += [ctypes.c_int64, ctypes.c_void_p]

    @classmethod
    def load(cls, cache_dir: Path) -> NativeSend | None:
        """None where libzmq is not a library of its own here, or no C compiler is."""
        libzmq = _libzmq()
        lib = load("zmq_send", cache_dir, SRC_DIR, (ZmqApi,)) if libzmq is not None else None
        if libzmq is None or lib is None:
            log.info("KV frames go through pyzmq's zero-copy send (libzmq's C API not found)")
            return None
        return cls(lib, libzmq)

    @staticmethod
    def takes(frames: Sequence[Any]) -> bool:
        """Whether `frames` can go this way: non-empty C-contiguous numpy arrays."""
        return all(
            isinstance(f, np.ndarray) and f.flags.c_contiguous and f.nbytes > 0 for f in frames
        )

    def send(self, sock: zmq.Socket, head: bytes, frames: Frames) -> Pending:
        """Queue one message: `head`, then `frames` read in place. Raises zmq.ZMQError
        where libzmq refuses it (the frames are let go either way)."""
        n = len(frames.arrays)
        pending = Pending(frames.arrays)
        err = self._send(
            ctypes.byref(self._api), sock.underlying, head, len(head), frames.addrs,
            frames.sizes, n, pending.address,
        )  # fmt: skip
        if err:
            raise zmq.ZMQError(err if err > 0 else None)
        return pending


class Frames:
    """A message's frames made ready for NativeSend: their addresses and sizes as C arrays
    (about 25 us for eight here, most of a send's Python), made where the caller can
    afford it (sending/push.py: before the decode's Ready, as pyzmq's frames are).
    Precondition: NativeSend.takes(arrays)."""

    __slots__ = ("arrays", "addrs", "sizes")

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        n = len(arrays)
        self.arrays = list(arrays)
        self.addrs = (ctypes.c_void_p * n)(*(a.ctypes.data for a in arrays))
        self.sizes = (ctypes.c_int64 * n)(*(a.nbytes for a in arrays))


native_send = functools.cache(NativeSend.load)  # once per process and cache folder
