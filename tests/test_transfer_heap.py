"""Freed KV frames stay mapped in an engine process (transfer/heap.py).

The probe does what a KV transfer does to the heap, without the timing noise of a real
one: one thread allocates 8 MiB frames and fills them (libzmq's I/O thread receiving),
another frees them (the receiver's thread, done with a chunk). With glibc's adaptive
thresholds every round faults in all its pages again; with keep_freed_memory() the
frames' memory is reused. (Through the real loopback transfer, 8k tokens: 0-8,000
faults a transfer without, about 0 with on a quiet machine: the docstring of heap.py.)
Each run is its own interpreter: mallopt is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, queue, resource, sys, threading
from pdserve.transfer.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "1" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
FRAME, ROUNDS, handoff = 8 << 20, 8, queue.Queue()
def receive():
    for _ in range(ROUNDS):
        frames = [libc.malloc(FRAME) for _ in range(4)]
        for f in frames:
            ctypes.memset(f, 1, FRAME)
        handoff.put(frames)
        handoff.join()
    handoff.put(None)
thread = threading.Thread(target=receive)
thread.start()
done = 0
while (frames := handoff.get()) is not None:
    for f in frames:
        libc.free(f)
    handoff.task_done()
    done += 1
    if done == 2:  # rounds 1-2 warm up (the first frames are mmapped)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
thread.join()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (ROUNDS - 2)
print(json.dumps({"kept": kept, "faults": faults, "pages": 4 * FRAME // 4096}))
"""


def _round_faults(keep: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if keep else "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_frames_freed_on_another_thread_are_reused_not_faulted_in_again() -> None:
    kept = _round_faults(True)
    if not kept["kept"]:
        pytest.skip("not glibc: mallopt unavailable")
    plain = _round_faults(False)
    # measured here: 8,160 of 8,192 pages a round without, 0.1 with
    assert plain["faults"] > 0.5 * plain["pages"], plain
    assert kept["faults"] < 0.05 * kept["pages"], kept


def test_the_users_environment_wins(monkeypatch) -> None:
    from pdserve.transfer import heap

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert heap.keep_freed_memory() is False
