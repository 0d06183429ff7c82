"""benchmarks/proc_cpu.py: a server's CPU is counted over its whole process tree."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import proc_cpu  # as tests import benchmarks.soak: no sys.path change

BUSY_CHILD = (
    "import time\n"
    "end = time.process_time() + 0.5\n"
    "while time.process_time() < end: pass\n"
    "time.sleep(30)\n"
)
PARENT = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {BUSY_CHILD!r}], start_new_session=True)\ntime.sleep(30)\n"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")
def test_a_grandchild_in_its_own_session_is_counted() -> None:
    root = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    try:
        usage = proc_cpu.Usage(root=root.pid)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the grandchild has burnt its 0.5 s
            tree = proc_cpu.tree_cpu(root.pid)
            if len(tree) == 2 and max(cpu for _, cpu in tree.values()) >= 0.5:
                break
            time.sleep(0.1)
        report = usage.done()
        assert report is not None and len(report["processes"]) == 2, report
        assert report["server_cpu_s"] >= 0.4, report  # counted from the first snapshot
        assert 0.0 <= report["machine_busy"] <= 1.0
    finally:
        for pid in proc_cpu.tree_cpu(root.pid):
            subprocess.run(["kill", "-9", pid], check=False)
        root.wait()
